"""The throughput part: 4 configs trained one after another with TRL, against one study through the executor.

Per model shape: (a) the sequential baseline, 4 configs (learning rates 1e-4 to 1e-3) trained with
``SFTTrainer.train()`` on the same base model after an untimed warm-up run; (b) the same 4 configs as one study
through ``RapidFireExecutor`` (time-sliced, all 4 live, ``NopPruner``). See benchmarks/README.md (throughput).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import optuna
import torch
from peft import get_peft_model
from trl import SFTTrainer

from benchmarks.harness.bench import Bench
from benchmarks.harness.hooks import Recorder
from benchmarks.harness.measure import drop, peak_memory_gb, percentile, reset_peak, sync
from benchmarks.harness.models import build_model, configure_from_params, lora, sft_args


def run(bench: Bench, shapes: list[str], save: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Every shape in turn, saved after each."""
    data: dict[str, Any] = {"runs": []}
    for shape in shapes:
        data["runs"].append(measure(bench, shape))
        save(data)
    return data


def measure(bench: Bench, shape: str) -> dict[str, Any]:
    """(a) and (b) on one model shape."""
    # 128 rows (32 steps of 4 x 512 tokens) per chunk; eval_samples="auto" then evaluates 32 rows.
    rows, chunks = (512, 4) if not bench.smoke else (32, 4)
    learning_rates = [1e-4, 2e-4, 5e-4, 1e-3]
    model, tokenizer = build_model(shape, bench.tokenizer_dir)
    # Warm-up (not timed): CUDA context, kernels and allocator, which every later run of the process
    # shares, so the first timed config does not pay them.
    warm = get_peft_model(model, lora())
    SFTTrainer(
        model=warm,
        args=sft_args(1e-4, bench.batch, output_dir=str(bench.workdir / "trl"), max_steps=8),
        train_dataset=bench.rows(64),
        processing_class=tokenizer,
    ).train()
    base = warm.unload()
    del warm
    sequential = []
    for lr in learning_rates:
        peft_model = get_peft_model(base, lora())
        trainer = SFTTrainer(
            model=peft_model,
            args=sft_args(lr, bench.batch, output_dir=str(bench.workdir / "trl")),
            train_dataset=bench.rows(rows),
            processing_class=tokenizer,
        )
        sync()
        start = time.perf_counter()
        trainer.train()
        sync()
        seconds = time.perf_counter() - start
        sequential.append({"learning_rate": lr, "seconds": seconds, "tokens": trainer._total_train_tokens})
        base = peft_model.unload()
        del trainer, peft_model
    del model, base
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    seq_tokens = sum(r["tokens"] for r in sequential)
    seq_seconds = sum(r["seconds"] for r in sequential)

    executor = bench.executor(shape, rows, chunks, len(learning_rates))
    study = optuna.create_study(pruner=optuna.pruners.NopPruner())
    for lr in learning_rates:
        study.enqueue_trial({"learning_rate": lr, "r": 16})
    objective_ready = executor.objective(configure_from_params(bench.batch))  # loads the model
    del objective_ready
    reset_peak()
    with Recorder() as recorder:
        start = time.perf_counter()
        executor.optimize(study, configure_from_params(bench.batch), n_trials=len(learning_rates))
        wall = time.perf_counter() - start
    peak = peak_memory_gb()
    drop(executor)
    first_decision = max(recorder.first_report.values()) - start
    # Sequentially, the last config's first chunk ends after every other config has trained fully.
    seq_first_decision = sum(r["seconds"] for r in sequential[:-1]) + sequential[-1]["seconds"] / chunks
    train_tps = recorder.tokens / max(recorder.train_seconds + sum(recorder.switches), 1e-9)
    return {
        "model": shape,
        "configs": len(learning_rates),
        "rows": rows,
        "num_chunks": chunks,
        "batch": bench.batch,
        "sequential": {
            "runs": sequential,
            "tokens": seq_tokens,
            "seconds": seq_seconds,
            "tokens_per_second": seq_tokens / seq_seconds,
        },
        "executor": {
            "tokens": recorder.tokens,
            "wall_seconds": wall,
            "train_seconds": recorder.train_seconds,
            "eval_seconds": recorder.eval_seconds,
            "eval_share": recorder.eval_seconds / max(recorder.train_seconds + recorder.eval_seconds, 1e-9),
            "training_tokens_per_second": train_tps,
            "wall_tokens_per_second": recorder.tokens / wall,
            "switch_ms_median": statistics.median(recorder.switches) * 1e3 if recorder.switches else None,
            "switch_ms_p95": percentile(recorder.switches, 0.95) * 1e3,
            "switches": len(recorder.switches),
            "time_to_first_decision_seconds": first_decision,
            "peak_memory_gb": peak,
        },
        "interleaved_over_sequential_throughput": train_tps / (seq_tokens / seq_seconds),
        "interleaved_over_sequential_throughput_with_eval": (recorder.tokens / wall) / (seq_tokens / seq_seconds),
        "sequential_time_to_first_decision_seconds": seq_first_decision,
        "time_to_first_decision_speedup": seq_first_decision / first_decision,
    }


def summary(data: dict[str, Any]) -> dict[str, Any]:
    """The part's keys of summary.json, from its first shape."""
    main = data["runs"][0]
    return {
        "switch_latency_ms_median": main["executor"]["switch_ms_median"],
        "switch_latency_ms_p95": main["executor"]["switch_ms_p95"],
        "interleaved_over_sequential_throughput": main["interleaved_over_sequential_throughput"],
        "interleaved_over_sequential_throughput_with_eval": main["interleaved_over_sequential_throughput_with_eval"],
        "eval_share_of_chunk_time": main["executor"]["eval_share"],
        "time_to_first_decision_speedup": main["time_to_first_decision_speedup"],
    }


def markdown(data: dict[str, Any]) -> list[str]:
    """The part's section of results.md."""
    lines = [
        "",
        "## Throughput (4 configs, sequential TRL vs interleaved)",
        "",
        "| model | sequential tok/s | interleaved tok/s (training) | ratio | ratio incl. eval | "
        "switch ms median / p95 | first decision s (seq / ours) | peak GB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in data["runs"]:
        e = r["executor"]
        seq_tps, ratio_eval = (
            r["sequential"]["tokens_per_second"],
            r["interleaved_over_sequential_throughput_with_eval"],
        )
        lines.append(
            f"| {r['model']} | {seq_tps:.0f} | {e['training_tokens_per_second']:.0f} | "
            f"{r['interleaved_over_sequential_throughput']:.3f} | {ratio_eval:.3f} | "
            f"{e['switch_ms_median']:.2f} / {e['switch_ms_p95']:.2f} | "
            f"{r['sequential_time_to_first_decision_seconds']:.1f} / {e['time_to_first_decision_seconds']:.1f} | "
            f"{e['peak_memory_gb']:.2f} |"
        )
    return lines
