"""The device's slots: how many trials it holds at once, leased one per trial.

A counting semaphore with priorities (a resumed trial goes before a new one) and slots lent beside the
device's own (a schedule that keeps waiting trials asks for one more so that a new config can start). The
study's pool takes a lease per trial; the device's scheduler lends.
"""

from __future__ import annotations

import threading
from typing import Any


class Lease:
    """One slot held by one trial; :meth:`release` gives it back, once (later calls do nothing)."""

    def __init__(self, slots: Slots) -> None:
        self._slots = slots
        self.held = True

    def release(self) -> None:
        self._slots._give_back(self)


class Slots:
    """A counting semaphore of leases, where resumed trials go before new ones."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.base = size
        self._used = 0
        self._resuming = 0
        self._cond = threading.Condition()

    def lend(self, most: int) -> bool:
        """One more slot, for a new trial beside trials that wait (a schedule's promotion rule) and keep theirs;
        it goes away again with the next slot given back. ``False``: ``most`` slots are out already."""
        with self._cond:
            if self.size >= most:
                return False
            self.size += 1
            self._cond.notify_all()
            return True

    def acquire(self, *, resume: bool = False) -> Lease:
        """Wait for a free slot and hold it (``resume``: before any new trial)."""
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
            return Lease(self)

    def _give_back(self, lease: Lease) -> None:
        with self._cond:
            if lease.held:
                lease.held = False
                self._used -= 1
                if self.size > self.base:  # a lent slot goes back
                    self.size -= 1
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
