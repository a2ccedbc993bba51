"""Fused multi-adapter LoRA: K trials' adapters in one forward/backward pass over the shared base.

The pass under the fused engine (:mod:`optuna_rapidfire._engines._fused_engine`). A *gang* is K adapters
of the resident ``PeftModel`` and, for one step, K contiguous row segments of a batch: segment i belongs
to adapter i. Inside :func:`fused_forward`, every PEFT LoRA ``Linear`` computes the frozen base once for
all rows and adds each adapter's low-rank update to its own rows only, with two batched matrix products
over the K adapters: without copies when the adapters share rank and targets and the segments their row
count, else over ranks and rows zero-padded to the largest, gathered by index (one gather of the rows,
one of the stacked projections, one indexed add of the updates per layer, whatever K; an adapter that
does not target the layer adds nothing). Dropout masks are computed from each adapter's own stream
(:mod:`optuna_rapidfire._fused._dropout`), so a trial gets the same masks alone or in any gang. Per-trial
losses are computed on each segment (:func:`segment_losses`); backpropagating their sum gives every
adapter the gradient of its own loss, since adapters share no parameters and the base is frozen.
"""

from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from optuna_rapidfire._fused._dropout import apply, feature_keys, keep_scale, layer_salt, position_keys, row_keys

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence

    from optuna_rapidfire._fused._stacks import GangStacks


@dataclass
class Gang:
    """K adapters sharing a pass: adapter names, rows per adapter (in order), and each adapter's dropout key
    for this pass (:meth:`~optuna_rapidfire._fused._dropout.DropoutStream.next_key`; ignored by adapters
    without dropout)."""

    names: list[str]
    rows: list[int]
    keys: list[int]
    _row_keys: dict[torch.device, torch.Tensor] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not (len(self.names) == len(self.rows) == len(self.keys)) or not self.names:
            raise ValueError("A gang needs one row count and one dropout key per adapter.")
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"A gang's adapters must differ, got {self.names}.")
        if any(r < 1 for r in self.rows):
            raise ValueError(f"Every adapter of a gang needs at least one row, got {self.rows}.")

    def row_keys(self, device: torch.device) -> torch.Tensor:
        """Each row's dropout key (:func:`~optuna_rapidfire._fused._dropout.row_keys`), on ``device``."""
        found = self._row_keys.get(device)
        if found is None:
            found = self._row_keys[device] = _to_device(row_keys(self.keys, self.rows).tolist(), device)
        return found


def unsupported(layer: Any, name: str) -> str | None:
    """Why adapter ``name`` of the LoRA ``layer`` cannot be fused (or ``None``)."""
    if name in getattr(layer, "lora_variant", {}):
        return f"adapter {name!r} uses a LoRA variant (DoRA, ...) the fused pass does not implement"
    if name in getattr(layer, "lora_A", {}) and not isinstance(layer.lora_A[name], torch.nn.Linear):
        return f"adapter {name!r} is not a plain linear LoRA"
    return None


def lora_layers(model: torch.nn.Module) -> list[Any]:
    """PEFT's LoRA ``Linear`` layers of ``model``."""
    return [layer for _, layer in named_lora_layers(model)]


def named_lora_layers(model: torch.nn.Module) -> list[tuple[str, Any]]:
    """PEFT's LoRA ``Linear`` layers of ``model`` with the base model's name for each (``model.layers.0.
    self_attn.q_proj``, whether ``model`` is the ``PeftModel`` or the base it wraps)."""
    from peft.tuners.lora.layer import Linear

    prefix = "base_model.model."
    return [
        (name[len(prefix) :] if name.startswith(prefix) else name, m)
        for name, m in model.named_modules()
        if isinstance(m, Linear)
    ]


def layer_plans(
    model: torch.nn.Module, gang: Gang, layers: list[tuple[str, Any]] | None = None
) -> list[tuple[Any, _LayerPlan]]:
    """``model``'s LoRA layers, each with what it needs for ``gang``: reusable while the gang's adapters,
    rows and the adapters' settings stay the same (an engine prepares them once per chunk). ``layers``:
    :func:`named_lora_layers` of ``model``, when the caller keeps them (else listed here: a walk of the model).

    Raises:
        ValueError: If an adapter cannot be fused (a LoRA variant such as DoRA).
    """
    plans = []
    for module_name, layer in named_lora_layers(model) if layers is None else layers:
        for name in gang.names:
            reason = unsupported(layer, name)
            if reason is not None:
                raise ValueError(reason)
        plans.append((layer, _LayerPlan.of(layer, gang, layer_salt(module_name))))
    return plans


