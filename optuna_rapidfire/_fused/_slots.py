"""A gang's adapters in slots: stacked, rank-padded storage that one compiled pass and one optimizer launch serve.

The fused engine's launched pass (:mod:`optuna_rapidfire._engines._launched`) does not read the trials'
own PEFT parameters: for the length of a chunk, each member's LoRA weights and Adam moments are copied into
a *slot* of one storage (:class:`GangSlots`), in which every LoRA projection of the model is one tensor
over all slots, ``A`` as ``[slots, rank, in]`` and ``B`` transposed as ``[slots, rank, out]``, ranks
zero-padded to the layout's rank bucket. The storage is a ``[slots, n]`` matrix per quantity (weights,
gradients, first and second moments), so one elementwise launch updates every member (:class:`GangAdamW`),
and the pass's inputs are the same tensors whoever the members are: a trial that joins a seen layout
changes values, never shapes or addresses, and triggers no compilation. At the end of the chunk each member's
slot is copied back into its own parameters and optimizer state, which everything else (evaluation,
snapshots, checkpoints, export, the time-sliced engine) keeps using.

Padding stays exactly zero through training: a zero row of ``A`` meets a zero column of ``B``, so both get
zero gradients, zero moments and zero updates (weight decay of zero is zero).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from collections.abc import Sequence

    from torch.optim import Optimizer


@dataclass(frozen=True)
class Projection:
    """One LoRA-adapted linear map of the model: decoder layer, projection name, input and output features."""

    layer: int
    name: str
    features_in: int
    features_out: int


@dataclass
class MemberAdapter:
    """A trial's LoRA in slot terms: for each projection it adapts, its ``A`` and ``B`` parameters and scaling;
    its rank, dropout probability and its parameters in the order its optimizer holds them."""

    projections: dict[Projection, tuple[torch.nn.Parameter, torch.nn.Parameter, float]]
    rank: int
    dropout: float


def rank_bucket(rank: int) -> int:
    """The padded rank of a layout: the next power of two, at least 8."""
    return max(8, 1 << max(rank - 1, 0).bit_length())


class GangSlots:
    """Storage for ``slots`` members' adapters over ``projections``, ranks padded to ``rank``.

    Attributes:
        a: Per projection, ``A`` of every slot ``[slots, rank, in]`` (a leaf that requires grad; its
            ``.grad`` is a view of :attr:`grad`, where backward passes accumulate in place).
        b: Per projection, ``B`` transposed ``[slots, rank, out]`` (likewise).
        scale: Per projection, each slot's LoRA scaling ``[slots]``.
        drop: Each slot's dropout probability ``[slots]`` (float32).
        params, grad, exp_avg, exp_avg_sq: The ``[slots, n]`` matrices behind them.
        step: Each slot's optimizer step count (float32 ``[slots]``).
    """

    def __init__(
        self, projections: Sequence[Projection], rank: int, slots: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.projections = list(projections)
        self.rank, self.slots, self.dtype, self.device = rank, slots, dtype, device
        sizes = [rank * (p.features_in + p.features_out) for p in self.projections]
        total = sum(sizes)
        self.params = torch.zeros(slots, total, dtype=dtype, device=device)
        self.grad = torch.zeros_like(self.params)
        self.exp_avg = torch.zeros(slots, total, dtype=torch.float32, device=device)
        self.exp_avg_sq = torch.zeros_like(self.exp_avg)
        self.step = torch.zeros(slots, dtype=torch.float32, device=device)
        self.scale = {p: torch.zeros(slots, dtype=torch.float32, device=device) for p in self.projections}
        self.drop = torch.zeros(slots, dtype=torch.float32, device=device)
        self.a: dict[Projection, torch.Tensor] = {}
        self.b: dict[Projection, torch.Tensor] = {}
        self._offsets: dict[Projection, int] = {}
        offset = 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the views' strides differ from a dense tensor's (by design)
            for projection, size in zip(self.projections, sizes, strict=True):
                self._offsets[projection] = offset
                a_size = rank * projection.features_in
                self.a[projection] = self._leaf(offset, (rank, projection.features_in))
                self.b[projection] = self._leaf(offset + a_size, (rank, projection.features_out))
                offset += size
        self.members: list[MemberAdapter | None] = [None] * slots

    def _leaf(self, offset: int, shape: tuple[int, int]) -> torch.Tensor:
        size = shape[0] * shape[1]
        leaf = self.params[:, offset : offset + size].view(self.slots, *shape)
        leaf.requires_grad_(True)
        leaf.grad = self.grad[:, offset : offset + size].view(self.slots, *shape)
        return leaf

    def nbytes(self) -> int:
        """Bytes of the storage (weights, gradients, moments)."""
        return sum(t.numel() * t.element_size() for t in (self.params, self.grad, self.exp_avg, self.exp_avg_sq))

    def load(self, slot: int, member: MemberAdapter, optimizer: Optimizer) -> None:
        """Copy a member's weights, moments and step count into ``slot`` (and zero what it does not use)."""
        for matrix in (self.params, self.grad, self.exp_avg, self.exp_avg_sq):
            matrix[slot].zero_()
        for scale in self.scale.values():
            scale[slot] = 0.0
        self.step[slot] = 0.0
        with torch.no_grad():
            for projection, (a, b, scaling) in member.projections.items():
                if projection not in self._offsets:
                    raise ValueError(f"The layout has no slot storage for {projection}.")
                rank = a.shape[0]
                self.a[projection][slot, :rank].copy_(a, non_blocking=True)
                self.b[projection][slot, :rank].copy_(b.t(), non_blocking=True)
                self.scale[projection][slot] = scaling
                state = optimizer.state.get(a)
                if state:
                    self._moments(slot, projection, rank, "a").copy_(state["exp_avg"], non_blocking=True)
                    self._moments(slot, projection, rank, "a", second=True).copy_(
                        state["exp_avg_sq"], non_blocking=True
                    )
                    state_b = optimizer.state[b]
                    self._moments(slot, projection, rank, "b").copy_(state_b["exp_avg"].t(), non_blocking=True)
                    self._moments(slot, projection, rank, "b", second=True).copy_(
                        state_b["exp_avg_sq"].t(), non_blocking=True
                    )
                    self.step[slot : slot + 1].copy_(state["step"].reshape(1), non_blocking=True)
        self.drop[slot] = member.dropout
        self.members[slot] = member

    def store(self, slot: int, optimizer: Optimizer) -> None:
        """Copy ``slot`` back into its member's weights and optimizer state (the moments and step count in the
        form the member's optimizer keeps them)."""
        member = self.members[slot]
        assert member is not None
        step = self.step[slot]
        with torch.no_grad():
            for projection, (a, b, _) in member.projections.items():
                rank = a.shape[0]
                a.copy_(self.a[projection][slot, :rank], non_blocking=True)
                b.copy_(self.b[projection][slot, :rank].t(), non_blocking=True)
                for param, which in ((a, "a"), (b, "b")):
                    first = self._moments(slot, projection, rank, which)
                    second = self._moments(slot, projection, rank, which, second=True)
                    if which == "b":
                        first, second = first.t(), second.t()
                    state = optimizer.state[param]
                    if not state:
                        state["step"] = _step_tensor(optimizer, param, 0.0)
                        state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                        state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    state["exp_avg"].copy_(first, non_blocking=True)
                    state["exp_avg_sq"].copy_(second, non_blocking=True)
                    state["step"].copy_(step)
        self.members[slot] = None

    def _moments(self, slot: int, projection: Projection, rank: int, which: str, second: bool = False) -> torch.Tensor:
        """A member's rows of a moment matrix for one projection's ``A`` or transposed ``B``."""
        matrix = self.exp_avg_sq if second else self.exp_avg
        offset = self._offsets[projection]
        width = projection.features_in
        if which == "b":
            offset += self.rank * projection.features_in
            width = projection.features_out
        return matrix[slot, offset : offset + self.rank * width].view(self.rank, width)[:rank]


