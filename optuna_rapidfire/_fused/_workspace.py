"""The launched decode's workspace: static buffers of one decode shape, and which decoders it knows.

See :mod:`~optuna_rapidfire._fused._launched_decode`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from optuna_rapidfire._fused._sampling import Sampling

if TYPE_CHECKING:
    from collections.abc import Sequence

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def supports(lm: Any) -> str | None:
    """Why the launched decode cannot run ``lm`` (``None``: it can).

    It needs a Llama-layout decoder (``model.layers[i]`` with ``self_attn.{q,k,v,o}_proj``, ``mlp.{gate,
    up,down}_proj``, two RMS norms, ``model.rotary_emb``) and full attention on every layer.
    """
    model = getattr(lm, "model", None)
    layers = getattr(model, "layers", None)
    if model is None or layers is None or not hasattr(model, "rotary_emb") or not hasattr(model, "norm"):
        return f"{type(lm).__name__} has no Llama-layout decoder"
    for layer in layers:
        attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attention is None or mlp is None or not hasattr(layer, "post_attention_layernorm"):
            return f"{type(lm).__name__}'s layers are not Llama-layout"
        if any(not hasattr(attention if name in PROJECTIONS[:4] else mlp, name) for name in PROJECTIONS):
            return f"{type(lm).__name__}'s layers miss a projection of {PROJECTIONS}"
        if getattr(attention, "sliding_window", None) is not None or hasattr(attention, "q_norm"):
            return f"{type(lm).__name__} uses sliding-window attention or query/key norms"
    return None


def projection(layer: Any, name: str) -> Any:
    owner = layer.self_attn if name in PROJECTIONS[:4] else layer.mlp
    return getattr(owner, name)


@dataclass(frozen=True)
class Shape:
    """What a workspace's graph is built for: slots, rows per slot, KV columns, output columns, the largest
    rank, the targeted projections and which sampling stages run."""

    slots: int
    rows: int
    columns: int
    rank: int
    targets: tuple[tuple[int, str], ...]
    stages: tuple[bool, bool, bool, bool, bool]  # sample, top-k, top-p, min-p, repetition penalty
    dtype: torch.dtype
    eos: int  # EOS ids per row (padded with -1)


class Workspace:
    """Static buffers of one decode shape, and the graph of its step once captured."""

    def __init__(self, lm: Any, shape: Shape, device: torch.device, vocab: int) -> None:
        config, rows = lm.config, shape.slots * shape.rows
        attention = lm.model.layers[0].self_attn
        heads = config.num_key_value_heads
        head_dim = getattr(attention, "head_dim", config.hidden_size // config.num_attention_heads)
        self.shape, self.device, self.vocab = shape, device, vocab
        cache = (rows, heads, shape.columns, head_dim)
        self.keys = [torch.zeros(cache, dtype=shape.dtype, device=device) for _ in lm.model.layers]
        self.values = [torch.zeros(cache, dtype=shape.dtype, device=device) for _ in lm.model.layers]
        # Each targeted projection's A (times the slot's scaling) and B of every slot, as PEFT lays them out
        # ([r, in] and [out, r]), zero-padded to the largest rank.
        self.down: dict[tuple[int, str], torch.Tensor] = {}
        self.up: dict[tuple[int, str], torch.Tensor] = {}
        for index, name in shape.targets:
            base = projection(lm.model.layers[index], name).base_layer
            self.down[index, name] = torch.zeros(
                shape.slots, shape.rank, base.in_features, dtype=shape.dtype, device=device
            )
            self.up[index, name] = torch.zeros(
                shape.slots, base.out_features, shape.rank, dtype=shape.dtype, device=device
            )

        def new(*size: int, dtype: torch.dtype = torch.long, fill: float = 0) -> torch.Tensor:
            return torch.full(size, fill, dtype=dtype, device=device)

        self.token, self.position = new(rows), new(rows)
        self.column, self.step = new(1), new(1)
        self.valid = new(rows, shape.columns, dtype=torch.bool)
        self.done = new(rows, dtype=torch.bool)
        self.out, self.lengths = new(rows, shape.columns), new(rows)
        self.max_new, self.eos = new(rows), new(rows, max(shape.eos, 1), fill=-1)
        self.noise = new(rows, vocab, dtype=torch.float32, fill=1.0)
        self.logits = new(rows, vocab, dtype=torch.float32)
        self.seen = new(rows, vocab, dtype=torch.bool) if shape.stages[4] else None
        self.samples = new(rows, dtype=torch.bool)
        floats = [new(rows, dtype=torch.float32) for _ in range(4)]
        self.sampling = Sampling(floats[0], new(rows), floats[1], floats[2], floats[3])
        self.pad = new(1)
        self.graph: torch.cuda.CUDAGraph | None = None

    def load(self, lm: Any, names: Sequence[str | None]) -> None:
        """Copy the slots' adapters in (``None``: an idle slot, zeros), each A times its scaling (so that a step
        need not scale): one multi-tensor product and one multi-tensor copy, whatever K."""
        downs: list[torch.Tensor] = []
        scalings: list[float] = []
        ups: list[torch.Tensor] = []
        targets: list[torch.Tensor] = []
        up_targets: list[torch.Tensor] = []
        for (index, name), down in self.down.items():
            layer, up = projection(lm.model.layers[index], name), self.up[index, name]
            for slot, adapter in enumerate(names):
                if adapter is None or adapter not in layer.lora_A:
                    down[slot].zero_()
                    up[slot].zero_()
                    continue
                a, b = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight  # [r, in], [out, r]
                rank = a.shape[0]
                if rank < self.shape.rank:
                    down[slot].zero_()
                    up[slot].zero_()
                downs.append(a)
                scalings.append(float(layer.scaling[adapter]))
                ups.append(b)
                targets.append(down[slot, :rank])
                up_targets.append(up[slot, :, :rank])
        if downs:
            with torch.no_grad():
                torch._foreach_copy_(targets + up_targets, [*torch._foreach_mul(downs, scalings), *ups])
