"""Who gets the device next.

The scheduler is a thread-safe table of the live trials of one device. Optuna's worker threads add
trials and wait on it; the device's worker thread asks it for the next task. It knows nothing about
models or training: an engine carries out the tasks it hands out.

Rules:

* housekeeping first (saving a finished trial's adapter, releasing a stopped trial's state), then
  building new trials;
* the device goes to a READY trial with the least progress, and only if no live trial has less
  progress, so live trials advance in lock-step rounds: chunk k of every trial before anyone's
  chunk k+1. A trial that joins later has the least progress and catches up first;
* at the start of a study the scheduler waits briefly for the first wave to register, so that
  wave starts together;
* round barriers: a trial's pruning decision for step s waits until every other live trial has
  reported step s (:meth:`Scheduler.wait_for_round`);
* a paused trial is not live: nobody waits for it, and its state leaves the device.
"""

from __future__ import annotations

import enum
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any


class Phase(enum.Enum):
    """Where a live trial is in its cycle."""

    BUILD = "build"  # registered, its state not yet created
    READY = "ready"  # may train its next chunk
    TRAINING = "training"  # on the device now
    AWAITING = "awaiting"  # reported a chunk, its pruning decision pending
    PAUSE = "pause"  # stopped by a person: move its state off the device
    PAUSED = "paused"  # keeps its state, holds no slot, is not waited for
    FINISH = "finish"  # complete: save the adapter, then release
    RELEASE = "release"  # pruned or failed: release the state
    GONE = "gone"


class Task(enum.Enum):
    """What the worker is asked to do for an entry."""

    BUILD = "build"
    TRAIN = "train"
    TRAIN_GANG = "train_gang"  # the fused engine: every ready trial at the least progress, together
    PAUSE = "pause"
    FINISH = "finish"
    RELEASE = "release"


_LIVE = (Phase.BUILD, Phase.READY, Phase.TRAINING, Phase.AWAITING)


@dataclass(eq=False)
class Entry:
    """One live trial as the scheduler sees it.

    Attributes:
        number: Optuna trial number (unique within the study).
        trial_id: Optuna trial id (unique within the storage).
        spec: What the engine needs to build the trial.
        chunks_done: Chunks trained so far.
        reported: Highest step the trial has reported to Optuna (-1: none).
        screened: Highest step for which the trial's first pruning pass ran (-1: none).
        events: What the worker tells the trial's Optuna thread, in order.
        runtime: The engine's per-trial object, owned by the worker thread.
    """

    number: int
    trial_id: int
    spec: Any
    phase: Phase = Phase.BUILD
    chunks_done: int = 0
    reported: int = -1
    screened: int = -1
    events: queue.Queue[Any] = field(default_factory=queue.Queue)
    runtime: Any = None


