"""A gang's shared passes, laid out ahead: which micro-batches of which members share a pass, with what
inputs, loss token positions, dropout keys and (launched) row layout; and the hidden states at the loss
tokens that the training and evaluation passes compute their losses from.

Everything here runs on the host before a chunk's first pass (or is a launch of device work): the training
loop (:mod:`optuna_rapidfire._engines._gang_training`) and the evaluation
(:mod:`optuna_rapidfire._engines._gang_evaluation`) only launch the passes laid out here.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from optuna_rapidfire import _compat
from optuna_rapidfire._engines._pass_graphs import token_bucket
from optuna_rapidfire._fused._decoder import Rows
from optuna_rapidfire._fused._dropout import feature_keys, position_keys, row_keys
from optuna_rapidfire._fused._fused_pass import (
    Gang,
    backbone_and_head,
    base_only,
    fused_forward,
    layer_plans,
    pad_right,
    pad_token_id,
    to_device_async,
)
from optuna_rapidfire._fused._slots import gcd_units
from optuna_rapidfire._fused._token_stats import token_stats
from optuna_rapidfire._resident._data import rows_of
from optuna_rapidfire._trainers._base import _to_device, accumulation_divisor

if TYPE_CHECKING:
    from collections.abc import Sequence

    from optuna_rapidfire._engines._launched import LaunchedPasses, Layout
    from optuna_rapidfire._engines._trials import DeviceTrials
    from optuna_rapidfire._engines._types import TrialRuntime
    from optuna_rapidfire._fused._dropout import DropoutStream
    from optuna_rapidfire._trainers._fused_loss import FusedLoss

PASS_TOKENS = 16_384
"""The most tokens (rows x padded length) one shared pass takes: 32 rows of 512, where one adapter's pass
already saturates an H200 on a 1B model. Larger gangs train in several passes of at most this size, so
fusing never makes a step slower than the members' own passes would be."""

Layouts = dict[tuple[tuple[str, ...], tuple[int, ...]], Any]
"""The LoRA layer plans of the model-module path, per (adapter names, rows) of a pass: shared by a chunk."""


