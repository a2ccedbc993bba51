"""The multi_gpu part: the same study on one GPU, then with one worker process per GPU sharing an SQLite study."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import optuna
import torch
from transformers import AutoTokenizer

from benchmarks.harness.bench import Bench
from benchmarks.harness.hooks import attrs
from benchmarks.harness.measure import drop
from benchmarks.harness.models import configure_from_params


def run(bench: Bench, shapes: list[str], save: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """16 configs (256 rows, 8 chunks) on the first visible GPU, then on all of them, on the first shape."""
    shape = shapes[0]
    chosen_devices = devices(bench.smoke)
    rows, chunks, configs = (256, 8, 16) if not bench.smoke else (32, 2, 4)
    result: dict[str, Any] = {"model": shape, "configs": configs, "rows": rows, "devices": chosen_devices}
    for label, chosen in (("one_gpu", chosen_devices[:1]), ("all_gpus", chosen_devices)):
        url = f"sqlite:///{bench.workdir / f'{label}.db'}"
        study = optuna.create_study(storage=url, study_name=label, pruner=optuna.pruners.NopPruner())
        for i in range(configs):
            study.enqueue_trial({"learning_rate": 1e-4 * (1 + i % 4), "r": 16})
        # Lock-step, the only schedule when results/multi_gpu.json was measured: the ratio compares devices,
        # so both runs keep the schedule those numbers ran under (waves of 8 trials, every chunk a switch),
        # not the default "promote", which changes the order of switches and when trials start and end.
        executor = bench.executor(
            shape, rows, chunks, 8, devices=chosen if len(chosen) > 1 else chosen[0], schedule="lockstep"
        )
        start = time.perf_counter()
        executor.optimize(study, configure_from_params(bench.batch), n_trials=configs)
        wall = time.perf_counter() - start
        drop(executor)
        trials = study.get_trials()
        window = max(t.datetime_complete for t in trials) - min(t.datetime_start for t in trials)
        tokens = configs * _tokens_per_trial(bench, rows)
        result[label] = {
            "wall_seconds": wall,
            "trial_window_seconds": window.total_seconds(),
            "tokens": tokens,
            "tokens_per_second": tokens / window.total_seconds(),
            "workers": sorted({t.user_attrs.get(attrs.WORKER, "") for t in trials}),
        }
    result["two_gpu_over_one_gpu_throughput"] = (
        result["all_gpus"]["tokens_per_second"] / result["one_gpu"]["tokens_per_second"]
    )
    return result


def devices(smoke: bool) -> list[str]:
    """The part's devices: every visible GPU, at least 2; on a machine without one, two CPU workers for a
    --smoke dry run of the harness. Exits with the reason otherwise."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count >= 2:
        return [f"cuda:{i}" for i in range(count)]
    if count == 0 and smoke:
        return ["cpu", "cpu"]
    raise SystemExit(
        f"multi_gpu compares one GPU with several: it needs at least 2 visible GPUs, but torch sees {count}"
        + (" (without a GPU, --smoke dry-runs it with two CPU workers)." if count == 0 else ".")
    )


def _tokens_per_trial(bench: Bench, rows: int) -> int:
    """Training tokens of one trial: packed 512-token rows, as many as the data fills."""
    tokenizer = AutoTokenizer.from_pretrained(bench.tokenizer_dir)
    text = bench.rows(rows)["text"]
    return sum(len(tokenizer(t + tokenizer.eos_token)["input_ids"]) for t in text)


def summary(data: dict[str, Any]) -> dict[str, Any]:
    """The part's keys of summary.json."""
    return {
        "two_gpu_over_one_gpu_throughput": data["two_gpu_over_one_gpu_throughput"],
        "two_gpu_over_one_gpu_wall": data["one_gpu"]["wall_seconds"] / data["all_gpus"]["wall_seconds"],
    }


def markdown(data: dict[str, Any]) -> list[str]:
    """The part's section of results.md."""
    lines = [
        "",
        f"## Several GPUs ({data['model']}, {data['configs']} configs)",
        "",
        "| | tokens/s (first trial start to last trial end) | trial window s | wall s (incl. process start) |",
        "|---|---|---|---|",
    ]
    for label in ("one_gpu", "all_gpus"):
        run = data[label]
        lines.append(
            f"| {label} | {run['tokens_per_second']:.0f} | {run['trial_window_seconds']:.1f} | "
            f"{run['wall_seconds']:.1f} |"
        )
    lines.append(f"\nRatio: {data['two_gpu_over_one_gpu_throughput']:.2f}")
    return lines
