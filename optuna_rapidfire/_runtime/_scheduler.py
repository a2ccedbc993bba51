"""Who gets the device next.

The scheduler is a thread-safe table of the live trials of one device. Optuna's worker threads add
trials, tell it their decisions and wait on it; the device's worker thread asks it for the next task.
It knows nothing about models or training: an engine carries out the tasks it hands out.

What a trial *is* (its :class:`Status`) is kept apart from what was *decided* about it (a
:class:`Decision` from its driver, which may leave a :class:`Request` for the device) and from *which*
ready trials train next (a :class:`BaseSchedule`, one small class per policy, like Optuna's pruners).

Rules:

* housekeeping first (pausing, saving a finished trial's adapter, releasing a stopped trial's state),
  then building new trials;
* at the start of a study the scheduler waits briefly for the first wave to register, so that
  wave starts together;
* then the schedule picks who trains:

  - :class:`LockstepSchedule`: the device goes to a READY trial with the least progress, and only if
    no live trial has less progress, so live trials advance in lock-step rounds: chunk k of every
    trial before anyone's chunk k+1. A trial that joins later has the least progress and catches up
    first. A device that fuses takes every READY trial at the least progress as one group. Pruning
    decisions wait for round barriers: a trial's decision for step s waits until every other live
    trial has reported step s (:meth:`Scheduler.wait_for_round`);
  - :class:`PromoteSchedule`: ASHA's promotion rule, no barriers: a trial that reports at a rung waits
    there until it ranks in the top 1/eta of the trials that reported at that rung; new trials train
    their first chunk before anyone waiting; when nothing else may train, the best waiting trial goes
    on. A device that fuses takes every trial the rule lets train, each its own next chunk. A trial's
    pruning decision at step s is taken at once, against every trial that has reported step s (running,
    paused or finished);

* a paused trial is not live: nobody waits for it, and its state leaves the device.
"""

from __future__ import annotations

import enum
import inspect
import queue
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Collection, Mapping, Sequence


class Status(enum.Enum):
    """What a trial is doing on the device."""

    BUILDING = "building"  # registered, its state not created yet
    READY = "ready"  # may train its next chunk
    TRAINING = "training"  # on the device now
    AWAITING = "awaiting"  # reported a chunk; its driver has not decided yet
    PAUSED = "paused"  # keeps its state off the device, holds no slot, is not waited for
    GONE = "gone"  # left the device


class Decision(enum.Enum):
    """What a trial's driver decided after a chunk (as Ray Tune's schedulers answer a result)."""

    CONTINUE = "continue"  # train the next chunk
    PAUSE = "pause"  # a person stopped it: move its state off the device, keep it
    FINISH = "finish"  # complete: save its adapter, then release it
    STOP = "stop"  # pruned, failed or deleted: release its state


class Request(enum.Enum):
    """Housekeeping a decision leaves for the device's worker."""

    PAUSE = "pause"
    FINISH = "finish"
    RELEASE = "release"


class Task(enum.Enum):
    """What the worker is asked to do, for the list of entries the task carries (one, except a fused TRAIN)."""

    BUILD = "build"
    TRAIN = "train"  # one trial, or a group for an engine that fuses (which trials: the schedule's choice)
    PAUSE = "pause"
    FINISH = "finish"
    RELEASE = "release"


_REQUESTED = {Decision.PAUSE: Request.PAUSE, Decision.FINISH: Request.FINISH, Decision.STOP: Request.RELEASE}
_LIVE = (Status.BUILDING, Status.READY, Status.TRAINING, Status.AWAITING)


