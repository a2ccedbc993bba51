"""Results of the search part, recomputed from the runs after every save: per replicate the targets, each method's
anytime curve and time to each target, the comparisons, and their medians over replicates.

Targets, per replicate (every method of it ran the same configs on the same base): each config's value is the
best COMPLETE value any method got for it; ``best`` is within 1% of the best config's, ``loose`` within 1% of
the third best's (a method reaches it with any of the top three configs). A method that never holds a COMPLETE
trial that good never reaches the target: its time is infinite (a ratio over it is infinite, or 0 when the
executor is the one that never did).
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from benchmarks.parts.search.space import LOOSE_RANK, TARGET_SLACK, method

TARGET_NAMES = ("best", "loose")


def targets(runs: dict[str, dict[str, Any]]) -> dict[str, float] | None:
    """The replicate's targets from every method's COMPLETE trials (None before any trial completed)."""
    per_config: dict[int, float] = {}
    for run in runs.values():
        for trial in run.get("trials", []):
            if trial["state"] == "COMPLETE" and trial["value"] is not None:
                number = trial["number"]
                per_config[number] = min(per_config.get(number, math.inf), trial["value"])
    if not per_config:
        return None
    ordered = sorted(per_config.values())
    loose = ordered[min(LOOSE_RANK, len(ordered)) - 1]
    return {"best": ordered[0] * (1 + TARGET_SLACK), "loose": loose * (1 + TARGET_SLACK), "configs": len(ordered)}


def marks(run: dict[str, Any], goal: dict[str, float] | None) -> dict[str, Any]:
    """A method's anytime curve (best COMPLETE value so far against its seconds) and its times to the targets."""
    curve: list[list[float]] = []
    for seconds, _, state, value in run["ends"]:
        if state == "COMPLETE" and value is not None and (not curve or value < curve[-1][1]):
            curve.append([seconds, value])
    reached = {name: next((t for t, v in curve if goal is not None and v <= goal[name]), None) for name in TARGET_NAMES}
    out = {
        "time_to_target": reached["best"],
        "time_to_loose_target": reached["loose"],
        "best": curve[-1][1] if curve else None,
        "curve": curve,
    }
    keep = ("label", "wall", "chunks", "states", "gpu_busy_share", "multi_member_pass_share", "workers")
    out.update({key: run.get(key) for key in keep})
    # Each trial's end: [number, state, chunks trained, its last value] (who the search kept, and how far).
    out["trial_ends"] = [
        [t["number"], t["state"], len(t["values"]), round(t["values"][-1], 4) if t["values"] else None]
        for t in run.get("trials", [])
    ]
    if "compile_seconds" in run:
        out["compile_seconds"] = sum(run["compile_seconds"])
        out["passes"] = len(run["passes"])
        out["pass_seconds"] = sum(entry[1] for entry in run["passes"])  # the host's, a stream's passes queued
        if run["passes"]:
            out["first_pass_at"] = run["passes"][0][0]
        # The gang's fill over time: each pass's start (seconds since the go) and how many members it trained.
        out["pass_trace"] = [[round(entry[0], 2), entry[3]] for entry in run["passes"]]
        out["member_cost_log"] = [line for line in run.get("log", []) if "longer per member" in line[2]]
    if "times" in run:
        out["times"] = run["times"]
    return out


def _seconds(value: float | None) -> float:
    return math.inf if value is None else value


def _ratio(top: float, bottom: float) -> float:
    """``top / bottom`` for times where either may be infinite (never reached)."""
    if math.isinf(top) and math.isinf(bottom):
        return math.nan
    if math.isinf(bottom):
        return 0.0
    return math.inf if math.isinf(top) else top / bottom


def compare(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One replicate's comparisons with the executor as a user gets it: > 1 means the executor is sooner. The
    processes count with their best variant (the one sooner to the target; on a tie the shorter wall)."""
    if "executor" not in results:
        return {}
    ours = results["executor"]
    out: dict[str, Any] = {}
    variants = [name for name in results if method(name).family == "processes"]
    if variants:
        best = min(variants, key=lambda n: (_seconds(results[n]["time_to_target"]), results[n]["wall"]))
        theirs = results[best]
        out["processes_variant"] = best
        out["time_to_target_vs_processes"] = _ratio(
            _seconds(theirs["time_to_target"]), _seconds(ours["time_to_target"])
        )
        out["time_to_loose_target_vs_processes"] = _ratio(
            _seconds(theirs["time_to_loose_target"]), _seconds(ours["time_to_loose_target"])
        )
        out["wall_vs_processes"] = theirs["wall"] / ours["wall"]
    if "sequential" in results:
        theirs = results["sequential"]
        out["time_to_target_vs_sequential"] = _ratio(
            _seconds(theirs["time_to_target"]), _seconds(ours["time_to_target"])
        )
        out["wall_vs_sequential"] = theirs["wall"] / ours["wall"]
    return out


def _median(values: list[float]) -> float | None:
    """The median, infinities included (None for none, or when it falls on an undefined ratio)."""
    if not values:
        return None
    middle = statistics.median(sorted(values))
    return None if math.isnan(middle) else middle


def finite(value: Any) -> Any:
    """JSON has no infinity: an infinite number is written as the string "inf", NaN as None."""
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def finalize(data: dict[str, Any]) -> None:
    """Per replicate its targets, each method's marks, the comparisons and the code its methods ran (``None`` when
    they ran different code); then the medians over the replicates measured at the latest call's code
    (``aggregate``, the summary's) and over all of them (``aggregate_all``)."""
    comparisons = []
    for replicate in data.get("replicates", {}).values():
        runs = {name: run for name, run in replicate["methods"].items() if "error" not in run}
        goal = targets(runs)
        results = {name: marks(run, goal) for name, run in runs.items()}
        compared = compare(results)
        replicate["targets"] = goal
        replicate["results"] = results
        replicate["comparison"] = {key: finite(value) for key, value in compared.items()}
        codes = {run.get("code") for run in runs.values()}
        replicate["code"] = codes.pop() if len(codes) == 1 else None
        comparisons.append((replicate["code"], compared, results.get("executor")))
    calls = data.get("calls") or [{}]
    latest = calls[-1].get("code")
    data["aggregate"] = _medians([(c, r) for code, c, r in comparisons if code == latest]) | {"code": latest}
    data["aggregate_all"] = _medians([(c, r) for _, c, r in comparisons])


def _medians(comparisons: list[tuple[dict[str, Any], dict[str, Any] | None]]) -> dict[str, Any]:
    """The medians of the comparisons and of the executor's pass shares over ``comparisons``' replicates."""
    medians: dict[str, Any] = {}
    for key in (
        "time_to_target_vs_processes",
        "time_to_loose_target_vs_processes",
        "time_to_target_vs_sequential",
        "wall_vs_processes",
        "wall_vs_sequential",
    ):
        values = [compared[key] for compared, _ in comparisons if key in compared]
        medians[key] = finite(_median(values))
        medians[f"{key}_replicates"] = len(values)
    executors = [run for _, run in comparisons if run is not None]
    shares = [run["multi_member_pass_share"] for run in executors if run.get("multi_member_pass_share") is not None]
    medians["multi_member_pass_share"] = _median(shares)
    compile_shares = [run["compile_seconds"] / run["wall"] for run in executors if "compile_seconds" in run]
    medians["compile_share"] = _median(compile_shares)
    medians["replicates"] = sum("time_to_target_vs_processes" in compared for compared, _ in comparisons)
    return medians
