"""The demo and the examples run end to end (small, on the CPU, with the tiny local model)."""

from __future__ import annotations

from pathlib import Path

import optuna
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


def test_quickstart_example(tmp_path: Path, tiny_model: str) -> None:
    out = _run(
        [
            str(ROOT / "examples" / "quickstart.py"),
            "--model",
            tiny_model,
            "--n-trials",
            "3",
            "--train-rows",
            "32",
            "--storage",
            f"sqlite:///{tmp_path / 'q.db'}",
        ],
        tmp_path,
    )
    assert "best adapter:" in out


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


def test_dpo_example(tmp_path: Path, tiny_model: str) -> None:
    out = _run(
        [
            str(ROOT / "examples" / "dpo_gsm8k.py"),
            "--model",
            tiny_model,
            "--n-trials",
            "3",
            "--train-rows",
            "32",
            "--storage",
            f"sqlite:///{tmp_path / 'd.db'}",
        ],
        tmp_path,
    )
    assert "best adapter:" in out


def test_grpo_example(tmp_path: Path, tiny_model: str) -> None:
    out = _run(
        [
            str(ROOT / "examples" / "grpo_gsm8k.py"),
            "--model",
            tiny_model,
            "--n-trials",
            "2",
            "--train-rows",
            "32",
            "--storage",
            f"sqlite:///{tmp_path / 'g.db'}",
        ],
        tmp_path,
    )
    assert "mean eval reward:" in out and "best adapter:" in out