@dataclass(eq=False)
class Entry:
    """One trial as the scheduler sees it.

    Attributes:
        number: Optuna trial number (unique within the study).
        trial_id: Optuna trial id (unique within the storage).
        spec: What the engine needs to build the trial.
        status: What the trial is doing.
        request: Housekeeping asked for and not done yet.
        chunks_done: Chunks trained so far.
        reported: Highest step the trial has reported to Optuna (-1: none).
        screened: Highest step for which the trial's first pruning pass ran (-1: none).
        awaiting_since: When the trial last became AWAITING (``time.monotonic()``).
        mates: Numbers of the trials that trained the same step in the same pass (a fused gang's
            members at equal progress): under a schedule without barriers they decide together.
        events: What the worker tells the trial's Optuna thread, in order.
        runtime: The engine's per-trial object, owned by the worker thread.
    """

    number: int
    trial_id: int
    spec: Any
    status: Status = Status.BUILDING
    request: Request | None = None
    chunks_done: int = 0
    reported: int = -1
    screened: int = -1
    awaiting_since: float = 0.0
    mates: frozenset[int] = frozenset()
    events: queue.Queue[Any] = field(default_factory=queue.Queue)
    runtime: Any = None

    @property
    def live(self) -> bool:
        """Counts in the lock-step rounds: registered, not paused, not leaving."""
        return self.status in _LIVE and self.request is None

    @property
    def gone(self) -> bool:
        return self.status is Status.GONE


@dataclass(frozen=True)
class Reports:
    """What a schedule may read besides the live trials: every value reported on this device, by step
    (``values[step][trial number]``; finished and pruned trials' too), the study's direction, how many trials
    the device holds at once, and when a trial last arrived or left (``time.monotonic()``)."""

    values: Mapping[int, Mapping[int, float]]
    maximize: bool = False
    capacity: int = 1
    last_change: float = 0.0
    # Asks for one more slot beside the waiting trials, so that the sampler's next config can start (``False``:
    # none can be had); ``None``: nothing to ask.
    ask_for_trial: Callable[[], bool] | None = None


class BaseSchedule(ABC):
    """Which ready trials train next. Pure: it looks at the live trials and changes nothing.

    Attributes:
        name: The name ``RapidFireExecutor(schedule=...)`` accepts for it.
        barriers: Pruning decisions wait for round barriers (every live trial has reported the step)
            rather than being taken as soon as a trial reports.
    """

    name: str = ""
    barriers: bool = False

    @abstractmethod
    def choose(
        self, live: Sequence[Entry], *, fuse: bool, now: float, reports: Reports | None = None
    ) -> list[Entry] | float | None:
        """What the device does now.

        Args:
            live: The live trials, in number order.
            fuse: The engine trains a group of trials together (else one trial).
            now: ``time.monotonic()``.
            reports: The values reported so far (``None``: none known).

        Returns:
            The trials to train now (one unless ``fuse``); or a number of seconds after which to ask
            again if nothing changes; or ``None``: wait for a change.
        """

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class LockstepSchedule(BaseSchedule):
    """Least progress first, and nobody ahead of a live trial with less: chunk k of all before chunk k+1.

    Every config is compared with every other on the same data at the same time; pruning decisions
    wait for round barriers. Trials all complete at the end of their wave.
    """

    name = "lockstep"
    barriers = True

    def choose(
        self, live: Sequence[Entry], *, fuse: bool, now: float, reports: Reports | None = None
    ) -> list[Entry] | float | None:
        if not live:
            return None
        least = min(e.chunks_done for e in live)
        behind = [e for e in live if e.chunks_done == least]
        if fuse:
            if any(e.status in (Status.AWAITING, Status.BUILDING) for e in behind):
                return None  # a member of the group is still being decided on or built
            group = [e for e in behind if e.status is Status.READY]
            return group or None
        ready = next((e for e in behind if e.status is Status.READY), None)
        return None if ready is None else [ready]


