"""The launched decode: a gang's decode step as one captured CUDA graph over a static KV cache.

:func:`~optuna_rapidfire._fused._fused_decode.decode` runs here for the decoders this module knows (Llama,
Mistral and Qwen2 layouts with full attention: :func:`~optuna_rapidfire._fused._workspace.supports`). The
HF forward it replaces launches a few thousand small kernels per generated token from Python, and a
dynamic KV cache grows by copies; at a gang's batch the GPU then waits on the host (about 60-150 ms per
step on an H200 for a 1B model, whose weights read in ~0.5 ms). Here, as in vLLM's multi-LoRA decode:

- **A static workspace** per batch shape: a KV cache of ``rows x heads x columns`` per layer, every
  row's state (next token, position, valid key columns, ended, its output) and every adapter's LoRA
  projections stacked as ``[K, in, R]`` and ``[K, R, out]`` (ranks zero-padded to the largest, scalings
  folded in, an adapter that does not target a projection adds zeros). Workspaces are kept per model and
  reused by later decodes of the same shape (weights and state copied in), so their graphs are too: a model's
  last six shapes, fewer when the idle ones' buffers would take over a tenth of the GPU's memory, and all of
  them are dropped when a new workspace does not fit (:func:`~optuna_rapidfire._fused._workspace.kept_workspace`).
- **Per-row adapters without a per-adapter loop**: the rows sit in K slots of S rows (a request's rows,
  then idle rows up to S), so a projection's update is two batched matmuls over a view of its input,
  each slot reading its own adapter's stacked A and B (SGMV, Punica's segmented form).
- **One step = one graph replay**: sampling (HF's processors, vectorised as in
  :func:`~optuna_rapidfire._fused._fused_decode.warp`), the step's bookkeeping and the next forward are
  recorded once per workspace with ``torch.cuda.graph`` and replayed; each request's exponential noise is
  drawn from its own generator into a static buffer before the replay (a request's draws stay its own).
- **No host synchronisation per token**: ended rows are read back every :data:`CHECK_EVERY` steps; a
  request draws every step until a check sees all its rows ended, so its draws (and its generator's
  state after the decode) depend on it alone. When a check finds whole requests ended, the live ones
  move to a workspace of fewer slots (their KV cache and state selected), so a finished request stops
  costing compute.

The prefill runs the same layer code eagerly over each slot's distinct prompts, once each: GRPO repeats every
prompt once per generation, and the rows of one prompt take its KV cache. The prompts are **packed by length**:
sorted, cut into runs where one more pass costs less than the padding it saves (:func:`length_buckets`), and
each run passes alone, left-padded to its own longest prompt only; its prompts may come from any slots, so a
prefill projection gathers each prompt's adapter (BGMV: each row reads its own A and B). Every row's cache
then holds its prompt at the columns left padding to the widest prompt would give it, so the steps (one
shape per workspace, captured once) read every row's columns up to the workspace's width, masked. On a CPU
there is no graph: the step runs eagerly, the same code, which the tests check against HF ``generate``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import sys
from dataclasses import fields
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from optuna_rapidfire._fused._capture import capture_graph
from optuna_rapidfire._fused._fused_pass import attention_kernels
from optuna_rapidfire._fused._norms import rms_norm
from optuna_rapidfire._fused._sampling import DecodeRequest, Sampling, penalize, warp
from optuna_rapidfire._fused._workspace import PROJECTIONS, Shape, Workspace, kept_workspace, projection

if TYPE_CHECKING:
    from collections.abc import Sequence

CHECK_EVERY = 8
"""Steps between two reads of the rows' ended flags (the decode's only host synchronisations)."""

# The KV cache's columns: at least this many, else the next power of two, so that decodes of a study (training
# and evaluation prompts of different widths) share a workspace and its graph (a step reads every column).
_MIN_COLUMNS = 256


class LaunchedDecode:
    """One decode over ``requests`` with the launched step (see the module's docstring)."""

    def __init__(
        self, model: torch.nn.Module, lm: Any, requests: list[DecodeRequest], pad: int, device: torch.device
    ) -> None:
        self.model, self.lm, self.requests, self.pad, self.device = model, lm, requests, pad, device
        self.vocab = lm.get_output_embeddings().weight.shape[0]
        self.autocast = torch.is_autocast_enabled(device.type)
        weight = lm.get_input_embeddings().weight
        self.dtype = torch.get_autocast_dtype(device.type) if self.autocast else weight.dtype
        self.steps = max(r.max_new_tokens for r in requests)
        self.width = max(len(p) for r in requests for p in r.prompts)
        self.rows = max(len(r.prompts) for r in requests)
        layers = lm.model.layers
        self.rope = sys.modules[type(layers[0].self_attn).__module__].apply_rotary_pos_emb
        self.targets = tuple(
            (index, name)
            for index, layer in enumerate(layers)
            for name in PROJECTIONS
            if any(r.adapter in getattr(projection(layer, name), "lora_A", {}) for r in requests)
        )
        rank = 0
        for index, name in self.targets:
            adapters = projection(layers[index], name).lora_A
            rank = max([rank] + [adapters[r.adapter].weight.shape[0] for r in requests if r.adapter in adapters])
        self.rank = rank
        self.layouts: list[list[int]] = []  # the requests in the slots, per layout (a compaction adds one)
        self.prefilled: list[tuple[int, int]] = []  # each prefill pass's prompts and width (a pass per bucket)

    # -- the decode ------------------------------------------------------------------------------

    def run(self) -> list[list[list[int]]]:
        """Each request's completions, one token list per prompt (cut at its length, as the HF path cuts).

        The steps' attention takes PyTorch's default kernels, cuDNN's included: without cuDNN, the H200 decoded
        3.6x slower (0.66 s against 0.18 s for 128 rows of 32 tokens), although cuDNN builds a plan at each
        new shape (the decode that captures a workspace's graph takes about 1 s). The prefill, whose shape
        changes at every decode, does without cuDNN.
        """
        live = list(range(len(self.requests)))
        self.layouts = [list(live)]
        space = self._workspace(len(live))
        self._start(space, live)
        tokens: dict[int, torch.Tensor] = {}
        lengths: dict[int, torch.Tensor] = {}
        ended = [False] * len(self.requests)
        for step in range(self.steps):
            self._draw(space, live, ended, step)
            self._step(space)
            if (step + 1) % CHECK_EVERY and step + 1 < self.steps:
                continue
            done = space.done.view(len(live), self.rows).all(-1).tolist()  # the check: one synchronisation
            for slot, k in enumerate(live):
                ended[k] = done[slot] or step + 1 >= self.requests[k].max_new_tokens
            if all(ended[k] for k in live) or step + 1 >= self.steps:
                break
            if any(ended[k] for k in live):  # whole requests ended: the others move to fewer slots
                keep = [slot for slot, k in enumerate(live) if not ended[k]]
                for slot, k in enumerate(live):
                    if ended[k]:
                        tokens[k], lengths[k] = self._output(space, slot)
                moved = self._workspace(len(keep))
                self._move(space, moved, keep, [live[slot] for slot in keep])
                space, live = moved, [live[slot] for slot in keep]
                self.layouts.append(list(live))
        for slot, k in enumerate(live):
            tokens[k], lengths[k] = self._output(space, slot)
        out = []
        for k, request in enumerate(self.requests):
            rows, counts = tokens[k].tolist(), lengths[k].tolist()
            out.append([rows[j][: counts[j]] for j in range(len(request.prompts))])
        return out

    def _output(self, space: Workspace, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = slice(slot * self.rows, (slot + 1) * self.rows)
        return space.out[rows, : self.steps].clone(), space.lengths[rows].clone()

    def _workspace(self, slots: int) -> Workspace:
        """The model's workspace of this decode's shape with ``slots`` slots (made, or reused)."""
        columns = max(_MIN_COLUMNS, 2 ** math.ceil(math.log2(self.width + self.steps)))
        chosen = self.requests
        stages = (
            any(r.do_sample for r in chosen),
            any(r.do_sample and r.top_k for r in chosen),
            any(r.do_sample and r.top_p < 1 for r in chosen),
            any(r.do_sample and r.min_p for r in chosen),
            any(r.repetition_penalty != 1.0 for r in chosen),
        )
        eos = max(len(r.eos_token_ids) for r in chosen)
        shape = Shape(slots, self.rows, columns, self.rank, self.targets, stages, self.dtype, eos)
        return kept_workspace(self.model, self.lm, shape, self.device, self.vocab)

    def _start(self, space: Workspace, live: list[int]) -> None:
        """Fill the workspace with the requests' rows and run the prefill (its logits for the first step)."""
        requests, rows, width, device = [self.requests[k] for k in live], self.rows, self.width, self.device
        space.load(self.lm, [r.adapter for r in requests])
        prompts, real = [], []
        for r in requests:
            for j in range(rows):
                real.append(j < len(r.prompts))
                prompts.append(r.prompts[j] if j < len(r.prompts) else [self.pad])  # an idle row
        ids, mask = left_padded(prompts, width, self.pad, device)
        real_rows = torch.tensor(real, device=device)
        # A reused workspace's cache holds an earlier decode's keys and values; masked columns still enter the
        # attention's products (with weight 0), so a non-finite value left there would spread: zeros instead.
        torch._foreach_zero_(space.keys + space.values)
        space.valid.zero_()
        space.valid[:, :width].copy_(mask)
        space.done.copy_(~real_rows)
        space.out.fill_(self.pad)
        space.lengths.zero_()
        space.pad.fill_(self.pad)
        space.max_new.copy_(torch.tensor([r.max_new_tokens for r in requests for _ in range(rows)], device=device))
        eos = space.eos.shape[1]
        space.eos.copy_(
            torch.tensor(
                [list(r.eos_token_ids) + [-1] * (eos - len(r.eos_token_ids)) for r in requests for _ in range(rows)],
                device=device,
            )
        )
        space.samples.copy_(torch.tensor([r.do_sample for r in requests for _ in range(rows)], device=device))
        padded = [r if len(r.prompts) == rows else _padded(r, rows) for r in requests]
        _copy_sampling(space.sampling, Sampling.of(padded, self.vocab, device))
        space.noise.fill_(1.0)
        _prefill(self, space, requests, width)
        if space.seen is not None:
            pointed = ids.clamp(max=self.vocab).masked_fill(~mask, self.vocab)
            seen = torch.zeros(len(prompts), self.vocab + 1, dtype=torch.bool, device=device).scatter_(1, pointed, True)
            space.seen.copy_(seen[:, : self.vocab])
        space.token.copy_(ids[:, -1])
        space.position.copy_(mask.sum(-1))
        space.column.fill_(width)
        space.step.zero_()

    def _move(self, source: Workspace, target: Workspace, slots: list[int], live: list[int]) -> None:
        """Carry the rows of ``slots`` (of ``source``) into ``target``, in order: the next slots' layout."""
        rows = self.rows
        index = torch.tensor([s * rows + j for s in slots for j in range(rows)], device=self.device)
        target.load(self.lm, [self.requests[k].adapter for k in live])
        for mine, theirs in ((target.keys, source.keys), (target.values, source.values)):
            for a, b in zip(mine, theirs, strict=True):
                a.copy_(b.index_select(0, index))
        for name in ("token", "position", "valid", "done", "out", "lengths", "max_new", "eos", "samples", "logits"):
            getattr(target, name).copy_(getattr(source, name).index_select(0, index))
        if target.seen is not None and source.seen is not None:
            target.seen.copy_(source.seen.index_select(0, index))
        _copy_sampling(target.sampling, source.sampling.select(index))
        target.noise.fill_(1.0)
        target.pad.copy_(source.pad)
        target.column.copy_(source.column)
        target.step.copy_(source.step)

    def _draw(self, space: Workspace, live: list[int], ended: list[bool], step: int) -> None:
        """Each sampling request still going draws its rows' exponential noise for this step."""
        if not space.shape.stages[0]:
            return
        for slot, k in enumerate(live):
            request = self.requests[k]
            if request.do_sample and not ended[k] and step < request.max_new_tokens:
                start = slot * self.rows
                space.noise[start : start + len(request.prompts)].exponential_(generator=request.generator)

    def _step(self, space: Workspace) -> None:
        """One step: a replay of the captured graph on CUDA (captured at the workspace's first step)."""
        if self.device.type != "cuda":
            self._body(space)
            return
        if space.graph is None:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self._body(space)  # the step itself, and the warm-up the capture needs
            torch.cuda.current_stream(self.device).wait_stream(side)
            with _autocast(self):
                space.graph, _ = capture_graph(lambda: self._body(space))
            return
        space.graph.replay()

    # -- the step's code (captured) --------------------------------------------------------------

    def _body(self, space: Workspace) -> None:
        """Sample from the logits, record the tokens, then the next forward: device work only."""
        sample, top_k, top_p, min_p, _ = space.shape.stages
        scores = penalize(space.logits, space.seen, space.sampling.penalty)
        token = scores.argmax(dim=-1)
        if sample:
            warped = warp(scores, space.sampling, top_k=top_k, top_p=top_p, min_p=min_p)
            drawn = (warped.softmax(dim=-1) / space.noise).argmax(dim=-1)
            token = torch.where(space.samples, drawn, token)
        if space.seen is not None:
            space.seen.scatter_(1, token[:, None], True)
        token = torch.where(space.done, space.pad, token)
        space.out.index_copy_(1, space.step, token[:, None])
        space.lengths.add_((~space.done).long())
        ended = (token[:, None] == space.eos).any(-1) | (space.max_new <= space.step + 1)
        space.done.logical_or_(ended)
        space.token.copy_(token)
        space.valid.index_fill_(1, space.column, True)
        hidden = self._layers(space, token[:, None], space.position[:, None], space.column, space.valid[:, None, None])
        space.logits.copy_(self._head(hidden[:, -1]))
        space.position.add_(1)
        space.column.add_(1)
        space.step.add_(1)

    def _layers(
        self,
        space: Workspace,
        ids: torch.Tensor,
        positions: torch.Tensor,
        columns: torch.Tensor,
        mask: torch.Tensor,
        prefill: _Fill | None = None,
    ) -> torch.Tensor:
        """The decoder over ``ids`` (rows x tokens) at ``positions``, writing the KV cache at ``columns``;
        ``mask``: which cache columns each query sees (rows x 1 x tokens x columns). ``prefill``: ``ids`` are
        distinct prompts of any slots, which see their own tokens only (``mask`` is rows x 1 x tokens x
        tokens); ``prefill`` names their slots and which batch rows take which prompt's cache."""
        lm = self.lm
        hidden = lm.model.embed_tokens(ids)
        cos, sin = lm.model.rotary_emb(hidden, positions)
        for index, layer in enumerate(lm.model.layers):
            attention = layer.self_attn
            normed = rms_norm(layer.input_layernorm, hidden)
            shape = (*normed.shape[:-1], -1, attention.head_dim)
            slots = None if prefill is None else prefill.slots
            q = _adapted(space, layer, index, "q_proj", normed, self.autocast, slots).view(shape).transpose(1, 2)
            k = _adapted(space, layer, index, "k_proj", normed, self.autocast, slots).view(shape).transpose(1, 2)
            v = _adapted(space, layer, index, "v_proj", normed, self.autocast, slots).view(shape).transpose(1, 2)
            q, k = self.rope(q, k, cos, sin)
            k, v = k.to(space.shape.dtype), v.to(space.shape.dtype)
            if prefill is not None:  # the prompts attend to themselves; every row's cache takes its prompt's
                for cache, new in ((space.keys[index], k), (space.values[index], v)):
                    cache[:, :, prefill.columns].index_copy_(0, prefill.rows, new.index_select(0, prefill.prompts))
                groups = q.shape[1] // k.shape[1]  # heads repeated, for the kernels that take a mask
                keys, values = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            else:
                space.keys[index].index_copy_(2, columns, k)
                space.values[index].index_copy_(2, columns, v)
                keys, values = space.keys[index], space.values[index]
            attended = F.scaled_dot_product_attention(
                q.to(keys.dtype),
                keys,
                values,
                attn_mask=mask,
                scale=attention.scaling,
                enable_gqa=keys.shape[1] != q.shape[1],
            )
            attended = attended.transpose(1, 2).reshape(*normed.shape[:-1], -1)
            hidden = hidden + _adapted(space, layer, index, "o_proj", attended, self.autocast, slots)
            normed = rms_norm(layer.post_attention_layernorm, hidden)
            mlp = layer.mlp
            gated = mlp.act_fn(_adapted(space, layer, index, "gate_proj", normed, self.autocast, slots))
            inner = gated * _adapted(space, layer, index, "up_proj", normed, self.autocast, slots)
            hidden = hidden + _adapted(space, layer, index, "down_proj", inner, self.autocast, slots)
        return rms_norm(lm.model.norm, hidden)

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm.get_output_embeddings()(hidden).float()


def _prefill(decode: LaunchedDecode, space: Workspace, requests: list[DecodeRequest], width: int) -> None:
    """Run each slot's distinct prompts once (GRPO repeats each prompt once per generation), packed by length:
    prompts of similar lengths pass together (:func:`length_buckets`), each pass left-padded to its own
    longest prompt only. Every row takes its prompt's KV cache (at the columns before ``width``, as left
    padding to the widest prompt would put them) and its last logits."""
    prompts: list[list[int]] = []  # the distinct prompts of all slots
    slot_of: list[int] = []
    spread: list[int] = []  # each row's prompt (idle rows: their slot's first)
    for slot, r in enumerate(requests):
        own: dict[tuple[int, ...], int] = {}
        for prompt in r.prompts:
            own.setdefault(tuple(prompt), len(prompts) + len(own))
        spread += [own[tuple(p)] for p in r.prompts] + [len(prompts)] * (decode.rows - len(r.prompts))
        prompts += [list(p) for p in own]
        slot_of += [slot] * len(own)
    device, logits = decode.device, torch.empty(len(prompts), decode.vocab, device=decode.device)
    rows_of = torch.tensor(spread, device=device)
    for bucket in length_buckets([len(p) for p in prompts], _BUCKET_TOKENS):
        chosen = [prompts[i] for i in bucket]
        wide = max(len(p) for p in chosen)
        ids, mask = left_padded(chosen, wide, decode.pad, device)
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
        columns = torch.arange(wide, device=device)
        # Causal over the real tokens; a padding query sees itself (no row of the mask is empty).
        see = (columns[None, :] <= columns[:, None])[None] & mask[:, None, :]
        see |= torch.eye(wide, dtype=torch.bool, device=device)[None]
        position = {prompt: at for at, prompt in enumerate(bucket)}
        takers = [row for row, prompt in enumerate(spread) if prompt in position]
        fill = _Fill(
            torch.tensor(takers, device=device),
            torch.tensor([position[spread[row]] for row in takers], device=device),
            torch.tensor([slot_of[i] for i in bucket], device=device),
            slice(width - wide, width),
        )
        decode.prefilled.append((len(bucket), wide))
        # A prefill's shape changes at every decode (its prompts' widths): no cuDNN, which plans per new shape
        # (1.4 s of a GRPO study's 25 gang decodes on the H200); the steps keep it (one shape, captured once).
        with attention_kernels():
            hidden = decode._layers(space, ids, positions, columns, see[:, None], prefill=fill)
        logits.index_copy_(0, torch.tensor(bucket, device=device), decode._head(hidden[:, -1]))
    space.logits.copy_(logits.index_select(0, rows_of))


def _adapted(
    space: Workspace,
    layer: Any,
    index: int,
    name: str,
    x: torch.Tensor,
    autocast: bool,
    slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """A projection's frozen base on every row, plus each row's adapter update: the rows of ``x`` lie in the
    workspace's slots, S rows each (SGMV), or, given ``slots`` (each row's slot), in any order (BGMV: each row
    gathers its slot's A and B)."""
    module = projection(layer, name)
    down = space.down.get((index, name))
    if down is None:
        return module.base_layer(x) if hasattr(module, "base_layer") else module(x)
    result = module.base_layer(x)
    up = space.up[index, name]
    if slots is not None:
        down, up = down.index_select(0, slots), up.index_select(0, slots)
    groups = down.shape[0]
    stacked = x.reshape(groups, -1, x.shape[-1])
    if not autocast:
        stacked = stacked.to(down.dtype)
    # Each group's rows through its own A (scaled when loaded), then its own B, added to the base's output in
    # the same product (PEFT computes B(A(x)) * scaling): three kernels per projection, with the base's.
    hidden = torch.bmm(stacked, down.transpose(1, 2))
    up = up.transpose(1, 2)
    if autocast or result.dtype == up.dtype:
        return torch.baddbmm(result.view(groups, -1, result.shape[-1]), hidden, up).view(result.shape)
    return result + torch.bmm(hidden, up).view(result.shape).to(result.dtype)


@dataclasses.dataclass(frozen=True)
class _Fill:
    """A packed prefill pass: the batch ``rows`` that take the cache of the pass's prompt ``prompts`` names
    (one per row), each prompt's slot, and the cache ``columns`` the pass's width fills (ending at the decode's
    prompt width, as left padding puts every prompt)."""

    rows: torch.Tensor
    prompts: torch.Tensor
    slots: torch.Tensor
    columns: slice


_BUCKET_TOKENS = 4096
"""What one more prefill pass costs, in padded prompt tokens. Measured on an H200 with a 1B Llama shape
(``python -m benchmarks.decode_profile``, its packing cases): an eager prefill pass costs about 19 ms
besides its tokens, a prompt token about 8 us, so a pass pays off once it saves ~2,300 tokens of padding;
4,096 keeps GSM8K-like prompts (35-140 tokens) in one pass and splits prompts 4-16x longer than the
others into 2-3 passes (1.4-3.2x faster prefills than one pass padded to the longest)."""


def length_buckets(lengths: Sequence[int], pass_tokens: int) -> list[list[int]]:
    """Which prompts (indices into ``lengths``) to prefill together: prompts sorted by length, cut into runs
    where the tokens computed (each run's prompts times its longest, padding included) plus ``pass_tokens``
    per run are fewest (exact, by dynamic programming over the distinct lengths: a cut between prompts of
    one length never helps)."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    ends = [at + 1 for at in range(len(order)) if at + 1 == len(order) or lengths[order[at + 1]] != lengths[order[at]]]
    best: list[float] = [0.0] + [math.inf] * len(ends)  # best[i]: the fewest tokens up to the i-th distinct length
    cut = [0] * (len(ends) + 1)
    for i, end in enumerate(ends, 1):
        widest = lengths[order[end - 1]]
        for j in range(i):
            cost = best[j] + (end - (ends[j - 1] if j else 0)) * widest + pass_tokens
            if cost < best[i]:
                best[i], cut[i] = cost, j
    runs: list[list[int]] = []
    i = len(ends)
    while i:
        start = ends[cut[i] - 1] if cut[i] else 0
        runs.append(order[start : ends[i - 1]])
        i = cut[i]
    return runs[::-1]


def left_padded(
    prompts: Sequence[Sequence[int]], width: int, pad: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``prompts`` left-padded with ``pad`` to ``width`` columns (rows x width), and where the tokens are (a boolean
    mask): built in NumPy, a copy each to the device (nested lists through ``torch.tensor`` took ~4 ms a gang decode
    of 128 rows)."""
    lengths = np.fromiter((len(p) for p in prompts), dtype=np.int64, count=len(prompts))
    mask = np.arange(width)[None, :] >= (width - lengths)[:, None]
    ids = np.full((len(prompts), width), pad, dtype=np.int64)
    ids[mask] = np.fromiter(itertools.chain.from_iterable(prompts), dtype=np.int64, count=int(lengths.sum()))
    return torch.from_numpy(ids).to(device), torch.from_numpy(mask).to(device)


def _padded(request: DecodeRequest, rows: int) -> DecodeRequest:
    """``request`` with idle rows up to ``rows`` (repeats of its last prompt: only its settings are read)."""
    return dataclasses.replace(request, prompts=request.prompts + [request.prompts[-1]] * (rows - len(request.prompts)))


def _autocast(decode: LaunchedDecode) -> Any:
    """The caller's autocast for the capture, without its weight cache (a graph must not keep casts it did
    not make); nothing when the caller had none."""
    if not decode.autocast:
        return contextlib.nullcontext()
    return torch.autocast(decode.device.type, dtype=decode.dtype, cache_enabled=False)


def _copy_sampling(target: Sampling, source: Sampling) -> None:
    """Copy ``source``'s settings into ``target``'s tensors (a graph reads them where they are)."""
    for field in fields(source):
        getattr(target, field.name).copy_(getattr(source, field.name))
