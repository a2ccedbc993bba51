"""One method of one replicate, run for real: its processes started together (each warmed up, untimed), one go,
then its record: every trial's end, values and state, chunks trained, GPU busy share, and the executor's passes."""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import optuna
import torch

from benchmarks.harness.workers import spawn_workers
from benchmarks.parts.search.runs import journal_study
from benchmarks.parts.search.settings import Settings
from benchmarks.parts.search.space import Method, make_pruner

WORKER = "benchmarks.parts.search.worker"
"""The module every method's processes run (``python -m WORKER --worker SPEC``)."""


class BusySampler:
    """Samples the GPU's utilisation (NVML: the share of time a kernel ran) every ``interval`` seconds while in
    use; :meth:`share` averages it over a window. On a machine without a GPU it samples nothing."""

    def __init__(self, interval: float = 0.1) -> None:
        self.interval = interval
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="gpu-busy", daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.samples.append((time.time(), float(torch.cuda.utilization())))
            except Exception:  # no NVML here: no samples
                return

    def __enter__(self) -> BusySampler:
        if torch.cuda.is_available():
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def share(self, since: float, until: float) -> float | None:
        inside = [percent for at, percent in self.samples if since <= at <= until]
        return statistics.mean(inside) / 100 if inside else None


def _trial_records(trials: list[dict[str, Any]], configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The trials in number order, each checked to have run the config of its number (they were enqueued in
    the list's order)."""
    ordered = sorted(trials, key=lambda t: t["number"])
    for trial in ordered:
        if trial["params"] != configs[trial["number"]]:
            raise RuntimeError(f"trial {trial['number']} ran {trial['params']}, not config {trial['number']}")
    return ordered


def _optuna_method(method: Method, settings: Settings, base: Path, seed: int, configs: list[dict[str, Any]]) -> Any:
    folder = Path(tempfile.mkdtemp(prefix="search-journal-"))
    storage = str(folder / "study.log")
    study = optuna.create_study(
        study_name="search",
        storage=optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(storage)),
        pruner=make_pruner(),
    )
    for config in configs:
        study.enqueue_trial(config)
    spec = {"mode": "optuna", "storage": storage, "study": "search", "workers": method.workers}
    spec |= {"compiled": method.compiled, "configs": len(configs), "seed": seed}
    specs = [{**spec, "settings": dataclasses.asdict(settings), "base": str(base)}] * method.workers

    def record(results: list[dict[str, Any]]) -> dict[str, Any]:
        runs = {run["number"]: {**run, "worker": r["index"]} for r in results for run in r["runs"]}
        trials = []
        for trial in journal_study(storage, "search").trials:
            run = runs[trial.number]
            trials.append(
                {
                    "number": trial.number,
                    "params": trial.params,
                    "state": trial.state.name,
                    "value": trial.value,
                    "values": [trial.intermediate_values[s] for s in sorted(trial.intermediate_values)],
                    "start": run["start"],
                    "end": run["end"],
                    "build": run["build"],
                    "worker": run["worker"],
                }
            )
        trials = _trial_records(trials, configs)
        ends = [[t["end"], t["number"], t["state"], t["value"]] for t in trials]
        return {"wall": max(t["end"] for t in trials), "ends": ends, "trials": trials}

    return specs, record


def _executor_method(method: Method, settings: Settings, base: Path, seed: int, configs: list[dict[str, Any]]) -> Any:
    spec = {"mode": "executor", "options": method.options, "config_list": configs, "seed": seed}
    specs = [{**spec, "settings": dataclasses.asdict(settings), "base": str(base)}]

    def record(results: list[dict[str, Any]]) -> dict[str, Any]:
        result = dict(results[0])
        result["trials"] = _trial_records(result["trials"], configs)
        passes = result["passes"]
        result["multi_member_pass_share"] = sum(p[3] >= 2 for p in passes) / len(passes) if passes else None
        return result

    return specs, record


def run_method(
    method: Method, settings: Settings, base: Path, seed: int, configs: list[dict[str, Any]], timeout: float
) -> dict[str, Any]:
    """``method`` on ``configs`` for real; its record (seconds since its go: every clock starts before the
    method's first model load, after each of its processes warmed up once). It fails (RuntimeError) when it has
    not ended ``timeout`` seconds (at most the method timeout) after its processes started."""
    build = _executor_method if method.is_executor else _optuna_method
    specs, record = build(method, settings, base, seed, configs)
    began = time.time()
    with BusySampler() as busy:
        results = spawn_workers(specs, module=WORKER, timeout=min(timeout, settings.method_timeout))
    out = record(results)
    go = results[0]["go"]
    trials = out["trials"]
    out.update(
        method=method.name,
        label=method.label,
        workers=max(method.workers, 1),
        compiled=method.compiled,
        options=method.options,
        ends=sorted(out["ends"]),
        chunks=sum(len(t["values"]) for t in trials),
        states={state: sum(t["state"] == state for t in trials) for state in ("COMPLETE", "PRUNED", "FAIL")},
        gpu_busy_share=busy.share(go, go + out["wall"]),
        warm_up=[r["warm_up"] for r in results],
        seconds_with_warm_up=time.time() - began,
    )
    return out
