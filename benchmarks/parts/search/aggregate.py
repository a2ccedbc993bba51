"""Results of the search part: per seed and method the anytime curve and time to target, their aggregate over
seeds, and the replays recomputed from whatever the results hold."""

from __future__ import annotations

import math
import statistics
from typing import Any

from benchmarks.parts.search.calibrate import slowdowns
from benchmarks.parts.search.replay import TimeModel, replay_check, replays
from benchmarks.parts.search.settings import Settings
from benchmarks.parts.search.space import METHODS, TARGET_SLACK


def summarize(run: dict[str, Any], target: float, b_end: float | None) -> dict[str, Any]:
    """A method's anytime curve (best COMPLETE value so far against seconds since it started) and its marks."""
    curve: list[list[float]] = []
    for seconds, _, state, value in sorted(run["completions"], key=lambda c: c[0]):
        if state == "COMPLETE" and value is not None and (not curve or value < curve[-1][1]):
            curve.append([seconds, value])
    reached = next((t for t, v in curve if v <= target), None)
    held = [v for t, v in curve if b_end is not None and t <= b_end]
    return {
        "time_to_target": reached,
        "wall": run["wall"],
        "best": curve[-1][1] if curve else None,
        "best_at_b_end": held[-1] if held else None,
        "chunks": run["chunks"],
        "states": run["states"],
        "curve": curve,
    }


def quantile(values: list[float], q: float) -> float:
    """The q-quantile with linear interpolation; infinite when it reaches an infinite value."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low, high = math.floor(position), math.ceil(position)
    if math.isinf(ordered[high]):
        return math.inf
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _finite(value: float) -> float | None:
    return None if math.isinf(value) else value


def aggregate(seeds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per method over seeds: time to target (median, IQR; a seed that never reached it counts as infinite),
    how many seeds never reached it, wall time, and the regret held when (b) finished."""
    methods: dict[str, Any] = {}
    for method in METHODS:
        entries = [(seed, seed["methods"][method]) for seed in seeds if method in seed["methods"]]
        if not entries:
            continue
        reached = [e["time_to_target"] if e["time_to_target"] is not None else math.inf for _, e in entries]
        regrets = [
            (e["best_at_b_end"] - seed["best_exhaustive"]) / seed["best_exhaustive"]
            for seed, e in entries
            if e["best_at_b_end"] is not None
        ]
        methods[method] = {
            "seeds": len(entries),
            "never_reached": sum(math.isinf(t) for t in reached),
            "time_to_target_median": _finite(quantile(reached, 0.5)),
            "time_to_target_q25": _finite(quantile(reached, 0.25)),
            "time_to_target_q75": _finite(quantile(reached, 0.75)),
            "wall_median": statistics.median(e["wall"] for _, e in entries),
            "regret_at_b_end_median": statistics.median(regrets) if regrets else None,
            "no_complete_trial_at_b_end": len(entries) - len(regrets),
            "chunks_median": statistics.median(e["chunks"] for _, e in entries),
        }
    ratios = {}
    for key, (numerator, denominator) in {
        "time_to_target_vs_sequential_optuna": ("sequential_optuna", "executor_promote"),
        "time_to_target_vs_parallel_optuna_processes": ("parallel_optuna_processes", "executor_promote"),
        "time_to_target_vs_exhaustive": ("exhaustive", "executor_promote"),
        "time_to_target_lockstep_over_promote": ("executor_lockstep", "executor_promote"),
        "time_to_target_clone_over_promote": ("executor_promote_clone", "executor_promote"),
    }.items():
        top = methods.get(numerator, {}).get("time_to_target_median")
        bottom = methods.get(denominator, {}).get("time_to_target_median")
        ratios[key] = top / bottom if top is not None and bottom else None
    return {"methods": methods, "ratios": ratios}


def finalize(data: dict[str, Any], settings: Settings) -> None:
    """Replays, per-seed results, the aggregate and the replay check, from whatever ``data`` holds so far."""
    calibration = data.get("calibration", {})
    times = TimeModel(calibration) if "alone" in calibration else None
    seeds = []
    for key in sorted(data.get("records", {}), key=int):
        record = data["records"][key]
        best = min(trial["values"][-1] for trial in record["trials"])
        target = best * (1 + TARGET_SLACK)
        runs: dict[str, dict[str, Any]] = replays(record, times, settings, int(key)) if times else {}
        runs.update(data.get("executor_runs", {}).get(key, {}))
        b_end = runs["sequential_optuna"]["wall"] if "sequential_optuna" in runs else None
        seeds.append(
            {
                "seed": int(key),
                "configs": record["configs"],
                "best_exhaustive": best,
                "target": target,
                "methods": {name: summarize(run, target, b_end) for name, run in sorted(runs.items())},
            }
        )
    data["seeds"] = seeds
    data["aggregate"] = aggregate(seeds)
    if times is not None and data.get("validation"):
        data["replay_check"] = replay_check(data, times, settings)
    if "processes" in calibration:
        calibration["slowdown"] = slowdowns(calibration)