def fused_forward(
    model: torch.nn.Module,
    gang: Gang,
    plans: list[tuple[Any, _LayerPlan]] | None = None,
    stacks: GangStacks | None = None,
) -> contextlib.AbstractContextManager[None]:
    """Within the context, ``model``'s LoRA layers apply ``gang``'s adapters row segment by row segment.

    ``plans``: :func:`layer_plans` of this model and gang, when the caller has them already. ``stacks``: where
    the layers it holds read the gang's adapters stacked (:class:`~optuna_rapidfire._fused._stacks.GangStacks`,
    loaded for this pass) instead of stacking them.

    Raises:
        ValueError: If an adapter cannot be fused (a LoRA variant such as DoRA).
    """
    plans = layer_plans(model, gang) if plans is None else plans
    return _forwards(
        plans, lambda layer, plan: _bound_forward(gang, plan, None if stacks is None else stacks.of(layer))
    )


def attention_kernels() -> contextlib.AbstractContextManager[None]:
    """Within the context, scaled-dot-product attention takes the flash, memory-efficient or math kernel, not
    cuDNN's: cuDNN builds a plan for every new shape, and a GRPO gang's policy passes bring new sequence
    lengths at every step (on the H200 the study's time outside decoding fell from 24-29 s to 17.6 s)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def base_only(plans: list[tuple[Any, _LayerPlan]]) -> contextlib.AbstractContextManager[None]:
    """Within the context, the planned LoRA layers compute their frozen base layer only (a reference model).

    Unlike PEFT's ``disable_adapter()``, this leaves which adapters are trainable untouched.
    """
    return _forwards(plans, lambda layer, plan: _base_forward)


@contextlib.contextmanager
def _forwards(plans: list[tuple[Any, _LayerPlan]], forward: Callable[[Any, _LayerPlan], Any]) -> Iterator[None]:
    """Within the context, each planned layer runs ``forward(layer, plan)`` (bound to the layer) instead of its own."""
    try:
        for layer, plan in plans:
            layer.forward = types.MethodType(forward(layer, plan), layer)
        yield
    finally:
        for layer, _ in plans:
            layer.__dict__.pop("forward", None)


def _base_forward(layer: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return layer.base_layer(x, *args, **kwargs)


@dataclass
class _LayerPlan:
    """What one LoRA layer needs for a gang, worked out once per pass rather than once per call.

    ``present``: the gang's adapters that target the layer (positions in the gang); ``uniform``: every
    adapter targets it with the same rank and the segments have equal rows, so the rows reshape to
    ``[K, rows * tokens, in]`` without copies and the ranks need no padding; ``dropout``: each present
    adapter's dropout probability; ``salt``: the layer's dropout salt; ``shared_scale``: the present adapters'
    scaling when they share one.
    """

    present: list[int]
    uniform: bool
    scales: list[float]
    dropout: list[float]
    rank: int
    salt: int
    shared_scale: float | None = None
    _row_drop: dict[torch.device, torch.Tensor] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, layer: Any, gang: Gang, salt: int) -> _LayerPlan:
        present = [i for i, name in enumerate(gang.names) if name in layer.lora_A]
        ranks = [layer.lora_A[gang.names[i]].weight.shape[0] for i in present]
        uniform = len(present) == len(gang.names) and len(set(ranks)) <= 1 and len(set(gang.rows)) == 1
        scales = [float(layer.scaling[gang.names[i]]) for i in present]
        return cls(
            present=present,
            uniform=uniform,
            scales=scales,
            dropout=[float(getattr(layer.lora_dropout[gang.names[i]], "p", 0.0)) for i in present],
            rank=max(ranks, default=0),
            salt=salt,
            shared_scale=scales[0] if len(set(scales)) == 1 else None,
        )

    def row_drop(self, gang: Gang, device: torch.device) -> torch.Tensor:
        """Each row's dropout probability in this layer (0 for adapters that do not target it)."""
        found = self._row_drop.get(device)
        if found is None:
            own = dict(zip(self.present, self.dropout, strict=True))
            values = [own.get(i, 0.0) for i, count in enumerate(gang.rows) for _ in range(count)]
            found = self._row_drop[device] = torch.tensor(values, dtype=torch.float32).to(device)
        return found


