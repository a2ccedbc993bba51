"""The search space, the configs every method runs, the one pruner, and the methods compared."""

from __future__ import annotations

from typing import Any

import optuna

METHODS = {
    "exhaustive": "(a) exhaustive sequential TRL (replayed)",
    "sequential_optuna": "(b) sequential Optuna + TRL + pruner (replayed)",
    "parallel_optuna_processes": "(c) Optuna, TRL processes sharing the GPU (replayed)",
    "executor_lockstep": "(d) executor, lockstep",
    "executor_promote": "(e) executor, promote",
    "executor_promote_clone": "(f) executor, promote + CloneSampler",
}
"""The methods compared, by their key in the results, with their label in the report."""
TARGET_SLACK = 0.01  # the target: within 1% of the best final value of the seed's exhaustive sweep


def make_pruner() -> optuna.pruners.BasePruner:
    """The one pruner of every method, real or replayed."""
    return optuna.pruners.MedianPruner(n_startup_trials=5, n_warmup_steps=1)


TARGETS = {
    "attn": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "all": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}
BATCHES = (4, 8, 16)


def suggest(trial: optuna.Trial) -> dict[str, Any]:
    """The trial's params (an enqueued trial gets its fixed ones back)."""
    return {
        "learning_rate": trial.suggest_float("learning_rate", 1e-5, 3e-3, log=True),
        "r": trial.suggest_categorical("r", [8, 16, 32, 64]),
        "alpha_multiple": trial.suggest_categorical("alpha_multiple", [0.5, 1.0, 2.0]),  # lora_alpha / r
        "target_modules": trial.suggest_categorical("target_modules", list(TARGETS)),
        "lora_dropout": trial.suggest_float("lora_dropout", 0.0, 0.1),
        "batch_size": trial.suggest_categorical("batch_size", list(BATCHES)),
        "warmup_ratio": trial.suggest_float("warmup_ratio", 0.0, 0.1),
    }


def sample_configs(seed: int, n: int) -> list[dict[str, Any]]:
    """``n`` configs from a seeded random sampler: the list every non-adaptive method runs, in order."""
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))
    configs = []
    for _ in range(n):
        trial = study.ask()
        configs.append(suggest(trial))
        study.tell(trial, 0.0)
    return configs


def kind_of(params: dict[str, Any]) -> str:
    """What the time of a chunk depends on, besides the rank: per-device batch and target set."""
    return f"{params['batch_size']}/{params['target_modules']}"
