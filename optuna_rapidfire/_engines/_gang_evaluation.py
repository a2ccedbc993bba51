"""Evaluating a gang in shared forward passes: each member's own eval micro-batches (collated by its own
trainer, once per trial) with its own adapter, and for kinds that compare against one (DPO) a pass with the
adapters off; the per-row sums reach the host once, and each kind computes its metrics from them
(:meth:`~optuna_rapidfire._trainers._fused_loss.FusedLoss.eval_metrics`).

:meth:`GangEvaluation.passes_of` is the seam tests wrap to watch or break the shared eval passes.
"""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING

import torch

from optuna_rapidfire import _compat, events
from optuna_rapidfire._engines._environment import evaluation_refusal
from optuna_rapidfire._engines._gang_passes import Layouts, chunk_width, precision
from optuna_rapidfire._engines._pass_graphs import replayed
from optuna_rapidfire._fused._fused_pass import backbone_and_head
from optuna_rapidfire._fused._slots import gcd_units
from optuna_rapidfire._fused._token_stats import token_stats
from optuna_rapidfire._logging import get_logger
from optuna_rapidfire._resident._data import rows_of
from optuna_rapidfire._trainers._fused_loss import EvalRows

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from optuna_rapidfire._engines._gang_passes import GangPasses, MemberChunk, Pass
    from optuna_rapidfire._engines._launched import Layout
    from optuna_rapidfire._engines._types import TrialRuntime
    from optuna_rapidfire._trainers._fused_loss import FusedLoss

_logger = get_logger(__name__)


