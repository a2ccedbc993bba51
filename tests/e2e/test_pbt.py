"""CloneSampler with the executor: Population Based Training end to end."""

from __future__ import annotations

import itertools
import time

import optuna
import pytest
from _numerics import assert_apart, gradient_terms
from helpers import lora, sft_args
from optuna.trial import TrialState
from transformers import AutoConfig

from optuna_rapidfire._study import _attrs
from optuna_rapidfire.samplers import CloneSampler

# Trial 0 hardly learns (a rate a thousand times too low, not a too high one, whose curve rounding decides);
# the others learn at different speeds.
LEARNING_RATES = [1e-5, 1e-2, 2e-2, 3e-2]


def configure(trial: optuna.Trial):
    lr = trial.suggest_float("learning_rate", 1e-5, 0.5, log=True)
    return lora(target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], lora_dropout=0.1), sft_args(learning_rate=lr)


# Lock-step on both engines: the loser must be pruned during the first wave (MedianPruner judges from step 1),
# and under "promote" it waits at its first rung (step 0) until the others are done.
@pytest.mark.parametrize(("engine", "schedule"), [("time_sliced", "lockstep"), ("fused", "lockstep")])
def test_pruned_losers_are_replaced_by_warm_perturbed_clones_of_winners(
    make_executor, tiny_model, engine: str, schedule: str
) -> None:
    study = optuna.create_study(
        sampler=CloneSampler(clone_probability=0.0, min_population=3, quantile=0.25, seed=0),
        pruner=optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=1),
    )
    for lr in LEARNING_RATES:  # a first wave with one clear loser (trial 0)
        study.enqueue_trial({"learning_rate": lr})
    executor = make_executor(engine=engine, schedule=schedule, num_chunks=5, max_concurrent_trials=4)
    executor.optimize(study, configure, n_trials=6)
    # The first wave's values are far apart at every step that the pruner and the sampler compare (from
    # step 1 on), so its ranking (who is pruned, who is a parent) cannot depend on rounding.
    terms = gradient_terms(AutoConfig.from_pretrained(tiny_model), rows=4, length=128)
    for a, b in itertools.combinations(study.trials[:4], 2):
        for step in (a.intermediate_values.keys() & b.intermediate_values.keys()) - {0}:
            value_a, value_b = a.intermediate_values[step], b.intermediate_values[step]
            assert_apart(value_a, value_b, terms=terms, what=f"trials {a.number} and {b.number} at step {step}")

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


class _Recording(optuna.samplers.RandomSampler):
    """Records when trials are sampled and told; telling takes a while (a sampler updating its model)."""

    def __init__(self) -> None:
        super().__init__(seed=0)
        self.calls: list[tuple[str, int]] = []

    def before_trial(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        self.calls.append(("sampled", trial.number))
        super().before_trial(study, trial)

    def after_trial(self, study, trial, state, values) -> None:  # type: ignore[no-untyped-def]
        self.calls.append(("told", trial.number))
        time.sleep(0.5)  # a trial started in this one's slot meanwhile would be sampled before it was told
        self.calls.append(("told done", trial.number))
        super().after_trial(study, trial, state, values)


def test_the_trial_started_in_an_ended_trials_slot_is_sampled_after_that_trial_was_told(make_executor) -> None:
    """A clone sampler exploits a winner when a loser is pruned (``after_trial``): the trial that takes the loser's
    slot must be sampled after that, not as soon as the device freed the slot."""
    sampler = _Recording()
    study = optuna.create_study(sampler=sampler)
    executor = make_executor(num_chunks=1, max_concurrent_trials=1)
    executor.optimize(study, configure, n_trials=3)
    assert sampler.calls == [(what, n) for n in range(3) for what in ("sampled", "told", "told done")]
