"""What serialising a trial's chunk state costs the device's thread (issue 35; any machine, no GPU needed).

    python -m benchmarks.snapshot_gil --out benchmarks/results

A fused gang's host work runs in Python threads that share one global lock (the device's thread, the members'
threads, the trials' threads that checkpoint each chunk). This builds the state of one trial of the grpo part's
shape (Llama-3.2-1B, LoRA r16 on the attention projections: A, B and AdamW's two moments per projection, float32,
~41 MB in ~400 tensors), and measures for each writer (``safetensors``: ``safetensors.torch.save``; ``blob``:
:meth:`TrialSnapshot.blob`'s writer):

- ``seconds``: one serialisation alone (median of :data:`REPEATS`);
- ``slowdown``: how much longer a stand-in for the device's thread (:data:`OPERATORS` small torch operators in a
  loop, one thread) takes while another thread serialises snapshots without pause, over the same loop alone.

and the other way round, what Python code in another thread (a trial's thread reporting to its study, a stand-in:
building small dicts without pause) costs the device's thread as it copies that state out (``copies``): the
state's tensors gathered into one buffer and cut back into views by one operator each (``bulk``,
:func:`~optuna_rapidfire._resident._snapshot.copied_to_cpu`) against the same gathering cut by a ``clone`` per
tensor (``per_tensor``: one release and retaking of Python's lock per tensor), each alone and beside that thread.

Writes ``snapshot_gil.json``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save

from benchmarks.harness.environment import machine
from optuna_rapidfire import _compat
from optuna_rapidfire._resident._snapshot import TrialSnapshot, copied_to_cpu, safetensors_blob
from optuna_rapidfire._resident._state import Position, RngState

REPEATS = 9
OPERATORS = 20_000
# The grpo part's shape: 16 layers; q and o 2048 -> 2048, k and v 2048 -> 512 (8 KV heads of 64).
LAYERS, RANK = 16, 16
PROJECTIONS = {"q_proj": 2048, "k_proj": 512, "v_proj": 512, "o_proj": 2048}


def trial_state() -> TrialSnapshot:
    """One trial's chunk state of the grpo part's shape, with random values."""
    weights: dict[str, torch.Tensor] = {}
    state: dict[int, dict[str, Any]] = {}
    for layer in range(LAYERS):
        for name, out in PROJECTIONS.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            for key, shape in ((f"{prefix}.lora_A.weight", (RANK, 2048)), (f"{prefix}.lora_B.weight", (out, RANK))):
                weights[key] = torch.randn(shape)
                moments = {"exp_avg": torch.randn(shape), "exp_avg_sq": torch.rand(shape)}
                state[len(state)] = {"step": torch.tensor(3.0), **moments}
    rng = RngState(cpu=torch.get_rng_state(), device=None, python=random.getstate(), numpy=np.random.get_state())
    optimizer = {"state": state, "param_groups": [{"lr": 1e-5, "params": list(state)}]}
    return TrialSnapshot(1, "grpo", weights, optimizer, 3, None, rng, Position(1, 3), [{"eval_reward": 0.0}])


def writers(snapshot: TrialSnapshot) -> dict[str, Callable[[], Any]]:
    def with_safetensors() -> bytes:
        tensors, metadata = snapshot._parts("study")
        return save({k: v.contiguous() for k, v in tensors.items()}, metadata=metadata)

    def as_blob() -> memoryview:
        return safetensors_blob(*snapshot._parts("study"))  # uncached: each call serialises again

    return {"safetensors": with_safetensors, "blob": as_blob}


def operators() -> float:
    """Seconds of :data:`OPERATORS` small torch operators in a row (a host-bound device thread's stand-in)."""
    x = torch.randn(64, 64)
    y = x
    start = time.perf_counter()
    for _ in range(OPERATORS):
        y = torch.add(y, x)
    return time.perf_counter() - start


def beside(write: Callable[[], Any]) -> float:
    """:func:`operators` while another thread runs ``write`` without pause."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            write()

    thread = threading.Thread(target=loop)
    thread.start()
    time.sleep(0.05)
    try:
        return operators()
    finally:
        stop.set()
        thread.join()


def copiers(snapshot: TrialSnapshot) -> dict[str, Callable[[], Any]]:
    tensors = [*snapshot.weights.values()] + [v for s in snapshot.optimizer["state"].values() for v in s.values()]

    def per_tensor() -> list[torch.Tensor]:
        with torch.no_grad():
            pieces = _compat.flatten_dense_tensors(tensors).split([t.numel() for t in tensors])
            return [piece.view(t.shape).clone() for piece, t in zip(pieces, tensors, strict=True)]

    return {"per_tensor": per_tensor, "bulk": lambda: copied_to_cpu(tensors)}


def timed(work: Callable[[], Any]) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def python_beside(work: Callable[[], Any]) -> float:
    """Seconds of ``work`` while another thread runs Python code without pause (small dicts built)."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            {i: str(i) for i in range(200)}

    thread = threading.Thread(target=loop)
    thread.start()
    time.sleep(0.05)
    try:
        return timed(work)
    finally:
        stop.set()
        thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    options = parser.parse_args()
    torch.set_num_threads(1)
    snapshot = trial_state()
    found: dict[str, Any] = {"command": "python -m benchmarks.snapshot_gil", "machine": machine()}
    found["bytes"] = safetensors_blob(*snapshot._parts("study")).nbytes
    found["tensors"] = len(snapshot._parts("study")[0])
    alone = statistics.median(operators() for _ in range(REPEATS))
    found["operators_alone_seconds"] = alone
    for label, write in writers(snapshot).items():
        times = []
        for _ in range(REPEATS):
            start = time.perf_counter()
            write()
            times.append(time.perf_counter() - start)
        slowed = statistics.median(beside(write) for _ in range(REPEATS))
        found[label] = {"seconds": statistics.median(times), "operators_seconds": slowed, "slowdown": slowed / alone}
        print(f"{label}: {found[label]['seconds'] * 1e3:.1f} ms a snapshot; operators beside it x{slowed / alone:.2f}")
    found["copies"] = {}
    for label, copy in copiers(snapshot).items():
        alone = statistics.median(timed(copy) for _ in range(REPEATS))
        slowed = statistics.median(python_beside(copy) for _ in range(REPEATS))
        found["copies"][label] = {"seconds": alone, "seconds_beside_python": slowed}
        print(f"copies {label}: {alone * 1e3:.1f} ms alone, {slowed * 1e3:.1f} ms beside a thread running Python")
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "snapshot_gil.json").write_text(json.dumps(found, indent=2) + "\n")


if __name__ == "__main__":
    main()
