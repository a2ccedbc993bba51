"""The executor's studies: recording every config's per-chunk values (step record) and the real runs of (d)-(f)
(step executor)."""

from __future__ import annotations

import functools
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import optuna
from optuna.distributions import BaseDistribution
from optuna.trial import FrozenTrial, TrialState

from benchmarks.harness.hooks import ChunkLog, attrs
from benchmarks.harness.measure import drop
from benchmarks.parts.search.base import model_kwargs
from benchmarks.parts.search.settings import Settings, configure, eval_rows, say, train_rows
from benchmarks.parts.search.space import make_pruner, sample_configs
from optuna_rapidfire import RapidFireExecutor
from optuna_rapidfire.samplers import CloneSampler


def make_executor(settings: Settings, base: Path, seed: int, concurrency: int, schedule: str) -> RapidFireExecutor:
    return RapidFireExecutor(
        model=str(base),
        model_kwargs=model_kwargs(),
        train_dataset=train_rows(settings),
        eval_dataset=eval_rows(settings),
        eval_samples=None,  # the whole (small) eval set, as the plain TRL trainers evaluate it
        num_chunks=settings.num_chunks,
        max_concurrent_trials=concurrency,
        seed=seed,
        engine="fused",
        output_dir=tempfile.mkdtemp(prefix="search-executor-"),
        show_progress_bar=False,
        dashboard_controls=False,
        schedule=schedule,
    )


def _say_gang(members: int, steps: list[int], seconds: float) -> None:
    say(f"  gang of {members} at steps {steps}: {seconds:.1f} s")


def record(settings: Settings, base: Path, seed: int) -> dict[str, Any]:
    """Every config of ``seed`` trained to the end once, no pruner: per chunk its value and times."""
    configs = sample_configs(seed, settings.configs)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed), pruner=optuna.pruners.NopPruner())
    for config in configs:
        study.enqueue_trial(config)
    with ChunkLog(on_gang=_say_gang) as log:
        start = time.perf_counter()
        # Lock-step: equal progress, so every round fuses all live trials (values do not depend on the schedule).
        executor = make_executor(settings, base, seed, settings.record_concurrency, "lockstep")
        executor.optimize(study, functools.partial(configure, settings=settings, output_dir=""), n_trials=len(configs))
        wall = time.perf_counter() - start
    drop(executor)
    trials = sorted(study.trials, key=lambda t: t.number)
    failed = [(t.number, t.user_attrs.get(attrs.FAIL_REASON)) for t in trials if t.state != TrialState.COMPLETE]
    if failed:
        raise RuntimeError(f"record of seed {seed}: trials that did not complete: {failed}")
    out = []
    for index, (trial, config) in enumerate(zip(trials, configs, strict=True)):
        if trial.params != config:
            raise RuntimeError(f"record of seed {seed}: trial {trial.number} ran {trial.params}, not config {index}")
        times = log.chunks.get(trial.number, {})
        steps = range(settings.num_chunks)
        out.append(
            {
                "values": [trial.intermediate_values[s] for s in steps],
                "train_seconds": [times[s][0] if s in times else None for s in steps],
                "eval_seconds": [times[s][1] if s in times else None for s in steps],
            }
        )
    return {"configs": configs, "trials": out, "wall": wall, "concurrency": settings.record_concurrency}


class ReplaySampler(optuna.samplers.BaseSampler):
    """Hands out a fixed list of configs in order, one per trial it samples (a clone's params are the clone
    sampler's, so a clone takes none): the base sampler of (f), so that (f) draws what the others run."""

    def __init__(self, configs: list[dict[str, Any]]) -> None:
        self._configs = configs
        self._taken: dict[int, int] = {}
        self._lock = threading.Lock()

    def infer_relative_search_space(self, study: optuna.Study, trial: FrozenTrial) -> dict[str, BaseDistribution]:
        return {}

    def sample_relative(
        self, study: optuna.Study, trial: FrozenTrial, search_space: dict[str, BaseDistribution]
    ) -> dict[str, Any]:
        return {}

    def sample_independent(
        self, study: optuna.Study, trial: FrozenTrial, param_name: str, param_distribution: BaseDistribution
    ) -> Any:
        with self._lock:
            index = self._taken.setdefault(trial.number, len(self._taken))
        if index >= len(self._configs):
            raise RuntimeError(f"ReplaySampler: all {len(self._configs)} configs were handed out already.")
        return self._configs[index][param_name]


def executor_run(settings: Settings, base: Path, seed: int, method: str, configs: list[dict[str, Any]]) -> dict:
    """One real study of (d), (e) or (f): wall time from before the executor is built (model load included)."""
    schedule = "lockstep" if method == "lockstep" else "promote"
    if method == "clone":
        sampler: optuna.samplers.BaseSampler = CloneSampler(ReplaySampler(configs), seed=seed)
    else:
        sampler = optuna.samplers.RandomSampler(seed=seed)
    study = optuna.create_study(sampler=sampler, pruner=make_pruner())
    if method != "clone":
        for config in configs:
            study.enqueue_trial(config)
    completions: list[list[Any]] = []
    start = time.perf_counter()

    def finished(study: optuna.Study, trial: FrozenTrial) -> None:
        completions.append([time.perf_counter() - start, trial.number, trial.state.name, trial.value])

    with ChunkLog(on_gang=_say_gang) as log:
        executor = make_executor(settings, base, seed, settings.concurrency, schedule)
        executor.optimize(
            study,
            functools.partial(configure, settings=settings, output_dir=""),
            n_trials=settings.configs,
            callbacks=[finished],
        )
        wall = time.perf_counter() - start
    drop(executor)
    trials = sorted(study.trials, key=lambda t: t.number)
    return {
        "schedule": schedule,
        "concurrency": settings.concurrency,
        "wall": wall,
        "completions": completions,  # [seconds, trial number, state, value]
        "chunks": log.count(),
        "states": {state: sum(t.state.name == state for t in trials) for state in ("COMPLETE", "PRUNED", "FAIL")},
        "clones": {kind: sum(t.user_attrs.get(attrs.CLONE) == kind for t in trials) for kind in ("warm", "cold")},
        "trials": [
            {
                "number": t.number,
                "params": t.params,
                "state": t.state.name,
                "value": t.value,
                "values": [t.intermediate_values[s] for s in sorted(t.intermediate_values)],
                "parent": t.user_attrs.get(attrs.PARENT),
            }
            for t in trials
        ],
    }
