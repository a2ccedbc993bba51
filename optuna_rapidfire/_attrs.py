"""Names of the trial user attributes the executor writes (one place, so readers and writers agree)."""

from __future__ import annotations

PREFIX = "rapidfire:"

ADAPTER_PATH = PREFIX + "adapter_path"
"""Directory of a COMPLETE trial's final adapter, in PEFT's format."""

CHUNKS_DONE = PREFIX + "chunks_done"
"""Chunks the trial has trained so far."""

TOTAL_CHUNKS = PREFIX + "total_chunks"
"""Chunks the trial trains when it is not stopped early (``num_chunks`` x epochs)."""

METRIC = PREFIX + "metric"
"""Name of the evaluation metric reported as intermediate and final values."""

TRAIN_LOSS = PREFIX + "train_loss"
"""Mean training loss of the trial's latest chunk."""

FAIL_REASON = PREFIX + "fail_reason"
"""Why a FAIL trial failed (exception type and message)."""
