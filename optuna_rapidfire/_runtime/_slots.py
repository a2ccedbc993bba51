"""The device's slots: how many trials it holds at once, leased one per trial.

A counting semaphore with priorities (a resumed trial goes before a new one). Trials that a schedule keeps
waiting (at a rung, for a promotion) are *parked*: they keep their lease, but the device counts as many more
slots, so that new configs train beside them. The study's pool takes a lease per trial and says whether it
will start more; the device's scheduler parks.
"""

from __future__ import annotations

import threading
import time
from typing import Any


class Lease:
    """One slot held by one trial; :meth:`release` gives it back, once (later calls do nothing).

    A lease the pool takes for a trial it is about to start is *starting* until :meth:`registered` (its trial
    reached the device) or :meth:`release`: the device then knows a new trial is on its way. Such a lease is
    *pooled*: the pool gives it back once Optuna has told the trial's end, so that the trial started in its place
    is sampled after the sampler saw this one end (a clone sampler exploits a winner after a loser is pruned).
    """

    def __init__(self, slots: Slots, *, starting: bool = False) -> None:
        self._slots = slots
        self.held = True
        self.starting = starting
        self.pooled = starting
        self.since = time.monotonic()

    def registered(self) -> None:
        """The trial of this lease is on the device (no longer on its way)."""
        self._slots._arrived(self)

    def release(self) -> None:
        self._slots._give_back(self)


class Slots:
    """A counting semaphore of leases, where resumed trials go before new ones."""

    PARKED_MOST = 3
    """Parked trials count as extra slots up to this many times the device's own (their states take memory)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.base = size
        self._used = 0
        self._resuming = 0
        self._starting: list[Lease] = []  # leases of trials on their way to the device
        self.starts: bool | None = None  # whether the pool starts more trials; None: no pool (plain Optuna)
        self._cond = threading.Condition()

    def park(self, waiting: int) -> None:
        """``waiting`` trials wait for a promotion: they hold no slot of the device's own (up to
        :attr:`PARKED_MOST` times it), so as many new trials may start beside them."""
        with self._cond:
            size = self.base + min(max(waiting, 0), self.PARKED_MOST * self.base)
            if size != self.size:
                grew = size > self.size
                self.size = size
                if grew:
                    self._cond.notify_all()

    def more_trials(self) -> bool | None:
        """Whether a new trial may still come: ``True`` while one is on its way, ``False`` once the pool starts
        no more and none is, ``None`` when nobody can tell (the pool may start one, or trials come from a plain
        ``study.optimize``)."""
        with self._cond:
            if self._starting:
                return True
            return False if self.starts is False else None

    def arriving_since(self) -> float | None:
        """Since when (``time.monotonic()``) the oldest trial on its way has been coming; ``None``: none is."""
        with self._cond:
            return min((lease.since for lease in self._starting), default=None)

    def set_starting(self, starts: bool | None) -> None:
        """The pool says whether it starts more trials (``None``: no pool)."""
        with self._cond:
            self.starts = starts
            self._cond.notify_all()

    def acquire(self, *, resume: bool = False, starting: bool = False) -> Lease:
        """Wait for a free slot and hold it (``resume``: before any new trial; ``starting``: for a trial the
        pool is about to start, counted as on its way until it registers)."""
        with self._cond:
            if resume:
                self._resuming += 1
            try:
                while self._used >= self.size or (not resume and self._resuming > 0):
                    self._cond.wait()
            finally:
                if resume:
                    self._resuming -= 1
            self._used += 1
            lease = Lease(self, starting=starting)
            if starting:
                self._starting.append(lease)
            return lease

    def _arrived(self, lease: Lease) -> None:
        with self._cond:
            if lease.starting:
                lease.starting = False
                self._starting.remove(lease)
                self._cond.notify_all()

    def _give_back(self, lease: Lease) -> None:
        with self._cond:
            if lease.starting:
                lease.starting = False
                self._starting.remove(lease)
            if lease.held:
                lease.held = False
                self._used -= 1
                self._cond.notify_all()

    def free(self) -> int:
        """Slots a new trial could take now."""
        with self._cond:
            return self.size - self._used - self._resuming

    def wait_for_change(self, timeout: float) -> None:
        with self._cond:
            self._cond.wait(timeout)

    def notify(self) -> None:
        with self._cond:
            self._cond.notify_all()


class PausedTrials:
    """The device's paused trials. Their drivers (Optuna's threads) add and remove them; the executor ends
    them when a study is over and waits until none is left. Every change wakes whoever waits on ``slots``."""

    def __init__(self, slots: Slots) -> None:
        self._lock = threading.Lock()
        self._entries: list[Any] = []
        self._slots = slots

    def add(self, entry: Any) -> None:
        with self._lock:
            if entry not in self._entries:
                self._entries.append(entry)

    def discard(self, entry: Any) -> None:
        with self._lock:
            if entry in self._entries:
                self._entries.remove(entry)
        self._slots.notify()

    def entries(self) -> list[Any]:
        """The paused trials now (a copy)."""
        with self._lock:
            return list(self._entries)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def wait_until_empty(self) -> None:
        """Block until every paused trial has left (each is told the study is over first)."""
        while len(self):
            self._slots.wait_for_change(0.1)
