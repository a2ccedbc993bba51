"""Time-sliced engine: one trial on the device at a time, switched by adapter hot-swap.

A switch activates the trial's adapter in the shared ``PeftModel`` and restores its RNG; the base
weights never move. Each trial trains with its own TRL trainer's loss, optimizer and LR schedule, so
a chunk here is the same computation TRL's own loop would run on those batches. Building, clones,
snapshots, the memory budget, evaluation and export are the device's
(:mod:`optuna_rapidfire._engines._trials`); so is finishing a chunk.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from optuna_rapidfire._engines._base import Engine
from optuna_rapidfire._engines._trials import chunks_starting
from optuna_rapidfire._engines._types import ChunkResult, EngineStats, clips, train_metrics
from optuna_rapidfire._resident._data import rows_of
from optuna_rapidfire._resident._state import RngState

if TYPE_CHECKING:
    from collections.abc import Sequence

    from optuna_rapidfire._engines._types import TrialRuntime


class TimeSlicedEngine(Engine):
    """Trains one trial at a time on the device of ``trials``."""

    fuses = False
    name = "time_sliced"

    def run(self, runtimes: Sequence[TrialRuntime]) -> list[ChunkResult | BaseException]:
        """Train the trials' next chunks one after another (the scheduler hands this engine one trial)."""
        return [self.run_chunk(runtime) for runtime in runtimes]

    def stats(self) -> EngineStats:
        return self.trials.stats()

    def run_chunk(self, runtime: TrialRuntime) -> ChunkResult:
        """Train the trial's next chunk alone, then evaluate it."""
        chunks_starting(self.trials, [runtime])
        self.trials.placement.switch_to(runtime)
        start = time.perf_counter()
        metrics = self.train_chunk(runtime)
        runtime.state.rng = RngState.capture(self.device)
        return self.trials.finish(runtime, metrics, train_seconds=time.perf_counter() - start)

    def train_chunk(self, runtime: TrialRuntime) -> dict[str, float]:
        """Train the trial's next chunk (the device is switched to it); the chunk's training metrics."""
        kind, trainer, args, state = runtime.spec.kind, runtime.trainer, runtime.args, runtime.state
        dataset, micro = self.trials.next_chunk(runtime)
        accumulation = args.gradient_accumulation_steps
        model = self.trials.resident.module
        model.train()
        scaler = state.scaler
        step_losses: list[torch.Tensor] = []
        grad_norm: torch.Tensor | None = None
        for first in range(0, len(micro), accumulation):
            batches = [rows_of(dataset, indices) for indices in micro[first : first + accumulation]]
            step_losses.append(kind.accumulate(trainer, model, batches, self.device, scaler))
            if scaler is not None:
                scaler.unscale_(state.optimizer)
            if clips(args):
                grad_norm = torch.nn.utils.clip_grad_norm_(state.params, args.max_grad_norm)
            stepped = True
            if scaler is not None:
                scale = scaler.get_scale()
                scaler.step(state.optimizer)
                scaler.update()
                stepped = scaler.get_scale() >= scale
            else:
                state.optimizer.step()
            self.trials.after_optimizer_step(runtime, stepped)
        state.position.chunks_done += 1
        return train_metrics(runtime, step_losses, grad_norm)
