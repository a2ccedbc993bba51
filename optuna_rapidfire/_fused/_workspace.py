"""The launched decode's workspace: static buffers of one decode shape, and which decoders it knows.

See :mod:`~optuna_rapidfire._fused._launched_decode`.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, cast

import torch

from optuna_rapidfire._fused._sampling import Sampling
from optuna_rapidfire._logging import get_logger

if TYPE_CHECKING:
    from collections.abc import Sequence

_logger = get_logger(__name__)

_KEPT = 6
"""Workspaces kept per model for later decodes of their shapes (least recently used dropped first)."""
_KEPT_SHARE = 0.1
"""The share of a GPU's memory that the workspaces kept idle may take (the one in use aside)."""
_CPU_KEPT_BYTES = 2**31
"""What the workspaces kept idle may take on a CPU."""
_WORKSPACES: weakref.WeakKeyDictionary[torch.nn.Module, OrderedDict[Shape, Workspace]] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()  # over _WORKSPACES: each device's worker decodes in a thread of its own

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
        self._loading: _Loading | None = None  # what the last load copied (reused for the same adapters)
        tensors = [*self.keys, *self.values, *self.down.values(), *self.up.values()]
        tensors += [getattr(self.sampling, field.name) for field in fields(self.sampling)]
        tensors += [value for value in vars(self).values() if isinstance(value, torch.Tensor)]
        self.nbytes = sum(tensor.nbytes for tensor in tensors)
        """The device memory the workspace's buffers take (its captured graph's own memory pool aside)."""

    def load(self, lm: Any, names: Sequence[str | None]) -> None:
        """Copy the slots' adapters in (``None``: an idle slot, zeros), each A times its scaling (so that a step
        need not scale): one multi-tensor product and one multi-tensor copy, whatever K.

        What to copy where is found once for the slots' adapters (:class:`_Loading`: a walk of every targeted
        projection and slot, some 500 module lookups for a gang of 8 on 64 projections, ~8 ms of host time on an
        H100 host) and reused while those adapters are the same modules; what must be zero is zeroed when it is found
        (only the loads of one set of adapters write the workspace meanwhile, never into those parts)."""
        key = tuple(names)
        loading = self._loading
        if loading is None or loading.names != key or not loading.current():
            loading = self._loading = _Loading.of(self, lm, key)
            if loading.zeros:
                torch._foreach_zero_(loading.zeros)
        downs, ups = loading.weights()
        if downs:
            with torch.no_grad():
                torch._foreach_copy_(loading.targets, [*torch._foreach_mul(downs, loading.scalings), *ups])