class Scheduler:
    """Thread-safe table of the live trials of one device."""

    def __init__(self, *, gather_seconds: float = 1.0) -> None:
        self._cond = threading.Condition()
        self._entries: dict[int, Entry] = {}
        self._gather_seconds = gather_seconds
        self._expected = 1
        self._gathering = True
        self._last_arrival = time.monotonic()
        self._closed = False
        self.fuse = False  # hand ready trials of equal progress to the worker together (fused engine)

    # -- Optuna's threads ---------------------------------------------------------------------

    def expect(self, first_wave: int) -> None:
        """Say how many trials the first wave will hold, so the device waits for them to register."""
        with self._cond:
            self._expected = max(1, first_wave)
            if not self._entries:
                self._gathering = True

    def add(self, entry: Entry) -> None:
        """Register a new live trial."""
        with self._cond:
            if entry.number in self._entries:
                raise RuntimeError(
                    f"Trial {entry.number} is already running in this executor: the storage handed it out twice. "
                    "Optuna pops enqueued trials without a row lock on SQLite, so study.optimize(n_jobs > 1) can "
                    "run one twice; executor.optimize serialises asking and avoids this."
                )
            self._entries[entry.number] = entry
            self._last_arrival = time.monotonic()
            self._cond.notify_all()

    def mark(self, entry: Entry, *, reported: int | None = None, screened: int | None = None) -> None:
        """Record that the trial reported (or screened) a step."""
        with self._cond:
            if reported is not None:
                entry.reported = reported
            if screened is not None:
                entry.screened = screened
            self._cond.notify_all()

    def wait_for_round(self, entry: Entry, step: int, *, stage: str) -> set[int]:
        """Block until every other live trial has reached ``stage`` ("reported"/"screened") at ``step``.

        Returns:
            Trial ids of those peers (the trial's round).
        """
        with self._cond:
            while True:
                peers = [e for e in self._entries.values() if e is not entry and e.phase in _LIVE]
                if all(getattr(e, stage) >= step for e in peers):
                    return {e.trial_id for e in peers}
                self._cond.wait()

    def set_phase(self, entry: Entry, phase: Phase) -> None:
        """Move a trial to ``phase`` (READY to continue, FINISH or RELEASE to leave)."""
        with self._cond:
            entry.phase = phase
            self._cond.notify_all()

    def live_numbers(self) -> list[int]:
        """Trial numbers of the live trials, in order."""
        with self._cond:
            return sorted(n for n, e in self._entries.items() if e.phase in _LIVE)

    # -- the device's worker thread ------------------------------------------------------------

    def next_task(self) -> tuple[Task, Entry] | None:
        """Block until there is work for the device; ``None`` once closed."""
        with self._cond:
            while True:
                if self._closed:
                    return None
                picked, wait = self._pick()
                if picked is not None:
                    return picked
                self._cond.wait(timeout=wait)

    def _pick(self) -> tuple[tuple[Task, Entry] | None, float | None]:
        entries = sorted(self._entries.values(), key=lambda e: e.number)
        for e in entries:
            if e.phase == Phase.FINISH:
                return (Task.FINISH, e), None
            if e.phase == Phase.RELEASE:
                return (Task.RELEASE, e), None
            if e.phase == Phase.PAUSE:
                e.phase = Phase.PAUSED
                return (Task.PAUSE, e), None
        for e in entries:
            if e.phase == Phase.BUILD and e.runtime is None:
                return (Task.BUILD, e), None
        live = [e for e in entries if e.phase in _LIVE]
        if not live:
            return None, None
        if self._gathering:
            quiet = time.monotonic() - self._last_arrival
            if len(live) < self._expected and quiet < self._gather_seconds:
                return None, self._gather_seconds - quiet
            self._gathering = False
        least = min(e.chunks_done for e in live)
        if self.fuse:
            at_least = [e for e in live if e.chunks_done == least]
            if any(e.phase in (Phase.AWAITING, Phase.BUILD) for e in at_least):
                return None, None  # a peer of the gang is still being decided on or built
            gang = [e for e in at_least if e.phase == Phase.READY]
            if gang:
                for e in gang:
                    e.phase = Phase.TRAINING
                return (Task.TRAIN_GANG, gang), None  # type: ignore[return-value]
            return None, None
        for e in live:
            if e.phase == Phase.READY and e.chunks_done == least:
                e.phase = Phase.TRAINING
                return (Task.TRAIN, e), None
        return None, None

    def built(self, entry: Entry, runtime: Any, chunks_done: int = 0, finished: bool = False) -> None:
        """The trial's state exists (a warm clone starts with its parent's progress): it may train.

        A clone of a trial that had already trained all its chunks has nothing left to train: it
        waits for its Optuna thread to finish it.
        """
        with self._cond:
            entry.runtime = runtime
            entry.chunks_done = chunks_done
            entry.reported = entry.screened = chunks_done - 1
            if entry.phase in _LIVE:
                entry.phase = Phase.AWAITING if finished else Phase.READY
            self._cond.notify_all()

    def find(self, number: int) -> Entry | None:
        """The registered trial ``number``, if any."""
        with self._cond:
            return self._entries.get(number)

    def chunk_done(self, entry: Entry) -> None:
        """The trial trained and evaluated a chunk; its decision is pending."""
        with self._cond:
            entry.chunks_done += 1
            if entry.phase in _LIVE:
                entry.phase = Phase.AWAITING
            self._cond.notify_all()

    def entries(self) -> list[Entry]:
        """Every registered trial, in number order."""
        with self._cond:
            return sorted(self._entries.values(), key=lambda e: e.number)

    def remove(self, entry: Entry) -> None:
        """The trial has left the device."""
        with self._cond:
            entry.phase = Phase.GONE
            entry.runtime = None
            self._entries.pop(entry.number, None)
            if not self._entries:
                self._gathering = True
            self._cond.notify_all()

    def close(self) -> None:
        """Stop handing out tasks."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
