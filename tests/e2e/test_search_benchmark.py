"""The search benchmark's smoke run, end to end on the CPU: every method kind trained for real in its own
processes, and the file the GPU runs write (benchmarks/results/search.json) with every key the report reads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks.parts.search.base import fingerprint, pretrain
from benchmarks.parts.search.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


def _smoke(out: Path, base: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "benchmarks.run", "--smoke", "--parts", "search", "--out", str(out)]
    command += ["--search-base", str(base), "--corpus", str(out / "no-corpus"), *extra]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("search-smoke")
    done = _smoke(out, out / "base")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out, json.loads((out / "search.json").read_text())


def test_the_smoke_part_runs_every_method_kind_on_the_same_configs(smoke) -> None:
    _, data = smoke
    replicate = data["replicates"]["0"]
    configs = replicate["configs"]
    assert len(configs) == 6
    assert set(replicate["methods"]) == {"processes_2", "executor", "sequential", "executor_lockstep"}
    for name, run in replicate["methods"].items():
        assert "error" not in run, (name, run.get("error"))
        # Exactly the enqueued configs, in their order, each once: no process asked the sampler for more.
        assert [t["number"] for t in run["trials"]] == list(range(6))
        assert [t["params"] for t in run["trials"]] == configs
        assert sum(run["states"].values()) == 6
        assert run["chunks"] == sum(len(t["values"]) for t in run["trials"]) > 0
        assert len(run["ends"]) == 6 and all(0 < end[0] <= run["wall"] + 1e-6 for end in run["ends"])
    processes = replicate["methods"]["processes_2"]
    assert {t["worker"] for t in processes["trials"]} == {0, 1}  # both processes took configs
    lockstep = replicate["methods"]["executor_lockstep"]
    assert lockstep["multi_member_pass_share"] > 0  # the fused lock-step gang trained several trials per pass
    assert all(p[2] in ("fused", "stream") for p in lockstep["passes"])  # a fixed gang's chunk, or a streamed pass
    # The same config, the same rows in the same order: plain TRL and the executor agree on its values.
    sequential, executor = replicate["methods"]["sequential"], replicate["methods"]["executor"]
    for a, b in zip(sequential["trials"], executor["trials"], strict=True):
        if a["state"] == b["state"] == "COMPLETE":
            assert a["value"] == pytest.approx(b["value"], rel=1e-3)


def test_the_smoke_part_writes_targets_comparisons_summary_and_report(smoke) -> None:
    out, data = smoke
    replicate = data["replicates"]["0"]
    goal = replicate["targets"]
    assert goal["best"] <= goal["loose"]
    for result in replicate["results"].values():
        assert {"time_to_target", "time_to_loose_target", "wall", "curve", "gpu_busy_share"} <= set(result)
    assert {"time_to_target_vs_processes", "time_to_target_vs_sequential", "wall_vs_processes"} <= set(
        replicate["comparison"]
    )
    summary = json.loads((out / "summary.json").read_text())
    keys = {
        "search_time_to_target_vs_processes",
        "search_time_to_target_vs_sequential",
        "search_wall_vs_processes",
        "search_multi_member_pass_share",
        "search_compile_share",
        "search_replicates",
        "search_code",
    }
    assert keys <= set(summary)
    assert summary["search_replicates"] == 1 and summary["search_code"] == data["calls"][-1]["code"]
    assert (out / "search.png").stat().st_size > 0
    assert "### Replicate 0" in (out / "search.md").read_text()
    assert data["bases"][replicate["base"]]["steps"] == data["settings"]["values"]["pretrain_steps"]


def test_a_replicate_measured_on_other_weights_is_refused_before_any_work(smoke, tmp_path: Path) -> None:
    _, data = smoke
    copy = tmp_path / "out"
    copy.mkdir()
    data["replicates"]["0"]["base"] = "0123456789abcdef"
    (copy / "search.json").write_text(json.dumps(data))
    done = _smoke(copy, tmp_path / "base", "--search-methods", "executor")
    assert done.returncode != 0
    assert "replicate 0 was measured on a base with weights 0123456789abcdef" in done.stderr
    assert json.loads((copy / "search.json").read_text())["replicates"]["0"]["methods"].keys() == {
        "processes_2",
        "executor",
        "sequential",
        "executor_lockstep",
    }


def test_the_base_is_rebuilt_bit_identically_from_its_recipe(tmp_path: Path) -> None:
    settings = Settings.from_options(SimpleNamespace(smoke=True, pretrain_steps=4))
    marks = []
    for name in ("a", "b"):
        info = pretrain(settings, tmp_path / "no-corpus", tmp_path / name)
        marks.append(info["fingerprint"])
        assert fingerprint(tmp_path / name) == info["fingerprint"]
    assert marks[0] == marks[1]


def test_the_stream_profile_times_every_streamed_pass_and_splits_the_gaps(tmp_path: Path) -> None:
    """benchmarks/stream_profile.py on the CPU (smoke sizes, the fused engine's stream): every pass is logged with
    its members and rows, the time between passes is told with its evaluations and builds, and the gang's fill
    adds up to the passes."""
    command = [sys.executable, "-m", "benchmarks.stream_profile", "--smoke", "--compile", "false", "--engine", "fused"]
    command += ["--window", "1:3", "--out", str(tmp_path)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads((tmp_path / "stream_profile_false.json").read_text())
    assert record["passes"] == len(record["pass_log"]) == sum(record["gang_fill"]) > 3
    assert all(members >= 1 and rows >= members for _, members, rows, _, _ in record["pass_log"])
    between = record["between"]
    assert between["gaps"] > 0 and between["evaluations"] > 0 and between["builds"] > 0
    assert record["window"]["passes"] == [1, 3] and "stream: pass" in record["window"]["host_seconds_per_pass_in"]
    table = (tmp_path / "stream_profile_false.txt").read_text()
    assert "stream: pass" in table and "stream: gap" in table