class PromoteSchedule(BaseSchedule):
    """ASHA's promotion rule (Li et al., "A System for Massively Parallel Hyperparameter Tuning", MLSys 2020;
    Syne Tune's promotion variant): trials wait at rungs and only the best go on.

    A *rung* is a chunk boundary: after chunks 1, eta, eta², ... (``rungs="geometric"``, the default) or after
    every chunk (``rungs="every"``). A trial that has just reported at a rung waits there, and is promoted
    (trains its next chunk) only when it ranks in the top ``floor(n / eta)`` of the ``n`` trials that have
    reported at that rung on this device (running, paused, pruned or complete ones alike), and at least
    ``eta`` have. Whom the device trains, in this order:

    1. promotable trials, the highest rung first, the best value first;
    2. trials that have not reported yet (new trials and fresh clones), oldest first;
    3. trials between rungs, the most chunks first;
    4. when none of these is there and no live trial is being decided on or built: ask for the sampler's next
       config (when every slot holds a waiting trial, the device lends one more slot beside them, up to four
       times ``max_concurrent_trials``; waiting trials' states leave the device as the memory budget needs)
       and wait ``new_trial_seconds`` for it; if none comes (the study's budget is spent), promote the best
       waiting trial (the highest rung, the best value there).

    On an engine that fuses, everything of 1-3 trains together as a gang, each member its own next chunk.
    The study's pruner still makes every stop, judging a trial at step s against every trial that has
    reported step s; the schedule only decides who trains next. Ties go to the older trial.

    Worked example (eta = 2, rungs after every chunk, a minimizing study): trials 0-3 report 0.9, 0.5, 0.7,
    0.6 after chunk 1. Of the 4 at rung 1 the top 2 (1 and 3) are promoted and train chunk 2; 0 and 2 wait.
    1 and 3 report 0.4 and 0.55 after chunk 2: of the 2 at rung 2 the top 1 (trial 1) goes on; 3 waits. A
    new trial 4 arrives and trains before anyone waiting; it reports 0.45 after chunk 1: now 5 at rung 1,
    the top 2 are 1 and 4 (1 is past it), so 4 goes on.

    Args:
        eta: The reduction factor: the top 1/eta of a rung goes on (at least 2).
        rungs: ``"geometric"`` (after chunks 1, eta, eta², ...) or ``"every"`` chunk.
        gang_wait_seconds: On an engine that fuses, how long a gang waits for members whose decision
            about their last chunk is in flight (reporting and pruning take milliseconds; a member that
            misses a pass trains alone, and the rest of the gang after it). Never waits for a trial
            that is paused or being built.
        new_trial_seconds: How long a device with a free slot waits for a new trial before it promotes
            the best waiting one instead (4 above).
    """

    name = "promote"
    barriers = False

    def __init__(
        self,
        eta: int = 3,
        rungs: str = "geometric",
        gang_wait_seconds: float = 2.0,
        new_trial_seconds: float = 1.0,
    ) -> None:
        if not (isinstance(eta, int) and not isinstance(eta, bool) and eta >= 2):
            raise ValueError(f"eta must be an integer of at least 2, but got {eta=}.")
        if rungs not in ("geometric", "every"):
            raise ValueError(f"rungs must be 'geometric' or 'every', but got {rungs=}.")
        for name, value in (("gang_wait_seconds", gang_wait_seconds), ("new_trial_seconds", new_trial_seconds)):
            if not (isinstance(value, (int, float)) and value >= 0):
                raise ValueError(f"{name} must be a number of at least 0, but got {name}={value!r}.")
        self.eta = eta
        self.rungs = rungs
        self.gang_wait_seconds = float(gang_wait_seconds)
        self.new_trial_seconds = float(new_trial_seconds)

    def is_rung(self, chunks: int) -> bool:
        """Whether a trial that has trained ``chunks`` chunks stands at a rung."""
        if chunks < 1:
            return False
        if self.rungs == "every":
            return True
        while chunks % self.eta == 0:
            chunks //= self.eta
        return chunks == 1

    def promotable(self, entry: Entry, reports: Reports) -> bool:
        """Whether ``entry``, waiting at its rung, ranks in the top ``1/eta`` of the trials that reported there."""
        values = reports.values.get(entry.chunks_done - 1, {})
        if entry.number not in values or len(values) < self.eta:
            return False
        top = len(values) // self.eta
        return entry.number in [number for number, _ in _ranked(values, reports.maximize)[:top]]

    def choose(
        self, live: Sequence[Entry], *, fuse: bool, now: float, reports: Reports | None = None
    ) -> list[Entry] | float | None:
        reports = reports or Reports(values={})
        ready = [e for e in live if e.status is Status.READY]
        promoted, fresh, between, waiting = [], [], [], []
        for e in ready:
            values = reports.values.get(e.chunks_done - 1, {})
            if e.chunks_done == 0 or e.number not in values:
                fresh.append(e)
            elif not self.is_rung(e.chunks_done):
                between.append(e)
            elif self.promotable(e, reports):
                promoted.append(e)
            else:
                waiting.append(e)
        promoted.sort(key=lambda e: (-e.chunks_done, _rank(e, reports)))
        fresh.sort(key=lambda e: e.number)
        between.sort(key=lambda e: (-e.chunks_done, e.number))
        chosen = promoted + fresh + between
        if not chosen:
            if not waiting or any(e.status in (Status.AWAITING, Status.BUILDING) for e in live):
                return None  # a report or a build to come changes what may be promoted
            if now - reports.last_change < self.new_trial_seconds and len(live) < reports.capacity:
                return self.new_trial_seconds - (now - reports.last_change)  # the sampler's next config
            if len(live) >= reports.capacity and reports.ask_for_trial is not None and reports.ask_for_trial():
                return self.new_trial_seconds  # a slot beside the waiting trials, for the sampler's next config
            return [min(waiting, key=lambda e: (-e.chunks_done, _rank(e, reports)))]
        if not fuse:
            return chosen[:1]
        deciding = [now - e.awaiting_since for e in live if e.status is Status.AWAITING]
        if deciding:
            # Each member gets gang_wait_seconds from its own chunk's delivery; still bounded, since no
            # trial becomes AWAITING while the device waits.
            waited = min(deciding)
            if waited < self.gang_wait_seconds:
                return self.gang_wait_seconds - waited
        return chosen

    def __repr__(self) -> str:
        return (
            f"PromoteSchedule(eta={self.eta}, rungs={self.rungs!r}, gang_wait_seconds={self.gang_wait_seconds}, "
            f"new_trial_seconds={self.new_trial_seconds})"
        )


