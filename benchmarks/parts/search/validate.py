"""The baselines run for real, cheaply (step validate), for the replay check."""

from __future__ import annotations

import dataclasses
import tempfile
import time
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial

from benchmarks.harness.workers import spawn_workers
from benchmarks.parts.search.settings import Settings
from benchmarks.parts.search.space import make_pruner, suggest
from benchmarks.parts.search.trl_runs import WORKER, trl_trial, warm_up


def validate_exhaustive(settings: Settings, base: Path, params: dict[str, Any], seed: int) -> dict[str, Any]:
    """(a) one config trained to the end with real TRL, evaluated once."""
    warm_up(settings, base)
    run = trl_trial(params, settings, base, seed, per_chunk_eval=False)
    return {"seed": seed, "params": params, "run": run}


def validate_sequential(settings: Settings, base: Path, configs: list[dict[str, Any]], seed: int) -> dict[str, Any]:
    """(b) real sequential Optuna + TRL + callback on ``configs``, stopped after ``validate_chunks`` chunks."""
    warm_up(settings, base)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed), pruner=make_pruner())
    for config in configs:
        study.enqueue_trial(config)
    runs: list[dict[str, Any]] = []
    completions: list[list[Any]] = []
    start = time.time()

    def objective(trial: optuna.Trial) -> float:
        run = trl_trial(suggest(trial), settings, base, seed, trial=trial, stop_after=settings.validate_chunks)
        runs.append({**run, "number": trial.number, "start": run["start"] - start, "end": run["end"] - start})
        if run["pruned"]:
            raise optuna.TrialPruned()
        return float(run["values"][-1])

    def finished(study: optuna.Study, trial: FrozenTrial) -> None:
        completions.append([time.time() - start, trial.number, trial.state.name, trial.value])

    study.optimize(objective, n_trials=len(configs), callbacks=[finished])
    return {"seed": seed, "configs": configs, "wall": time.time() - start, "runs": runs, "completions": completions}


def validate_processes(settings: Settings, base: Path, configs: list[dict[str, Any]], seed: int) -> dict[str, Any]:
    """(c) real worker processes, one per config, sharing a journal-file study, ``validate_chunks`` chunks."""
    folder = Path(tempfile.mkdtemp(prefix="search-journal-"))
    path = str(folder / "study.log")
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(path))
    study = optuna.create_study(study_name="validate", storage=storage, pruner=make_pruner())
    for config in configs:
        study.enqueue_trial(config)
    spec = {"mode": "validate", "settings": dataclasses.asdict(settings), "base": str(base), "storage": path}
    spec["seed"] = seed
    results = spawn_workers([spec] * len(configs), stop_when_done=False, module=WORKER)
    runs = [run for result in results for run in result["runs"]]
    trials = {t.number: t for t in study.trials}
    for run in runs:
        run["state"] = trials[run["number"]].state.name
    return {
        "seed": seed,
        "configs": configs,
        "wall": max(run["end"] for run in runs),
        "runs": sorted(runs, key=lambda run: run["number"]),
        "started": [result["started"] for result in results],
    }
