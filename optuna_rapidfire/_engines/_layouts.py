"""What the launched pass keys its compiled code and slot storage on: a gang's *layout* (:class:`LayoutKey`), its
state (:class:`Layout`), and a member in slot terms (:class:`Member`, :func:`member_of`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from optuna_rapidfire._fused._decoder import PROJECTIONS, Lora, projection_of
from optuna_rapidfire._fused._fused_pass import unsupported
from optuna_rapidfire._fused._slots import MemberAdapter, Projection, adam_settings

if TYPE_CHECKING:
    import torch

    from optuna_rapidfire._engines._types import TrialRuntime
    from optuna_rapidfire._fused._slots import AdamSettings, GangAdamW, GangSlots


@dataclass(frozen=True)
class LayoutKey:
    """What a gang's compiled pass depends on."""

    projections: frozenset[Projection]
    rank: int
    dtype: torch.dtype
    dropout: bool

    def describe(self) -> str:
        layers = {p.layer for p in self.projections}
        names = sorted({p.name for p in self.projections}, key=PROJECTIONS.index)
        return (
            f"{'/'.join(n.removesuffix('_proj') for n in names)} on {len(layers)} layers, rank <= {self.rank}, "
            f"{str(self.dtype).removeprefix('torch.')}{', dropout' if self.dropout else ''}"
        )


@dataclass(eq=False)
class Layout:
    """A layout's state: its key, slot storage and optimizer (allocated while the layout is in use), the
    per-layer LoRA inputs and dropout salts, whether it runs compiled, and its compilation counters."""

    key: LayoutKey
    compiled: bool
    slots: GangSlots | None = None
    optimizer: GangAdamW | None = None
    loras: list[tuple[Lora | None, ...]] = field(default_factory=list)
    salts: torch.Tensor | None = None
    compiles: int = 0
    first_pass_seconds: float | None = None
    background_seconds: float = 0.0
    unit: int = 0  # a stream's rows per unit (streams of one unit share the padded sizes below)
    width: int = 0  # the tokens a stream's rows are padded to: only ever grows


@dataclass
class Member:
    """A gang member as the launched pass sees it: its adapter in slot terms and AdamW settings."""

    adapter: MemberAdapter
    settings: AdamSettings


def covering(layouts: dict[LayoutKey, Layout], key: LayoutKey, compiles: bool) -> Layout | None:
    """The smallest seen layout that can run a gang of ``key`` (every projection of it, a rank bucket as
    large, the same dtype, dropout if it drops), or ``None``.

    A gang whose members come and go (the promote schedule's gangs change from chunk to chunk) would
    otherwise compile a layout for nearly every composition, each taking tens of seconds. In a larger
    layout a member's unused projections have zero weights and scale, and its rank is padded with
    zeros: it computes the same values, at the cost of the larger layout's pass.
    """
    covering = [
        layout
        for seen, layout in layouts.items()
        if key.projections <= seen.projections
        and key.rank <= seen.rank
        and key.dtype == seen.dtype
        and (seen.dropout or not key.dropout)
        and (layout.compiled or not compiles)
    ]
    return min(covering, key=lambda layout: (len(layout.key.projections), layout.key.rank), default=None)


def member_of(named: list[tuple[str, Any]], runtime: TrialRuntime) -> Member | str:
    """The trial in slot terms (its LoRA layers among the model's ``named`` ones, its AdamW settings), or why the
    launched pass cannot take it."""
    name = runtime.state.adapter_name
    projections: dict[Projection, tuple[torch.nn.Parameter, torch.nn.Parameter, float]] = {}
    drops: set[float] = set()
    for module_name, layer in named:
        if name not in layer.lora_A:
            continue
        where = projection_of(module_name)
        reason = unsupported(layer, name)
        if where is None or reason is not None:
            return reason or f"adapts {module_name}, which the launched pass does not"
        if getattr(layer.lora_B[name], "bias", None) is not None:
            return "has a LoRA bias"
        a, b = layer.lora_A[name].weight, layer.lora_B[name].weight
        projection = Projection(where[0], where[1], a.shape[1], b.shape[0])
        projections[projection] = (a, b, float(layer.scaling[name]))
        drops.add(float(getattr(layer.lora_dropout[name], "p", 0.0)))
    params = runtime.state.params
    owned = {id(t) for a, b, _ in projections.values() for t in (a, b)}
    if not projections or owned != {id(p) for p in params}:
        return "trains parameters besides LoRA's A and B (modules_to_save?)"
    if len(drops) > 1 or len({a.dtype for a, _, _ in projections.values()}) > 1:
        return "has per-layer dropout or dtypes"
    settings = adam_settings(runtime.state.optimizer, params, runtime.args.max_grad_norm)
    if isinstance(settings, str):
        return settings
    rank = max(a.shape[0] for a, _, _ in projections.values())
    return Member(MemberAdapter(projections, rank, drops.pop()), settings)
