"""optuna-rapidfire benchmarks: sequential TRL against the executor, on one machine, in one run.

    CUDA_VISIBLE_DEVICES=0 python -m benchmarks.run --parts throughput,scale --out benchmarks/results
    CUDA_VISIBLE_DEVICES=0 python -m benchmarks.run --parts search --out benchmarks/results  # parts/search/
    CUDA_VISIBLE_DEVICES=0 python -m benchmarks.run --parts fused,grpo --out benchmarks/results  # parts/
    python -m benchmarks.run --parts multi_gpu --out benchmarks/results            # two GPUs
    python -m benchmarks.run --smoke --parts all --out /tmp/bench                  # CPU, tiny model, minutes

Models are random-weight models of real shapes (Llama-3.2-1B, TinyLlama-1.1B) built on the device in
bf16; speed does not depend on the weights. Data: the bundled GSM8K train set, packed into 512-token rows.
Every part writes ``<part>.json`` (numbers, machine, versions, command); ``summary.json``, ``results.md``
and the plots gather them. See benchmarks/README.md for what each number means.

This module is the command only: the parts live in :mod:`benchmarks.parts`, what they share in
:mod:`benchmarks.harness`, the report in :mod:`benchmarks.report`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna
import torch

from benchmarks.harness.bench import Bench
from benchmarks.parts import fused, grpo, multi_gpu, scale, search, throughput
from benchmarks.report import PARTS, rebuild, write_reports

Part = Callable[[Bench, list[str], Callable[[dict[str, Any]], None]], dict[str, Any]]
RUNS: dict[str, Part] = {
    "throughput": throughput.run,
    "scale": scale.run,
    "search": search.run,
    "fused": fused.run,
    "grpo": grpo.run,
    "multi_gpu": multi_gpu.run,
}
"""Each part's ``run(bench, shapes, save)``; ``throughput`` measures every shape, the others the first."""


def _positive(text: str) -> int:
    """An argument that must be a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is below 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--parts", default="throughput,scale", help="throughput, scale, search, fused, grpo, multi_gpu or all"
    )
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--batch", type=int, default=4, help="per-trial batch of 512-token rows")
    group = parser.add_argument_group(
        "search part (benchmarks/parts/search/); unset sizes take the defaults or --smoke's"
    )
    group.add_argument("--seeds", default=None, help="replicates: each seed's config list (default 0,1)")
    group.add_argument(
        "--search-methods",
        default=None,
        help="methods, in this order: sequential, processes_N, processes_N_compiled, executor, executor_lockstep, "
        "executor_time_sliced, executor_fused, executor_promote_all "
        "(default processes_8,executor,processes_4,sequential)",
    )
    group.add_argument("--search-configs", type=int, default=None, help="configs per replicate (default 16)")
    group.add_argument("--trial-rows", type=int, default=None, help="GSM8K rows each trial trains on (default 1024)")
    group.add_argument("--search-chunks", type=int, default=None, help="chunks per trial (default 8)")
    group.add_argument("--pretrain-steps", type=int, default=None, help="pretraining steps of the base (800)")
    group.add_argument("--method-timeout", type=float, default=None, help="seconds one method may run (420)")
    group.add_argument(
        "--search-deadline",
        type=float,
        default=None,
        help="seconds after the part starts by which its methods must end: a method not expected to fit is skipped",
    )
    group.add_argument(
        "--code",
        default=None,
        help="label of the code this call measures, kept with each method it runs; summary.json's medians are over "
        "the replicates measured at the latest call's code (default: the checkout's git HEAD; 'unrecorded' without)",
    )
    group.add_argument("--corpus", default=None, help="folder of the pretraining corpus (.bench/corpus)")
    group.add_argument("--search-base", default=None, help="where the base model is cached (.bench/search-base)")
    parser.add_argument(
        "--rebuild", action="store_true", help="only rebuild summary, table and plot from the JSONs in --out"
    )
    parser.add_argument("--smoke", action="store_true", help="tiny model and sizes: a CPU dry run of the harness")
    parser.add_argument("--profile", action="store_true", help="fused part: also profile one fused study")
    parser.add_argument(
        "--fused-runs", default="", help="fused part: only these runs (comma-separated), merged into --out/fused.json"
    )
    parser.add_argument(
        "--grpo-runs", default="", help="grpo part: only these runs (comma-separated), merged into --out/grpo.json"
    )
    parser.add_argument(
        "--grpo-repeats",
        type=_positive,
        default=None,
        help="grpo part: runs of each engine's study, in turns; the ratios take the median walls (default 3, "
        "--smoke 1)",
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    options = build_parser().parse_args(argv)
    if options.rebuild:
        rebuild(Path(options.out))
        return
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    known = list(PARTS)
    parts = known if options.parts == "all" else options.parts.split(",")
    unknown = sorted(set(parts) - set(known))
    if unknown:
        raise SystemExit(f"unknown parts {unknown}: choose among {', '.join(known)}, all")
    one_gpu_parts = [p for p in parts if p != "multi_gpu"]
    if one_gpu_parts and torch.cuda.device_count() > 1:
        raise SystemExit(
            f"{', '.join(one_gpu_parts)} measure one GPU (TRL's trainer would use DataParallel over "
            f"{torch.cuda.device_count()}): run them with CUDA_VISIBLE_DEVICES=0, and multi_gpu separately."
        )
    if "multi_gpu" in parts:
        multi_gpu.devices(options.smoke)  # too few GPUs: say so before the other parts run
    bench = Bench(options)
    shapes = ["tiny"] if options.smoke else ["llama-3.2-1b", "tinyllama-1.1b"]
    results: dict[str, Any] = {}
    for part in parts:
        start = time.perf_counter()

        def save(data: dict[str, Any], part: str = part) -> None:
            """Write what the part has so far: a call cut short by a time limit keeps what finished."""
            write_reports(Path(options.out), {part: data}, bench.command)

        results[part] = RUNS[part](bench, shapes, save)
        results[part]["seconds"] = time.perf_counter() - start
        print(f"{part}: {results[part]['seconds']:.1f} s", flush=True)
        write_reports(
            Path(options.out),
            {part: results[part]},
            " ".join([sys.executable, "-m", "benchmarks.run", *(argv or sys.argv[1:])]),
        )


if __name__ == "__main__":
    main()
