"""The demo and the examples run end to end (small, on the CPU, with the tiny local model)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import optuna
import pytest
from helpers import run_python

ROOT = Path(__file__).resolve().parents[2]


def _run(args: list[str], cwd: Path) -> str:
    return run_python(args, cwd).stdout


def test_demo_prints_the_table_the_best_adapter_and_the_dashboard_command(tmp_path: Path) -> None:
    out = _run(
        [
            "-m",
            "optuna_rapidfire.demo",
            "--workdir",
            str(tmp_path),
            "--n-trials",
            "4",
            "--train-rows",
            "64",
            "--eval-rows",
            "8",
            "--num-chunks",
            "2",
            "--concurrent",
            "2",
        ],
        tmp_path,
    )
    assert "COMPLETE" in out and "chunks_done" in out
    best = out.split("Best adapter: ")[1].splitlines()[0]
    assert (Path(best) / "adapter_model.safetensors").is_file()
    assert f"optuna-dashboard sqlite:///{tmp_path / 'demo.db'}" in out
    study = optuna.load_study(study_name="rapidfire-demo", storage=f"sqlite:///{tmp_path / 'demo.db'}")
    assert len(study.trials) == 4
    # The printed `ls` command runs as printed, from another folder, in a shell that has not activated the venv.
    listing = out.split("List or control its trials with:")[1].splitlines()[0].strip()
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"} | {"PATH": "/usr/bin:/bin"}
    shown = subprocess.run(["bash", "-c", listing], cwd="/", env=env, capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    rows = [line.split()[:2] for line in shown.stdout.splitlines()[1:]]
    assert rows == [[str(t.number), t.state.name] for t in study.trials], shown.stdout


def test_real_model_example_runs_with_a_local_path(tmp_path: Path, tiny_model: str) -> None:
    out = _run(
        [
            str(ROOT / "examples" / "real_model_gpu.py"),
            "--model",
            tiny_model,
            "--n-trials",
            "2",
            "--concurrent",
            "2",
            "--num-chunks",
            "2",
            "--train-rows",
            "32",
            "--eval-samples",
            "8",
            "--storage",
            f"sqlite:///{tmp_path / 'r.db'}",
        ],
        tmp_path,
    )
    assert "best adapter:" in out


def test_pbt_and_control_example(tmp_path: Path, tiny_model: str) -> None:
    out = _run(
        [
            str(ROOT / "examples" / "pbt_and_control.py"),
            "--model",
            tiny_model,
            "--n-trials",
            "6",
            "--storage",
            f"sqlite:///{tmp_path / 'p.db'}",
        ],
        tmp_path,
    )
    assert "resumed trial " in out, out
    leader = int(out.split("resumed trial ")[1].split()[0])
    assert f"paused trial {leader}," in out and f"cloned trial {leader} as trial" in out
    study = optuna.load_study(study_name="pbt", storage=f"sqlite:///{tmp_path / 'p.db'}")
    assert any(t.user_attrs.get("rapidfire:parent") == leader for t in study.trials)
    # Resumed, it ran to its end (a pruner may have stopped it after the resume).
    assert study.trials[leader].user_attrs["rapidfire:status"] in ("complete", "pruned")


@pytest.mark.parametrize(
    ("script", "n_trials", "expected"),
    [
        ("quickstart.py", 3, ["best adapter:"]),
        ("dpo_gsm8k.py", 3, ["best adapter:"]),
        ("grpo_gsm8k.py", 2, ["mean eval reward:", "best adapter:"]),
    ],
)
def test_example_runs_a_study_and_prints_its_best_adapter(
    tmp_path: Path, tiny_model: str, script: str, n_trials: int, expected: list[str]
) -> None:
    out = _run(
        [
            str(ROOT / "examples" / script),
            "--model",
            tiny_model,
            "--n-trials",
            str(n_trials),
            "--train-rows",
            "32",
            "--storage",
            f"sqlite:///{tmp_path / 'study.db'}",
        ],
        tmp_path,
    )
    for text in expected:
        assert text in out
