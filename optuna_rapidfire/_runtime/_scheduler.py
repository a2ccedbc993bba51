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
    there, holding no slot (the scheduler *parks* it in the device's slots, so a new trial starts beside
    it), until it ranks in the top 1/eta of the trials that reported at that rung; new trials train
    their first chunk before anyone waiting; once the budget is spent, the waiting trials no promotion
    can reach are stopped (a :class:`Stop`: each driver hears it as a :class:`Stopped` event and ends
    its trial as PRUNED). A device that fuses takes every trial the rule lets train, each its own next chunk. A trial's
    pruning decision at step s is taken at once, against every trial that has reported step s (running,
    paused or finished);

* a paused trial is not live: nobody waits for it, and its state leaves the device.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

from optuna_rapidfire._runtime._entry import Decision, Entry, Request, Stopped, Task
from optuna_rapidfire._runtime._pass_costs import PassCosts
from optuna_rapidfire._runtime._promote import PromoteSchedule
from optuna_rapidfire._runtime._schedule import BaseSchedule, Reports, Status, Stop
from optuna_rapidfire._runtime._schedules import takes_reports

if TYPE_CHECKING:
    from collections.abc import Callable, Collection


_REQUESTED = {Decision.PAUSE: Request.PAUSE, Decision.FINISH: Request.FINISH, Decision.STOP: Request.RELEASE}
FINISH_GATHER_SECONDS = 0.05
"""How long a trial's FINISH waits, after its chunk was delivered, for the mates it trained beside to decide: members
of a gang ending together are saved together (one bulk copy) and freed after every one is saved, rather than in
groups of the drivers that happened to decide first (their decisions came ~2 ms apart on an H100 host, and a second
group then waited ~0.1 s for the first one's saves and frees)."""


def _reports(scheduler: Scheduler, live: int, streaming: bool) -> Reports:
    """What a schedule that takes reports is told besides the trials (see :class:`Reports`)."""
    lender = scheduler.lender
    return Reports(
        scheduler._values,
        scheduler.maximize,
        max(scheduler.capacity, live) if lender is None else lender.base,
        scheduler._last_change,
        None if lender is None else lender.more_trials(),
        None if lender is None else lender.arriving_since(),
        streaming,
        scheduler.pass_costs.member_cost(),
    )


def _stop(live: list[Entry], stop: Stop) -> None:
    """End the READY trials a schedule stopped: each driver hears why and ends its trial as PRUNED."""
    for e in live:
        reason = stop.reasons.get(e.number)
        if reason is not None and e.status is Status.READY:
            _await(e)  # its driver decides (STOP) next; nothing trains it meanwhile
            e.events.put(Stopped(reason))


def _await(entry: Entry) -> None:
    entry.status = Status.AWAITING
    entry.awaiting_since = time.monotonic()


def _housekeeping(entry: Entry, entries: list[Entry]) -> tuple[Task, list[Entry]]:
    if entry.request is Request.PAUSE:
        entry.request, entry.status = None, Status.PAUSED
        return Task.PAUSE, [entry]
    # A finish or release request stays (the entry is not live) until the worker removes the entry.
    if entry.request is Request.FINISH:  # every trial finishing now (a gang's members): saved, then freed
        return Task.FINISH, [e for e in entries if e.request is Request.FINISH]
    return Task.RELEASE, [entry]


def _chores(entries: list[Entry], draining: bool) -> tuple[Task, list[Entry]] | float | None:
    """Housekeeping first, then a build (none while ``draining``), or ``None``; a number: seconds to wait for the mates
    of a finishing trial to decide (:data:`FINISH_GATHER_SECONDS`; nothing is built meanwhile)."""
    wait: float | None = None
    for e in entries:
        if e.request is Request.FINISH:
            left = _finish_wait(e, entries)
            if left > 0:
                wait = left if wait is None else min(wait, left)
                continue
        if e.request is not None:
            return _housekeeping(e, entries)
    if wait is not None:
        return wait
    for e in [] if draining else entries:
        if e.buildable:
            e.taken = True
            return Task.BUILD, [e]
    return None


def _finish_wait(entry: Entry, entries: list[Entry]) -> float:
    """How much longer the FINISH of ``entry`` waits for mates that have not decided (<= 0: none, or long enough)."""
    if not any(o.number in entry.mates and o.status is Status.AWAITING and o.request is None for o in entries):
        return 0.0
    return FINISH_GATHER_SECONDS - (time.monotonic() - entry.awaiting_since)


