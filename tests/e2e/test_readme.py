"""The README's quick start runs as written (on this CPU), with the tiny local model in place of the hub id.

Only sizes change: the model id becomes the tiny model's path (loaded by the same code a hub id is), the
data sets, trial count and chunk count shrink so the test takes seconds, and the SQLite file goes to a
temporary folder. Everything else, the configs included, is the README's text.
"""

from __future__ import annotations

import re
from pathlib import Path

import optuna
from helpers import run_python

ROOT = Path(__file__).resolve().parents[2]


def _python_blocks(section: str) -> list[str]:
    """The ```python blocks of the README section that starts with ``section``."""
    text = (ROOT / "README.md").read_text()
    start = text.index(section)
    end = text.find("\n## ", start + len(section))
    return re.findall(r"```python\n(.*?)```", text[start : end if end > 0 else None], flags=re.S)


def _shrunk(code: str, replacements: list[tuple[str, str]]) -> str:
    for old, new in replacements:
        assert old in code, f"the README no longer has {old!r}: update this test with it"
        code = code.replace(old, new)
    return code


def test_the_quick_start_runs_as_written(tmp_path: Path, tiny_model: str) -> None:
    blocks = _python_blocks("## Quick start")
    assert len(blocks) == 2, "the quick start has the script and the plain-Optuna line"
    script = _shrunk(
        "\n".join(blocks),
        [
            ('"meta-llama/Llama-3.2-1B"', repr(tiny_model)),
            ('load_gsm8k("train")', 'load_gsm8k("train", num_rows=32)'),
            ('load_gsm8k("test")', 'load_gsm8k("test", num_rows=8)'),
            ("num_chunks=8", "num_chunks=2"),
            ("max_concurrent_trials=8", "max_concurrent_trials=2"),
            ("n_trials=32", "n_trials=2"),
            ("sqlite:///rf.db", f"sqlite:///{tmp_path / 'rf.db'}"),
        ],
    )
    result = run_python(["-c", script], tmp_path, timeout=600)
    study = optuna.load_study(study_name="demo", storage=f"sqlite:///{tmp_path / 'rf.db'}")
    finished = [t for t in study.trials if t.state.is_finished()]
    assert len(finished) == 4  # two from executor.optimize, two from study.optimize
    assert Path(result.stdout.strip().splitlines()[0], "adapter_model.safetensors").is_file()
    # What a user sees: no warning they cannot act on, no progress bars of data preparation.
    for noise in ("FutureWarning", "was active which is now deleted", "examples/s]", "Token indices"):
        assert noise not in result.stderr, f"{noise!r} in:\n{result.stderr[-4000:]}"
