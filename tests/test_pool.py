"""The trial pool behind executor.optimize: every enqueued trial runs once, also on SQLite."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import optuna

from optuna_rapidfire._pool import Slots, TrialPool


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
        pool.local.slot_taken = False
        with lock:
            runs.append(trial.number)
        time.sleep(0.01)
        slots.release()
        return trial.suggest_float("x", 0, 100)

    slots = Slots(8)
    pool = TrialPool(
        study,
        objective,
        slots,
        n_trials=n,
        timeout=None,
        callbacks=None,
        catch=(),
        gc_after_trial=False,
        paused=lambda: 0,
        end_paused=lambda: None,
        pause_grace=1.0,
        externally_finished=lambda number: False,
    )
    pool.run()
    assert sorted(runs) == list(range(n))
    trials = study.get_trials()
    assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE] * n
    assert sorted(t.params["x"] for t in trials) == [float(i) for i in range(n)]
