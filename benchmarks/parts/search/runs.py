"""One method's work inside its worker process, after the go: plain Optuna + TRL taking configs from the shared
study, or the executor's whole study. Times are seconds since the go (the method's clock)."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from benchmarks.harness.hooks import PackageLog, PassLog, StudyTimes
from benchmarks.harness.measure import drop
from benchmarks.parts.search.base import model_kwargs
from benchmarks.parts.search.settings import Settings, configure, eval_rows, train_rows
from benchmarks.parts.search.space import make_pruner, suggest
from benchmarks.parts.search.trl_runs import trl_trial
from optuna_rapidfire import RapidFireExecutor


def journal_study(path: str, name: str) -> optuna.Study:
    """The study the plain-TRL processes of one method share, in a journal file (Optuna's multi-process storage)."""
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(path))
    return optuna.load_study(study_name=name, storage=storage, pruner=make_pruner())


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def optuna_worker(spec: dict[str, Any], settings: Settings, base: Path, go: float) -> dict[str, Any]:
    """A plain Optuna + TRL worker: the user's objective, on configs from the shared study until none is left.

    One worker (``sequential``) is plain ``study.optimize`` over the enqueued configs. Several workers take them
    with ``ask``/``tell`` under a file lock, so that none asks the sampler for a config beyond the list (Optuna's
    ``ask`` creates a new trial when the queue is empty, and two workers could both see its last config).
    """
    study = journal_study(spec["storage"], spec["study"])
    runs: list[dict[str, Any]] = []

    def objective(trial: optuna.Trial) -> float:
        run = trl_trial(trial, suggest(trial), settings, base, spec["seed"], compiled=spec["compiled"])
        runs.append({**run, "number": trial.number, "start": run["start"] - go, "end": run["end"] - go})
        if run["pruned"]:
            raise optuna.TrialPruned()
        return float(run["values"][-1])

    if spec["workers"] == 1:
        study.optimize(objective, n_trials=spec["configs"])
    else:
        while True:
            with _locked(spec["storage"] + ".queue"):
                if not study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
                    break
                trial = study.ask()
            try:
                value = objective(trial)
            except optuna.TrialPruned:
                study.tell(trial, state=TrialState.PRUNED)
            else:
                study.tell(trial, value)
    return {"runs": runs}


def executor_worker(spec: dict[str, Any], settings: Settings, base: Path, go: float) -> dict[str, Any]:
    """The executor's study of the enqueued configs, built after the go (model load and data included)."""
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=spec["seed"]), pruner=make_pruner())
    for config in spec["config_list"]:
        study.enqueue_trial(config)
    ends: list[list[Any]] = []

    def finished(study: optuna.Study, trial: FrozenTrial) -> None:
        ends.append([time.time() - go, trial.number, trial.state.name, trial.value])

    with (
        PassLog() as passes,
        StudyTimes() as times,
        PackageLog() as log,
        tempfile.TemporaryDirectory(prefix="search-executor-") as out,
    ):
        executor = RapidFireExecutor(
            model=str(base),
            model_kwargs=model_kwargs(),
            train_dataset=train_rows(settings),
            eval_dataset=eval_rows(settings),
            eval_samples=None,  # the whole (small) eval set, as the plain TRL trainers evaluate it
            num_chunks=settings.num_chunks,
            seed=spec["seed"],
            output_dir=out,
            show_progress_bar=False,
            dashboard_controls=False,
            **spec["options"],
        )
        built = time.time() - go
        objective = functools.partial(configure, settings=settings)
        executor.optimize(study, objective, n_trials=len(spec["config_list"]), callbacks=[finished])
        wall = time.time() - go
        stats = executor.stats()
        drop(executor)
    return {
        "built": built,
        "wall": wall,
        "ends": ends,
        "trials": [
            {
                "number": t.number,
                "params": t.params,
                "state": t.state.name,
                "value": t.value,
                "values": [t.intermediate_values[s] for s in sorted(t.intermediate_values)],
            }
            for t in study.trials
        ],
        "passes": [[start - go, seconds, *rest] for start, seconds, *rest in passes.passes],
        "times": times.times,
        "compile_seconds": log.compile_seconds,
        "background_compile_seconds": log.background_seconds,
        "log": log.lines,
        "engine": {
            "fused_steps": stats.fused_steps,
            "compiles": stats.compiles,
            "switches": stats.switches,
            "gang_fill": list(stats.gang_fill),
            "graphs_recorded": stats.graphs_recorded,
            "graph_replays": stats.graph_replays,
            "graph_failures": stats.graph_failures,
        },
    }
