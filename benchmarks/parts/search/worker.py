"""``python -m benchmarks.parts.search.worker --worker SPEC``: one plain-TRL process among ``processes`` on the GPU,
started by :func:`benchmarks.harness.workers.spawn_workers` for the calibration under contention and the real
run of (c)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import optuna

from benchmarks.harness.workers import wait_for_go, worker_main, write_result
from benchmarks.parts.search.settings import Settings
from benchmarks.parts.search.space import make_pruner, suggest
from benchmarks.parts.search.trl_runs import trl_trial, warm_up


def main(spec_path: str) -> None:
    """The worker of ``spec_path``: warm up, wait for the go, then calibrate or run its validation trial."""
    spec = json.loads(Path(spec_path).read_text())
    folder, index = Path(spec["dir"]), spec["index"]
    settings = Settings(**spec["settings"])
    base = Path(spec["base"])
    ready = time.time()
    warm = warm_up(settings, base)
    go = wait_for_go(folder, index)
    result: dict[str, Any] = {"index": index, "started": ready - spec["spawned"], "warm_up": warm}
    if spec["mode"] == "calibrate":
        run = trl_trial(
            spec["params"],
            settings,
            base,
            0,
            done_after=settings.calibrate_chunks,
            done_file=folder / f"done-{index}",
            stop_file=folder / "stop",
        )
        result["run"] = run
    else:
        storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(spec["storage"]))
        study = optuna.load_study(study_name="validate", storage=storage, pruner=make_pruner())
        runs: list[dict[str, Any]] = []

        def objective(trial: optuna.Trial) -> float:
            params = suggest(trial)
            run = trl_trial(params, settings, base, spec["seed"], trial=trial, stop_after=settings.validate_chunks)
            runs.append({**run, "number": trial.number})
            if run["pruned"]:
                raise optuna.TrialPruned()
            return float(run["values"][-1])

        study.optimize(objective, n_trials=1)
        result["runs"] = runs
    for run in [result.get("run"), *result.get("runs", [])]:
        if run:
            run["start"] -= go
            run["end"] -= go
    write_result(folder, index, result)


if __name__ == "__main__":
    worker_main(main, "run the search part with: python -m benchmarks.run --parts search --out DIR")