@dataclass
class _Loading:
    """What :meth:`Workspace.load` copies for the adapters ``names`` (one per slot): each adapter's A and B
    (weak references: a deleted adapter's weights are not kept alive here), its scaling, the workspace's views
    they go to (A's then B's), and the slot buffers that stay zero (idle slots, projections an adapter does not
    target, the columns past an adapter's rank). ``anchors``: per slot, its adapter's first A module, to tell
    an adapter rebuilt under the same name."""

    names: tuple[str | None, ...]
    downs: list[weakref.ref[torch.Tensor]]
    ups: list[weakref.ref[torch.Tensor]]
    scalings: list[float]
    targets: list[torch.Tensor]
    zeros: list[torch.Tensor]
    anchors: list[tuple[Any, str, weakref.ref[Any]]]

    @classmethod
    def of(cls, space: Workspace, lm: Any, names: tuple[str | None, ...]) -> _Loading:
        downs: list[weakref.ref[torch.Tensor]] = []
        ups: list[weakref.ref[torch.Tensor]] = []
        scalings: list[float] = []
        down_targets: list[torch.Tensor] = []
        up_targets: list[torch.Tensor] = []
        zeros: list[torch.Tensor] = []
        anchors: dict[int, tuple[Any, str, weakref.ref[Any]]] = {}
        for (index, name), down in space.down.items():
            layer, up = projection(lm.model.layers[index], name), space.up[index, name]
            for slot, adapter in enumerate(names):
                if adapter is None or adapter not in layer.lora_A:
                    zeros += [down[slot], up[slot]]
                    continue
                module = layer.lora_A[adapter]
                anchors.setdefault(slot, (layer.lora_A, adapter, weakref.ref(module)))
                a, b = module.weight, layer.lora_B[adapter].weight  # [r, in], [out, r]
                rank = a.shape[0]
                if rank < space.shape.rank:
                    zeros += [down[slot, rank:], up[slot, :, rank:]]
                downs.append(weakref.ref(a))
                ups.append(weakref.ref(b))
                scalings.append(float(layer.scaling[adapter]))
                down_targets.append(down[slot, :rank])
                up_targets.append(up[slot, :, :rank])
        return cls(names, downs, ups, scalings, down_targets + up_targets, zeros, list(anchors.values()))

    def current(self) -> bool:
        """Whether the slots' adapters are still the modules found (none deleted, none rebuilt)."""
        if len(self.anchors) != sum(adapter is not None for adapter in self.names):
            return False  # an adapter targets none of the projections: nothing tells whether it changed
        for modules, adapter, anchor in self.anchors:
            module = anchor()
            if module is None or modules._modules.get(adapter) is not module:
                return False
        return True

    def weights(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        downs, ups = [ref() for ref in self.downs], [ref() for ref in self.ups]
        if any(t is None for t in downs) or any(t is None for t in ups):
            raise RuntimeError("A decode's adapter was deleted while its weights were being loaded.")
        return cast("list[torch.Tensor]", downs), cast("list[torch.Tensor]", ups)


def kept_workspace(model: torch.nn.Module, lm: Any, shape: Shape, device: torch.device, vocab: int) -> Workspace:
    """``model``'s workspace of ``shape``: the one kept from an earlier decode (its graph captured), or a new one.

    Kept workspaces are ``model``'s last :data:`_KEPT` shapes, fewer when the idle ones' buffers would take more
    than :data:`_KEPT_SHARE` of the GPU's memory (per model: the executor keeps one model per device; each
    captured graph's own memory pool is not counted). When a new workspace does not fit in the device's memory,
    every workspace kept on the device is dropped and the allocation tried once more.
    """
    with _LOCK:
        kept = _WORKSPACES.setdefault(model, OrderedDict())
        space = kept.pop(shape, None)
    if space is None or space.device != device:
        space = _new_workspace(lm, shape, device, vocab)
    limit = _kept_bytes(device)
    with _LOCK:
        kept[shape] = space
        while len(kept) > 1 and (len(kept) > _KEPT or sum(w.nbytes for w in kept.values()) - space.nbytes > limit):
            kept.popitem(last=False)
    return space


def drop_workspaces(device: torch.device) -> int:
    """Forget every workspace kept on ``device`` (of every model) and return the GPU's cached memory; how many."""
    dropped = 0
    with _LOCK:  # device workers decode in threads of their own: no other thread adds a model meanwhile
        for kept in list(_WORKSPACES.values()):
            for shape, space in list(kept.items()):
                if space.device == device:
                    kept.pop(shape, None)
                    dropped += 1
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return dropped


def _new_workspace(lm: Any, shape: Shape, device: torch.device, vocab: int) -> Workspace:
    try:
        return Workspace(lm, shape, device, vocab)
    except torch.cuda.OutOfMemoryError:
        dropped = drop_workspaces(device)
        if not dropped:
            raise
        _logger.warning(
            "A decode workspace (%d rows x %d columns) did not fit in %s's memory; dropped the %d kept for "
            "other decode shapes (their graphs are captured again when needed) and trying again.",
            shape.slots * shape.rows,
            shape.columns,
            device,
            dropped,
        )
    return Workspace(lm, shape, device, vocab)  # out of the handler: the failed attempt's buffers are freed


def _kept_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory * _KEPT_SHARE)
    return _CPU_KEPT_BYTES