def _step_tensor(optimizer: Optimizer, param: torch.Tensor, value: float) -> torch.Tensor:
    """An Adam step count as ``torch.optim.Adam`` creates it: on the parameter's device when fused or
    capturable, else a CPU scalar."""
    group = next(g for g in optimizer.param_groups if any(p is param for p in g["params"]))
    on_device = bool(group.get("fused")) or bool(group.get("capturable"))
    return torch.tensor(value, dtype=torch.float32, device=param.device if on_device else "cpu")


@dataclass(frozen=True)
class AdamSettings:
    """A member's AdamW settings, the same for all its parameters: betas, eps, weight decay, clipping."""

    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    max_grad_norm: float


def adam_settings(
    optimizer: Optimizer, params: Sequence[torch.Tensor], max_grad_norm: float | None
) -> AdamSettings | str:
    """The member's settings if one gang AdamW step equals its optimizer's step, else why not."""
    from torch.optim import Adam

    if not isinstance(optimizer, Adam):
        return f"its optimizer is {type(optimizer).__name__} (the gang steps AdamW)"
    wanted = {id(p) for p in params}
    found = set()
    for group in optimizer.param_groups:
        mine = [p for p in group["params"] if id(p) in wanted]
        if not mine:
            continue
        decoupled = bool(group.get("decoupled_weight_decay", type(optimizer).__name__ == "AdamW"))
        if group.get("amsgrad") or group.get("maximize") or group.get("differentiable"):
            return "its optimizer uses amsgrad, maximize or differentiable"
        if not decoupled and group["weight_decay"]:
            return "its optimizer is Adam with L2 weight decay"
        beta1, beta2 = (float(b) for b in group["betas"])
        found.add((beta1, beta2, float(group["eps"]), float(group["weight_decay"]) if decoupled else 0.0))
    if len(found) != 1:
        return "its parameters have different optimizer settings"
    beta1, beta2, eps, weight_decay = found.pop()
    clip = float(max_grad_norm) if max_grad_norm is not None and max_grad_norm > 0 else 0.0
    return AdamSettings(beta1, beta2, eps, weight_decay, clip)


