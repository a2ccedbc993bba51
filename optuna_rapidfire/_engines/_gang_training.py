"""Training a gang's chunk in shared passes: every pass laid out ahead, then only launched; each member
steps its own optimizer after its own accumulation steps (or, launched, the gang's AdamW steps every slot at
once), with its own clipping, learning rate schedule and dropout stream.

:meth:`GangTraining.run_pass` is one forward/backward of a laid-out pass; a listener of
:class:`~optuna_rapidfire.events.PassStarting` hears each one before it runs (and breaks it by raising).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from optuna_rapidfire import _compat, events
from optuna_rapidfire._engines._gang_passes import Layouts, StepTables, chunk_width, precision
from optuna_rapidfire._engines._pass_graphs import replayed
from optuna_rapidfire._engines._types import clips, train_metrics
from optuna_rapidfire._fused._fused_pass import clip_gang, fused_forward
from optuna_rapidfire._fused._stacks import KeptStacks, computing_dtype
from optuna_rapidfire._resident._state import RngState

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from optuna_rapidfire._engines._gang_passes import GangPasses, MemberChunk, Pass
    from optuna_rapidfire._engines._launched import Layout
    from optuna_rapidfire._engines._types import TrialRuntime
    from optuna_rapidfire._trainers._fused_loss import FusedLoss


class GangTraining:
    """Trains gangs' chunks through :class:`GangPasses`; counts fused and launched steps.

    Attributes:
        fused_steps: Steps of shared passes.
        launched_steps: Those that took the launched (compiled) pass.
        layout: The launched layout of the gang trained last (its slots still hold the members' weights).
        stepped: Whether any member of the chunk being trained has stepped its optimizer.
    """

    def __init__(self, passes: GangPasses, say: Callable[[str], None]) -> None:
        self.passes = passes
        self.trials = passes.trials
        self.launched = passes.launched
        self.device = passes.device
        self.say = say
        self.fused_steps = 0
        self.launched_steps = 0
        self.layout: Layout | None = None
        self.stepped = False
        self.stacks = KeptStacks()  # the gang's adapters stacked for passes in the model's own modules

    def train(self, runtimes: Sequence[TrialRuntime]) -> list[dict[str, float]]:
        """Train every member's next chunk in shared passes; each member's training metrics. An error of a
        pass propagates; :attr:`stepped` then says whether any member had stepped its optimizer by then."""
        self.stepped = False
        loss = runtimes[0].spec.kind.fused_loss
        assert loss is not None  # train_refusal() lets only kinds with a fused loss through
        plans = [self.passes.plan(runtime, loss) for runtime in runtimes]
        self.trials.placement.enter_gang(runtimes)
        self.trials.resident.module.train()
        launched = self.launched_refusal(runtimes, plans)
        if launched is not None and len(runtimes) > 1:
            self.say(f"Training in the model's own modules, not the launched pass: {launched}.")
        layout = self.launched.load(runtimes) if launched is None else None
        self.layout = layout
        try:
            return self._train(runtimes, plans, layout, loss)
        finally:
            self.stacks.clear()

    def _train(
        self, runtimes: Sequence[TrialRuntime], plans: list[MemberChunk], layout: Layout | None, loss: FusedLoss
    ) -> list[dict[str, float]]:
        device, first = self.device, runtimes[0]
        losses: list[list[torch.Tensor]] = [[] for _ in runtimes]
        grad_norms: list[torch.Tensor | None] = [None for _ in runtimes]
        longest = max(len(plan.inputs) for plan in plans)
        streams = [self.trials.placement.dropout_stream(runtime) for runtime in runtimes]
        # Every pass of the chunk is laid out before the first runs, so the loop below only launches work:
        # no host-side preparation or synchronisation between one pass and the next.
        layouts: Layouts = {}
        width = chunk_width(plans) if layout is not None else None
        schedule = []
        for index in range(longest):
            members = [k for k, plan in enumerate(plans) if index < len(plan.inputs)]
            passes = [
                self.passes.lay_out(runtimes, plans, streams, group, index, layouts, loss, layout, width)
                for group in self.passes.split(plans, index)
            ]
            schedule.append((members, passes))
        tables = StepTables.of(runtimes, plans, self.launched.capacity, device) if layout is not None else None
        for index, (members, passes) in enumerate(schedule):
            for shared in passes:
                self.starting(runtimes, shared.group)
                for k, value in zip(shared.group, self.run_pass(first, shared), strict=True):
                    losses[k].append(value)
            self.fused_steps += 1
            self.launched_steps += layout is not None
            ready = [k for k in members if plans[k].steps_at(index)]
            if ready and layout is not None and tables is not None:
                self.stepped = True
                self.launched.step(layout, *tables.at(index))
            elif ready:
                self.step(runtimes, ready, grad_norms)
        if layout is not None and tables is not None:
            self.finish_launched(runtimes, layout, tables, grad_norms)
        metrics = []
        for k, runtime in enumerate(runtimes):
            state = runtime.state
            state.position.chunks_done += 1
            state.rng = RngState.capture(device)
            state.dropout_rng = streams[k].state()
            plan = plans[k]
            per_step = [
                torch.stack(losses[k][i : i + plan.accumulation]).sum()
                for i in range(0, len(losses[k]), plan.accumulation)
            ]
            trainer: Any = runtime.trainer
            _compat.count_train_tokens(trainer, plan.tokens)
            metrics.append(train_metrics(runtime, per_step, grad_norms[k]))
        self.trials.placement.leave_gang(runtimes)
        return metrics

    def launched_refusal(self, runtimes: Sequence[TrialRuntime], plans: Sequence[MemberChunk]) -> str | None:
        """Why this chunk of the gang cannot take the launched pass (``None``: it can)."""
        reason = self.launched.refusal(runtimes)
        if reason is not None:
            return reason
        if not all(all(plan.right_padded) for plan in plans):
            return "a micro-batch is padded on the left or inside (the launched pass pads on the right only)"
        return self.launched.decoder.window_refusal(chunk_width(plans))

    def finish_launched(
        self,
        runtimes: Sequence[TrialRuntime],
        layout: Layout,
        tables: StepTables,
        grad_norms: list[torch.Tensor | None],
    ) -> None:
        """After a launched chunk: every member's slot back into its own state, its schedule and step count
        moved on by the steps it took, and its last gradient norm kept (when it clips)."""
        self.launched.store(layout, runtimes)
        assert layout.optimizer is not None
        for k, runtime in enumerate(runtimes):
            state = runtime.state
            state.position.optimizer_steps += tables.steps[k]
            _compat.seek_lr_scheduler(state.lr_scheduler, state.position.optimizer_steps)
            runtime.trainer.state.global_step = state.position.optimizer_steps
            if clips(runtime.args):
                grad_norms[k] = layout.optimizer.last_norm[k].clone()

    @staticmethod
    def starting(runtimes: Sequence[TrialRuntime], group: Sequence[int]) -> None:
        """Say that a pass of the gang positions ``group`` starts (while anyone listens)."""
        if events.listening(events.PassStarting):
            events.emit(events.PassStarting(tuple(runtimes[k].spec.number for k in group)))

    def run_pass(self, first: TrialRuntime, shared: Pass) -> list[torch.Tensor]:
        """One forward/backward of a laid-out pass; each member's loss, detached.

        The losses need no host synchronisation: the label positions were found on the host when the chunk
        was collated, and the per-member sums come from ``index_add_``. The kind's loss says what the pass
        compares against (DPO: a reference pass of the whole gang with the adapters off) and computes the
        members' losses. A launched pass whose compilation fails runs again uncompiled (nothing of it was
        applied: the compiler fails before the first kernel of the graph runs).
        """
        layout = shared.layout
        if layout is None:
            # The gang's layers stay in place through the backward pass too: activation checkpointing
            # recomputes forwards there (from the stacks as loaded: nothing loads them again meanwhile).
            compute = computing_dtype(first.spec.kind.autocast(first.args, self.device), self.device)
            names, rows = shared.gang.names, shared.gang.rows
            version = self.trials.resident.adapters_version
            stacks = self.stacks.loaded(shared.layers, names, rows, version, compute, grad=True)
            members = range(len(names))
            try:
                with fused_forward(self.trials.resident.module, shared.gang, shared.layers, stacks):
                    losses = self.forward_backward(first, shared)
                if stacks is not None:
                    stacks.hand_out(members)
            finally:
                if stacks is not None:
                    stacks.forget(members)
            return losses
        with self.launched.compiling(layout):
            try:
                return self.forward_backward(first, shared)
            except Exception as error:
                if not (layout.compiled and _compat.is_compile_error(error)):
                    raise
                self.launched.fall_back(layout, error)
            return self.forward_backward(first, shared)

    def forward_backward(self, first: TrialRuntime, shared: Pass) -> list[torch.Tensor]:
        """The pass's forward and backward; each member's loss, detached. A padded launched pass
        (:attr:`Pass.sums`) is replayed from a CUDA graph of its shape where the engine records them
        (:mod:`~optuna_rapidfire._engines._pass_graphs`)."""
        if shared.sums is not None and shared.layout is not None:
            sums = replayed(
                self.launched.graphs,
                shared.layout.slots,
                ("pass", type(shared.loss), precision(first.args)),
                shared.tensors(),
                lambda tensors: self.member_losses(first, shared.with_tensors(tensors)),
            )
            assert sums is not None
        else:
            sums = self.member_losses(first, shared)
        return list(sums[: len(shared.group)].unbind())

    def member_losses(self, first: TrialRuntime, shared: Pass) -> torch.Tensor:
        """The pass's forward and backward; the loss sums, scaled and detached (one per member, and one of
        padding when :attr:`Pass.sums` says so)."""
        loss, rows = shared.loss, len(shared.input_ids)
        assert loss is not None and shared.scales is not None  # a training pass
        reference = loss.reference(lambda: self.passes.token_nll(first, shared, base=True), shared.where, rows)
        # Mixed precision covers the forward pass and the losses only.
        with first.spec.kind.autocast(first.args, self.device):
            nll = self.passes.token_nll(first, shared)
            count = shared.sums if shared.sums is not None else len(shared.group)
            sums = loss.losses(nll, reference, shared.where, shared.extras, rows, count)
            member_losses = sums * shared.scales
        member_losses.sum().backward()
        return member_losses.detach()

    def step(self, runtimes: Sequence[TrialRuntime], ready: list[int], grad_norms: list[torch.Tensor | None]) -> None:
        self.stepped = True
        grads = []
        for k in ready:  # a step whose micro-batches had no loss token gets zero gradients, as a backward would
            params = runtimes[k].state.params
            grads.append([p.grad if p.grad is not None else _zero_grad(p) for p in params])
        norms = clip_gang(grads, [runtimes[k].args.max_grad_norm for k in ready])
        for k, norm in zip(ready, norms, strict=True):
            runtime = runtimes[k]
            if clips(runtime.args):
                grad_norms[k] = norm
            runtime.state.optimizer.step()
            self.trials.after_optimizer_step(runtime)


def _zero_grad(param: torch.nn.Parameter) -> torch.Tensor:
    param.grad = torch.zeros_like(param)
    return param.grad
