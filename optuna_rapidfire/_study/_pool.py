"""How many trials run at once: slots for live trials, and the thread pool behind ``executor.optimize``.

A live trial holds one of ``max_concurrent_trials`` slots; a paused trial gives its slot back and a
resumed one takes the next free slot before any new trial does. ``executor.optimize`` runs each trial
with Optuna's own ``study.optimize(n_trials=1)`` in a thread of its own (so asking, telling, heartbeats,
callbacks and logging are Optuna's), starting one whenever a slot is free; unlike a fixed ``n_jobs``
pool, a paused trial does not take a thread away from the live ones.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import hashlib
import os
import tempfile
import threading
import time
import warnings
from typing import IO, TYPE_CHECKING, Any

import optuna
from optuna.trial import TrialState

from optuna_rapidfire import _compat
from optuna_rapidfire._logging import get_logger
from optuna_rapidfire._study import _attrs, _commands
from optuna_rapidfire._study._storages import (
    STALE_REASON,
    StorageUnavailableError,
    file_path,
    on_long_outage,
    retrying,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from optuna_rapidfire._runtime._slots import Lease, Slots

_logger = get_logger(__name__)
_WAIT_SECONDS = 1.0  # how often a worker waiting for the study's end looks at the storage
_RETRY_ON_ITS_WAY_SECONDS = 120.0  # how long a stale trial's retry is waited for after the trial failed


def fail_stale_trials(study: optuna.Study) -> None:
    """``optuna.storages.fail_stale_trials`` through a storage that marks each stale trial as failed, with
    why, before it is failed (see ``_storages``)."""
    storage = retrying(_compat.storage(study), 0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(_compat.with_storage(study, storage))


def _storage_error_in(error: BaseException) -> StorageUnavailableError | None:
    """The StorageUnavailableError behind ``error``, if any: Optuna's tell, failing in turn while the
    storage is down, can raise something less telling on top of it."""
    seen: BaseException | None = error
    for _ in range(20):
        if seen is None:
            return None
        if isinstance(seen, StorageUnavailableError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _counts(
    storage: Any, trials: list[optuna.trial.FrozenTrial], counted: tuple[TrialState, ...]
) -> tuple[int, int, int]:
    """``(finished, running, waiting)``: trials in the ``counted`` states, running (a retry on its way included),
    and enqueued."""
    states = [t.state for t in trials]
    finished = sum(states.count(state) for state in counted)
    return (
        finished,
        states.count(TrialState.RUNNING) + _retries_on_their_way(storage, trials),
        states.count(TrialState.WAITING),
    )


def _retries_on_their_way(storage: Any, trials: list[optuna.trial.FrozenTrial]) -> int:
    """The trials failed as stale whose retry is not in the study yet but will be: Optuna fails every stale
    trial first and enqueues the retries after, so a worker counting in between would see a config short and
    sample a new one besides the retry (two trials for one config). Each counts as running for a while after it
    failed; a retry that never comes (the worker failing it died in between) stops being waited for then."""
    retried = {t.system_attrs["retry_history"][-1] for t in trials if t.system_attrs.get("retry_history")}
    now = datetime.datetime.now()
    return sum(
        1
        for t in trials
        if t.state == TrialState.FAIL
        and t.number not in retried
        and str(t.user_attrs.get(_attrs.FAIL_REASON, "")) == STALE_REASON
        and t.datetime_complete is not None
        and (now - t.datetime_complete).total_seconds() < _RETRY_ON_ITS_WAY_SECONDS
        and _compat.retries_stale_trial(storage, t)
    )


class AskLock:
    """Serialises Optuna's ``study.ask`` across the pool's threads (and, on SQLite, processes).

    Popping an enqueued (WAITING) trial is a read-then-write in Optuna's RDB storage; PostgreSQL and
    MySQL make it atomic with ``SELECT ... FOR UPDATE``, SQLite does not, so two threads or processes can
    both pop the same trial and run it twice. The pool holds this lock from before a thread asks until
    its objective starts. On SQLite a lock file extends it to the other worker processes of the machine:
    it lives in the temporary folder, named after the database's path, so nothing is left beside the
    database (removing a lock file that other processes may hold would break the lock).
    """

    def __init__(self, study: optuna.Study) -> None:
        self._thread_lock = threading.Lock()
        path = file_path(study, journal=False)
        self._path = None
        if path is not None:
            digest = hashlib.sha256(path.encode()).hexdigest()[:24]
            self._path = os.path.join(tempfile.gettempdir(), f"optuna-rapidfire-ask-{digest}.lock")

    def acquire(self) -> IO[bytes] | None:
        self._thread_lock.acquire()
        if self._path is None:
            return None
        try:
            handle = open(self._path, "ab")  # noqa: SIM115 - held until release
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError:  # no writable temporary folder: threads are still serialised
            _logger.debug("No lock file %s; asks are serialised within this process only.", self._path)
            return None
        return handle

    def release(self, handle: IO[bytes] | None) -> None:
        if handle is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(handle, fcntl.LOCK_UN)
            handle.close()
        self._thread_lock.release()


class TrialPool:
    """Runs ``n_trials`` trials of ``objective`` on ``study``, one thread per trial, as slots allow.

    Args:
        study: The study.
        objective: The executor's objective.
        slots: The device's slots; the pool takes a lease for each trial it starts and hands it to the
            trial's driver.
        n_trials: Trials to start (``None``: until ``timeout`` or ``study.stop()``).
        timeout: Seconds after which no new trial starts.
        callbacks, catch, gc_after_trial: As in ``study.optimize``.
        paused: Number of trials of this pool that are paused now.
        end_paused: Ends paused trials (as PRUNED).
        pause_grace: Seconds to wait for a resume once only paused trials are left, before
            ``end_paused``.
        externally_finished: Whether the trial ``number`` was finished from outside (dashboard "Fail
            Trial"): Optuna's tell then raises, and the pool goes on instead of failing.
        retry_seconds: How long the trials' storage calls retry while the storage is unreachable.
        after_long_outage: Called with its length once the storage is back after an outage longer than its
            heartbeat grace period (other workers may have failed this pool's trials meanwhile).
        target: ``(n, states)``: run until the study (all workers together) has ``n`` trials in ``states``
            (finished states, from a ``MaxTrialsCallback``),
            and nothing is left running elsewhere that could still come back as a retry.
        take_ticket: With several worker processes, takes one of the trials left to start among all
            of them (``False``: none is left), so a worker that started late takes fewer trials.
    """

    def __init__(
        self,
        study: optuna.Study,
        objective: Callable[[optuna.Trial], float],
        slots: Slots,
        *,
        n_trials: int | None,
        timeout: float | None,
        callbacks: Iterable[Callable[[optuna.Study, optuna.trial.FrozenTrial], None]] | None,
        catch: tuple[type[Exception], ...],
        gc_after_trial: bool,
        paused: Callable[[], int],
        end_paused: Callable[[], None],
        pause_grace: float,
        externally_finished: Callable[[int], bool],
        take_ticket: Callable[[], bool] | None = None,
        target: tuple[int, tuple[TrialState, ...]] | None = None,
        retry_seconds: float = 0.0,
        after_long_outage: Callable[[float], None] | None = None,
    ) -> None:
        self.study = study
        self.objective = objective
        self.slots = slots
        self.n_trials = n_trials
        self.timeout = timeout
        self.callbacks = list(callbacks or [])
        self.catch = catch
        self.gc_after_trial = gc_after_trial
        self._paused = paused
        self._end_paused = end_paused
        self._pause_grace = pause_grace
        self._externally_finished = externally_finished
        self._take_ticket = take_ticket
        self.target = target
        self._retry_seconds = retry_seconds
        self._unasked = 0  # threads started that have not asked for their trial yet
        self._by_hand = 0  # threads whose trial is a clone asked for by hand (not counted toward n_trials)
        self._first_new: int | None = None  # the first trial number enqueued or asked for during this call
        self._told_by_hand = False
        self._told_waiting = False
        self._storage = retrying(_compat.storage(study), retry_seconds)
        if after_long_outage is not None:
            on_long_outage(self._storage, after_long_outage)
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._stop = False
        self._error: BaseException | None = None
        self.local = threading.local()
        self._ask_lock = AskLock(study)

    def run(self, on_interrupt: Callable[[KeyboardInterrupt], None] | None = None) -> None:
        """Start trials until the budget is spent, then wait for them to end.

        A first ``KeyboardInterrupt`` (Ctrl-C) starts no further trial, calls ``on_interrupt`` with it (which ends
        the live trials after their chunk in flight), waits for them and raises it; a second one stops waiting at
        once.
        """
        try:
            self._run()
        except KeyboardInterrupt as error:
            if on_interrupt is None:
                raise
            self._stop = True
            on_interrupt(error)
            self._wait_for_trials()
            raise

    def _run(self) -> None:
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        self._first_new = len(self._storage.get_all_trials(_compat.study_id(self.study), deepcopy=False))
        self.slots.set_starting(True)
        try:
            self._start_trials(deadline)
        finally:
            self.slots.set_starting(False)  # the device's schedule may now treat its rungs as final
        self._wait_for_trials(lambda: self._start_clones_asked_by_hand(deadline))

    def _start_trials(self, deadline: float | None) -> None:
        started = 0
        while not self._should_stop_starting(started, deadline):
            if self.slots.free() <= 0:
                self.slots.wait_for_change(0.5)
                continue
            if self.target is not None:
                with self._lock:
                    unasked = self._unasked
                if unasked:  # a started thread has not taken its trial yet: the storage does not show it
                    self.slots.wait_for_change(0.05)
                    continue
                verdict = self._target_verdict()
                if verdict == "done":
                    break
                if verdict == "wait":
                    self.slots.wait_for_change(_WAIT_SECONDS)
                    continue
            lease = self.slots.acquire(starting=True)
            fail_stale_trials(_compat.with_storage(self.study, self._storage))  # before Optuna's own call does
            if self._take_ticket is not None and not self._take_ticket():
                lease.release()
                break
            self._start_one(lease, str(started))
            started += 1

    def _start_one(self, lease: Lease, name: str) -> None:
        thread = threading.Thread(target=self._one_trial, args=(lease,), name=f"rapidfire-trial-{name}", daemon=True)
        with self._lock:
            self._threads.append(thread)
            self._unasked += 1
        thread.start()

    def _wait_for_trials(self, meanwhile: Callable[[], None] | None = None) -> None:
        """Wait for the started trials to end, calling ``meanwhile`` about every second (and once more when they
        have ended, so that what it starts is waited for too)."""
        only_paused_since: float | None = None
        looked = 0.0
        while True:
            if meanwhile is not None and time.monotonic() - looked >= _WAIT_SECONDS:
                looked = time.monotonic()
                meanwhile()
            with self._lock:
                alive = [t for t in self._threads if t.is_alive()]
            if not alive and meanwhile is not None:
                meanwhile()  # a slot the last trial freed may go to what it starts
                with self._lock:
                    alive = [t for t in self._threads if t.is_alive()]
            if not alive:
                break
            if len(alive) > self._paused():
                only_paused_since = None
            elif only_paused_since is None:
                only_paused_since = time.monotonic()
                _logger.info(
                    "Only paused trials are left; they end as PRUNED unless resumed within %.0f s.", self._pause_grace
                )
            elif time.monotonic() - only_paused_since >= self._pause_grace:
                self._end_paused()
            self.slots.wait_for_change(0.2)
        for thread in self._threads:
            thread.join()
        if self._error is not None:
            raise self._error

    def _target_verdict(self) -> str:
        """With ``target``: ``start`` a trial, ``wait`` (another worker's trials may still need a retry),
        or ``done`` (the study has the target's trials and nothing is left to run)."""
        storage = self._storage
        # Optuna does this when a trial starts; a worker waiting for the study's end does it too, so the trials
        # of a dead worker come back (as retries) while others can take them.
        fail_stale_trials(_compat.with_storage(self.study, storage))
        assert self.target is not None
        wanted, counted = self.target
        trials = storage.get_all_trials(_compat.study_id(self.study), deepcopy=False)
        finished, running, waiting = _counts(storage, trials, counted)
        if finished >= wanted:
            return "done"
        if waiting or finished + running < wanted:
            return "start"
        with self._lock:
            mine = sum(t.is_alive() for t in self._threads)
        if running <= mine:
            # Every running trial is this worker's: wait for them, since one that fails leaves the target
            # short and is replaced (a paused one is not waited for here: the pause grace ends it).
            return "wait" if mine > self._paused() else "done"
        if not self._told_waiting:
            self._told_waiting = True
            _logger.info(
                "Waiting for %d trial(s) running on other workers%s.",
                running - mine,
                ""
                if _compat.heartbeats_enabled(storage)
                else " (without heartbeats, a dead worker's trials never end: "
                "give the storage a heartbeat_interval, or a timeout to this call)",
            )
        return "wait"

    def _should_stop_starting(self, started: int, deadline: float | None) -> bool:
        if self._stop or self._error is not None:
            return True
        if self.n_trials is not None:
            while True:  # a thread that has not asked yet may take a clone asked for by hand, not counted
                with self._lock:
                    unasked, counted = self._unasked, started - self._by_hand
                if counted < self.n_trials:
                    break
                if not unasked:
                    return True
                self.slots.wait_for_change(0.05)
        return deadline is not None and time.monotonic() >= deadline

    def _start_clones_asked_by_hand(self, deadline: float | None) -> None:
        """Once the budget is spent: start a thread for a clone a person asked for during this call, when a slot
        is free and the next trial the study hands out (the oldest enqueued) is one."""
        if self._stop or self._error is not None or (deadline is not None and time.monotonic() >= deadline):
            return
        with self._lock:
            if self._unasked or self.slots.free() <= 0:
                return
        waiting = self._storage.get_all_trials(
            _compat.study_id(self.study), deepcopy=False, states=(TrialState.WAITING,)
        )
        oldest = min(waiting, key=lambda t: t.number, default=None)
        if oldest is not None and _commands.asked_by_hand(oldest) and oldest.number >= (self._first_new or 0):
            self._start_one(self.slots.acquire(starting=True), "by-hand")

    def _one_trial(self, lease: Lease) -> None:
        # A study object per thread (each has its own stop flag, which study.optimize resets on entry),
        # whose storage calls retry while the storage is down.
        study = _compat.with_storage(self.study, self._storage)
        self.local.lease = lease  # the trial's driver takes it over (take_lease)
        self.local.trial_number = None
        self.local.ask_handle = self._ask_lock.acquire()
        self.local.asking = True
        try:
            study.optimize(
                self.objective,
                n_trials=1,
                catch=self.catch,
                callbacks=[*self.callbacks, self._watch_stop],
                gc_after_trial=self.gc_after_trial,
                show_progress_bar=False,
            )
        except BaseException as error:
            number = self.local.trial_number
            if number is not None and self._externally_finished(number):
                _logger.debug("Trial %d was finished from outside the executor; the study goes on.", number)
            else:
                with self._lock:
                    self._error = self._error or _storage_error_in(error) or error
        finally:
            self.asked()
            lease.release()  # the driver gave it back already, or the objective never ran
            self.slots.notify()

    def take_lease(self, trial_number: int, *, by_hand: bool = False) -> Lease | None:
        """The slot the pool took for the calling thread, handed to its trial ``trial_number`` (once);
        ``by_hand``: the trial is a clone a person asked for; one asked for during this call does not count
        toward ``n_trials``."""
        lease: Lease | None = getattr(self.local, "lease", None)
        self.local.lease = None
        self.local.trial_number = trial_number
        # A clone enqueued before this call is an enqueued trial like any other (Optuna counts it).
        by_hand = by_hand and self._first_new is not None and trial_number >= self._first_new
        if by_hand and lease is not None:
            with self._lock:
                self._by_hand += 1
                told, self._told_by_hand = self._told_by_hand, True
            if not told and (self.n_trials is not None or self.target is not None):
                _logger.info(
                    "Trial %d is a clone asked for by hand: it trains in this study now, and clones asked for by "
                    "hand do not count toward the study's trial budget.",
                    trial_number,
                )
        return lease

    def asked(self) -> None:
        """The calling thread's trial is asked (its objective runs): other threads may ask now."""
        if getattr(self.local, "asking", False):
            self.local.asking = False
            self._ask_lock.release(self.local.ask_handle)
            self.local.ask_handle = None
            with self._lock:
                self._unasked -= 1
            self.slots.notify()

    def stop(self) -> None:
        """Start no further trial (a mistake every trial would hit; those running end as they do)."""
        self._stop = True
        self.slots.notify()

    def _watch_stop(self, study: optuna.Study, trial: Any) -> None:
        if _compat.stop_requested(study):
            self._stop = True
