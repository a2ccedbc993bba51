"""Behaviour 5, the central correctness test: a config gives the same per-chunk values alone or among others."""

from __future__ import annotations

import math

import optuna
import pytest
from helpers import by_number, lora, sft_args

TARGET = (
    lora(r=8, lora_dropout=0.2, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    sft_args(learning_rate=2e-2, per_device_train_batch_size=2, gradient_accumulation_steps=2, seed=7),
)
OTHERS = [
    (lora(r=4, lora_dropout=0.1), sft_args(learning_rate=5e-3, seed=1)),
    (lora(r=16, target_modules=["o_proj", "up_proj"]), sft_args(learning_rate=1e-1, per_device_train_batch_size=3)),
    (lora(r=2, lora_dropout=0.3), sft_args(learning_rate=3e-2, gradient_checkpointing=True, seed=7)),
]


def _values(make_executor, configs, position: int, **executor_kwargs) -> list[float]:
    executor = make_executor(num_chunks=3, max_concurrent_trials=len(configs), **executor_kwargs)
    study = optuna.create_study(pruner=optuna.pruners.NopPruner())
    executor.optimize(study, by_number(configs), n_trials=len(configs))
    if "state_memory_budget" in executor_kwargs:
        assert executor.stats().offloads > 0
    trial = study.trials[position]
    assert trial.state == optuna.trial.TrialState.COMPLETE
    values = [trial.intermediate_values[s] for s in sorted(trial.intermediate_values)]
    assert len(values) == 3
    return values


def _assert_close(a: list[float], b: list[float]) -> None:
    for x, y in zip(a, b, strict=True):
        assert math.isclose(x, y, rel_tol=1e-6, abs_tol=0.0), (a, b)


@pytest.mark.parametrize("position", [0, 2])
def test_same_values_alone_and_interleaved(make_executor, position: int) -> None:
    alone = _values(make_executor, [TARGET], 0)
    mixed = list(OTHERS)
    mixed.insert(position, TARGET)
    together = _values(make_executor, mixed, position)
    _assert_close(alone, together)


def test_same_values_when_idle_state_is_offloaded(make_executor) -> None:
    mixed = [*OTHERS, TARGET]
    resident = _values(make_executor, mixed, 3)
    offloaded = _values(make_executor, mixed, 3, state_memory_budget=1)
    _assert_close(resident, offloaded)


def test_dropout_actually_draws_random_masks(make_executor) -> None:
    # Guards the test above: with dropout, a different seed must give different values.
    base = _values(make_executor, [TARGET], 0)
    reseeded = (TARGET[0], sft_args(**{**_overrides(TARGET[1]), "seed": 8}))
    assert _values(make_executor, [reseeded], 0) != base


def _overrides(args) -> dict:
    return {
        "learning_rate": args.learning_rate,
        "per_device_train_batch_size": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "seed": args.seed,
    }