class GangEvaluation:
    """Evaluates gangs through :class:`GangPasses`; keeps each live trial's collated eval set."""

    def __init__(self, passes: GangPasses, say: Callable[[str], None]) -> None:
        self.gang_passes = passes
        self.trials = passes.trials
        self.launched = passes.launched
        self.device = passes.device
        self.say = say
        self._plans: dict[TrialRuntime, tuple[MemberChunk, list[int]]] = {}

    def release(self, runtime: TrialRuntime) -> None:
        """Drop the trial's eval set (the trial left the device)."""
        self._plans.pop(runtime, None)

    def evaluate(
        self, runtimes: Sequence[TrialRuntime], layout: Layout | None, slots: Sequence[int] | None = None
    ) -> list[tuple[dict[str, float], float] | None]:
        """Each member's eval metrics and seconds, from shared forward passes over the members' eval
        micro-batches (each member's own batches, collated by its own trainer, with its own adapter); or
        ``None`` for the members that evaluate alone: every member when the kind's metrics need its trainer
        (the log says why, once), or when a shared pass failed (each member then fails or not on its own).
        ``slots``: each member's slot in ``layout`` (default: member k in slot k)."""
        loss = runtimes[0].spec.kind.fused_loss
        assert loss is not None  # train_refusal() lets only kinds with a fused loss through
        reason = loss.eval_refusal() or evaluation_refusal()
        if reason is not None:
            self.say(f"Evaluating trial by trial, not in shared passes: {reason}.")
            return [None] * len(runtimes)
        start = time.perf_counter()
        try:
            try:
                sums = self.passes_of(runtimes, loss, layout, slots)
            except Exception as error:
                if layout is None or not layout.compiled or not _compat.is_compile_error(error):
                    raise
                self.launched.fall_back(layout, error)
                sums = self.passes_of(runtimes, loss, layout, slots)
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
        if events.listening(events.Evaluated):
            numbers = tuple(runtime.spec.number for runtime in runtimes)
            tokens = tuple(tuple(int(sum(batch.tokens)) for batch in member) for member in sums)
            events.emit(events.Evaluated(numbers, True, "eval", seconds * len(runtimes), tokens))
        evaluated: list[tuple[dict[str, float], float] | None] = []
        for runtime, batches in zip(runtimes, sums, strict=True):
            metrics = loss.eval_metrics(runtime.trainer, runtime.args, batches)
            evaluated.append((metrics, seconds))
        return evaluated

    @torch.no_grad()
    def passes_of(
        self,
        runtimes: Sequence[TrialRuntime],
        loss: FusedLoss,
        layout: Layout | None,
        slots: Sequence[int] | None = None,
    ) -> list[list[EvalRows]]:
        """For each member, each eval micro-batch's sums over each row's loss tokens (:class:`EvalRows`).

        The k-th micro-batches of the members share passes (at most :attr:`pass_tokens` tokens each), in
        eval mode, under the gang's precision, and a reference pass with the adapters off where the kind's
        metrics compare against one; the sums reach the host once, at the end.
        """
        first, model = runtimes[0], self.trials.resident.module
        plans = [self.plan(runtime, loss) for runtime in runtimes]
        chunks = [chunk for chunk, _ in plans]
        # Right after a launched chunk its slots still hold the members' weights: evaluate through them.
        layout = layout if all(all(chunk.right_padded) for chunk in chunks) else None
        width = chunk_width(chunks)
        layouts: Layouts = {}
        sums: list[list[torch.Tensor]] = [[] for _ in runtimes]
        # Only the model's own forward reads its modules' mode (the launched pass drops nothing without dropout
        # keys, which evaluation passes have none of): switched to eval for such a pass alone, as the walk over
        # every module of every adapter costs tens of milliseconds each way.
        was_training, toggled = model.training, False
        # Recorded as CUDA graphs where the training passes are: rows padded to a bucket, loss tokens to a power of
        # two (into one more row of sums), so that a pass's shapes repeat from one evaluation to the next.
        record = (
            self.launched.graphs is not None and layout is not None and loss.pads_tokens and not loss.eval_reference
        )
        try:
            for index in range(max(len(chunk.inputs) for chunk in chunks)):
                for group in self.gang_passes.split(chunks, index):
                    shape = sums_count = None
                    if record:
                        counts = [len(chunks[k].inputs[index]["input_ids"]) for k in group]
                        unit = gcd_units(counts)
                        # A power of two of units (one unit too: nothing here is compiled).
                        shape = (unit, unit << (sum(counts) // unit - 1).bit_length())
                        sums_count = shape[1] + 1
                    shared = self.gang_passes.lay_out(
                        runtimes,
                        chunks,
                        None,
                        group,
                        index,
                        layouts,
                        None,
                        layout,
                        width,
                        slots=None if slots is None else [slots[k] for k in group],
                        shape=shape,
                        sums=sums_count,
                    )
                    if shared.rows is None and not toggled:
                        model.eval()
                        toggled = True
                    with self.gang_passes.context(shared):
                        if record and layout is not None:
                            totals = replayed(
                                self.launched.graphs,
                                layout.slots,
                                ("eval", precision(first.args), loss.eval_outputs),
                                shared.tensors(),
                                functools.partial(self._replayed_sums, first, shared, loss),
                            )
                            assert totals is not None
                        else:
                            totals = self.row_sums(first, shared, loss)
                    start = 0
                    for k in group:
                        count = len(chunks[k].inputs[index]["input_ids"])
                        sums[k].append(totals[start : start + count])
                        start += count
        finally:
            if toggled and was_training:
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

    def row_sums(self, first: TrialRuntime, shared: Pass, loss: FusedLoss) -> torch.Tensor:
        """One eval pass's sums over each row's loss tokens (``[rows, 6]``, the columns of :class:`EvalRows`; one
        row more when the loss tokens are padded: :attr:`Pass.sums`)."""
        _, head = backbone_and_head(self.trials.resident.base)
        config = self.trials.resident.base.config
        with first.spec.kind.autocast(first.args, self.device):
            hidden = self.gang_passes.loss_hidden(shared)
            stats = token_stats(hidden, head, shared.where[2], config, loss.eval_outputs)
        zeros = torch.zeros_like(stats.log_probs)
        reference = zeros
        if loss.eval_reference:
            with first.spec.kind.autocast(first.args, self.device):
                base = self.gang_passes.loss_hidden(shared, base=True)
                reference = token_stats(base, head, shared.where[2], config).log_probs
        columns = [
            stats.log_probs,
            zeros if stats.entropy is None else stats.entropy.float(),
            zeros if stats.is_top1 is None else stats.is_top1.float(),
            zeros if stats.mean_logits is None else stats.mean_logits.float(),
            torch.ones_like(stats.log_probs),
            reference,
        ]
        rows = shared.sums if shared.sums is not None else len(shared.input_ids)
        return zeros.new_zeros(rows, len(columns)).index_add_(0, shared.where[1], torch.stack(columns, 1))

    def _replayed_sums(
        self, first: TrialRuntime, shared: Pass, loss: FusedLoss, tensors: Sequence[torch.Tensor | None]
    ) -> torch.Tensor:
        return self.row_sums(first, shared.with_tensors(tensors), loss)

    def plan(self, runtime: TrialRuntime, loss: FusedLoss) -> tuple[MemberChunk, list[int]]:
        """The trial's eval micro-batches, collated by its trainer, as :meth:`GangPasses.plan` lays out a chunk, and
        the examples of each (rows of the eval set). The eval set does not change: each trial collates it
        and copies it to the device once, not after every chunk."""
        found = self._plans.get(runtime)
        if found is None:
            dataset = self.trials.data.eval_set(runtime.data_key, runtime.prepare)
            batches = runtime.spec.kind.eval_batches(runtime.args, len(dataset))
            collated = [loss.collate(runtime.trainer, rows_of(dataset, indices)) for indices in batches]
            found = self.gang_passes.member_chunk(collated, loss, accumulation=1), [len(indices) for indices in batches]
            self._plans[runtime] = found
        return found

    # -- training a gang's chunk -----------------------------------------------------------------
