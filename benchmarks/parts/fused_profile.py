"""The fused part's profiled runs: a study's top operators (``--profile``), and how busy the GPU is while a gang
trains (the GPU busy share of issue 19, from a chrome trace of torch's profiler)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import optuna
import torch

from benchmarks.harness.bench import Bench
from benchmarks.harness.hooks import GangTrainingWindows, Recorder
from benchmarks.harness.models import configure_from_params
from optuna_rapidfire import RapidFireExecutor


def profile_busy(
    executor: RapidFireExecutor, configure: Any, params: list[dict[str, Any]], label: str, bench: Bench
) -> dict[str, Any]:
    """How busy the GPU is while a fused gang trains: a study of ``params`` on ``executor`` (whose layout is
    compiled already) under torch's profiler; the share of the training phase's wall time (the engine's gang
    chunks, synchronised at both ends) during which a kernel, copy or memset ran. Writes the top kernels to
    ``<label>.txt`` in ``--out``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    # Wall-clock ns of each gang chunk's training (the worker thread's).
    with GangTrainingWindows() as gangs, profile(activities=activities) as prof, Recorder() as recorder:
        study = optuna.create_study(pruner=optuna.pruners.NopPruner())
        for trial_params in params:
            study.enqueue_trial(trial_params)
        executor.optimize(study, configure, n_trials=len(params))
    trace = bench.workdir / f"{label}.trace.json"
    prof.export_chrome_trace(str(trace))
    exported = json.loads(trace.read_text())
    base = int(exported.get("baseTimeNanoseconds", 0))
    sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    out = Path(bench.options.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{label}.txt").write_text(prof.key_averages().table(sort_by=sort, row_limit=30))
    # The trace's timestamps are microseconds after its base time (wall clock, ns).
    ranges = [((a - base) / 1e3, (b - base) / 1e3) for a, b in gangs.windows]
    found = busy_share(exported.get("traceEvents", []), ranges)
    # The training rate of these chunks (the layout compiled, no compilation in them), under the profiler.
    found["tokens"] = recorder.tokens
    found["tokens_per_second"] = recorder.tokens / found["training_wall_seconds"] if ranges else None
    return found


def profile_operators(executor: RapidFireExecutor, trials: int, batch: int, path: Path) -> None:
    """One more study on ``executor`` under torch's profiler; its top operators go to ``path``."""
    from torch.profiler import ProfilerActivity, profile

    study = optuna.create_study(pruner=optuna.pruners.NopPruner())
    for i in range(trials):
        study.enqueue_trial({"learning_rate": 1e-4 * (1 + i), "r": 16})
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        executor.optimize(study, configure_from_params(batch), n_trials=trials)
    sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    tables = [prof.key_averages().table(sort_by=key, row_limit=40) for key in (sort, "cpu_time_total")]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n\n".join(tables))


def busy_share(events: list[dict[str, Any]], ranges: list[tuple[float, float]]) -> dict[str, Any]:
    """From a chrome trace's events: the share of the wall time of ``ranges`` (trace microseconds) during which
    the GPU ran a kernel, a copy or a memset (the union of their intervals, clipped to the ranges)."""
    device = sorted(
        (e["ts"], e["ts"] + e["dur"])
        for e in events
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and e.get("ph") == "X"
    )
    wall = sum(end - begin for begin, end in ranges)
    busy, kernels = 0.0, 0
    for begin, end in ranges:
        inside = [(max(a, begin), min(b, end)) for a, b in device if b > begin and a < end]
        busy += _union(inside)
        kernels += len(inside)
    return {
        "busy_share": busy / wall if wall and device else None,
        # A check of the time base: every device event of the whole profiled study, and its span.
        "study_gpu_busy_seconds": _union(device) / 1e6,
        "study_span_seconds": (device[-1][1] - device[0][0]) / 1e6 if device else 0.0,
        "training_wall_seconds": wall / 1e6,
        "gpu_busy_seconds": busy / 1e6,
        "device_events": kernels,
        "gang_chunks": len(ranges),
    }


def _union(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by ``intervals``."""
    total, reach = 0.0, float("-inf")
    for begin, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(begin, reach)
        reach = end
    return total
