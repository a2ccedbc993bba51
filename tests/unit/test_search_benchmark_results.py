"""The search benchmark's results from its runs: targets, times to them, the comparisons and their medians
(benchmarks/parts/search/aggregate.py), and its method names."""

from __future__ import annotations

import math

import pytest

from benchmarks.parts.search.aggregate import finalize, marks, targets
from benchmarks.parts.search.part import _estimate
from benchmarks.parts.search.space import method


def _run(values: dict[int, tuple[str, float | None]], ends: list[float], wall: float, **extra) -> dict:
    trials = [{"number": n, "state": s, "value": v, "values": [1.0]} for n, (s, v) in values.items()]
    ordered = [[t, n, values[n][0], values[n][1]] for t, n in zip(ends, values, strict=True)]
    return {"trials": trials, "ends": ordered, "wall": wall, "label": "x", "chunks": len(trials), "states": {}, **extra}


def test_targets_take_each_config_s_best_complete_value_over_the_methods() -> None:
    runs = {
        "executor": _run({0: ("COMPLETE", 2.0), 1: ("PRUNED", None), 2: ("COMPLETE", 3.0)}, [1, 2, 3], 3),
        "processes_2": _run({0: ("COMPLETE", 2.2), 1: ("COMPLETE", 2.5), 2: ("COMPLETE", 4.0)}, [1, 2, 3], 3),
    }
    goal = targets(runs)
    assert goal == {"best": pytest.approx(2.0 * 1.01), "loose": pytest.approx(3.0 * 1.01), "configs": 3}
    assert targets({"executor": _run({0: ("PRUNED", None)}, [1], 1)}) is None


def test_time_to_target_is_the_first_complete_trial_that_good_and_none_when_never() -> None:
    run = _run({0: ("COMPLETE", 3.0), 1: ("COMPLETE", 2.0), 2: ("COMPLETE", 1.0)}, [5, 9, 20], 21)
    result = marks(run, {"best": 1.01, "loose": 2.02})
    assert (result["time_to_target"], result["time_to_loose_target"]) == (20, 9)
    assert result["curve"] == [[5, 3.0], [9, 2.0], [20, 1.0]]
    never = marks(run, {"best": 0.5, "loose": 0.9})
    assert never["time_to_target"] is None


def _replicate(executor_end: float, processes_end: float, sequential_end: float) -> dict:
    return {
        "methods": {
            "executor": _run({0: ("COMPLETE", 1.0)}, [executor_end], executor_end + 1, passes=[], compile_seconds=[]),
            "processes_8": _run({0: ("COMPLETE", 1.0)}, [processes_end], processes_end + 1),
            "processes_4": _run({0: ("COMPLETE", 1.0)}, [processes_end * 2], processes_end * 2 + 1),
            "sequential": _run({0: ("COMPLETE", 1.0)}, [sequential_end], sequential_end + 1),
        }
    }


def test_comparisons_take_the_better_process_variant_and_the_median_over_replicates() -> None:
    data = {"replicates": {"0": _replicate(10, 20, 40), "1": _replicate(10, 5, 30), "2": _replicate(10, 30, 50)}}
    finalize(data)
    first = data["replicates"]["0"]["comparison"]
    assert first["processes_variant"] == "processes_8"
    assert first["time_to_target_vs_processes"] == pytest.approx(2.0)
    assert data["aggregate"]["time_to_target_vs_processes"] == pytest.approx(2.0)  # median of 2, 0.5, 3
    assert data["aggregate"]["time_to_target_vs_sequential"] == pytest.approx(4.0)  # median of 4, 3, 5
    assert data["aggregate"]["replicates"] == 3


def test_the_summary_medians_are_over_the_replicates_measured_at_the_latest_call_s_code() -> None:
    replicates = {"0": _replicate(10, 20, 40), "1": _replicate(10, 5, 30), "2": _replicate(10, 30, 50)}
    for seed, code in (("0", "old"), ("1", "new"), ("2", "new")):
        for run in replicates[seed]["methods"].values():
            run["code"] = code
    replicates["2"]["methods"]["sequential"]["code"] = "old"  # one method of another version: a mixed replicate
    data = {"replicates": replicates, "calls": [{"code": "old"}, {"code": "new"}]}
    finalize(data)
    assert [data["replicates"][seed]["code"] for seed in "012"] == ["old", "new", None]
    assert data["aggregate"]["code"] == "new" and data["aggregate"]["replicates"] == 1
    assert data["aggregate"]["time_to_target_vs_processes"] == pytest.approx(0.5)  # replicate 1 alone
    assert data["aggregate_all"]["replicates"] == 3
    assert data["aggregate_all"]["time_to_target_vs_processes"] == pytest.approx(2.0)  # median of 2, 0.5, 3


def test_a_method_that_never_reaches_the_target_counts_as_infinitely_late() -> None:
    replicate = _replicate(10, 20, 40)
    replicate["methods"]["processes_8"]["trials"][0]["state"] = "PRUNED"
    replicate["methods"]["processes_8"]["ends"][0][2] = "PRUNED"
    replicate["methods"]["processes_4"] = replicate["methods"]["processes_8"]
    data = {"replicates": {"0": replicate}}
    finalize(data)
    assert data["replicates"]["0"]["comparison"]["time_to_target_vs_processes"] == "inf"
    assert data["aggregate"]["time_to_target_vs_processes"] == "inf"
    assert not math.isnan(data["aggregate"]["time_to_target_vs_sequential"])


def test_method_names_are_parsed_and_a_bad_one_is_refused_naming_it() -> None:
    assert method("processes_8_compiled").workers == 8 and method("processes_8_compiled").compiled
    assert method("sequential").workers == 1
    assert method("executor_lockstep").options == {"engine": "fused", "schedule": "lockstep"}
    assert method("processes_4").family == "processes" and method("executor").family == "executor"
    with pytest.raises(SystemExit, match="'processes_1'"):
        method("processes_1")
    with pytest.raises(SystemExit, match="'fast'"):
        method("fast")


def test_a_method_s_time_is_estimated_from_its_runs_at_this_code_first() -> None:
    replicates = {
        "0": {"methods": {"executor": {"seconds_in_call": 300.0, "code": "old"}}},
        "1": {"methods": {"executor": {"seconds_in_call": 60.0, "code": "new"}, "processes_8": {"error": "x"}}},
        "2": {"methods": {"processes_8": {"seconds_in_call": 130.0, "code": "old"}}},
    }
    assert _estimate(replicates, method("executor"), "new") == 60.0  # the slow run of older code is not it
    assert _estimate(replicates, method("executor"), "newer") == 300.0  # none at this code: the longest
    assert _estimate(replicates, method("processes_4"), "new") == 130.0  # none of its own: its family's
    assert _estimate(replicates, method("sequential"), "new") == 0.0
