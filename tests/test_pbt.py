"""CloneSampler with the executor: Population Based Training end to end."""

from __future__ import annotations

import optuna
import pytest
from conftest import lora, sft_args
from optuna.trial import TrialState

from optuna_rapidfire import _attrs
from optuna_rapidfire.samplers import CloneSampler

LEARNING_RATES = [0.3, 1e-2, 2e-2, 3e-2]


def configure(trial: optuna.Trial):
    lr = trial.suggest_float("learning_rate", 1e-3, 0.5, log=True)
    return lora(target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], lora_dropout=0.1), sft_args(learning_rate=lr)


def test_pruned_losers_are_replaced_by_warm_perturbed_clones_of_winners(make_executor) -> None:
    study = optuna.create_study(
        sampler=CloneSampler(clone_probability=0.0, min_population=3, quantile=0.25, seed=0),
        pruner=optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=1),
    )
    for lr in LEARNING_RATES:  # a first wave with one clear loser (trial 0)
        study.enqueue_trial({"learning_rate": lr})
    executor = make_executor(num_chunks=5, max_concurrent_trials=4)
    executor.optimize(study, configure, n_trials=6)

    assert study.trials[0].state == TrialState.PRUNED
    clones = [t for t in study.trials if _attrs.PARENT in t.user_attrs]
    assert clones, "the pruned loser was not replaced by a clone"
    clone = clones[0]
    assert clone.user_attrs[_attrs.CLONE] == "warm"
    parent = study.trials[clone.user_attrs[_attrs.PARENT]]
    assert parent.number in (2, 3)  # top quantile of the first wave
    assert clone.params["learning_rate"] in (
        pytest.approx(parent.params["learning_rate"] * 0.8),
        pytest.approx(parent.params["learning_rate"] * 1.2),
    )
    branch = clone.user_attrs[_attrs.BRANCH_STEP]
    assert branch >= 2
    for step in range(branch):  # its curve continues the parent's
        assert clone.intermediate_values[step] == parent.intermediate_values[step]
    assert clone.state in (TrialState.COMPLETE, TrialState.PRUNED)
