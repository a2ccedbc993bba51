"""The search space, the configs every method runs, the one pruner, and the methods compared."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import optuna

TARGETS = {
    "attn": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "all": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}
BATCHES = (4, 8, 16)
TARGET_SLACK = 0.01  # the target: within 1% of the best COMPLETE value of the replicate
LOOSE_RANK = 3  # the looser target: a config as good as the replicate's third best (within the same slack)


def make_pruner() -> optuna.pruners.BasePruner:
    """The one pruner of every method, asked after every chunk (the last one included)."""
    return optuna.pruners.MedianPruner(n_startup_trials=5, n_warmup_steps=1)


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
    """``n`` configs from a seeded random sampler: the list every method runs, enqueued in this order."""
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))
    configs = []
    for _ in range(n):
        trial = study.ask()
        configs.append(suggest(trial))
        study.tell(trial, 0.0)
    return configs


@dataclass(frozen=True)
class Method:
    """One way to run the search: plain Optuna + TRL in ``workers`` processes, or the executor with ``options``."""

    name: str
    label: str
    workers: int = 0  # plain-TRL worker processes sharing one journal study; 0: the executor
    compiled: bool = False  # TRL's torch_compile=True (compilation inside the clock)
    options: dict[str, Any] = field(default_factory=dict)  # the executor's keywords beyond the shared ones

    @property
    def is_executor(self) -> bool:
        return self.workers == 0

    @property
    def family(self) -> str:
        """What the summary compares: ``executor`` (the defaults), ``processes`` (the best of the process
        variants), ``sequential``, or the method's own name for the other executor variants."""
        if self.name == "sequential" or self.name == "executor":
            return self.name
        return "processes" if not self.is_executor else self.name


_EXECUTORS = {
    "executor": ("(e) the executor as a user gets it (defaults)", {}),
    "executor_lockstep": ("(d) executor, fused, lockstep", {"engine": "fused", "schedule": "lockstep"}),
    "executor_time_sliced": ("(d) executor, time-sliced, promote", {"engine": "time_sliced", "schedule": "promote"}),
    "executor_fused": ("(d) executor, fused, promote", {"engine": "fused", "schedule": "promote"}),
    "executor_promote_all": ("(d) executor, promote_all (waiting trials trained on)", {"schedule": "promote_all"}),
    "executor_eager": ("(d) executor, launched pass not compiled", {"compile": False}),
}
_PROCESSES = re.compile(r"processes_(\d+)(_compiled)?")


def method(name: str) -> Method:
    """The method called ``name``: ``sequential``, ``processes_N`` (``_compiled``), or an executor variant."""
    if name == "sequential":
        return Method(name, "(b) sequential Optuna + TRL + pruner", workers=1)
    if name in _EXECUTORS:
        label, options = _EXECUTORS[name]
        return Method(name, label, options=options)
    match = _PROCESSES.fullmatch(name)
    if match is None or int(match.group(1)) < 2:
        known = ", ".join(["sequential", "processes_N", "processes_N_compiled (N >= 2)", *_EXECUTORS])
        raise SystemExit(f"--search-methods: unknown method {name!r}; choose among {known}")
    workers, compiled = int(match.group(1)), bool(match.group(2))
    label = f"(c) {workers} Optuna + TRL processes sharing the GPU" + (", torch_compile=True" if compiled else "")
    return Method(name, label, workers=workers, compiled=compiled)
