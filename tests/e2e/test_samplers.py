"""Behaviour 6: any Optuna sampler works and sees running trials' intermediate values."""

from __future__ import annotations

import time
from typing import Any

import optuna
import pytest
from helpers import lora, sft_args
from optuna.trial import TrialState


def configure(trial: optuna.Trial):
    rank = trial.suggest_categorical("r", [2, 4])
    lr = trial.suggest_float("learning_rate", 1e-3, 3e-2, log=True)
    return lora(r=rank), sft_args(learning_rate=lr)


class PruneFirstTrial(optuna.pruners.BasePruner):
    """Prunes trial 0 after its first chunk, once trial 1 has reported its own first chunk: trial 2 is then asked
    while trial 1 is mid-run with a value in the storage (whichever trial's thread is quicker)."""

    def prune(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> bool:
        if trial.number != 0:
            return False
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            others = study.get_trials(deepcopy=False)
            if len(others) > 1 and 0 in others[1].intermediate_values:
                break
            time.sleep(0.01)
        return True


class Watching(optuna.samplers.BaseSampler):
    """Delegates to ``inner`` and records what it sees of running trials when a trial starts."""

    def __init__(self, inner: optuna.samplers.BaseSampler) -> None:
        self.inner = inner
        self.seen: list[dict[int, dict[int, float]]] = []

    def before_trial(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        self.seen.append({t.number: dict(t.intermediate_values) for t in running if t.number != trial.number})
        self.inner.before_trial(study, trial)

    def infer_relative_search_space(self, study, trial):
        return self.inner.infer_relative_search_space(study, trial)

    def sample_relative(self, study, trial, search_space):
        return self.inner.sample_relative(study, trial, search_space)

    def sample_independent(self, study, trial, param_name, param_distribution):
        return self.inner.sample_independent(study, trial, param_name, param_distribution)

    def after_trial(self, study, trial, state, values) -> None:
        self.inner.after_trial(study, trial, state, values)


SAMPLERS: dict[str, Any] = {
    "tpe": lambda: optuna.samplers.TPESampler(seed=0, n_startup_trials=2),
    "cmaes": lambda: optuna.samplers.CmaEsSampler(seed=0, n_startup_trials=2),
    "gp": lambda: optuna.samplers.GPSampler(seed=0, n_startup_trials=2),
    "random": lambda: optuna.samplers.RandomSampler(seed=0),
    "grid": lambda: optuna.samplers.GridSampler({"r": [2, 4], "learning_rate": [1e-3, 1e-2]}, seed=0),
}


@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_sampler_runs_and_sees_running_trials(make_executor, name: str) -> None:
    sampler = Watching(SAMPLERS[name]())
    executor = make_executor(num_chunks=2, max_concurrent_trials=2)
    study = optuna.create_study(sampler=sampler, pruner=PruneFirstTrial())
    executor.optimize(study, configure, n_trials=4)

    states = [t.state for t in study.trials]
    assert states[0] == TrialState.PRUNED
    assert states[1:] == [TrialState.COMPLETE] * 3
    assert all(len(t.intermediate_values) == 2 for t in study.trials[1:])
    # When trial 2 was asked, trial 1 was running with its first chunk's value in the storage.
    assert sampler.seen[2].get(1) and 0 in sampler.seen[2][1]
    if name == "grid":
        assert len({(t.params["r"], t.params["learning_rate"]) for t in study.trials}) == 4
