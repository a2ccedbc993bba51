"""How long plain TRL takes (step calibrate): alone per kind of config, and under ``processes`` processes sharing
the GPU; the slowdowns between the two."""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path
from typing import Any

from benchmarks.harness.workers import spawn_workers
from benchmarks.parts.search.settings import Settings, say
from benchmarks.parts.search.space import BATCHES, TARGETS, kind_of
from benchmarks.parts.search.trl_runs import WORKER, trl_trial, warm_up


def _calibration_params(kind: str, r: int = 8) -> dict[str, Any]:
    batch, target = kind.split("/")
    return {
        "learning_rate": 1e-4,
        "r": r,
        "alpha_multiple": 1.0,
        "target_modules": target,
        "lora_dropout": 0.05,
        "batch_size": int(batch),
        "warmup_ratio": 0.05,
    }


KINDS = [f"{batch}/{target}" for batch in BATCHES for target in TARGETS]
RANK_KIND = "8/all"


def calibrate_alone(settings: Settings, base: Path) -> dict[str, Any]:
    """Plain TRL alone: per kind (batch, targets) at r8, the first and a later chunk's training time, the
    evaluation time and the build time (model load + trainer, which tokenizes the train set); r64 once."""
    warm = warm_up(settings, base)
    kinds: dict[str, Any] = {}
    chunks = settings.calibrate_chunks
    for kind in [*KINDS, f"{RANK_KIND}@r64"]:
        name, _, rank = kind.partition("@r")
        run = trl_trial(_calibration_params(name, int(rank or 8)), settings, base, 0, stop_after=chunks)
        kinds[kind] = {
            "build": run["build"],
            "first_chunk": run["train"][0],
            "chunk": statistics.mean(run["train"][1:]) if len(run["train"]) > 1 else run["train"][0],
            "eval": statistics.mean(run["eval"]),
            "raw": {key: run[key] for key in ("train", "eval", "values")},
        }
        say(f"calibrate alone {kind}: build {run['build']:.1f} s, chunks {run['train']}, evals {run['eval']}")
    return {"warm_up_seconds": warm, "chunks_timed": chunks, "kinds": kinds}


def calibrate_processes(settings: Settings, base: Path) -> dict[str, Any]:
    """The same under ``processes`` OS processes sharing the GPU, with mixed kinds, all training at once."""
    specs = [
        {
            "mode": "calibrate",
            "settings": dataclasses.asdict(settings),
            "base": str(base),
            "params": _calibration_params(KINDS[i % len(KINDS)]),
        }
        for i in range(settings.processes)
    ]
    results = spawn_workers(specs, stop_when_done=True, module=WORKER)
    workers = []
    for result in results:
        run = result["run"]
        timed = settings.calibrate_chunks
        workers.append(
            {
                "kind": kind_of(run["params"]),
                "started": result["started"],
                "warm_up": result["warm_up"],
                "build": run["build"],
                "train": run["train"][:timed],
                "eval": run["eval"][:timed],
            }
        )
    return {"processes": settings.processes, "workers": workers}


def slowdowns(calibration: dict[str, Any]) -> dict[str, Any]:
    """Time under ``processes`` processes over time alone: per kind for training, one factor for evaluation
    and one for building (each worker against the alone run of its own kind)."""
    alone = calibration["alone"]["kinds"]
    train: dict[str, list[float]] = {}
    evals, builds = [], []
    for worker in calibration["processes"]["workers"]:
        mine = alone[worker["kind"]]
        expected = mine["first_chunk"] + mine["chunk"] * (len(worker["train"]) - 1)
        train.setdefault(worker["kind"], []).append(sum(worker["train"]) / expected)
        evals.append(statistics.mean(worker["eval"]) / mine["eval"])
        builds.append(worker["build"] / mine["build"])
    per_kind = {kind: statistics.mean(values) for kind, values in train.items()}
    return {
        "train": per_kind,
        "train_mean": statistics.mean(per_kind.values()),
        "eval": statistics.mean(evals),
        "build": statistics.mean(builds),
    }
