"""A Llama-family decoder as plain functions of its weights: the body of the fused engine's launched pass.

The launched pass (:mod:`optuna_rapidfire._engines._launched`) runs the frozen base and every gang member's
LoRA without going through the model's modules: :func:`decoder_layer` computes one decoder layer from
tensors only (the hidden states, the rotary tables, the layer's base weights, the gang's slot storage for
the layer's projections, the pass's unit layout and dropout keys), with no Python control flow that depends
on data. So ``torch.compile`` can capture it whole (``fullgraph``), once for every layer of the model (they
have the same shapes) and for every gang of the same layout (whose members only change the tensors' values).

It computes what the model's own forward computes (the pre-norm layer of Llama, Mistral, Qwen2 and Qwen3:
RMSNorm, rotary attention with grouped KV heads, SiLU-gated MLP, residuals), with each projection's LoRA
update added to its rows: the rows of a pass are laid out as units of equal row count, each unit one
member's, so a projection's update is two batched products over the units, ``x @ A.T @ B.T`` with each
unit's own ``A`` and ``B`` gathered from the slots (padded ranks add zeros), added onto the base output as a
contiguous view (no gather of activations, no indexed add). Attention is causal with no mask: the engine
pads rows on the right only, so no real token attends to padding. :class:`Decoder` says whether a model is
of this family and holds its layers' weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.nn.functional as F

from optuna_rapidfire._fused._dropout import dropped

if TYPE_CHECKING:
    from collections.abc import Sequence

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The LoRA-adaptable projections of a decoder layer, in the order :func:`decoder_layer` takes them."""

_LAYERS = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer")


@dataclass(frozen=True)
class Shape:
    """What every layer of the model shares: heads, KV heads, head size, RMSNorm epsilon, attention scaling,
    and whether the heads share KV heads (a bool of its own: the compiler may make the counts symbolic, and
    attention takes a plain bool)."""

    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    scaling: float
    gqa: bool = False


