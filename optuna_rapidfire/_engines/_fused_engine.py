"""The fused engine: a gang of live trials trains its chunks together, in shared passes.

Everything but training is the device's (:mod:`optuna_rapidfire._engines._trials`: building, clones,
checkpoints, evaluation, export, finishing a chunk), as for the time-sliced engine, which this engine uses
for the gangs it cannot fuse. A *gang* is the set of live trials the scheduler hands over together (the
schedule's choice: every ready trial under "promote", those at the least progress under "lockstep"); each
member trains its own next chunk, whatever the others' progress. Each fused step takes the next
micro-batch of every gang member that has one left in the chunk, pads them to one length, runs the
frozen backbone once with every adapter on its own rows (:mod:`optuna_rapidfire._fused._fused_pass`),
and computes each trial's loss as TRL does, through its kind's
:class:`~optuna_rapidfire._trainers._fused_loss.FusedLoss`: SFT, the shifted labels' negative
log-probabilities summed and divided by the tokens of the trial's own accumulated batch; DPO, the sigmoid
loss of each pair's log-ratio margin against a reference pass of the whole gang with the adapters off,
with the trial's own beta. After its own ``gradient_accumulation_steps`` micro-batches a trial clips its
gradients to its own ``max_grad_norm`` and steps its own optimizer and LR schedule. Trials whose chunk
holds fewer micro-batches leave the later steps.

Adapter dropout masks come from each trial's own generator (seeded from its ``seed``, saved with its
state and checkpoints) and are drawn for the trial's own sequence length, so a trial gets the same masks
alone or in any gang; a lone trial trains through the same fused path for that reason. Only gangs that
can share a pass are fused: SFT or DPO trials (not mixed) with the same precision and activation
checkpointing, no LoRA variant (DoRA), no padding-free packing, TRL's default loss, no custom loss or
metrics; any other gang trains time-sliced (with PEFT's dropout from the global RNG), and the engine says
why once. A shared pass that fails before any member stepped is retried one member at a time.

The parts: :mod:`~optuna_rapidfire._engines._fusion` decides whether a gang shares its passes,
:mod:`~optuna_rapidfire._engines._gang_passes` lays the passes out,
:mod:`~optuna_rapidfire._engines._gang_training` trains and :mod:`~optuna_rapidfire._engines._gang_evaluation`
evaluates through them; this engine sequences them and recovers from a failed shared pass. A fused gang
evaluates in shared forward passes too (each member's own eval batches and adapter, and for DPO a pass with
the adapters off; its kind's metrics from per-row sums: :meth:`FusedLoss.eval_metrics`); a kind without
those metrics evaluates each member alone. A gang of trials that sample completions (GRPO) runs each
member's TRL steps and evaluation in turns: the members waiting to generate decode in one batch
(:mod:`optuna_rapidfire._trainers.grpo._generation`), and those taking a policy step share its forward and
backward passes (:mod:`optuna_rapidfire._trainers.grpo._policy_pass`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

import torch

from optuna_rapidfire import events
from optuna_rapidfire._engines._base import Engine
from optuna_rapidfire._engines._fusion import train_refusal
from optuna_rapidfire._engines._gang_evaluation import GangEvaluation
from optuna_rapidfire._engines._gang_passes import GangPasses
from optuna_rapidfire._engines._gang_stream import GangStream
from optuna_rapidfire._engines._gang_training import GangTraining
from optuna_rapidfire._engines._launched import LaunchedPasses
from optuna_rapidfire._engines._time_sliced import TimeSlicedEngine
from optuna_rapidfire._engines._trials import chunks_starting
from optuna_rapidfire._engines._types import runtime_of
from optuna_rapidfire._logging import get_logger

if TYPE_CHECKING:
    from collections.abc import Sequence

    from optuna_rapidfire._engines._gang_stream import Refill
    from optuna_rapidfire._engines._trials import DeviceTrials
    from optuna_rapidfire._engines._types import ChunkResult, EngineStats, TrialRuntime
    from optuna_rapidfire._trainers._host import Member

_logger = get_logger(__name__)


class FusedEngine(Engine):
    """Trains gangs of trials in shared forward/backward passes; falls back to time slicing.

    Attributes:
        launched: The compiled passes of the gang layouts seen so far.
        passes: Lays out the gangs' passes (:attr:`GangPasses.pass_tokens` caps their size).
        training: Trains a gang's chunk (:meth:`GangTraining.run_pass`: one shared pass).
        evaluation: Evaluates a gang.
    """

    fuses = True
    name = "fused"

    def __init__(
        self, trials: DeviceTrials, *, compile: str | bool = False, capacity: int = 8, graphs: bool = False
    ) -> None:
        super().__init__(trials)
        self._alone = TimeSlicedEngine(trials)  # gangs that cannot share a pass, and retries one by one
        self._said: set[str] = set()
        self.launched = LaunchedPasses(trials.resident, compile, capacity, graphs=graphs)
        self.passes = GangPasses(trials, self.launched)
        self.training = GangTraining(self.passes, self.say)
        self.evaluation = GangEvaluation(self.passes, self.say)
        self.streaming = GangStream(self.training, self.evaluation)

    @classmethod
    def create(cls, trials: DeviceTrials, *, compile: str | bool, capacity: int, graphs: bool = False) -> Engine:
        return cls(trials, compile=compile, capacity=capacity, graphs=graphs)

    def release(self, runtime: TrialRuntime) -> None:
        self.evaluation.release(runtime)
        super().release(runtime)

    def close(self) -> None:
        self.launched.close()

    def stats(self) -> EngineStats:
        graphs = self.launched.graphs
        base = self.trials.stats()
        return dataclasses.replace(
            base,
            fused_steps=self.training.fused_steps + base.fused_steps,  # base: a kind's own shared passes (GRPO's)
            pass_tokens=self.passes.pass_tokens,
            launched_steps=self.training.launched_steps,
            compiles=self.launched.compiles,
            compile_failures=self.launched.compile_failures,
            gang_fill=self.streaming.fill(),
            graphs_recorded=0 if graphs is None else graphs.captured,
            graph_replays=0 if graphs is None else graphs.replays,
            graph_failures=0 if graphs is None else graphs.failures,
            graph_calls={} if graphs is None else dict(graphs.calls),
        )

    def stream_refusal(self, runtimes: Sequence[TrialRuntime]) -> str | None:
        if not runtimes[0].spec.kind.gang.streams:
            return "its trials sample completions (they train in turns)"
        return self.streaming.refusal(runtimes)

    def stream(self, runtimes: Sequence[TrialRuntime], refill: Refill) -> None:
        """The gang as a stream (:class:`~optuna_rapidfire._engines._gang_stream.GangStream`). A shared pass that
        fails before any member stepped trains the members seated then one by one."""
        try:
            self.streaming.run(runtimes, refill)
        except Exception as error:
            if self.training.stepped:  # the members' states moved on together: the seated members fail as one
                raise
            seated = self.streaming.seated
            refill.delivered(list(zip(seated, self._one_by_one(seated, error), strict=True)))

    def run(self, runtimes: Sequence[TrialRuntime]) -> list[ChunkResult | BaseException]:
        """Train every trial's next chunk, in shared passes when they can share them; then evaluate each.

        Returns:
            Each member's chunk result, or the error that failed that member alone (its evaluation, or
            its own chunk after a shared pass failed before any member stepped). An error after members
            stepped is raised: it fails the whole gang.
        """
        return list(runtimes[0].spec.kind.gang.run(self, runtimes))  # the kind's strategy chooses how

    # -- what a kind's gang strategy may ask (:class:`~optuna_rapidfire._trainers._host.GangEngine`) -------------

    @property
    def host(self) -> DeviceTrials:
        return self.trials

    def shared_passes(self, members: Sequence[Member]) -> list[ChunkResult | BaseException]:
        return self._shared_passes([runtime_of(m) for m in members])

    def alone(self, members: Sequence[Member]) -> list[ChunkResult | BaseException]:
        return self._alone.run([runtime_of(m) for m in members])

    def run_chunk(self, member: Member) -> ChunkResult:
        return self._alone.run_chunk(runtime_of(member))

    def say(self, text: str) -> None:
        """Log ``text`` once per engine (why a gang does not share its passes)."""
        if text not in self._said:
            self._said.add(text)
            _logger.info(text)

    def _shared_passes(self, runtimes: Sequence[TrialRuntime]) -> list[ChunkResult | BaseException]:
        """A gang of kinds with a fused loss (SFT, DPO): every step in one forward/backward pass, then the
        gang evaluates in shared forward passes; time-sliced when the gang cannot share them."""
        reason = train_refusal(self.trials.resident, self.trials.extras, runtimes)
        if reason is not None:
            if len(runtimes) > 1:
                self.say(f"Training time-sliced, not fused: {reason}.")
            return self._alone.run(runtimes)
        chunks_starting(self.trials, list(runtimes))
        start = time.perf_counter()
        try:
            with events.window(tuple(r.spec.number for r in runtimes), self.device):
                metrics = self.training.train(runtimes)
        except Exception as error:
            if self.training.stepped:  # the members' states moved on together: the gang fails as one
                raise
            return self._one_by_one(runtimes, error)
        train_seconds = (time.perf_counter() - start) / len(runtimes)
        evaluated = self.evaluation.evaluate(runtimes, self.training.layout)
        results: list[ChunkResult | BaseException] = []
        for runtime, chunk_metrics, own in zip(runtimes, metrics, evaluated, strict=True):
            try:
                results.append(self.trials.finish(runtime, chunk_metrics, train_seconds, own))
            except Exception as error:  # this member's evaluation only
                results.append(error)
        return results

    def _one_by_one(self, runtimes: Sequence[TrialRuntime], error: Exception) -> list[ChunkResult | BaseException]:
        """After a shared pass failed before any member stepped: train each member alone, so that only a
        trial that fails on its own fails. Out of memory also halves the size of later shared passes."""
        for runtime in runtimes:
            runtime.state.optimizer.zero_grad(set_to_none=True)
        self.trials.placement.leave_gang(runtimes)
        if isinstance(error, torch.cuda.OutOfMemoryError):
            torch.cuda.empty_cache()
            self.passes.pass_tokens = max(self.passes.pass_tokens // 2, 1)
        _logger.warning(
            "A shared pass of trials %s failed (%s: %s); training them one by one. Later passes take at most "
            "%d tokens.",
            [runtime.spec.number for runtime in runtimes],
            type(error).__name__,
            error,
            self.passes.pass_tokens,
        )
        results: list[ChunkResult | BaseException] = []
        for runtime in runtimes:
            try:
                results.append(self._alone.run_chunk(runtime))
            except Exception as own:
                results.append(own)
        return results
