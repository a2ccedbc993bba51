"""Turns: a gang's members run their own code one at a time, and meet for a step they share.

A GRPO trial generates from inside its TRL trainer's step (and its evaluation), deep in code the engine
does not own. To generate for a whole gang in one decode, each member's work runs in a thread of its
own, but the threads take *turns*: exactly one runs at any time, as if the engine ran them one after
another. A member runs until it finishes or calls :meth:`Turns.meet` with what it needs from the shared
step; when no member can run on, the coordinator (the thread that called :meth:`Turns.run`) does the
shared step once for every member waiting, and the members resume in order, each with its own answer.
Because only one member runs at a time and members resume in a fixed order, a gang's run is as
deterministic as running its members one after another; what a member must set up again when it
resumes (its adapter, its RNG) it does itself, after :meth:`~Turns.meet` returns.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch

from optuna_rapidfire._logging import get_logger

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

_logger = get_logger(__name__)

Request = TypeVar("Request")
Answer = TypeVar("Answer")

_NOTHING: Any = object()


class _Baton:
    """A turn handed from one thread to another: :meth:`give` wakes the one thread blocked in :meth:`take` (or lets
    its next :meth:`take` through). A lock held from the start, released by the giver: a wake-up costs one C call on
    each side, where ``threading.Semaphore`` takes a condition variable and a lock of its own per wait (about 40% more
    per round trip, some 800 round trips a GRPO gang study). Turns alternate strictly, so no baton is given twice
    without a take in between."""

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()

    def give(self) -> None:
        self._lock.release()

    def take(self) -> None:
        self._lock.acquire()


@dataclass(eq=False)
class _Member:
    work: Callable[[], Any]
    outcome: Any = None
    done: bool = False
    request: Any = _NOTHING
    answer: Any = _NOTHING
    thread: threading.Thread | None = field(default=None, repr=False)
    go: _Baton = field(default_factory=_Baton, repr=False)  # its turn
    after: _Member | None = field(default=None, repr=False)  # whom it hands the turn to (None: the coordinator)


class Turns(Generic[Request, Answer]):
    """Run work items in turns, meeting for a shared step.

    Args:
        shared: Given the requests of every member waiting (in member order), their answers, one per
            request: an answer that is an exception is raised in that member alone.
        name: Names the members' threads (in debuggers and thread dumps).
        setup: Run first in each member's thread, for what a thread has of its own (CUDA's current
            device, for instance).
    """

    def __init__(
        self,
        shared: Callable[[list[Request]], Sequence[Answer | BaseException]],
        name: str = "turn",
        setup: Callable[[], None] | None = None,
    ) -> None:
        self._shared = shared
        self._name = name
        self._setup = setup
        # A turn is handed over by giving the baton of whoever runs next (a member's ``go``, or ``_back`` for the
        # coordinator): only that thread wakes, whatever the number of members. The members ready to run go in a
        # sweep: each hands the turn straight to the next, the last back to the coordinator (one thread switch a
        # member, where a turn to and from the coordinator took two).
        self._back = _Baton()
        self._local = threading.local()
        self.member_seconds = 0.0  # host time the members ran their own code (all runs of this object)

    def inside(self) -> bool:
        """Whether the calling thread is one of this object's members (so :meth:`meet` can be called)."""
        return getattr(self._local, "member", None) is not None

    def run(self, work: Sequence[Callable[[], Any]]) -> list[Any]:
        """Run every item of ``work`` to its end, in turns; return each one's result or the exception it raised.

        Members start in order; each runs until it finishes or meets. When none can run on, the waiting
        members' requests go to ``shared`` together and those members become ready to run again.
        """
        members = [_Member(item) for item in work]
        interrupted: BaseException | None = None
        for position, member in enumerate(members):
            member.thread = threading.Thread(
                target=self._body, args=(member,), name=f"{self._name}-{position}", daemon=True
            )
            member.thread.start()
        while not all(member.done for member in members):
            ready = [member for member in members if not member.done and member.request is _NOTHING]
            if ready:
                start = time.perf_counter()
                self._sweep(ready)
                self.member_seconds += time.perf_counter() - start
            waiting = [member for member in members if not member.done and member.request is not _NOTHING]
            if not waiting:
                continue
            try:
                answers = list(self._shared([member.request for member in waiting]))
                if len(answers) != len(waiting):
                    raise RuntimeError(f"The shared step answered {len(answers)} of {len(waiting)} requests.")
            except BaseException as error:  # the shared step failed as a whole: every waiting member sees it
                answers = [error] * len(waiting)
                if not isinstance(error, Exception):  # an interrupt: raised here once the members have ended
                    interrupted = interrupted or error
            for member, answer in zip(waiting, answers, strict=True):
                member.request, member.answer = _NOTHING, answer
        for member in members:
            assert member.thread is not None
            member.thread.join()
        if interrupted is not None:
            raise interrupted
        return [member.outcome for member in members]

    def meet(self, request: Request) -> Answer:
        """From inside a member's work: hand ``request`` to the shared step and wait for this member's answer
        (the other members run meanwhile).

        Raises:
            RuntimeError: When called from a thread that is not a member.
            Exception: The member's answer, when it is an exception.
        """
        member: _Member | None = getattr(self._local, "member", None)
        if member is None:
            raise RuntimeError("Turns.meet() is called from inside a member's work only.")
        member.request = request
        self._pass_on(member)
        member.go.take()
        answer, member.answer = member.answer, _NOTHING
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def _sweep(self, ready: list[_Member]) -> None:
        """Let each member of ``ready`` run in turn until it finishes or meets, each handing the turn to the next."""
        for member, after in zip(ready, [*ready[1:], None], strict=True):
            member.after = after
        ready[0].go.give()
        self._back.take()

    def _pass_on(self, member: _Member) -> None:
        """``member`` stopped (it met or ended): the next member of its sweep runs, or the coordinator."""
        after, member.after = member.after, None
        (self._back if after is None else after.go).give()

    def _body(self, member: _Member) -> None:
        self._local.member = member
        member.go.take()
        try:
            if self._setup is not None:
                self._setup()
            member.outcome = member.work()
        except BaseException as error:  # the member's own failure, handed back to the caller
            member.outcome = error
        finally:
            member.done = True
            self._pass_on(member)


def each_alone_after_failure(
    run: Callable[[list[Request]], Sequence[Answer]],
    requests: list[Request],
    what: str,
    doing: str,
    again: Callable[[Request], None] | None = None,
) -> list[Answer | BaseException]:
    """``run`` over every request at once (a shared step); when that fails with several requests, ``run`` over
    each alone (after ``again(request)``, which puts the request back as it was), so that only a request that
    fails alone fails: its answer is then its error. ``what`` and ``doing`` word the log line ("A shared
    decode of 3 trials failed (...); decoding them one by one.")."""
    try:
        return list(run(requests))
    except Exception as error:
        if len(requests) == 1:
            raise
        if isinstance(error, torch.cuda.OutOfMemoryError):
            torch.cuda.empty_cache()
        _logger.warning(
            "A shared %s of %d trials failed (%s: %s); %s them one by one.",
            what,
            len(requests),
            type(error).__name__,
            error,
            doing,
        )
    answers: list[Answer | BaseException] = []
    for request in requests:
        if again is not None:
            again(request)
        try:
            answers.append(run([request])[0])
        except Exception as own:
            answers.append(own)
    return answers