def _ranked(values: Mapping[int, float], maximize: bool) -> list[tuple[int, float]]:
    """Trials by value, best first (a NaN last), ties to the older trial."""

    def badness(item: tuple[int, float]) -> tuple[float, int]:
        value = item[1]
        if value != value:  # NaN
            return (float("inf"), item[0])
        return (-value if maximize else value, item[0])

    return sorted(values.items(), key=badness)


def _rank(entry: Entry, reports: Reports) -> int:
    """``entry``'s place at the rung it stands on (0: best)."""
    values = reports.values.get(entry.chunks_done - 1, {})
    order = [number for number, _ in _ranked(values, reports.maximize)]
    return order.index(entry.number) if entry.number in order else len(order)


SCHEDULES: dict[str, type[BaseSchedule]] = {"lockstep": LockstepSchedule, "promote": PromoteSchedule}
"""The schedules ``RapidFireExecutor(schedule=...)`` knows by name."""


def _takes_reports(schedule: BaseSchedule) -> bool:
    """Whether the schedule's ``choose`` takes ``reports`` (one written before it existed does not)."""
    parameters = inspect.signature(schedule.choose).parameters
    return "reports" in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def schedule_from(setting: str | BaseSchedule) -> BaseSchedule:
    """A schedule from its name or itself; the error names the bad value and the choices."""
    if isinstance(setting, BaseSchedule):
        return setting
    if isinstance(setting, str) and setting in SCHEDULES:
        return SCHEDULES[setting]()
    raise ValueError(
        f"schedule must be one of {', '.join(repr(n) for n in SCHEDULES)} or a BaseSchedule instance "
        f"(e.g. PromoteSchedule()), but got schedule={setting!r}."
    )