def _forget(scheduler: Scheduler, entry: Entry) -> None:
    entry.status, entry.request, entry.runtime = Status.GONE, None, None
    scheduler._entries.pop(entry.number, None)
    scheduler._last_change = time.monotonic()
    if not scheduler._entries:
        scheduler._gathering = True


class Scheduler:
    """Thread-safe table of the trials of one device.

    Args:
        gather_seconds: How long the device waits for the first wave of a study to register: the first chunk
            starts once every trial expected has registered, or nothing has registered or been built for this long.
        schedule: Which ready trials train next (:class:`PromoteSchedule` by default, as the executor's).
    """

    def __init__(self, *, gather_seconds: float = 1.0, schedule: BaseSchedule | None = None) -> None:
        self._cond = threading.Condition()
        self._entries: dict[int, Entry] = {}
        self._gather_seconds = gather_seconds
        self.schedule = schedule or PromoteSchedule()
        self._expected = 1
        self._gathering = True
        self._last_arrival = time.monotonic()
        self._last_change = self._last_arrival
        self._closed = False
        self._draining = False  # an interrupted study: nothing new starts, chunks in flight finish
        self._on_late: Callable[[Entry], None] | None = None  # told of each trial registered while draining
        self._values: dict[int, dict[int, float]] = {}  # step -> trial number -> reported value
        self.maximize = False  # the study's direction (see :meth:`study`)
        self._study: Any = None
        self.capacity = 1
        # The device's slots: the scheduler parks the trials its schedule keeps waiting there, and reads from
        # them whether new trials may still come (Reports.more_trials).
        self.lender: Any = None
        self._promotion_waits: frozenset[int] = frozenset()  # the schedule's waiting trials, as last asked
        self.pass_costs = PassCosts()  # the fused passes' seconds by member count (Reports.member_cost)

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
            late = self._on_late  # set only while draining
        if late is not None:  # asked before the interrupt, registered after it: it must end too
            late(entry)

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

    def pruning_peers(self, entry: Entry) -> frozenset[int] | None:
        """Whose reports the trial's pruning decision waits for: the schedule's answer
        (:meth:`BaseSchedule.pruning_peers`; ``None``: every live trial)."""
        with self._cond:
            view = entry.view()
        return self.schedule.pruning_peers(view)

    def decide(self, entry: Entry, decision: Decision) -> bool:
        """The trial's driver decided: train on, or leave a request for the device.

        A trial the device has already removed (its gang failed after its chunk was delivered) stays
        gone: its driver learns it from the Failed event that follows.

        Returns:
            Whether a PAUSE or STOP was carried out here (a queued trial whose build the device has not
            taken: nothing on the device to move or release), so that no event follows.
        """
        with self._cond:
            self._cond.notify_all()
            if entry.status is Status.GONE:
                return False
            queued = entry.status is Status.BUILDING and not entry.taken
            if decision is Decision.CONTINUE:
                # A queued trial (held, or paused before it was built) goes back to be built.
                unbuilt = queued or (entry.status is Status.PAUSED and not entry.taken)
                entry.status, entry.held = (Status.BUILDING if unbuilt else Status.READY), False
            elif queued and decision in (Decision.PAUSE, Decision.STOP):
                entry.status, entry.held = Status.PAUSED, False
                if decision is Decision.STOP:
                    _forget(self, entry)
                return True
            else:
                entry.request = _REQUESTED[decision]
            return False

    def activity(self, entry: Entry) -> str:
        """What the trial does now, in words for people (``""``: between two states)."""
        with self._cond:
            status, promotion = entry.status, entry.number in self._promotion_waits
        if status is Status.READY:
            return f"waiting at its rung after chunk {entry.chunks_done}" if promotion else "waiting for the device"
        return {Status.TRAINING: "training", Status.BUILDING: "queued", Status.PAUSED: "paused"}.get(status, "")

    def hold(self, entry: Entry) -> bool:
        """Keep a READY trial (at a rung, or waiting for the device) from being chosen, or a queued one (BUILDING)
        from being built, so that its driver acts on it now (a person's command) and then decides, as after a
        chunk; a queued trial being built then waits, built, for that decision. ``False``: neither, not held."""
        with self._cond:
            if entry.request is not None or entry.status not in (Status.READY, Status.BUILDING):
                return False
            if entry.status is Status.BUILDING:
                entry.held = True
            else:
                _await(entry)
            self._cond.notify_all()
            return True

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
        chore = _chores(entries, self._draining)
        if chore is not None or self._draining:
            return (None, chore) if isinstance(chore, float) else (chore, None)
        live = [e for e in entries if e.live]
        if not live:
            return None, None
        if self._gathering:
            quiet = time.monotonic() - self._last_arrival
            if len(live) < self._expected and quiet < self._gather_seconds:
                return None, self._gather_seconds - quiet
            self._gathering = False
        choice = self._choose(live, fuse)
        if not isinstance(choice, list):
            return None, choice
        if not choice:
            return None, None
        for e in choice:
            e.status = Status.TRAINING
            e.mates = frozenset(o.number for o in choice if o is not e and o.chunks_done == e.chunks_done)
        return (Task.TRAIN, choice), None

    def _choose(self, live: list[Entry], fuse: bool, streaming: bool = False) -> list[Entry] | float | None:
        """The schedule's choice among the live trials: the READY entries to train, or how long to wait (``None``:
        until a change). A :class:`Stop` is carried out here (its trials' drivers hear it)."""
        views = [e.view() for e in live]
        extra: dict[str, Any] = {}
        if takes_reports(self.schedule):
            reports = _reports(self, len(live), streaming)
            extra["reports"] = reports
            self._promotion_waits = self.schedule.waiting(views, reports)
            if self.lender is not None:
                self.lender.park(len(self._promotion_waits))
        choice = self.schedule.choose(views, fuse=fuse, now=time.monotonic(), **extra)
        if isinstance(choice, Stop):
            _stop(live, choice)
            return None
        if not isinstance(choice, list):
            return choice
        by_number = {e.number: e for e in live}
        chosen = [by_number.get(v.number) for v in choice]
        return [e for e in chosen if e is not None and e.status is Status.READY]  # a custom schedule may err

    def side_task(self) -> tuple[Task, list[Entry]] | None:
        """Housekeeping or a build to do between two passes of a stream (never a TRAIN), or ``None``; never blocks."""
        with self._cond:
            chore = _chores(sorted(self._entries.values(), key=lambda e: e.number), self._closed or self._draining)
        return None if isinstance(chore, float) else chore  # a finish waiting for its mates: later

    def join(self, room: int, fits: Callable[[Entry], bool]) -> list[Entry]:
        """The trials that take free slots of a stream now (at most ``room``, marked TRAINING), as the schedule
        chooses them; the first that does not ``fit`` the stream ends the list. Does not block."""
        with self._cond:
            if self._closed or self._draining or room < 1:
                return []
            live = [e for e in sorted(self._entries.values(), key=lambda e: e.number) if e.live]
            choice = self._choose(live, fuse=True, streaming=True)
            group: list[Entry] = []
            for e in choice if isinstance(choice, list) else []:
                if len(group) >= room or not fits(e):
                    break
                e.status = Status.TRAINING
                e.mates = frozenset()  # set when its chunk is delivered, with the members that ended beside it
                group.append(e)
            return group

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
                entry.status = Status.AWAITING if finished or entry.held else Status.READY
                entry.awaiting_since = time.monotonic()
            if self._gathering:  # a build slows the threads still configuring their trials: wait as long again
                self._last_arrival = time.monotonic()
            self._cond.notify_all()

    def chunk_done(self, entry: Entry, mates: frozenset[int] | None = None) -> None:
        """The trial trained and evaluated a chunk; its decision is pending. ``mates``: the trials that ended the
        same step at the same pass boundary of a stream (they decide together)."""
        with self._cond:
            if mates is not None:
                entry.mates = mates
            entry.chunks_done += 1
            if entry.status is Status.TRAINING:
                _await(entry)
            self._cond.notify_all()

    def entries(self) -> list[Entry]:
        """Every registered trial, in number order."""
        with self._cond:
            return sorted(self._entries.values(), key=lambda e: e.number)

    def remove(self, entry: Entry) -> None:
        """The trial has left the device."""
        with self._cond:
            _forget(self, entry)
            self._cond.notify_all()

    def settle(self, working: Callable[[], bool]) -> None:
        """Wait, while the device is ``working``, until the trials that ended left it: a driver completes its trial
        once its adapter is saved, before the device frees the trial's state."""
        with self._cond:
            while any(e.leaving for e in self._entries.values()) and not self._closed and working():
                self._cond.wait(timeout=0.1)

    def drain(self, draining: bool = True, on_late: Callable[[Entry], None] | None = None) -> list[Entry]:
        """Start nothing new (no build, no chunk) while ``draining``; housekeeping goes on, and chunks in flight
        finish. Returns the trials registered now; ``on_late`` is called with each trial registered later
        while draining (one whose thread was between Optuna's ask and registering)."""
        with self._cond:
            self._draining = draining
            self._on_late = on_late if draining else None
            self._cond.notify_all()
            return sorted(self._entries.values(), key=lambda e: e.number)

    def close(self) -> None:
        """Stop handing out tasks."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
