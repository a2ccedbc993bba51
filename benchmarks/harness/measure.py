"""Measuring on the device: synchronisation, percentiles, peak memory, and freeing memory between runs."""

from __future__ import annotations

import gc
import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from optuna_rapidfire import RapidFireExecutor


def sync() -> None:
    """Wait for the GPU (no-op on the CPU), so that host clocks measure the device's work."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank ``q``-percentile of ``values`` (NaN for none)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def peak_memory_gb() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")


def reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def release() -> None:
    """Free what the last trainer, model or executor held, so the next one starts from the same memory."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def drop(executor: RapidFireExecutor) -> None:
    """Close the executor and free its model now, so the next run's peak memory is its own."""
    executor.close()
    release()
