"""The scale part: switch latency, offloads and memory against the number of live trials (time-sliced engine).

K = 1, 4, 8, 16, 32 live trials, each training 2 of 16 chunks; for K > 8 the state budget holds 8 trials'
states, so idle trials' adapters and Adam moments move to pinned CPU memory and back.
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable
from typing import Any

import optuna
from peft import LoraConfig
from trl import SFTConfig

from benchmarks.harness.bench import Bench
from benchmarks.harness.hooks import Recorder
from benchmarks.harness.measure import drop, peak_memory_gb, percentile, reset_peak
from benchmarks.harness.models import SHAPES, configure_from_params, lora, sft_args


def run(bench: Bench, shapes: list[str], save: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Switch latency, offloads and memory against the number of live trials, on the first shape."""
    shape = shapes[0]
    sizes = [1, 4, 8, 16, 32] if not bench.smoke else [1, 2, 4]
    rows_per_trial_chunk = 32 if not bench.smoke else 8
    results = []
    for k in sizes:
        chunks = 16
        # Room for 8 trials' states on the device: beyond that, idle trials move to pinned CPU memory.
        budget = None if k <= 8 else 8 * _state_bytes(shape)
        # Lock-step rounds, as these numbers were measured: each round trains every live trial once, in
        # turn, so with K > 8 the switches keep bringing back states the budget moved off the device (the
        # offloads, and switch latency with that traffic in it). The default "promote" trains leaders first
        # and completes them early, so fewer states are live at once and the offloads mostly go (0 instead
        # of 10 at K = 10 in a CPU run): no longer the K live trials this part is about.
        executor = bench.executor(
            shape,
            rows_per_trial_chunk * chunks,
            chunks,
            k,
            state_memory_budget=budget,
            schedule="lockstep",
        )
        executor.objective(configure_from_params(bench.batch))  # loads the model
        study = optuna.create_study(pruner=optuna.pruners.NopPruner())
        for i in range(k):
            study.enqueue_trial({"learning_rate": 1e-4 * (1 + i % 4), "r": 16})
        configure = functools.partial(_configure_two_chunks, batch=bench.batch, chunks=chunks)
        reset_peak()
        with Recorder() as recorder:
            executor.optimize(study, configure, n_trials=k)
        stats = executor.stats()
        results.append(
            {
                "live_trials": k,
                "switch_ms_median": statistics.median(recorder.switches) * 1e3 if recorder.switches else None,
                "switch_ms_p95": percentile(recorder.switches, 0.95) * 1e3 if recorder.switches else None,
                "switches": len(recorder.switches),
                "offloads": stats.offloads,
                "peak_memory_gb": peak_memory_gb(),
                "base_memory_gb": stats.base_bytes / 2**30,
            }
        )
        print(
            f"scale part, {k} live trials: {len(recorder.switches)} switches, {stats.offloads} offloads",
            flush=True,
        )
        drop(executor)
    return {"model": shape, "results": results}


def _configure_two_chunks(trial: optuna.Trial, batch: int, chunks: int) -> tuple[LoraConfig, SFTConfig]:
    lr = trial.suggest_float("learning_rate", 1e-5, 1e-2, log=True)
    rank = trial.suggest_categorical("r", [8, 16])
    return lora(rank), sft_args(lr, batch, num_train_epochs=2 / chunks)


def _state_bytes(shape: str) -> int:
    """Adapter + Adam moments of LoRA r16 on q, k, v, o (fp32), for the budget of the scale part."""
    s = SHAPES[shape]
    head = s["hidden_size"] // s["num_attention_heads"]
    kv = s["num_key_value_heads"] * head
    per_layer = 16 * (4 * s["hidden_size"] + 2 * s["hidden_size"] + 2 * kv + 2 * s["hidden_size"])
    return per_layer * s["num_hidden_layers"] * 4 * 3


def markdown(data: dict[str, Any]) -> list[str]:
    """The part's section of results.md."""
    lines = [
        "",
        f"## Scale ({data['model']})",
        "",
        "| live trials | switch ms median | p95 | offloads | peak GB |",
        "|---|---|---|---|---|",
    ]
    for r in data["results"]:
        median = "-" if r["switch_ms_median"] is None else f"{r['switch_ms_median']:.2f}"
        p95 = "-" if r["switch_ms_p95"] is None else f"{r['switch_ms_p95']:.2f}"
        lines.append(f"| {r['live_trials']} | {median} | {p95} | {r['offloads']} | {r['peak_memory_gb']:.2f} |")
    return lines
