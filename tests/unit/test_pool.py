"""The trial pool behind executor.optimize: every enqueued trial runs once, also on SQLite."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import optuna

from optuna_rapidfire._runtime._slots import Lease, Slots
from optuna_rapidfire._study._pool import TrialPool


def _pool(study: optuna.Study, objective: Any, slots: Slots, **settings: Any) -> TrialPool:
    """A pool with nothing paused, no timeout and no callbacks unless ``settings`` say otherwise."""
    defaults: dict[str, Any] = {"timeout": None, "callbacks": None, "catch": (), "gc_after_trial": False}
    defaults |= {"paused": lambda: 0, "end_paused": lambda: None, "pause_grace": 1.0}
    return TrialPool(study, objective, slots, externally_finished=lambda number: False, **(defaults | settings))


def test_enqueued_trials_each_run_once_on_sqlite(tmp_path: Path) -> None:
    # SQLite has no row lock: without the pool's ask lock, threads that ask at the same moment pop the
    # same WAITING trial and run it twice (seen as a hang of the executor before the lock existed).
    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 'pool.db'}")
    n = 24
    for i in range(n):
        study.enqueue_trial({"x": float(i)})
    runs: list[int] = []
    lock = threading.Lock()

    def objective(trial: optuna.Trial) -> float:
        pool.asked()
        lease = pool.take_lease(trial.number)
        with lock:
            runs.append(trial.number)
        time.sleep(0.01)
        lease.release()
        return trial.suggest_float("x", 0, 100)

    pool = _pool(study, objective, Slots(8), n_trials=n)
    pool.run()
    assert sorted(runs) == list(range(n))
    trials = study.get_trials()
    assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE] * n
    assert sorted(t.params["x"] for t in trials) == [float(i) for i in range(n)]


def test_a_lease_is_given_back_once_and_resumed_trials_go_first() -> None:
    slots = Slots(2)
    first, second = slots.acquire(), slots.acquire()
    assert slots.free() == 0
    first.release()
    first.release()  # a second release does nothing: the slot is not given back twice
    assert slots.free() == 1
    third = slots.acquire()  # full again
    taken: list[tuple[str, Lease]] = []

    def take(name: str, resume: bool) -> None:
        taken.append((name, slots.acquire(resume=resume)))

    waiting_new = threading.Thread(target=take, args=("new", False))
    waiting_new.start()
    time.sleep(0.05)
    waiting_resumed = threading.Thread(target=take, args=("resumed", True))
    waiting_resumed.start()
    time.sleep(0.05)
    second.release()  # one slot frees: the resumed trial takes it although the new one waited longer
    waiting_resumed.join(5)
    assert [name for name, _ in taken] == ["resumed"] and waiting_new.is_alive()
    third.release()
    waiting_new.join(5)
    assert [name for name, _ in taken] == ["resumed", "new"]


def test_a_trial_that_fails_is_replaced_until_the_target_count_is_met() -> None:
    """MaxTrialsCallback(4, states=(COMPLETE, PRUNED)) with a slot to spare: four trials start at once, enough
    if all end well; one fails, and a fifth is asked for, so that the study ends with exactly four counted."""
    study = optuna.create_study()
    counted = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)

    def objective(trial: optuna.Trial) -> float:
        pool.asked()
        lease = pool.take_lease(trial.number)
        time.sleep(0.3 if trial.number == 1 else 0.6)  # trial 1 fails while the others still run
        lease.release()
        return float("nan") if trial.number == 1 else 1.0

    callbacks = [optuna.study.MaxTrialsCallback(4, states=counted)]
    pool = _pool(study, objective, Slots(5), n_trials=None, callbacks=callbacks, target=(4, counted))
    pool.run()
    states = [t.state for t in study.trials]
    assert states.count(optuna.trial.TrialState.COMPLETE) == 4
    assert states.count(optuna.trial.TrialState.FAIL) == 1 and len(states) == 5


def test_the_summary_tells_a_trial_optuna_failed_outside_the_executor_as_failed() -> None:
    # Under a plain study.optimize, Optuna's heartbeat check fails a dead worker's trial through the user's own
    # storage, which cannot mark it: the summary must not list a FAIL trial as running.
    from optuna.trial import TrialState, create_trial

    from optuna_rapidfire._study import _attrs
    from optuna_rapidfire._tune._report import trial_entry

    def entry(state: TrialState, status: str) -> Any:
        value = 1.0 if state == TrialState.COMPLETE else None
        return trial_entry(create_trial(state=state, value=value, user_attrs={_attrs.STATUS: status}))["status"]

    assert entry(TrialState.FAIL, "running") == "failed"
    assert entry(TrialState.FAIL, "deleted") == "deleted"
    assert entry(TrialState.PRUNED, "paused-at-end") == "paused-at-end"
    assert entry(TrialState.RUNNING, "paused") == "paused"


def test_a_stale_trial_s_retry_on_its_way_is_waited_for_not_replaced_by_a_new_config(tmp_path: Path) -> None:
    """Optuna fails every stale trial first and enqueues their retries after: a worker counting in between
    must wait for the retry, not sample a new config besides it (seen in CI: three configs ended COMPLETE for
    a target of two, the retry and a new one)."""
    from optuna.trial import TrialState, create_trial

    from optuna_rapidfire._study import _attrs
    from optuna_rapidfire._study._storages import STALE_REASON

    retry = optuna.storages.RetryFailedTrialCallback(max_retry=1)
    storage = optuna.storages.RDBStorage(
        f"sqlite:///{tmp_path / 'stale.db'}", heartbeat_interval=60, failed_trial_callback=retry
    )
    study = optuna.create_study(storage=storage)
    distribution = optuna.distributions.CategoricalDistribution([1, 2, 3, 4])
    study.add_trial(create_trial(params={"x": 1}, distributions={"x": distribution}, value=1.0))
    stale = create_trial(
        state=TrialState.FAIL,
        params={"x": 2},
        distributions={"x": distribution},
        user_attrs={_attrs.FAIL_REASON: STALE_REASON},
    )
    study.add_trial(stale)  # failed by another worker's stale check, whose retry is not enqueued yet
    ran: list[int] = []

    def objective(trial: optuna.Trial) -> float:
        pool.asked()
        lease = pool.take_lease(trial.number)
        ran.append(trial.suggest_categorical("x", [1, 2, 3, 4]))
        lease.release()
        return 1.0

    counted = (TrialState.COMPLETE, TrialState.PRUNED)
    pool = _pool(study, objective, Slots(2), n_trials=None, target=(2, counted))
    runner = threading.Thread(target=pool.run)
    runner.start()
    time.sleep(2.5)  # the pool looks at the study every second meanwhile
    assert ran == [] and runner.is_alive()
    retry(study, study.trials[1])  # the other worker's callback enqueues the retry now
    runner.join(30)
    assert not runner.is_alive() and ran == [2]
    assert sorted(t.params["x"] for t in study.trials if t.state == TrialState.COMPLETE) == [1, 2]