class LayerWeights(NamedTuple):
    """One decoder layer's frozen weights (``None`` where the model has no such tensor)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    weights: tuple[torch.Tensor, ...]  # the projections' weights, in PROJECTIONS order
    biases: tuple[torch.Tensor | None, ...]


class Lora(NamedTuple):
    """One projection's LoRA for a pass: every slot's ``A`` ``[slots, r, in]``, ``B`` transposed
    ``[slots, r, out]`` and scaling ``[slots]``."""

    a: torch.Tensor
    b: torch.Tensor
    scale: torch.Tensor


class Rows(NamedTuple):
    """A pass's row layout: the slot of each unit (int64 ``[units]``, each unit ``rows / units`` consecutive
    rows of one member) and, when any member drops, each row's dropout key (int64) and probability, the
    token positions' keys and each projection's input features' keys (:mod:`~optuna_rapidfire._engines.
    _dropout`)."""

    units: torch.Tensor
    keys: torch.Tensor | None = None
    drop: torch.Tensor | None = None
    tokens: torch.Tensor | None = None
    features: tuple[torch.Tensor, ...] | None = None


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as the model computes it: in float32, rounded to the input's dtype, then scaled."""
    hidden = x.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hidden.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _project(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    lora: Lora | None,
    rows: Rows,
    salts: torch.Tensor,
    index: int,
) -> torch.Tensor:
    """The base projection of ``x`` (``[rows, tokens, in]``) plus each unit's LoRA update on its rows
    (projection ``index`` of :data:`PROJECTIONS`)."""
    out = F.linear(x, weight, bias)
    if lora is None:
        return out
    units = rows.units
    if rows.keys is not None and rows.drop is not None and rows.tokens is not None and rows.features is not None:
        x = dropped(x, rows.keys, salts[index], rows.drop, rows.tokens, rows.features[index])
    # Transposed before the gather: Inductor (torch 2.13, CPU) scatters a one-unit gather's gradient with the
    # wrong strides when the transpose comes after it.
    a = lora.a.transpose(1, 2).index_select(0, units)  # [units, in, r]
    b = lora.b.index_select(0, units) * lora.scale.index_select(0, units)[:, None, None]  # [units, r, out]
    hidden = torch.bmm(x.reshape(units.shape[0], -1, x.shape[-1]), a)
    update = torch.bmm(hidden, b)
    return out + update.reshape(out.shape).to(out.dtype)


def decoder_layer(
    h: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    weights: LayerWeights,
    loras: tuple[Lora | None, ...],
    rows: Rows,
    salts: torch.Tensor,
    shape: Shape,
) -> torch.Tensor:
    """One pre-norm decoder layer over ``h`` (``[rows, tokens, hidden]``) with each projection's LoRA.

    Args:
        h: The hidden states entering the layer.
        cos: Rotary table ``[1, tokens, head_dim]`` (the model's own rotary embedding).
        sin: Likewise.
        weights: The layer's frozen weights.
        loras: Per projection (:data:`PROJECTIONS` order), its slots, or ``None`` where no member adapts it.
        rows: The pass's units and dropout keys.
        salts: Each projection's dropout salt (int64 ``[7]``).
        shape: Heads, head size, epsilon, scaling.
    """
    count, tokens, _ = h.shape
    x = _rms(h, weights.input_norm, shape.eps)
    w, b = weights.weights, weights.biases
    q = _project(x, w[0], b[0], loras[0], rows, salts, 0).view(count, tokens, shape.heads, shape.head_dim)
    k = _project(x, w[1], b[1], loras[1], rows, salts, 1).view(count, tokens, shape.kv_heads, shape.head_dim)
    v = _project(x, w[2], b[2], loras[2], rows, salts, 2).view(count, tokens, shape.kv_heads, shape.head_dim)
    if weights.q_norm is not None and weights.k_norm is not None:
        q, k = _rms(q, weights.q_norm, shape.eps), _rms(k, weights.k_norm, shape.eps)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    cos_, sin_ = cos.unsqueeze(1), sin.unsqueeze(1)
    q = q * cos_ + _rotate_half(q) * sin_
    k = k * cos_ + _rotate_half(k) * sin_
    attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=shape.scaling, enable_gqa=shape.gqa)
    attended = attended.transpose(1, 2).reshape(count, tokens, shape.heads * shape.head_dim)
    h = h + _project(attended, w[3], b[3], loras[3], rows, salts, 3)
    x = _rms(h, weights.post_norm, shape.eps)
    gate = _project(x, w[4], b[4], loras[4], rows, salts, 4)
    up = _project(x, w[5], b[5], loras[5], rows, salts, 5)
    return h + _project(F.silu(gate) * up, w[6], b[6], loras[6], rows, salts, 6)


class Decoder:
    """A supported causal LM's parts for the launched pass: embedding, rotary embedding, final norm, and each
    layer's weights. :meth:`refusal` says why a model is not supported."""

    def __init__(self, model: Any) -> None:
        body = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        self.model = model
        self.embed = body.embed_tokens
        self.rotary = body.rotary_emb
        self.norm = body.norm
        first = body.layers[0]
        attention = first.self_attn
        self.shape = Shape(
            heads=int(model.config.num_attention_heads),
            kv_heads=int(model.config.num_key_value_heads),
            gqa=int(model.config.num_key_value_heads) != int(model.config.num_attention_heads),
            head_dim=int(attention.head_dim),
            eps=float(first.input_layernorm.variance_epsilon),
            scaling=float(attention.scaling),
        )
        self.layers = [_weights(layer) for layer in body.layers]
        self.sliding_windows = [getattr(layer.self_attn, "sliding_window", None) for layer in body.layers]
        self._tables: dict[tuple[int, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    @staticmethod
    def refusal(model: Any) -> str | None:
        """Why the launched pass cannot run ``model`` (``None``: it can)."""
        body = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
        layers = getattr(body, "layers", None)
        if body is None or not layers or not all(hasattr(body, a) for a in ("embed_tokens", "rotary_emb", "norm")):
            return f"{type(model).__name__} is not a decoder the launched pass knows"
        names = {type(layer).__name__ for layer in layers}
        if not names <= set(_LAYERS):
            return f"its layers are {sorted(names)} (the launched pass computes {', '.join(_LAYERS)})"
        config = model.config
        if getattr(config, "hidden_act", "silu") != "silu":
            return f"its activation is {config.hidden_act!r} (the launched pass computes SiLU)"
        if float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0:
            return "its attention has dropout"
        if int(getattr(config, "pretraining_tp", 1) or 1) > 1:
            return "it splits its projections (pretraining_tp > 1)"
        for layer in layers:
            for module in (*_projections(layer), layer.input_layernorm, layer.post_attention_layernorm):
                base = getattr(module, "base_layer", module)
                if type(base) not in (torch.nn.Linear,) and not hasattr(base, "variance_epsilon"):
                    return f"its layer {type(base).__name__} is not a plain Linear (quantized?)"
        return None

    def tables(self, tokens: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary ``cos`` and ``sin`` for positions ``0..tokens-1`` (cached)."""
        key = (tokens, dtype)
        found = self._tables.get(key)
        if found is None:
            positions = torch.arange(tokens, device=device)[None]
            probe = torch.empty(1, tokens, 1, dtype=dtype, device=device)
            with torch.no_grad():
                cos, sin = self.rotary(probe, positions)
            found = self._tables[key] = (cos, sin)
        return found

    def feature_widths(self) -> list[int]:
        """Each projection's input width (:data:`PROJECTIONS` order)."""
        return [int(weight.shape[1]) for weight in self.layers[0].weights]

    def window_refusal(self, tokens: int) -> str | None:
        """Why rows of ``tokens`` tokens cannot take the launched pass (a sliding window shorter than them)."""
        windows = [w for w in self.sliding_windows if w is not None and w < tokens]
        return f"its sliding attention window ({windows[0]}) is shorter than the rows ({tokens})" if windows else None


def _projections(layer: Any) -> list[Any]:
    attention, mlp = layer.self_attn, layer.mlp
    return [getattr(attention if name in PROJECTIONS[:4] else mlp, name) for name in PROJECTIONS]


def _weights(layer: Any) -> LayerWeights:
    bases = [getattr(m, "base_layer", m) for m in _projections(layer)]
    attention = layer.self_attn
    q_norm, k_norm = getattr(attention, "q_norm", None), getattr(attention, "k_norm", None)
    return LayerWeights(
        input_norm=layer.input_layernorm.weight,
        post_norm=layer.post_attention_layernorm.weight,
        q_norm=None if q_norm is None else q_norm.weight,
        k_norm=None if k_norm is None else k_norm.weight,
        weights=tuple(base.weight for base in bases),
        biases=tuple(base.bias for base in bases),
    )


def projection_of(name: str) -> tuple[int, str] | None:
    """``(layer, projection)`` of a LoRA layer's module name (``model.layers.3.self_attn.q_proj``), or ``None``
    when the name is not one of a decoder layer's projections."""
    parts = name.split(".")
    if len(parts) < 3 or parts[-1] not in PROJECTIONS:
        return None
    for i in range(len(parts) - 1):
        if parts[i] == "layers" and parts[i + 1].isdigit():
            return int(parts[i + 1]), parts[-1]
    return None


def salts_of(layers: int, names: Sequence[tuple[int, str]], salts: Sequence[int]) -> list[list[int]]:
    """Each layer's seven projection salts (0 where a projection has no LoRA layer)."""
    table = [[0] * len(PROJECTIONS) for _ in range(layers)]
    for (layer, projection), salt in zip(names, salts, strict=True):
        table[layer][PROJECTIONS.index(projection)] = salt
    return table
