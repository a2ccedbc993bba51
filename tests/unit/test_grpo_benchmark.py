"""benchmarks/parts/grpo's bookkeeping: the engines' ratio over the median of each study's repeated runs."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import pytest

from benchmarks.parts.grpo import keep_earlier, markdown, ratios
from benchmarks.run import build_parser

if TYPE_CHECKING:
    from pathlib import Path

SIZES = {"trials": 8, "prompts": 64, "num_chunks": 2, "eval_prompts": 16, "generations": 4, "batch": 16}
SIZES["completion"] = 32


def _study(engine: str, wall: float) -> dict[str, Any]:
    decodes = {"decodes": 25, "rows": 3200, "tokens": 102400, "seconds": 4.0, "tokens_per_second": 25600.0}
    return {
        "engine": engine,
        "wall_seconds": wall,
        "engine_decodes": 25,
        "engine_decoded_requests": 193,
        "generated_tokens": 102400,
        "decode_seconds": 4.0,
        "decode": decodes,
        "whole_gang_decodes": decodes,
        "rest_seconds": wall - 4.0,
        "peak_memory_gb": 1.0,
    }


def _repeats(*walls: float) -> list[dict[str, Any]]:
    return [{"wall_seconds": w, "decode_seconds": 4.0, "gang_seconds": {}, "failed": 0} for w in walls]


def test_the_ratios_take_each_studys_median_wall_over_its_repeats() -> None:
    data = {
        "model": "llama-3.2-1b",
        "sizes": SIZES,
        "runs": {
            "grpo_fused_k8": _study("fused", 20.0),  # the first run: a slow one, outvoted
            "grpo_time_sliced_k8": _study("time_sliced", 48.0),
            "grpo_processes_k8": {"engine": "processes", "wall_seconds": 60.0},
        },
        "repeats": {"grpo_fused_k8": _repeats(20.0, 12.0, 13.0), "grpo_time_sliced_k8": _repeats(48.0, 52.0, 40.0)},
    }
    ratios(data)
    assert data["grpo_fused_over_time_sliced_k8"] == pytest.approx(48.0 / 13.0)
    assert data["grpo_fused_over_parallel_processes"] == pytest.approx(60.0 / 13.0)
    text = "\n".join(markdown(data))
    assert "grpo_fused_k8 20.0, 12.0, 13.0 (median 13.0)" in text
    assert "grpo_time_sliced_k8 48.0, 52.0, 40.0 (median 48.0)" in text


def test_files_from_before_the_repeats_give_the_ratio_of_their_one_run_each() -> None:
    data = {
        "model": "llama-3.2-1b",
        "sizes": SIZES,
        "runs": {"grpo_fused_k8": _study("fused", 12.4), "grpo_time_sliced_k8": _study("time_sliced", 45.9)},
    }
    ratios(data)
    assert data["grpo_fused_over_time_sliced_k8"] == pytest.approx(45.9 / 12.4)
    assert "median" not in "\n".join(markdown(data))


def test_a_partial_run_keeps_the_earlier_studies_repeats_until_it_runs_them_again(tmp_path: Path) -> None:
    """``--grpo-runs`` merges into an earlier grpo.json: a study it does not run keeps its median (its repeats),
    one it runs again replaces its own; an earlier file of other sizes is refused by name, none changes nothing."""
    earlier = {
        "model": "llama-3.2-1b",
        "sizes": SIZES,
        "runs": {"grpo_fused_k8": _study("fused", 14.0), "grpo_time_sliced_k8": _study("time_sliced", 58.0)},
        "repeats": {"grpo_fused_k8": _repeats(14.0, 13.0, 15.0), "grpo_time_sliced_k8": _repeats(58.0, 52.0, 50.0)},
    }
    (tmp_path / "grpo.json").write_text(json.dumps(earlier))
    data: dict[str, Any] = {"model": "llama-3.2-1b", "sizes": SIZES, "runs": {}}
    keep_earlier(data, tmp_path / "grpo.json")
    data["runs"]["grpo_fused_k8"] = _study("fused", 11.0)  # the part running the fused study again
    data["repeats"]["grpo_fused_k8"] = _repeats(11.0, 10.0, 12.0)
    ratios(data)
    assert data["grpo_fused_over_time_sliced_k8"] == pytest.approx(52.0 / 11.0)  # not 58 / 11 (the first run)

    alone: dict[str, Any] = {"model": "llama-3.2-1b", "sizes": SIZES, "runs": {}}
    keep_earlier(alone, tmp_path / "absent.json")
    assert alone == {"model": "llama-3.2-1b", "sizes": SIZES, "runs": {}}
    other = {**alone, "sizes": {**SIZES, "trials": 4}}
    with pytest.raises(SystemExit, match=r"grpo\.json holds GRPO runs of other sizes"):
        keep_earlier(other, tmp_path / "grpo.json")


@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_a_repeat_count_below_one_or_not_a_number_is_refused_naming_it(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--grpo-repeats", value])
    assert "--grpo-repeats" in capsys.readouterr().err
    assert build_parser().parse_args(["--grpo-repeats", "2"]).grpo_repeats == 2
