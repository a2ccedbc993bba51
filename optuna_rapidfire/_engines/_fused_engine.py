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

A fused gang then evaluates in shared forward passes too (each member's own eval batches and adapter,
and for DPO a pass with the adapters off; its kind's metrics from per-row sums:
:meth:`FusedLoss.eval_metrics`); a kind without those metrics evaluates each member alone. A gang of
trials that sample completions (GRPO) runs each member's TRL steps and evaluation in turns: the members
waiting to generate decode in one batch (:mod:`optuna_rapidfire._trainers.grpo._generation`), and those taking
a policy step share its forward and backward passes (:mod:`optuna_rapidfire._trainers.grpo._policy_pass`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from optuna_rapidfire import _compat
from optuna_rapidfire._engines._base import ChunkResult, Engine, EngineStats
from optuna_rapidfire._engines._launched import LaunchedPasses
from optuna_rapidfire._engines._time_sliced import TimeSlicedEngine
from optuna_rapidfire._engines._trials import clips, train_metrics
from optuna_rapidfire._fused._decoder import Rows
from optuna_rapidfire._fused._dropout import feature_keys, position_keys, row_keys
from optuna_rapidfire._fused._fused_pass import (
    Gang,
    backbone_and_head,
    base_only,
    clip_gang,
    fused_forward,
    layer_plans,
    lora_layers,
    pad_right,
    pad_token_id,
    unsupported,
)
from optuna_rapidfire._fused._slots import gcd_units
from optuna_rapidfire._fused._token_stats import token_stats
from optuna_rapidfire._logging import get_logger
from optuna_rapidfire._resident._data import rows_of
from optuna_rapidfire._resident._state import RngState
from optuna_rapidfire._trainers._base import _to_device, accumulation_divisor
from optuna_rapidfire._trainers._fused_loss import EvalRows

if TYPE_CHECKING:
    from collections.abc import Sequence

    from optuna_rapidfire._engines._launched import Layout
    from optuna_rapidfire._engines._trials import DeviceTrials, TrialRuntime
    from optuna_rapidfire._fused._dropout import DropoutStream
    from optuna_rapidfire._trainers._fused_loss import FusedLoss

_logger = get_logger(__name__)


class FusedEngine(Engine):
    """Trains gangs of trials in shared forward/backward passes; falls back to time slicing."""

    fuses = True

    def __init__(self, trials: DeviceTrials, *, compile: str | bool = False, capacity: int = 8) -> None:
        super().__init__(trials)
        self._alone = TimeSlicedEngine(trials)  # gangs that cannot share a pass, and retries one by one
        self.launched = LaunchedPasses(trials.resident, compile, capacity)
        self.fused_steps = 0
        self.launched_steps = 0  # fused steps that took the launched pass
        self._layout: Layout | None = None  # the launched layout of the gang trained last (its slots hold it)
        self.pass_tokens = PASS_TOKENS
        self._stepped = False
        self._said: set[str] = set()
        # Each live trial's collated eval set (dropped when the trial is released).
        self._eval_plans: dict[TrialRuntime, tuple[_MemberChunk, list[int]]] = {}

    def release(self, runtime: TrialRuntime) -> None:
        self._eval_plans.pop(runtime, None)
        super().release(runtime)

    def stats(self) -> EngineStats:
        return dataclasses.replace(
            self.trials.stats(),
            fused_steps=self.fused_steps,
            pass_tokens=self.pass_tokens,
            launched_steps=self.launched_steps,
            compiles=self.launched.compiles,
            compile_failures=self.launched.compile_failures,
        )

    # -- which gangs can be fused ----------------------------------------------------------------

    def refusal(self, runtimes: Sequence[TrialRuntime]) -> str | None:
        """Why these trials cannot share a pass (``None``: they can)."""
        first = runtimes[0]
        for runtime in runtimes:
            reason = runtime.spec.kind.fused_refusal(runtime.trainer, runtime.args)
            if reason is not None:
                return f"trial {runtime.spec.number} {reason}"
            if getattr(runtime.args, "padding_free", False) or getattr(runtime.trainer, "padding_free", False):
                # SFTTrainer packs padding-free by itself with packing=True and its default strategy ("bfd").
                return f"trial {runtime.spec.number} uses padding-free packing"
        reason = self._pass_refusal(runtimes)
        if reason is not None:
            return reason
        if first.spec.kind.checkpointing(first.args)[0]:
            for layer in lora_layers(self.trials.resident.module):
                for runtime in runtimes:
                    name = runtime.state.adapter_name
                    dropout = layer.lora_dropout[name] if name in layer.lora_dropout else None  # noqa: SIM401
                    if dropout is not None and float(getattr(dropout, "p", 0.0)) > 0:
                        # Recomputing a checkpointed block would draw other masks from the trial's generator.
                        return "activation checkpointing with lora_dropout > 0"
        if (
            self.trials.extras.compute_metrics is not None
            or getattr(first.trainer, "compute_loss_func", None) is not None
        ):
            return "a custom loss or metrics function is set"
        return None

    def run(self, runtimes: Sequence[TrialRuntime]) -> list[ChunkResult | BaseException]:
        """Train every trial's next chunk, in shared passes when they can share them; then evaluate each.

        Returns:
            Each member's chunk result, or the error that failed that member alone (its evaluation, or
            its own chunk after a shared pass failed before any member stepped). An error after members
            stepped is raised: it fails the whole gang.
        """
        if runtimes[0].spec.kind.samples_completions:
            return self._generating_gang(runtimes)
        reason = self.refusal(runtimes)
        if reason is not None:
            if len(runtimes) > 1:
                self._say(f"Training time-sliced, not fused: {reason}.")
            return self._alone.run(runtimes)
        start = time.perf_counter()
        try:
            metrics = self._train_gang(runtimes)
        except Exception as error:
            if self._stepped:  # the members' states moved on together: the gang fails as one
                raise
            return self._one_by_one(runtimes, error)
        train_seconds = (time.perf_counter() - start) / len(runtimes)
        evaluated = self._evaluate_gang(runtimes)
        results: list[ChunkResult | BaseException] = []
        for runtime, chunk_metrics, own in zip(runtimes, metrics, evaluated, strict=True):
            try:
                results.append(self.trials.finish(runtime, chunk_metrics, train_seconds, own))
            except Exception as error:  # this member's evaluation only
                results.append(error)
        return results

    def _generating_gang(self, runtimes: Sequence[TrialRuntime]) -> list[ChunkResult | BaseException]:
        """A gang of trials that sample completions (GRPO): each trains its chunk and evaluates as alone,
        in turns, and the members waiting to generate decode together, in one batch
        (:class:`~optuna_rapidfire._trainers.grpo._generation.Generation`)."""
        first = runtimes[0]
        reason = None
        precision = (bool(first.args.bf16), bool(getattr(first.args, "fp16", False)))
        for runtime in runtimes[1:]:
            if type(runtime.spec.kind) is not type(first.spec.kind):
                reason = "the trials differ in trainer type"
            elif (bool(runtime.args.bf16), bool(getattr(runtime.args, "fp16", False))) != precision:
                reason = "the trials differ in precision"
        if reason is not None:
            self._say(f"Generating trial by trial, not together: {reason}.")
            return self._alone.run(runtimes)
        # A lone trial goes through the same turns and shared passes: its values do not depend on its gang.
        policy = self._policy_refusal(runtimes)
        if policy is not None:
            self._say(f"Scoring each GRPO step alone, not in shared passes: {policy}.")
        self.trials.on_device(runtimes)
        before = self.trials.generation.policy.passes
        results = self.trials.generation.run_gang(runtimes, self._alone.run_chunk, share_policy=policy is None)
        self.fused_steps += self.trials.generation.policy.passes - before
        return results

    def _policy_refusal(self, runtimes: Sequence[TrialRuntime]) -> str | None:
        """Why a GRPO gang's steps cannot share their forward and backward passes (``None``: they can)."""
        for runtime in runtimes:
            if runtime.spec.kind.checkpointing(runtime.args)[0]:
                return f"trial {runtime.spec.number} uses activation checkpointing"
            if getattr(runtime.trainer, "aux_loss_enabled", False):
                return f"trial {runtime.spec.number} adds a router auxiliary loss"
        return self._pass_refusal(runtimes)

    def _pass_refusal(self, runtimes: Sequence[TrialRuntime]) -> str | None:
        """What keeps any gang from sharing a forward/backward pass (``None``: nothing): mixed trainer types,
        fp16 (one grad scaler per trial), mixed precision, activation checkpointing or base dropout, and
        LoRA variants the fused pass does not implement."""
        first = runtimes[0]
        settings = _pass_settings(first)
        for runtime in runtimes:
            if type(runtime.spec.kind) is not type(first.spec.kind):
                return "the trials differ in trainer type"
            if bool(getattr(runtime.args, "fp16", False)):
                return f"trial {runtime.spec.number} trains in fp16 (its grad scaler is per trial)"
            own = _pass_settings(runtime)
            if own[:2] != settings[:2]:
                return "the trials differ in precision or activation checkpointing"
            if own[2] != settings[2]:
                return "the trials differ in disable_dropout"
        for layer in lora_layers(self.trials.resident.module):
            for runtime in runtimes:
                reason = unsupported(layer, runtime.state.adapter_name)
                if reason is not None:
                    return reason
        return None

    def _say(self, text: str) -> None:
        """Log ``text`` once per engine (why a gang does not share its passes)."""
        if text not in self._said:
            self._said.add(text)
            _logger.info(text)

    def _one_by_one(self, runtimes: Sequence[TrialRuntime], error: Exception) -> list[ChunkResult | BaseException]:
        """After a shared pass failed before any member stepped: train each member alone, so that only a
        trial that fails on its own fails. Out of memory also halves the size of later shared passes."""
        for runtime in runtimes:
            runtime.state.optimizer.zero_grad(set_to_none=True)
        self.trials.leave_gang(runtimes)
        if isinstance(error, torch.cuda.OutOfMemoryError):
            torch.cuda.empty_cache()
            self.pass_tokens = max(self.pass_tokens // 2, 1)
        _logger.warning(
            "A shared pass of trials %s failed (%s: %s); training them one by one. Later passes take at most "
            "%d tokens.",
            [runtime.spec.number for runtime in runtimes],
            type(error).__name__,
            error,
            self.pass_tokens,
        )
        results: list[ChunkResult | BaseException] = []
        for runtime in runtimes:
            try:
                results.append(self._alone.run_chunk(runtime))
            except Exception as own:
                results.append(own)
        return results

    # -- evaluating a gang -----------------------------------------------------------------------

    def _evaluate_gang(self, runtimes: Sequence[TrialRuntime]) -> list[tuple[dict[str, float], float] | None]:
        """Each member's eval metrics and seconds, from shared forward passes over the members' eval
        micro-batches (each member's own batches, collated by its own trainer, with its own adapter); or
        ``None`` for the members that evaluate alone: every member when the kind's metrics need its trainer
        (the log says why, once), or when a shared pass failed (each member then fails or not on its own)."""
        loss = runtimes[0].spec.kind.fused_loss
        assert loss is not None  # refusal() lets only kinds with a fused loss through
        reason = loss.eval_refusal()
        if reason is not None:
            self._say(f"Evaluating trial by trial, not in shared passes: {reason}.")
            return [None] * len(runtimes)
        start = time.perf_counter()
        try:
            try:
                sums = self._eval_passes(runtimes, loss)
            except Exception as error:
                layout = self._layout
                if layout is None or not layout.compiled or not _compat.is_compile_error(error):
                    raise
                self.launched.fall_back(layout, error)
                sums = self._eval_passes(runtimes, loss)
        except Exception as error:
            if isinstance(error, torch.cuda.OutOfMemoryError):
                torch.cuda.empty_cache()
            _logger.warning(
                "Evaluating trials %s in shared passes failed (%s: %s); evaluating them one by one.",
                [runtime.spec.number for runtime in runtimes],
                type(error).__name__,
                error,
            )
            return [None] * len(runtimes)
        seconds = (time.perf_counter() - start) / len(runtimes)
        evaluated: list[tuple[dict[str, float], float] | None] = []
        for runtime, batches in zip(runtimes, sums, strict=True):
            metrics = loss.eval_metrics(runtime.trainer, runtime.args, batches)
            evaluated.append((metrics, seconds))
        return evaluated

    @torch.no_grad()
    def _eval_passes(self, runtimes: Sequence[TrialRuntime], loss: FusedLoss) -> list[list[EvalRows]]:
        """For each member, each eval micro-batch's sums over each row's loss tokens (:class:`EvalRows`).

        The k-th micro-batches of the members share passes (at most :attr:`pass_tokens` tokens each), in
        eval mode, under the gang's precision, and a reference pass with the adapters off where the kind's
        metrics compare against one; the sums reach the host once, at the end.
        """
        first, model = runtimes[0], self.trials.resident.module
        _, head = backbone_and_head(self.trials.resident.base)
        config = self.trials.resident.base.config
        plans = [self._eval_plan(runtime, loss) for runtime in runtimes]
        chunks = [chunk for chunk, _ in plans]
        # Right after a launched chunk its slots still hold the members' weights: evaluate through them.
        layout = self._layout if all(all(chunk.right_padded) for chunk in chunks) else None
        width = _chunk_width(chunks)
        layouts: dict[tuple[tuple[str, ...], tuple[int, ...]], Any] = {}
        sums: list[list[torch.Tensor]] = [[] for _ in runtimes]
        was_training = model.training
        model.eval()
        try:
            for index in range(max(len(chunk.inputs) for chunk in chunks)):
                members = [k for k, chunk in enumerate(chunks) if index < len(chunk.inputs)]
                tokens = [chunks[k].inputs[index]["input_ids"].numel() for k in members]
                for group in _passes(members, tokens, self.pass_tokens):
                    shared = self._lay_out(runtimes, chunks, None, group, index, layouts, None, layout, width)
                    autocast = first.spec.kind.autocast(first.args, self.device)
                    with self._eval_context(shared), autocast:
                        hidden = self._loss_hidden(shared)
                        stats = token_stats(hidden, head, shared.where[2], config, loss.eval_outputs)
                    zeros = torch.zeros_like(stats.log_probs)
                    reference = zeros
                    if loss.eval_reference:
                        with self._eval_context(shared), first.spec.kind.autocast(first.args, self.device):
                            base = self._loss_hidden(shared, base=True)
                            reference = token_stats(base, head, shared.where[2], config).log_probs
                    columns = [
                        stats.log_probs,
                        zeros if stats.entropy is None else stats.entropy.float(),
                        zeros if stats.is_top1 is None else stats.is_top1.float(),
                        zeros if stats.mean_logits is None else stats.mean_logits.float(),
                        torch.ones_like(stats.log_probs),
                        reference,
                    ]
                    rows = len(shared.input_ids)
                    totals = zeros.new_zeros(rows, len(columns)).index_add_(0, shared.where[1], torch.stack(columns, 1))
                    start = 0
                    for k in group:
                        count = len(chunks[k].inputs[index]["input_ids"])
                        sums[k].append(totals[start : start + count])
                        start += count
        finally:
            if was_training:
                model.train()
        flat = [total for member in sums for total in member]
        values = iter(torch.cat(flat).tolist() if flat else [])
        return [
            [
                EvalRows.of(examples, [next(values) for _ in range(len(total))])
                for examples, total in zip(counts, member, strict=True)
            ]
            for (_, counts), member in zip(plans, sums, strict=True)
        ]

    def _eval_context(self, shared: _Pass) -> contextlib.AbstractContextManager[Any]:
        """The context of an eval pass: the gang's adapters on the model's modules, or none (launched)."""
        if shared.layout is not None:
            return self.launched.compiling(shared.layout)
        return fused_forward(self.trials.resident.module, shared.gang, shared.layers)

    def _eval_plan(self, runtime: TrialRuntime, loss: FusedLoss) -> tuple[_MemberChunk, list[int]]:
        """The trial's eval micro-batches, collated by its trainer, as :meth:`_plan` lays out a chunk, and
        the examples of each (rows of the eval set). The eval set does not change: each trial collates it
        and copies it to the device once, not after every chunk."""
        found = self._eval_plans.get(runtime)
        if found is None:
            dataset = self.trials.data.eval_set(runtime.data_key, runtime.prepare)
            batches = runtime.spec.kind.eval_batches(runtime.args, len(dataset))
            collated = [loss.collate(runtime.trainer, rows_of(dataset, indices)) for indices in batches]
            found = self._member_chunk(collated, loss, accumulation=1), [len(indices) for indices in batches]
            self._eval_plans[runtime] = found
        return found

    # -- training a gang's chunk -----------------------------------------------------------------

    def _train_gang(self, runtimes: Sequence[TrialRuntime]) -> list[dict[str, float]]:
        device = self.device
        self._stepped = False
        first = runtimes[0]
        loss = first.spec.kind.fused_loss
        assert loss is not None  # refusal() lets only kinds with a fused loss through
        plans = [self._plan(runtime, loss) for runtime in runtimes]
        self.trials.enter_gang(runtimes)
        self.trials.resident.module.train()
        launched = self._launched_refusal(runtimes, plans)
        if launched is not None and len(runtimes) > 1:
            self._say(f"Training in the model's own modules, not the launched pass: {launched}.")
        layout = self.launched.load(runtimes) if launched is None else None
        self._layout = layout
        losses: list[list[torch.Tensor]] = [[] for _ in runtimes]
        grad_norms: list[torch.Tensor | None] = [None for _ in runtimes]
        longest = max(len(plan.inputs) for plan in plans)
        streams = [self.trials.dropout_stream(runtime) for runtime in runtimes]
        # Every pass of the chunk is laid out before the first runs, so the loop below only launches work:
        # no host-side preparation or synchronisation between one pass and the next.
        layouts: dict[tuple[tuple[str, ...], tuple[int, ...]], Any] = {}
        width = _chunk_width(plans) if layout is not None else None
        schedule = []
        for index in range(longest):
            members = [k for k, plan in enumerate(plans) if index < len(plan.inputs)]
            tokens = [plans[k].inputs[index]["input_ids"].numel() for k in members]
            passes = [
                self._lay_out(runtimes, plans, streams, group, index, layouts, loss, layout, width)
                for group in _passes(members, tokens, self.pass_tokens)
            ]
            schedule.append((members, passes))
        tables = _StepTables.of(runtimes, plans, self.launched.capacity, device) if layout is not None else None
        for index, (members, passes) in enumerate(schedule):
            for shared in passes:
                for k, value in zip(shared.group, self._fused_pass(first, shared), strict=True):
                    losses[k].append(value)
            self.fused_steps += 1
            self.launched_steps += layout is not None
            ready = [k for k in members if plans[k].steps_at(index)]
            if ready and layout is not None and tables is not None:
                self._stepped = True
                self.launched.step(layout, *tables.at(index))
            elif ready:
                self._step(runtimes, ready, grad_norms)
        if layout is not None and tables is not None:
            self._finish_launched(runtimes, layout, tables, grad_norms)
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
        self.trials.leave_gang(runtimes)
        return metrics

    def _launched_refusal(self, runtimes: Sequence[TrialRuntime], plans: Sequence[_MemberChunk]) -> str | None:
        """Why this chunk of the gang cannot take the launched pass (``None``: it can)."""
        reason = self.launched.refusal(runtimes)
        if reason is not None:
            return reason
        if not all(all(plan.right_padded) for plan in plans):
            return "a micro-batch is padded on the left or inside (the launched pass pads on the right only)"
        return self.launched.decoder.window_refusal(_chunk_width(plans))

    def _finish_launched(
        self,
        runtimes: Sequence[TrialRuntime],
        layout: Layout,
        tables: _StepTables,
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

    def _lay_out(
        self,
        runtimes: Sequence[TrialRuntime],
        plans: list[_MemberChunk],
        streams: Sequence[DropoutStream] | None,
        group: list[int],
        index: int,
        layouts: dict[tuple[tuple[str, ...], tuple[int, ...]], Any],
        loss: FusedLoss | None,
        layout: Layout | None = None,
        width: int | None = None,
    ) -> _Pass:
        """The ``group``'s ``index``-th micro-batches as one pass: inputs, loss token positions, gang.

        ``streams``: the members' dropout streams (each member's next key is drawn; ``None``: no dropout,
        evaluation). ``loss``: the kind's loss, which says how the loss tokens are summed; ``None``
        (evaluation): one sum per row. ``layout``: the launched pass's layout (member k in slot k), or
        ``None`` for a pass through the model's own modules; ``width``: the tokens its rows are padded to.
        """
        batches = [plans[k].inputs[index] for k in group]
        length = max(b["input_ids"].shape[1] for b in batches)
        if layout is not None and width is not None:
            length = width
        pads = [pad_token_id(runtimes[k].trainer) for k in group]
        ids = [pad_right(b["input_ids"], length, pad) for b, pad in zip(batches, pads, strict=True)]
        if layout is not None and streams is not None and loss is not None and loss.pads_rows:
            # A member's short micro-batch (the last of its chunk) gets rows of padding up to its batch size, which
            # carry no loss: the compiled pass keeps its shapes and is not compiled again for them.
            sizes = [int(runtimes[k].args.per_device_train_batch_size) for k in group]
            ids = [_pad_rows(t, size, pad) for t, size, pad in zip(ids, sizes, pads, strict=True)]
        input_ids = torch.cat(ids)
        attention = None  # no mask at all when nothing is masked: the model then needs no check of it
        padded = any(b["input_ids"].shape[1] < length for b in batches)
        if layout is None and (padded or not all(plans[k].unmasked[index] for k in group)):
            attention = torch.cat(
                [pad_right(b.get("attention_mask", torch.ones_like(b["input_ids"])), length, 0) for b in batches]
            )
        rows = [len(t) for t in ids]
        names = [runtimes[k].state.adapter_name for k in group]
        keys = [0] * len(group) if streams is None else [streams[k].next_key() for k in group]
        gang = Gang(names, rows, keys)
        key = (tuple(names), tuple(rows))
        if layout is None and key not in layouts:
            layouts[key] = layer_plans(self.trials.resident.module, gang)
        flat, token_rows, target, offset = [], [], [], 0
        for j, k in enumerate(group):
            row, column, labels = plans[k].targets[index]
            flat.append((row + offset) * length + column)
            token_rows.append(row)
            target.append(labels)
            offset += rows[j]
        extras: tuple[torch.Tensor, ...]
        if loss is None:  # one sum per row
            segment, extras = torch.cat([row + sum(rows[:j]) for j, row in enumerate(token_rows)]), ()
        else:
            segment, extras = loss.lay_out(rows, token_rows, [runtimes[k].args for k in group])
        where = _to_device_async(torch.stack([torch.cat(flat), segment, torch.cat(target)]), self.device)
        scales = torch.stack([plans[k].scales[index] for k in group]) if loss is not None else None
        on_device = tuple(_to_device_async(extra, self.device) for extra in extras)
        unit_rows = None if layout is None else self._rows(layout, group, rows, keys, length, streams is not None)
        return _Pass(
            group, gang, layouts.get(key, []), input_ids, attention, where, scales, loss, on_device, layout, unit_rows
        )

    def _rows(
        self, layout: Layout, group: list[int], rows: list[int], keys: list[int], length: int, training: bool
    ) -> Rows:
        """The launched pass's row layout: units of equal rows (member k's in slot k) and, when a member
        drops, each row's dropout key and probability."""
        unit = gcd_units(rows)
        units = [k for k, count in zip(group, rows, strict=True) for _ in range(count // unit)]
        on = lambda values: _to_device_async(values, self.device)  # noqa: E731
        if not (training and layout.key.dropout):
            return Rows(on(torch.tensor(units)), None, None)
        assert layout.slots is not None
        slot_of_row = [k for k, count in zip(group, rows, strict=True) for _ in range(count)]
        drops = layout.slots.drop.index_select(0, on(torch.tensor(slot_of_row)))
        widths = self.launched.decoder.feature_widths()
        features = tuple(feature_keys(width, self.device) for width in widths)
        return Rows(
            on(torch.tensor(units)), on(row_keys(keys, rows)), drops, position_keys(length, self.device), features
        )

    def _fused_pass(self, first: TrialRuntime, shared: _Pass) -> list[torch.Tensor]:
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
            # recomputes forwards there.
            with fused_forward(self.trials.resident.module, shared.gang, shared.layers):
                return self._forward_backward(first, shared)
        with self.launched.compiling(layout):
            try:
                return self._forward_backward(first, shared)
            except Exception as error:
                if not (layout.compiled and _compat.is_compile_error(error)):
                    raise
                self.launched.fall_back(layout, error)
            return self._forward_backward(first, shared)

    def _forward_backward(self, first: TrialRuntime, shared: _Pass) -> list[torch.Tensor]:
        loss, rows = shared.loss, len(shared.input_ids)
        assert loss is not None and shared.scales is not None  # a training pass
        reference = loss.reference(lambda: self._token_nll(first, shared, base=True), shared.where, rows)
        # Mixed precision covers the forward pass and the losses only.
        with first.spec.kind.autocast(first.args, self.device):
            nll = self._token_nll(first, shared)
            sums = loss.losses(nll, reference, shared.where, shared.extras, rows, len(shared.group))
            member_losses = sums * shared.scales
        member_losses.sum().backward()
        return list(member_losses.detach().unbind())

    def _loss_hidden(self, shared: _Pass, base: bool = False) -> torch.Tensor:
        """The backbone's last hidden state at every loss token's position (the one predicting it); ``base``:
        with the adapters off."""
        if shared.rows is not None:  # the launched pass
            hidden = self.launched.hidden(shared.input_ids, shared.rows, None if base else shared.layout)
        else:
            backbone, _ = backbone_and_head(self.trials.resident.base)
            with base_only(shared.layers) if base else contextlib.nullcontext():
                hidden = backbone(
                    input_ids=shared.input_ids, attention_mask=shared.attention, use_cache=False
                ).last_hidden_state
        return hidden.reshape(-1, hidden.shape[-1]).index_select(0, shared.where[0])

    def _token_nll(self, first: TrialRuntime, shared: _Pass, base: bool = False) -> torch.Tensor:
        """The negative log-probability of every loss token of the pass (float32), without the pass's
        float32 logits (:func:`~optuna_rapidfire._fused._token_stats.token_stats`); ``base``: with the
        adapters off and no gradients (a reference model)."""
        resident = self.trials.resident
        _, head = backbone_and_head(resident.base)
        with torch.no_grad() if base else contextlib.nullcontext(), first.spec.kind.autocast(first.args, self.device):
            hidden = self._loss_hidden(shared, base)
            return -token_stats(hidden, head, shared.where[2], resident.base.config).log_probs

    def _plan(self, runtime: TrialRuntime, loss: FusedLoss) -> _MemberChunk:
        """The trial's micro-batches of its next chunk, collated, with where their loss tokens are."""
        trainer, args = runtime.trainer, runtime.args
        dataset, micro = self.trials.next_chunk(runtime)
        collated = [loss.collate(trainer, rows_of(dataset, indices)) for indices in micro]
        chunk = self._member_chunk(collated, loss, args.gradient_accumulation_steps)
        inputs, accumulation = chunk.inputs, chunk.accumulation
        for first in range(0, len(inputs), accumulation):
            group = slice(first, first + accumulation)
            count = _compat.num_items_in_batch(trainer, inputs[group], self.device)
            divisor = accumulation_divisor(trainer, count, len(inputs[group]))
            for batch, target in zip(collated[group], chunk.targets[group], strict=True):
                chunk.scales.append(loss.scale(batch, len(target[0]), count, divisor, self.device))
        return chunk

    def _member_chunk(self, collated: list[dict[str, Any]], loss: FusedLoss, accumulation: int) -> _MemberChunk:
        """Collated micro-batches on the device, with where their loss tokens are (found here, on the host)."""
        targets, unmasked, right_padded = [], [], []
        for batch in collated:
            shifted = loss.labels(batch)
            row, column = (shifted != -100).nonzero(as_tuple=True)
            targets.append((row, column, shifted[row, column]))
            mask = batch.get("attention_mask")
            unmasked.append(mask is None or bool(mask.all()))
            # Right padding only: each row's mask is ones, then zeros.
            right_padded.append(mask is None or bool((mask.cumprod(1).sum(1) == mask.sum(1)).all()))
        return _MemberChunk(
            inputs=[_to_device(batch, self.device) for batch in collated],
            targets=targets,
            unmasked=unmasked,
            right_padded=right_padded,
            scales=[],
            accumulation=accumulation,
            tokens=sum(
                int(b["attention_mask"].sum()) if "attention_mask" in b else b["input_ids"].numel() for b in collated
            ),
        )

    def _step(self, runtimes: Sequence[TrialRuntime], ready: list[int], grad_norms: list[torch.Tensor | None]) -> None:
        self._stepped = True
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


@dataclass
class _StepTables:
    """A launched chunk's optimizer steps, worked out ahead: for each micro-batch index where members step,
    which slots step (``ready``, 0/1) and each one's learning rate (its schedule's rate at that step), both
    ``[steps, slots]`` on the device; and how many steps each member takes."""

    indices: dict[int, int]
    ready: torch.Tensor
    lr: torch.Tensor
    steps: list[int]

    @classmethod
    def of(
        cls, runtimes: Sequence[TrialRuntime], plans: Sequence[_MemberChunk], slots: int, device: torch.device
    ) -> _StepTables:
        longest = max(len(plan.inputs) for plan in plans)
        taken = [0] * len(runtimes)
        indices: dict[int, int] = {}
        ready_rows: list[list[float]] = []
        lr_rows: list[list[float]] = []
        for index in range(longest):
            ready = [0.0] * slots
            lr = [0.0] * slots
            for k, (runtime, plan) in enumerate(zip(runtimes, plans, strict=True)):
                if index < len(plan.inputs) and plan.steps_at(index):
                    state = runtime.state
                    ready[k] = 1.0
                    lr[k] = _compat.lr_at(state.lr_scheduler, state.position.optimizer_steps + taken[k])
                    taken[k] += 1
            if any(ready):
                indices[index] = len(ready_rows)
                ready_rows.append(ready)
                lr_rows.append(lr)
        ready_t = _to_device_async(torch.tensor(ready_rows, dtype=torch.float32), device)
        lr_t = _to_device_async(torch.tensor(lr_rows, dtype=torch.float64), device)
        return cls(indices, ready_t, lr_t, taken)

    def at(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``ready`` and ``lr`` rows of the step after micro-batch ``index``."""
        row = self.indices[index]
        return self.ready[row], self.lr[row]


def _pad_rows(ids: torch.Tensor, rows: int, pad: int) -> torch.Tensor:
    """``ids`` (rows x tokens) with rows of ``pad`` appended up to ``rows``."""
    missing = rows - len(ids)
    return torch.cat([ids, ids.new_full((missing, ids.shape[1]), pad)]) if missing > 0 else ids


def _chunk_width(plans: Sequence[_MemberChunk]) -> int:
    """The tokens every launched pass of a chunk is padded to: its longest micro-batch's, rounded up to 64.

    One width per chunk (per eval set) rather than per pass: a pass of shorter rows (packing's remainder, a
    short batch) keeps the compiled graph's shapes instead of compiling it again in the middle of a study."""
    longest = max(batch["input_ids"].shape[1] for plan in plans for batch in plan.inputs)
    return -(-longest // 64) * 64


@dataclass
class _MemberChunk:
    """One trial's chunk in a gang: its micro-batches (on the device), each one's loss tokens (row,
    column, label; on the host), whether nothing in it is masked and whether it is padded on the right only,
    and its loss scale (training only); the trial's accumulation steps and trained tokens."""

    inputs: list[dict[str, Any]]
    targets: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    unmasked: list[bool]
    right_padded: list[bool]
    scales: list[torch.Tensor]
    accumulation: int
    tokens: int

    def steps_at(self, index: int) -> bool:
        """Whether the trial steps its optimizer after its ``index``-th micro-batch."""
        return (index + 1) % self.accumulation == 0 or index + 1 == len(self.inputs)


@dataclass
class _Pass:
    """One shared forward/backward, laid out ahead: members (gang positions), gang, LoRA layer plans,
    inputs, the loss tokens' flat positions / sum / target (``where``, 3 x tokens), loss scales, the
    kind's loss with its own tensors for the pass (:meth:`FusedLoss.lay_out`), and for a launched pass its
    layout and row layout."""

    group: list[int]
    gang: Gang
    layers: list[Any]
    input_ids: torch.Tensor
    attention: torch.Tensor | None
    where: torch.Tensor
    scales: torch.Tensor | None
    loss: FusedLoss | None
    extras: tuple[torch.Tensor, ...]
    layout: Layout | None = None
    rows: Rows | None = None


PASS_TOKENS = 16_384
"""The most tokens (rows x padded length) one shared pass takes: 32 rows of 512, where one adapter's pass
already saturates an H200 on a 1B model. Larger gangs train in several passes of at most this size, so
fusing never makes a step slower than the members' own passes would be."""


def _pass_settings(runtime: TrialRuntime) -> tuple[bool, bool, bool]:
    """What a shared pass sets for all its members: bf16, activation checkpointing, base dropout off."""
    kind, args = runtime.spec.kind, runtime.args
    return bool(args.bf16), kind.checkpointing(args)[0], kind.base_dropout_off(args)


def _passes(members: list[int], tokens: list[int], limit: int = PASS_TOKENS) -> list[list[int]]:
    """Split the members (in order) into passes of at most ``limit`` tokens (at least one member each)."""
    passes: list[list[int]] = []
    size = 0
    for member, count in zip(members, tokens, strict=True):
        if passes and size + count <= limit:
            passes[-1].append(member)
            size += count
        else:
            passes.append([member])
            size = count
    return passes


def _to_device_async(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a host tensor to the device without making the host wait (pinned first on CUDA)."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def _zero_grad(param: torch.nn.Parameter) -> torch.Tensor:
    param.grad = torch.zeros_like(param)
    return param.grad
