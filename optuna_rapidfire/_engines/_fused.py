"""Fused multi-adapter LoRA: K trials' adapters in one forward/backward pass over the shared base.

Groundwork for the fused engine (issue 7; not wired into the executor yet). A *gang* is K adapters of
the resident ``PeftModel`` and, for one step, K contiguous row segments of a batch: segment i belongs to
adapter i. Inside :func:`fused_forward`, every PEFT LoRA ``Linear`` computes the frozen base once for all
rows and adds each adapter's low-rank update to its own rows only, with two batched matrix products over
the K adapters (ranks zero-padded to the largest; an adapter that does not target the layer adds
nothing). Dropout masks come from each adapter's own ``torch.Generator``, so a trial draws the same
masks whether it trains alone or in a gang. Per-trial losses are computed on each segment
(:func:`segment_losses`); backpropagating their sum gives every adapter the gradient of its own loss,
since adapters share no parameters and the base is frozen.
"""

from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence


@dataclass
class Gang:
    """K adapters sharing a pass: adapter names, rows per adapter (in order), dropout generators.

    ``lengths`` (optional): each segment's own sequence length before the gang padded it to the longest;
    dropout masks are drawn for that length only, so a trial draws the same masks in any gang.
    """

    names: list[str]
    rows: list[int]
    generators: list[torch.Generator | None]
    lengths: list[int] | None = None

    def __post_init__(self) -> None:
        if not (len(self.names) == len(self.rows) == len(self.generators)) or not self.names:
            raise ValueError("A gang needs one row count and one generator (or None) per adapter.")
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"A gang's adapters must differ, got {self.names}.")
        if any(r < 1 for r in self.rows):
            raise ValueError(f"Every adapter of a gang needs at least one row, got {self.rows}.")


def unsupported(layer: Any, name: str) -> str | None:
    """Why adapter ``name`` of the LoRA ``layer`` cannot be fused (or ``None``)."""
    if name in getattr(layer, "lora_variant", {}):
        return f"adapter {name!r} uses a LoRA variant (DoRA, ...) the fused pass does not implement"
    if name in getattr(layer, "lora_A", {}) and not isinstance(layer.lora_A[name], torch.nn.Linear):
        return f"adapter {name!r} is not a plain linear LoRA"
    return None


def lora_layers(model: torch.nn.Module) -> list[Any]:
    """PEFT's LoRA ``Linear`` layers of ``model``."""
    from peft.tuners.lora.layer import Linear

    return [m for m in model.modules() if isinstance(m, Linear)]


@contextlib.contextmanager
def fused_forward(model: torch.nn.Module, gang: Gang) -> Iterator[None]:
    """Within the context, ``model``'s LoRA layers apply ``gang``'s adapters row segment by row segment.

    Raises:
        ValueError: If an adapter cannot be fused (a LoRA variant such as DoRA).
    """
    layers = lora_layers(model)
    for layer in layers:
        for name in gang.names:
            reason = unsupported(layer, name)
            if reason is not None:
                raise ValueError(reason)
    try:
        for layer in layers:
            layer.forward = types.MethodType(_bound_forward(gang), layer)
        yield
    finally:
        for layer in layers:
            layer.__dict__.pop("forward", None)