class GangAdamW:
    """One AdamW step for every slot of a :class:`GangSlots` at once, each slot with its own learning rate,
    betas, eps, weight decay and gradient clipping (device tensors), as ``torch.optim.AdamW`` followed by
    ``clip_grad_norm_`` computes them for each trial alone. Slots not ``ready`` in a step keep their
    weights, moments, step count and gradients (they are still accumulating)."""

    def __init__(self, slots: GangSlots, compiled: Any = None) -> None:
        self.slots = slots
        device, count = slots.device, slots.slots
        self.beta1 = torch.zeros(count, dtype=torch.float64, device=device)
        self.beta2 = torch.zeros(count, dtype=torch.float64, device=device)
        self.eps = torch.ones(count, dtype=torch.float64, device=device)
        self.weight_decay = torch.zeros(count, dtype=torch.float64, device=device)
        self.max_norm = torch.zeros(count, dtype=torch.float64, device=device)
        self.last_norm = torch.zeros(slots.slots, device=device)
        self._compiled_fn = compiled
        self.compiled = compiled is not None  # False: the step runs uncompiled

    def configure(self, slot: int, settings: AdamSettings) -> None:
        self.beta1[slot] = settings.beta1
        self.beta2[slot] = settings.beta2
        self.eps[slot] = settings.eps
        self.weight_decay[slot] = settings.weight_decay
        self.max_norm[slot] = settings.max_grad_norm

    def step(self, ready: torch.Tensor, lr: torch.Tensor, *, eager: bool = False) -> None:
        """Step the ``ready`` slots (float32 0/1 ``[slots]``) with learning rates ``lr`` (float64 ``[slots]``); their
        gradient norms before clipping are kept in :attr:`last_norm`; their gradients are zeroed. ``eager``:
        uncompiled whatever :attr:`compiled` says."""
        s = self.slots
        compiled = self.compiled and not eager and self._compiled_fn is not None
        step_fn = self._compiled_fn if compiled else adamw_step
        step_fn(
            s.params,
            s.grad,
            s.exp_avg,
            s.exp_avg_sq,
            s.step,
            self.last_norm,
            ready,
            lr,
            self.beta1,
            self.beta2,
            self.eps,
            self.weight_decay,
            self.max_norm,
        )


@torch.no_grad()
def adamw_step(
    params: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: torch.Tensor,
    last_norm: torch.Tensor,
    ready: torch.Tensor,
    lr: torch.Tensor,
    beta1: torch.Tensor,
    beta2: torch.Tensor,
    eps: torch.Tensor,
    weight_decay: torch.Tensor,
    max_norm: torch.Tensor,
) -> None:
    """The gang's AdamW step over ``[slots, n]`` matrices (see :class:`GangAdamW`); elementwise but for one
    norm per slot, so a compiler fuses it into a few kernels. The order of operations is
    ``torch.optim.AdamW``'s (decoupled decay, then the moments, then the bias-corrected update)."""
    norm = torch.linalg.vector_norm(grad.float(), 2.0, dim=1)
    keep = ready > 0
    last_norm.copy_(torch.where(keep, norm, last_norm))
    clip = torch.where(max_norm > 0, torch.clamp(max_norm / (norm.double() + 1e-6), max=1.0), torch.ones_like(max_norm))
    g = grad.float() * clip.float()[:, None]
    count = step + ready
    # Per-slot scalars in float64, as torch.optim.Adam computes them on the host (1 - 0.999 in float32 is off
    # by 1e-5 relative), then rounded once for the elementwise update.
    safe = torch.clamp(count, min=1.0).double()
    bias1 = 1 - beta1**safe
    bias2_sqrt = (1 - beta2**safe).sqrt()
    decay = (1 - lr * weight_decay).float()[:, None]
    step_size = (lr / bias1).float()[:, None]
    decayed = params * decay
    first = exp_avg.lerp(g, (1 - beta1).float()[:, None])
    second = exp_avg_sq * beta2.float()[:, None] + (1 - beta2).float()[:, None] * g * g
    denom = second.sqrt() / bias2_sqrt.float()[:, None] + eps.float()[:, None]
    updated = decayed - step_size * first / denom
    rows = keep[:, None]
    params.copy_(torch.where(rows, updated.to(params.dtype), params))
    exp_avg.copy_(torch.where(rows, first, exp_avg))
    exp_avg_sq.copy_(torch.where(rows, second, exp_avg_sq))
    step.copy_(count)
    grad.masked_fill_(rows, 0.0)


def gcd_units(rows: Sequence[int]) -> int:
    """The rows of a unit: the largest count that divides every member's rows in a pass."""
    unit = 0
    for count in rows:
        unit = math.gcd(unit, count)
    return unit
