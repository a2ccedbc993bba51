"""Several devices: one worker process per device, all pulling trials from the study's storage (CPU here)."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import optuna
import pytest
from helpers import lora, sft_args
from optuna.trial import TrialState

from optuna_rapidfire import RapidFireExecutor
from optuna_rapidfire._processes import Tickets
from optuna_rapidfire._study import _attrs


def configure(trial: optuna.Trial):
    # Module level: it travels to the worker processes by pickling.
    lr = trial.suggest_categorical("learning_rate", [1e-3, 3e-3, 1e-2, 3e-2])
    return lora(r=4, lora_dropout=0.1), sft_args(learning_rate=lr, seed=4)


def test_trials_are_shared_by_two_worker_processes(tiny_model, train_ds, eval_ds, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'rf.db'}"
    study = optuna.create_study(storage=url, study_name="multi", pruner=optuna.pruners.NopPruner())
    for lr in (1e-3, 3e-3, 1e-2, 3e-2):
        study.enqueue_trial({"learning_rate": lr})
    settings = {
        "model": tiny_model,
        "train_dataset": train_ds,
        "eval_dataset": eval_ds,
        "num_chunks": 3,
        "max_concurrent_trials": 2,
        "output_dir": tmp_path / "out",
        "show_progress_bar": False,
        "schedule": "promote_all",  # every trial trains to the end
    }
    executor = RapidFireExecutor(**settings, devices=["cpu", "cpu"])
    executor.optimize(study, configure, n_trials=4)

    trials = study.get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 4
    workers = {t.user_attrs[_attrs.WORKER] for t in trials}
    assert len({w.split(":")[1] for w in workers}) == 2  # two processes took trials

    # What a trial computes does not depend on which process ran it.
    alone = optuna.create_study(pruner=optuna.pruners.NopPruner())
    alone.enqueue_trial({"learning_rate": 1e-2})
    single = RapidFireExecutor(**settings, devices="cpu")
    single.optimize(alone, configure, n_trials=1)
    single.close()
    twin = next(t for t in trials if t.params["learning_rate"] == 1e-2)
    assert twin.intermediate_values == alone.trials[0].intermediate_values


def test_several_devices_need_a_shared_storage_and_picklable_arguments(tiny_model, train_ds, eval_ds) -> None:
    executor = RapidFireExecutor(
        model=tiny_model, train_dataset=train_ds, eval_dataset=eval_ds, devices=["cpu", "cpu"], show_progress_bar=False
    )
    with pytest.raises(ValueError, match="a storage they can all open"):
        executor.optimize(optuna.create_study(), configure, n_trials=2)
    shared = optuna.create_study(storage="sqlite:///:memory:")
    with pytest.raises(ValueError, match="configure must be picklable"):
        executor.optimize(shared, lambda trial: configure(trial), n_trials=2)
    with pytest.raises(ValueError, match=r"an objective for study\.optimize runs on one device"):
        executor.objective(configure)


def test_tickets_count_the_trials_left_to_start_across_processes() -> None:
    tickets = Tickets(multiprocessing.get_context("spawn"), 3)
    assert [tickets.take() for _ in range(5)] == [True, True, True, False, False]