class Scheduler:
    """Thread-safe table of the trials of one device.

    Args:
        gather_seconds: How long the device waits for the first wave of a study to register.
        schedule: Which ready trials train next (:class:`LockstepSchedule` by default).
    """

    def __init__(self, *, gather_seconds: float = 1.0, schedule: BaseSchedule | None = None) -> None:
        self._cond = threading.Condition()
        self._entries: dict[int, Entry] = {}
        self._gather_seconds = gather_seconds
        self.schedule = schedule or LockstepSchedule()
        self._expected = 1
        self._gathering = True
        self._last_arrival = time.monotonic()
        self._last_change = self._last_arrival
        self._closed = False
        self._values: dict[int, dict[int, float]] = {}  # step -> trial number -> reported value
        self.maximize = False  # the study's direction (see :meth:`study`)
        self._study: Any = None
        self.capacity = 1
        # Gives a schedule one more slot for a new trial beside waiting ones (the device's slots); see Reports.
        self.lender: Any = None

    # -- Optuna's threads ---------------------------------------------------------------------

    def expect(self, first_wave: int) -> None:
        """Say how many trials the first wave will hold, so the device waits for them to register."""
        with self._cond:
            self._expected = max(1, first_wave)
            self.capacity = max(self.capacity, self._expected)
            if not self._entries:
                self._gathering = True

    def study(self, key: Any, *, maximize: bool) -> None:
        """Say which study the trials added next belong to: another study than the last one's starts with no
        reported values (its trial numbers start again at 0)."""
        with self._cond:
            if key != self._study:
                self._study, self._values = key, {}
            self.maximize = maximize

    def add(self, entry: Entry) -> None:
        """Register a new trial (BUILDING)."""
        with self._cond:
            if entry.number in self._entries:
                raise RuntimeError(
                    f"Trial {entry.number} is already running in this executor: the storage handed it out twice. "
                    "Optuna pops enqueued trials without a row lock on SQLite, so study.optimize(n_jobs > 1) can "
                    "run one twice; executor.optimize serialises asking and avoids this."
                )
            self._entries[entry.number] = entry
            self._last_arrival = self._last_change = time.monotonic()
            self._cond.notify_all()

    def mark(
        self, entry: Entry, *, reported: int | None = None, screened: int | None = None, value: float | None = None
    ) -> None:
        """Record that the trial reported (with ``value``) or screened a step."""
        with self._cond:
            if reported is not None:
                entry.reported = reported
                if value is not None:
                    self._values.setdefault(reported, {})[entry.number] = float(value)
            if screened is not None:
                entry.screened = screened
            self._cond.notify_all()

    def wait_for_round(self, entry: Entry, step: int, *, stage: str, among: Collection[int] | None = None) -> set[int]:
        """Block until every other live trial has reached ``stage`` ("reported"/"screened") at ``step``.

        Args:
            among: Wait only for these trials (numbers), e.g. the trial's :attr:`Entry.mates`.

        Returns:
            Trial ids of those peers (the trial's round).
        """
        with self._cond:
            while True:
                peers = [
                    e
                    for e in self._entries.values()
                    if e is not entry and e.live and (among is None or e.number in among)
                ]
                if all(getattr(e, stage) >= step for e in peers):
                    return {e.trial_id for e in peers}
                self._cond.wait()

    def decide(self, entry: Entry, decision: Decision) -> None:
        """The trial's driver decided: train on, or leave a request for the device.

        A trial the device has already removed (its gang failed after its chunk was delivered) stays
        gone: its driver learns it from the Failed event that follows.
        """
        with self._cond:
            if entry.status is Status.GONE:
                return
            if decision is Decision.CONTINUE:
                entry.status = Status.READY
            else:
                entry.request = _REQUESTED[decision]
            self._cond.notify_all()

    # -- the device's worker thread ------------------------------------------------------------

    def next_task(self, *, fuse: bool = False) -> tuple[Task, list[Entry]] | None:
        """Block until there is work for the device; ``None`` once closed.

        Args:
            fuse: The engine trains the ready trials at the least progress together (one TRAIN task).
        """
        with self._cond:
            while True:
                if self._closed:
                    return None
                task, wait = self._next(fuse)
                if task is not None:
                    return task
                self._cond.wait(timeout=wait)

    def _next(self, fuse: bool) -> tuple[tuple[Task, list[Entry]] | None, float | None]:
        entries = sorted(self._entries.values(), key=lambda e: e.number)
        for e in entries:
            if e.request is not None:
                return self._housekeeping(e), None
        for e in entries:
            if e.status is Status.BUILDING and e.runtime is None:
                return (Task.BUILD, [e]), None
        live = [e for e in entries if e.live]
        if not live:
            return None, None
        if self._gathering:
            quiet = time.monotonic() - self._last_arrival
            if len(live) < self._expected and quiet < self._gather_seconds:
                return None, self._gather_seconds - quiet
            self._gathering = False
        extra: dict[str, Any] = {}
        if _takes_reports(self.schedule):
            capacity = self.capacity if self.lender is None else max(self.capacity, self.lender.size)
            extra["reports"] = Reports(
                self._values, self.maximize, capacity, self._last_change, None if self.lender is None else self._lend
            )
        choice = self.schedule.choose(live, fuse=fuse, now=time.monotonic(), **extra)
        if not isinstance(choice, list):
            return None, choice
        group = [e for e in choice if e.status is Status.READY]  # a custom schedule may hand back others
        if not group:
            return None, None
        for e in group:
            e.status = Status.TRAINING
            e.mates = frozenset(o.number for o in group if o is not e and o.chunks_done == e.chunks_done)
        return (Task.TRAIN, group), None

    def _lend(self) -> bool:
        """One more slot from the lender (at most four times the device's own), counted as a change."""
        if not self.lender.lend(most=4 * self.lender.base):
            return False
        self._last_change = time.monotonic()
        return True

    @staticmethod
    def _housekeeping(entry: Entry) -> tuple[Task, list[Entry]]:
        if entry.request is Request.PAUSE:
            entry.request, entry.status = None, Status.PAUSED
            return Task.PAUSE, [entry]
        # A finish or release request stays (the entry is not live) until the worker removes the entry.
        return (Task.FINISH if entry.request is Request.FINISH else Task.RELEASE), [entry]

    def built(self, entry: Entry, runtime: Any, chunks_done: int = 0, finished: bool = False) -> None:
        """The trial's state exists (a warm clone starts with its parent's progress): it may train.

        A clone of a trial that had already trained all its chunks has nothing left to train: it
        waits for its Optuna thread to finish it.
        """
        with self._cond:
            entry.runtime = runtime
            entry.chunks_done = chunks_done
            entry.reported = entry.screened = chunks_done - 1
            if entry.status is Status.BUILDING:
                entry.status = Status.AWAITING if finished else Status.READY
                entry.awaiting_since = time.monotonic()
            self._cond.notify_all()

    def chunk_done(self, entry: Entry) -> None:
        """The trial trained and evaluated a chunk; its decision is pending."""
        with self._cond:
            entry.chunks_done += 1
            if entry.status is Status.TRAINING:
                entry.status = Status.AWAITING
                entry.awaiting_since = time.monotonic()
            self._cond.notify_all()

    def entries(self) -> list[Entry]:
        """Every registered trial, in number order."""
        with self._cond:
            return sorted(self._entries.values(), key=lambda e: e.number)

    def remove(self, entry: Entry) -> None:
        """The trial has left the device."""
        with self._cond:
            entry.status = Status.GONE
            entry.request = None
            entry.runtime = None
            self._entries.pop(entry.number, None)
            self._last_change = time.monotonic()
            if not self._entries:
                self._gathering = True
            self._cond.notify_all()

    def close(self) -> None:
        """Stop handing out tasks."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