def _bound_forward(gang: Gang, plan: _LayerPlan, stacked: tuple[torch.Tensor, torch.Tensor] | None) -> Any:
    def forward(layer: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return fused_linear(layer, gang, plan, x, *args, stacked=stacked, **kwargs)

    return forward


_SCALES: dict[tuple[Any, ...], torch.Tensor] = {}


def _scales(values: list[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The adapters' LoRA scalings as a ``[K, 1, 1]`` tensor on the device, copied there once."""
    key = (tuple(values), dtype, device)
    tensor = _SCALES.get(key)
    if tensor is None:
        if len(_SCALES) > 256:
            _SCALES.clear()
        tensor = _SCALES[key] = torch.tensor(values, dtype=dtype, device=device).view(-1, 1, 1)
    return tensor


def fused_linear(
    layer: Any,
    gang: Gang,
    plan: _LayerPlan,
    x: torch.Tensor,
    *args: Any,
    stacked: tuple[torch.Tensor, torch.Tensor] | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """The base layer on all rows, plus adapter i's update on segment i, in batched matmuls.

    When every adapter targets the layer with one rank on equal row counts, two batched matmuls over a
    view of the input, the second adding onto the base output (``baddbmm``) when the dtypes allow; the
    adapters' down- and up-projections stacked here, or read from ``stacked`` (``[K, r, in]``, ``[K, out, r]``:
    a :class:`~optuna_rapidfire._fused._stacks.GangStacks` loaded with them), and a scaling the adapters
    share applied by the matmul (its ``alpha``). Else
    one gather of the present adapters' rows (zero-padded to the longest segment), one of their
    projections (zero-padded to the largest rank), two batched matmuls and one indexed add of the
    updates onto the base output: the operators launched do not grow with the number of adapters. The
    scalings are folded into the stacked up-projections, and under mixed precision the input is not cast to
    the adapters' dtype first (autocast casts it for the matmul, as it would PEFT's).
    """
    result = layer.base_layer(x, *args, **kwargs)
    if not plan.present or layer.disable_adapters:
        return result
    if x.shape[0] != sum(gang.rows):
        raise ValueError(f"The batch has {x.shape[0]} rows but the gang expects {sum(gang.rows)} ({gang.rows}).")
    names = [gang.names[i] for i in plan.present]
    weight_dtype = layer.lora_A[names[0]].weight.dtype if stacked is None else stacked[0].dtype
    autocast = torch.is_autocast_enabled(x.device.type)
    if not autocast:
        x = x.to(weight_dtype)
    inner = x.shape[1:-1].numel()  # tokens per row
    dropping = layer.training and any(p > 0 for p in plan.dropout)
    if dropping:  # one computed mask for all rows (each row's own key and probability)
        if x.dim() != 3:
            raise ValueError(f"Adapter dropout in a shared pass needs rows x tokens x features, got {tuple(x.shape)}.")
        tokens, features = position_keys(x.shape[1], x.device), feature_keys(x.shape[2], x.device)
        scale = keep_scale(gang.row_keys(x.device), plan.salt, plan.row_drop(gang, x.device), tokens, features)
        x = apply(x, scale)
    if plan.uniform:
        # Every adapter targets the layer with one rank, on equal row counts: no copies, no padding.
        rows = x.reshape(len(names), -1, x.shape[-1])  # a view: segments are contiguous rows
        if stacked is None:
            downs = torch.stack([layer.lora_A[name].weight for name in names])  # [K, r, in]
            ups = torch.stack([layer.lora_B[name].weight for name in names])  # [K, out, r]
        else:
            downs, ups = stacked
        # A scaling the adapters share is the matmul's alpha; else each adapter's scales its up-projection.
        up = ups if plan.shared_scale is not None else ups * _scales(plan.scales, ups.dtype, x.device)
        hidden = torch.bmm(rows, downs.transpose(1, 2))  # [K, rows*tokens, r]
        alpha = 1.0 if plan.shared_scale is None else plan.shared_scale
        if not dropping and (autocast or result.dtype == hidden.dtype):
            base = result.reshape(len(names), -1, result.shape[-1])
            fused = torch.baddbmm(base, hidden, up.transpose(1, 2), alpha=alpha)
            return fused.view(result.shape).to(result.dtype)
        update = torch.bmm(hidden, up.transpose(1, 2))
        return result + (update if alpha == 1.0 else update * alpha).view(result.shape).to(result.dtype)
    # Mixed ranks, targets or row counts: the present adapters' rows gathered into a stack zero-padded to
    # the longest segment, their projections zero-padded to the largest rank, two batched matmuls, and
    # the updates added back onto the base output by index.
    gather, valid, targets, longest = _row_indices(plan.present, gang.rows, inner, x.device)
    padded = F.pad(x.reshape(-1, x.shape[-1]), (0, 0, 0, 1))  # one zero row that padding positions read
    gathered = padded.index_select(0, gather).view(len(names), longest, x.shape[-1])
    down, up = _stacked_weights(layer, names, plan, x.device)  # [K, in, r], [K, r, out]
    update = torch.bmm(torch.bmm(gathered, down), up * _scales(plan.scales, up.dtype, x.device))
    rows = update.reshape(-1, update.shape[-1]).index_select(0, valid)
    out = result.reshape(-1, result.shape[-1]).index_add(0, targets, rows.to(result.dtype))
    return out.view(result.shape)


_INDICES: dict[tuple[Any, ...], Any] = {}


def _cached_indices(key: tuple[Any, ...], build: Callable[[], Any]) -> Any:
    """Index tensors shared by every layer with the same layout, built once (on the host, then copied
    without blocking) and kept; the cache is small, since a chunk's passes take few row layouts."""
    found = _INDICES.get(key)
    if found is None:
        if len(_INDICES) > 64:
            _INDICES.clear()
        found = _INDICES[key] = build()
    return found


def to_device_async(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a host tensor to ``device`` without making the host wait (page-locked first on CUDA: a copy from pageable
    memory waits for the device's queue)."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def _to_device(values: list[int], device: torch.device) -> torch.Tensor:
    return to_device_async(torch.tensor(values, dtype=torch.long), device)


def _row_indices(
    present: list[int], rows: list[int], tokens: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Three index tensors over a layer's ``[sum(rows) * tokens, features]`` input for the present
    adapters: where each one's tokens go in the ``[K * longest, features]`` stack (padding positions
    point one past the input, at a zero row), which stack rows hold real tokens, and which input rows
    they are; and ``longest``, the tokens of the largest segment."""

    def build() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        starts = [sum(rows[:i]) * tokens for i in range(len(rows))]
        pad_row = sum(rows) * tokens
        longest = max(rows[i] for i in present) * tokens
        gather: list[int] = []
        valid: list[int] = []
        targets: list[int] = []
        for slot, i in enumerate(present):
            own = list(range(starts[i], starts[i] + rows[i] * tokens))
            gather += own + [pad_row] * (longest - len(own))
            valid += range(slot * longest, slot * longest + len(own))
            targets += own
        return _to_device(gather, device), _to_device(valid, device), _to_device(targets, device), longest

    return _cached_indices(("rows", tuple(present), tuple(rows), tokens, device), build)


def _rank_index(ranks: list[int], rank: int, device: torch.device) -> torch.Tensor:
    """Where each adapter's rank rows sit in a ``[K * rank, ...]`` stack of projections concatenated
    along their rank (padding positions point one past them, at a zero row)."""

    def build() -> torch.Tensor:
        total, index, start = sum(ranks), [], 0
        for r in ranks:
            index += list(range(start, start + r)) + [total] * (rank - r)
            start += r
        return _to_device(index, device)

    return _cached_indices(("ranks", tuple(ranks), rank, device), build)


def _stacked_weights(
    layer: Any, names: list[str], plan: _LayerPlan, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The adapters' down- and up-projections stacked as ``[K, in, r]`` and ``[K, r, out]``, ranks
    zero-padded to the largest: with mixed ranks, one concatenation and one gather (from a zero row) per
    projection, whatever K, rather than a padding per adapter."""
    downs = [layer.lora_A[name].weight for name in names]  # [r_i, in]
    ups = [layer.lora_B[name].weight for name in names]  # [out, r_i]
    if all(d.shape[0] == plan.rank for d in downs):
        return torch.stack(downs).transpose(1, 2), torch.stack(ups).transpose(1, 2)
    index = _rank_index([d.shape[0] for d in downs], plan.rank, device)
    down = F.pad(torch.cat(downs), (0, 0, 0, 1)).index_select(0, index)  # [K * r, in]
    up = F.pad(torch.cat(ups, dim=1), (0, 1)).index_select(1, index)  # [out, K * r]
    k = len(names)
    return down.view(k, plan.rank, -1).transpose(1, 2), up.view(up.shape[0], k, plan.rank).permute(1, 2, 0)


def backbone_and_head(base: Any) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A causal LM's decoder (the model without its LM head) and its LM head."""
    backbone = base.get_decoder() if hasattr(base, "get_decoder") else base.model
    return backbone, base.get_output_embeddings()


def pad_token_id(trainer: Any) -> int:
    """The pad token of a trainer's tokenizer (or processor's tokenizer); 0 when it has none."""
    tokenizer: Any = getattr(trainer, "processing_class", None)
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None and hasattr(tokenizer, "tokenizer"):  # a processor
        pad = tokenizer.tokenizer.pad_token_id
    return int(pad) if pad is not None else 0


def pad_right(tensor: torch.Tensor, length: int, value: int) -> torch.Tensor:
    """``tensor`` (rows x tokens) padded with ``value`` on the right to ``length`` tokens."""
    return F.pad(tensor, (0, length - tensor.shape[1]), value=value) if tensor.shape[1] < length else tensor


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