def _bound_forward(gang: Gang) -> Any:
    def forward(layer: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return fused_linear(layer, gang, x, *args, **kwargs)

    return forward


def fused_linear(layer: Any, gang: Gang, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The base layer on all rows, plus adapter i's update on segment i, in two batched matmuls."""
    result = layer.base_layer(x, *args, **kwargs)
    present = [i for i, name in enumerate(gang.names) if name in layer.lora_A]
    if not present or layer.disable_adapters:
        return result
    if x.shape[0] != sum(gang.rows):
        raise ValueError(f"The batch has {x.shape[0]} rows but the gang expects {sum(gang.rows)} ({gang.rows}).")
    weight_dtype = layer.lora_A[gang.names[present[0]]].weight.dtype
    inner = x.shape[1:-1].numel()  # tokens per row
    segments = torch.split(x.to(weight_dtype), gang.rows, dim=0)
    longest = max(gang.rows[i] for i in present) * inner
    rank = max(layer.lora_A[gang.names[i]].weight.shape[0] for i in present)
    inputs, downs, ups, scales = [], [], [], []
    for i in present:
        name = gang.names[i]
        segment = _dropout(
            segments[i],
            layer.lora_dropout[name],
            gang.generators[i],
            layer.training,
            None if gang.lengths is None or x.dim() < 3 else gang.lengths[i],
        )
        flat = segment.reshape(-1, x.shape[-1])
        inputs.append(F.pad(flat, (0, 0, 0, longest - flat.shape[0])))
        down = layer.lora_A[name].weight  # [r_i, in]
        up = layer.lora_B[name].weight  # [out, r_i]
        downs.append(F.pad(down, (0, 0, 0, rank - down.shape[0])).t())
        ups.append(F.pad(up, (0, rank - up.shape[1])).t())
        scales.append(float(layer.scaling[name]))
    stacked = torch.stack(inputs)  # [K, rows*tokens, in]
    update = torch.bmm(torch.bmm(stacked, torch.stack(downs)), torch.stack(ups))  # [K, rows*tokens, out]
    update = update * torch.tensor(scales, dtype=update.dtype, device=update.device).view(-1, 1, 1)
    by_adapter = {i: update[k, : gang.rows[i] * inner] for k, i in enumerate(present)}
    full = [
        by_adapter[i].reshape(rows, *x.shape[1:-1], -1)
        if i in by_adapter
        else update.new_zeros(rows, *x.shape[1:-1], result.shape[-1])
        for i, rows in enumerate(gang.rows)
    ]
    return result + torch.cat(full, dim=0).to(result.dtype)


def _dropout(
    x: torch.Tensor,
    module: torch.nn.Module,
    generator: torch.Generator | None,
    training: bool,
    length: int | None = None,
) -> torch.Tensor:
    """Inverted dropout with masks from ``generator``, drawn for the first ``length`` positions only."""
    p = float(getattr(module, "p", 0.0))
    if not training or p == 0.0:
        return x
    if p >= 1.0:
        return torch.zeros_like(x)
    shape = x.shape if length is None else (x.shape[0], length, *x.shape[2:])
    keep = torch.empty(shape, dtype=x.dtype, device=x.device).bernoulli_(1 - p, generator=generator)
    if length is not None and length < x.shape[1]:
        keep = torch.cat([keep, keep.new_ones(x.shape[0], x.shape[1] - length, *x.shape[2:])], dim=1)
    return x * keep / (1 - p)


def segment_losses(logits: torch.Tensor, labels: torch.Tensor, rows: Sequence[int]) -> list[torch.Tensor]:
    """Each segment's causal-LM loss: mean token cross-entropy of its rows (labels -100 are ignored)."""
    losses = []
    for logit, label in zip(torch.split(logits, list(rows)), torch.split(labels, list(rows)), strict=True):
        shifted = logit[:, :-1].reshape(-1, logit.shape[-1]).float()
        target = label[:, 1:].reshape(-1)
        losses.append(F.cross_entropy(shifted, target, ignore_index=-100))
    return losses


def clip_gang(grads: Sequence[Sequence[torch.Tensor]], max_norms: Sequence[float | None]) -> list[torch.Tensor]:
    """Clip each trial's gradients to its own ``max_norm`` (``None`` or <= 0: no clipping), in one pass.

    The same result as ``torch.nn.utils.clip_grad_norm_(trial_grads, max_norm)`` per trial, but with one
    ``foreach`` norm over every trial's gradients and one ``foreach`` scale, instead of two kernel
    launches per tensor per trial.

    Returns:
        Each trial's total gradient norm before clipping.
    """
    if len(grads) != len(max_norms):
        raise ValueError(f"clip_gang needs one max_norm per trial: {len(grads)} trials, {len(max_norms)} norms.")
    flat = [g for trial in grads for g in trial]
    if not flat:
        return [torch.zeros(()) for _ in grads]
    norms = torch._foreach_norm(flat, 2.0)
    totals: list[torch.Tensor] = []
    scales: list[torch.Tensor] = []
    scaled: list[torch.Tensor] = []
    start = 0
    for trial, max_norm in zip(grads, max_norms, strict=True):
        own = norms[start : start + len(trial)]
        start += len(trial)
        total = torch.linalg.vector_norm(torch.stack(own), 2.0) if own else flat[0].new_zeros(())
        totals.append(total)
        if max_norm is not None and max_norm > 0 and trial:
            coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            scales.extend([coefficient] * len(trial))
            scaled.extend(trial)
    if scaled:
        torch._foreach_mul_(scaled, scales)
    return totals