class GangPasses:
    """Lays out a gang's passes and computes their hidden states; :attr:`pass_tokens` caps a pass's size
    (halved by the engine after a shared pass ran out of memory)."""

    def __init__(self, trials: DeviceTrials, launched: LaunchedPasses) -> None:
        self.trials = trials
        self.resident = trials.resident
        self.launched = launched
        self.device = trials.device
        self.pass_tokens = PASS_TOKENS

    def context(self, shared: Pass) -> contextlib.AbstractContextManager[Any]:
        """The context of a pass: the gang's adapters on the model's modules, or the launched layout's."""
        if shared.layout is not None:
            return self.launched.compiling(shared.layout)
        return fused_forward(self.resident.module, shared.gang, shared.layers)

    def split(self, plans: Sequence[MemberChunk], index: int) -> list[list[int]]:
        """The members that have an ``index``-th micro-batch, in passes of at most :attr:`pass_tokens`."""
        members = [k for k, plan in enumerate(plans) if index < len(plan.inputs)]
        tokens = [plans[k].inputs[index]["input_ids"].numel() for k in members]
        return split_passes(members, tokens, self.pass_tokens)

    def lay_out(
        self,
        runtimes: Sequence[TrialRuntime],
        plans: list[MemberChunk],
        streams: Sequence[DropoutStream] | None,
        group: list[int],
        index: int,
        layouts: Layouts,
        loss: FusedLoss | None,
        layout: Layout | None = None,
        width: int | None = None,
        *,
        at: Sequence[int] | None = None,
        slots: Sequence[int] | None = None,
        shape: tuple[int, int] | None = None,
        sums: int | None = None,
    ) -> Pass:
        """The ``group``'s ``index``-th micro-batches as one pass: inputs, loss token positions, gang.

        ``streams``: the members' dropout streams (each member's next key is drawn; ``None``: no dropout,
        evaluation). ``loss``: the kind's loss, which says how the loss tokens are summed; ``None``
        (evaluation): one sum per row. ``layout``: the launched pass's layout (member k in slot k), or
        ``None`` for a pass through the model's own modules; ``width``: the tokens its rows are padded to.
        A gang whose members are at different steps (:mod:`~optuna_rapidfire._engines._gang_stream`) gives
        each member's own micro-batch (``at``, one index per member of ``group``) and slot (``slots``), and the
        launched pass's ``shape``: ``(unit, rows)``, the rows of a unit and the rows the pass is padded to
        (rows of padding carry no loss), so that its compiled shapes stay the same as members come and go.
        ``sums`` (a loss that :attr:`~optuna_rapidfire._trainers._fused_loss.FusedLoss.pads_tokens`): the loss
        computes that many sums, the members' and one more, and the loss tokens are padded to a power of two
        (:func:`~optuna_rapidfire._engines._pass_graphs.token_bucket`) with tokens of that last sum, whose scale
        is zero: a pass whose shapes depend only on its rows and width, which a CUDA graph can replay.
        """
        at = [index] * len(group) if at is None else list(at)
        batches = [plans[k].inputs[i] for k, i in zip(group, at, strict=True)]
        length = max(b["input_ids"].shape[1] for b in batches)
        if layout is not None and width is not None:
            length = width
        pads = [pad_token_id(runtimes[k].trainer) for k in group]
        ids = [pad_right(b["input_ids"], length, pad) for b, pad in zip(batches, pads, strict=True)]
        if layout is not None and streams is not None and loss is not None and loss.pads_rows:
            # A member's short micro-batch (the last of its chunk) gets rows of padding up to its batch size, which
            # carry no loss: the compiled pass keeps its shapes and is not compiled again for them.
            sizes = [int(runtimes[k].args.per_device_train_batch_size) for k in group]
            ids = [pad_rows(t, size, pad) for t, size, pad in zip(ids, sizes, pads, strict=True)]
        input_ids = torch.cat(ids)
        attention = None  # no mask at all when nothing is masked: the model then needs no check of it
        padded = any(b["input_ids"].shape[1] < length for b in batches)
        if layout is None and (padded or not all(plans[k].unmasked[i] for k, i in zip(group, at, strict=True))):
            attention = torch.cat(
                [pad_right(b.get("attention_mask", torch.ones_like(b["input_ids"])), length, 0) for b in batches]
            )
        rows = [len(t) for t in ids]
        names = [runtimes[k].state.adapter_name for k in group]
        keys = [0] * len(group) if streams is None else [streams[k].next_key() for k in group]
        gang = Gang(names, rows, keys)
        key = (tuple(names), tuple(rows))
        if layout is None and key not in layouts:
            layouts[key] = layer_plans(self.resident.module, gang)
        flat, token_rows, target, offset = [], [], [], 0
        for j, (k, i) in enumerate(zip(group, at, strict=True)):
            row, column, labels = plans[k].targets[i]
            flat.append((row + offset) * length + column)
            token_rows.append(row)
            target.append(labels)
            offset += rows[j]
        extras: tuple[torch.Tensor, ...]
        if loss is None:  # one sum per row
            segment, extras = torch.cat([row + sum(rows[:j]) for j, row in enumerate(token_rows)]), ()
        else:
            segment, extras = loss.lay_out(rows, token_rows, [runtimes[k].args for k in group])
        laid = torch.stack([torch.cat(flat), segment, torch.cat(target)])
        if sums is not None:
            missing = token_bucket(laid.shape[1]) - laid.shape[1]
            filler = torch.tensor([[0], [sums - 1], [0]], dtype=laid.dtype).expand(3, missing)
            laid = torch.cat([laid, filler], dim=1)
        where = to_device_async(laid, self.device)
        scales = torch.stack([plans[k].scales[i] for k, i in zip(group, at, strict=True)]) if loss is not None else None
        if sums is not None and scales is not None:
            scales = torch.cat([scales, scales.new_zeros(sums - len(scales))])
        on_device = tuple(to_device_async(extra, self.device) for extra in extras)
        unit_rows = None
        if layout is not None:
            owners = list(group) if slots is None else list(slots)
            unit, total = shape if shape is not None else (gcd_units(rows), sum(rows))
            if total > sum(rows):
                pad = pads[0]
                input_ids = torch.cat([input_ids, input_ids.new_full((total - sum(rows), length), pad)])
            unit_rows = self.rows(layout, owners, rows, keys, length, streams is not None, unit, total)
        return Pass(
            group,
            gang,
            layouts.get(key, []),
            input_ids,
            attention,
            where,
            scales,
            loss,
            on_device,
            layout,
            unit_rows,
            sums,
        )

    def rows(
        self,
        layout: Layout,
        slots: list[int],
        rows: list[int],
        keys: list[int],
        length: int,
        training: bool,
        unit: int,
        total: int,
    ) -> Rows:
        """The launched pass's row layout: units of ``unit`` rows (each member's in its slot; the rows of
        padding up to ``total`` in the first member's, where they carry no loss) and, when a member drops, each
        row's dropout key and probability."""
        padding = total - sum(rows)
        owners, counts = [*slots, slots[0]], [*rows, padding]
        units = [k for k, count in zip(owners, counts, strict=True) for _ in range(count // unit)]
        on = lambda values: to_device_async(values, self.device)  # noqa: E731
        if not (training and layout.key.dropout):
            return Rows(on(torch.tensor(units)), None, None)
        assert layout.slots is not None
        slot_of_row = [k for k, count in zip(owners, counts, strict=True) for _ in range(count)]
        keys = [*keys, 0]
        rows = counts
        drops = layout.slots.drop.index_select(0, on(torch.tensor(slot_of_row)))
        widths = self.launched.decoder.feature_widths()
        features = tuple(feature_keys(width, self.device) for width in widths)
        return Rows(
            on(torch.tensor(units)), on(row_keys(keys, rows)), drops, position_keys(length, self.device), features
        )

    def loss_hidden(self, shared: Pass, base: bool = False) -> torch.Tensor:
        """The backbone's last hidden state at every loss token's position (the one predicting it); ``base``:
        with the adapters off."""
        if shared.rows is not None:  # the launched pass
            # A padded pass is one a CUDA graph records: uncompiled kernels.
            layout = None if base else shared.layout
            hidden = self.launched.hidden(shared.input_ids, shared.rows, layout, eager=shared.sums is not None)
        else:
            backbone, _ = backbone_and_head(self.resident.base)
            with base_only(shared.layers) if base else contextlib.nullcontext():
                hidden = backbone(
                    input_ids=shared.input_ids, attention_mask=shared.attention, use_cache=False
                ).last_hidden_state
        return hidden.reshape(-1, hidden.shape[-1]).index_select(0, shared.where[0])

    def token_nll(self, first: TrialRuntime, shared: Pass, base: bool = False) -> torch.Tensor:
        """The negative log-probability of every loss token of the pass (float32), without the pass's
        float32 logits (:func:`~optuna_rapidfire._fused._token_stats.token_stats`); ``base``: with the
        adapters off and no gradients (a reference model)."""
        resident = self.resident
        _, head = backbone_and_head(resident.base)
        with torch.no_grad() if base else contextlib.nullcontext(), first.spec.kind.autocast(first.args, self.device):
            hidden = self.loss_hidden(shared, base)
            return -token_stats(hidden, head, shared.where[2], resident.base.config).log_probs

    def plan(self, runtime: TrialRuntime, loss: FusedLoss) -> MemberChunk:
        """The trial's micro-batches of its next chunk, collated, with where their loss tokens are."""
        trainer, args = runtime.trainer, runtime.args
        dataset, micro = self.trials.next_chunk(runtime)
        collated = [loss.collate(trainer, rows_of(dataset, indices)) for indices in micro]
        chunk = self.member_chunk(collated, loss, args.gradient_accumulation_steps)
        inputs, accumulation = chunk.inputs, chunk.accumulation
        for first in range(0, len(inputs), accumulation):
            group = slice(first, first + accumulation)
            count = _compat.num_items_in_batch(trainer, inputs[group], self.device)
            divisor = accumulation_divisor(trainer, count, len(inputs[group]))
            for batch, target in zip(collated[group], chunk.targets[group], strict=True):
                chunk.scales.append(loss.scale(batch, len(target[0]), count, divisor, self.device))
        return chunk

    def member_chunk(self, collated: list[dict[str, Any]], loss: FusedLoss, accumulation: int) -> MemberChunk:
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
        return MemberChunk(
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


@dataclass
class StepTables:
    """A launched chunk's optimizer steps, worked out ahead: for each micro-batch index where members step,
    which slots step (``ready``, 0/1) and each one's learning rate (its schedule's rate at that step), both
    ``[steps, slots]`` on the device; and how many steps each member takes."""

    indices: dict[int, int]
    ready: torch.Tensor
    lr: torch.Tensor
    steps: list[int]

    @classmethod
    def of(
        cls, runtimes: Sequence[TrialRuntime], plans: Sequence[MemberChunk], slots: int, device: torch.device
    ) -> StepTables:
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
        ready_t = to_device_async(torch.tensor(ready_rows, dtype=torch.float32), device)
        lr_t = to_device_async(torch.tensor(lr_rows, dtype=torch.float64), device)
        return cls(indices, ready_t, lr_t, taken)

    def at(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``ready`` and ``lr`` rows of the step after micro-batch ``index``."""
        row = self.indices[index]
        return self.ready[row], self.lr[row]


def precision(args: Any) -> tuple[bool, bool]:
    """What of a trial's args a recorded pass's kernels depend on besides its inputs: bf16 and fp16 autocast."""
    return bool(getattr(args, "bf16", False)), bool(getattr(args, "fp16", False))


def pad_rows(ids: torch.Tensor, rows: int, pad: int) -> torch.Tensor:
    """``ids`` (rows x tokens) with rows of ``pad`` appended up to ``rows``."""
    missing = rows - len(ids)
    return torch.cat([ids, ids.new_full((missing, ids.shape[1]), pad)]) if missing > 0 else ids


def row_bucket(rows: int, unit: int) -> int:
    """The rows a pass of ``rows`` rows is padded to: ``unit`` times the next power of two, at least 2 (a few sizes
    only; never one unit, a size the compiler would specialise a graph for)."""
    units = max(-(-rows // unit), 2)
    return unit * (1 << (units - 1).bit_length())


def chunk_width(plans: Sequence[MemberChunk]) -> int:
    """The tokens every launched pass of a chunk is padded to: its longest micro-batch's, rounded up to 64.

    One width per chunk (per eval set) rather than per pass: a pass of shorter rows (packing's remainder, a
    short batch) keeps the compiled graph's shapes instead of compiling it again in the middle of a study."""
    longest = max(batch["input_ids"].shape[1] for plan in plans for batch in plan.inputs)
    return -(-longest // 64) * 64


@dataclass
class MemberChunk:
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
class Pass:
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
    sums: int | None = None  # the loss's sums when padded (members and one of padding); None: one per member

    def tensors(self) -> list[torch.Tensor | None]:
        """What a launched training pass reads that changes from pass to pass (see :meth:`with_tensors`)."""
        assert self.rows is not None
        rows = self.rows
        return [
            self.input_ids,
            self.where,
            self.scales,
            *self.extras,
            rows.units,
            rows.keys,
            rows.drop,
            rows.tokens,
            *(rows.features or ()),
        ]

    def with_tensors(self, tensors: Sequence[torch.Tensor | None]) -> Pass:
        """This pass reading ``tensors`` (in the order of :meth:`tensors`) instead of its own."""
        assert self.rows is not None
        n = len(self.extras)
        units, keys, drop, tokens = tensors[3 + n : 7 + n]
        features = tuple(_present(t) for t in tensors[7 + n :]) if self.rows.features is not None else None
        return dataclasses.replace(
            self,
            input_ids=_present(tensors[0]),
            where=_present(tensors[1]),
            scales=tensors[2],
            extras=tuple(_present(t) for t in tensors[3 : 3 + n]),
            rows=Rows(_present(units), keys, drop, tokens, features),
        )


def _present(tensor: torch.Tensor | None) -> torch.Tensor:
    assert tensor is not None
    return tensor


def split_passes(members: list[int], tokens: list[int], limit: int = PASS_TOKENS) -> list[list[int]]:
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
