"""Fused multi-adapter decoding: K trials sample their completions in one decode batch over the shared base.

GRPO trials spend most of their time generating. :func:`decode` runs the rows of K requests (one per
trial) as one batch with a KV cache: the prompts left-padded to the longest of the batch, one prefill,
then one token per step for all rows, inside :func:`~optuna_rapidfire._fused._fused_pass.fused_forward`
so that row segment i goes through request i's adapter. Each row is sampled with its request's settings,
vectorized over the batch, by HF's logits processors in HF's order (repetition penalty, then
temperature, top-k, top-p, min-p). A request's random draws come from its own ``torch.Generator`` alone,
in a shape that depends on it alone (its rows by the vocabulary, every step until its last row ends), so
a trial's completions are the same whether it decodes alone or in any gang, up to the rounding of the
shared pass. The draw is the exponential race ``torch.multinomial`` runs (``argmax(probs / q)``, ``q``
exponential noise): alone, with its generator seeded as the global RNG, a request samples the tokens of
HF ``generate``.

Rows end at their first EOS (kept), requests at their own ``max_new_tokens``, the decode when every row
has ended. Ended rows leave the batch (its KV cache and the gang's segments) once they are a quarter of
it, so a request that has finished stops costing compute; rows are independent, so this changes no
row's tokens beyond rounding.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import torch

from optuna_rapidfire._fused import _launched_decode, _workspace
from optuna_rapidfire._fused._fused_pass import Gang, fused_forward, layer_plans, lora_layers
from optuna_rapidfire._fused._sampling import DecodeRequest, Sampling, penalize, warp

if TYPE_CHECKING:
    from collections.abc import Sequence

# Ended rows leave the batch once they are this share of it: each compaction copies the KV cache of the
# rows that stay, so rows leave in a few large groups rather than one by one.
_COMPACT_SHARE = 0.25


def decode(
    model: torch.nn.Module,
    requests: Sequence[DecodeRequest],
    pad_token_id: int,
    *,
    launched: bool | None = None,
    layers: Sequence[tuple[str, Any]] | None = None,
) -> list[list[list[int]]]:
    """Each request's completions, sampled in one decode batch, each row through its request's adapter.

    ``model`` is a PEFT ``PeftModel`` (or its LoRA-injected base) that holds every request's adapter;
    it runs without gradients and without dropout (the HF forward in eval mode, giving the modes back
    after). A request's completions do not depend on the other requests (see the module's docstring).

    The decoders :func:`~optuna_rapidfire._fused._workspace.supports` names decode with the launched
    step (a static KV cache, the step captured as a CUDA graph on a GPU); others with the HF forward.

    Args:
        model: The model with the requests' LoRA adapters.
        requests: One request per trial, each with a different adapter.
        pad_token_id: Left-pads the prompts and fills the rows that have ended.
        launched: Whether to use the launched decode (``None``: where the model supports it; ``True``
            raises where it does not).
        layers: The model's LoRA layers (:func:`~optuna_rapidfire._fused._fused_pass.named_lora_layers`), when
            the caller keeps them; else listed here, by a walk of every module (a GRPO study decodes hundreds
            of times).

    Returns:
        For each request, its completions: one list of token ids per prompt, cut after the row's first
        EOS (EOS kept), as TRL's ``GRPOTrainer`` cuts them.

    Raises:
        ValueError: If there is no request, an adapter is missing or named twice, or a generator is on
            another device than the model; before any work.
    """
    from peft import PeftModel

    requests = list(requests)
    if not requests:
        raise ValueError(f"decode needs at least one request, but got requests={requests}.")
    names = [r.adapter for r in requests]
    if len(set(names)) != len(names):
        raise ValueError(f"Each request needs its own adapter, but got adapters {names}.")
    listed = lora_layers(model) if layers is None else [layer for _, layer in layers]
    held = {name for layer in listed for name in layer.lora_A}
    missing = [name for name in names if name not in held]
    if missing:
        raise ValueError(f"The model has no adapter {missing[0]!r} (its adapters: {sorted(held)}).")
    lm: Any = model.get_base_model() if isinstance(model, PeftModel) else model
    device = lm.get_input_embeddings().weight.device
    for r in requests:
        if r.generator is not None and r.generator.device.type != device.type:
            raise ValueError(
                f"The generator of adapter {r.adapter!r} is on {r.generator.device}, but the model is on {device}."
            )
    refusal = _workspace.supports(lm)
    if launched and refusal is not None:
        raise ValueError(f"The launched decode cannot run this model: {refusal}.")
    if refusal is None and launched is not False:
        # Train or eval mode changes nothing there (no dropout module runs): the model's modes stay as they are.
        with torch.no_grad():
            return _launched_decode.LaunchedDecode(model, lm, requests, pad_token_id, device).run()
    modes = {module: module.training for module in model.modules()}
    model.eval()
    try:
        with torch.no_grad():
            tokens, lengths = _Decode(model, lm, requests, pad_token_id, device).run()
    finally:
        for module, training in modes.items():
            module.training = training
    out: list[list[list[int]]] = []
    start = 0
    for r in requests:
        out.append([tokens[start + i][: lengths[start + i]] for i in range(len(r.prompts))])
        start += len(r.prompts)
    return out


@dataclass
class _Rows:
    """The rows in the batch, each tensor indexed by batch row: what a compaction selects.

    ``origin``: the row's index among all requests' rows; ``position``: the position of its next input;
    ``token``: its next input (its last token, pad once ended); ``mask``: its attention mask over the
    whole decode (the prompt left-padded, then ones); ``eos``: its request's EOS ids (``-1`` padded);
    ``seen``: the tokens in the row so far, for the repetition penalty (``None``: no request has one).
    """

    origin: torch.Tensor
    position: torch.Tensor
    token: torch.Tensor
    done: torch.Tensor
    mask: torch.Tensor
    max_new: torch.Tensor
    eos: torch.Tensor
    sampling: Sampling
    seen: torch.Tensor | None

    def select(self, index: torch.Tensor) -> _Rows:
        """The rows at ``index``."""

        def pick(value: Any) -> Any:
            if value is None:
                return None
            return value.select(index) if isinstance(value, Sampling) else value.index_select(0, index)

        return _Rows(**{f.name: pick(getattr(self, f.name)) for f in fields(self)})


class _Decode:
    """One decode's state and loop: the batch's rows, their requests, the KV cache and the gang."""

    def __init__(
        self,
        model: torch.nn.Module,
        lm: Any,
        requests: list[DecodeRequest],
        pad_token_id: int,
        device: torch.device,
    ) -> None:
        self.model, self.lm, self.requests, self.pad, self.device = model, lm, requests, pad_token_id, device
        self.owner = [k for k, r in enumerate(requests) for _ in r.prompts]  # each row's request
        self.starts = [sum(len(r.prompts) for r in requests[:k]) for k in range(len(requests))]
        self.steps = max(r.max_new_tokens for r in requests)
        parameters = inspect.signature(lm.forward).parameters
        # transformers renamed past_key_values to cache (5.x); logits_to_keep spares the prompt's logits.
        self.cache_key = "cache" if "cache" in parameters else "past_key_values"
        self.keep = {"logits_to_keep": 1} if "logits_to_keep" in parameters else {}
        self.gang = Gang([r.adapter for r in requests], [len(r.prompts) for r in requests], [0] * len(requests))
        self.plans = layer_plans(model, self.gang)
        self.layout = 0  # counts the batch's layouts: the noise rows are kept for one layout
        self.layouts = [list(self.gang.rows)]  # each layout's rows per request present
        self.noise_key: tuple[int, tuple[int, ...]] | None = None
        self.noise: tuple[torch.Tensor, torch.Tensor] | None = None

    def run(self) -> tuple[list[list[int]], list[int]]:
        """Every row's tokens (pad after it ended) and how many of them are its completion."""
        from transformers import DynamicCache

        prompts = [p for r in self.requests for p in r.prompts]
        width = max(len(p) for p in prompts)
        ids, mask = _launched_decode.left_padded(prompts, width, self.pad, self.device)
        prompt_mask = mask.long()
        cache = DynamicCache(config=self.lm.config)
        positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)  # as HF positions left-padded rows
        logits = self._forward(ids, prompt_mask, positions, cache)
        vocab = logits.shape[-1]
        total = len(prompts)
        eos = [r.eos_token_ids for r in self.requests]
        longest = max(len(e) for e in eos)
        seen = None
        if any(r.repetition_penalty != 1.0 for r in self.requests):
            # HF penalizes the prompt's tokens, not the padding (it points padding at a column it drops).
            pointed = ids.clamp(max=vocab).masked_fill(prompt_mask == 0, vocab)
            seen = torch.zeros(total, vocab + 1, dtype=torch.bool, device=self.device).scatter_(1, pointed, True)
            seen = seen[:, :vocab].contiguous()
        rows = _Rows(
            origin=torch.arange(total, device=self.device),
            position=prompt_mask.sum(-1),
            token=ids[:, -1],
            done=torch.zeros(total, dtype=torch.bool, device=self.device),
            mask=torch.cat([prompt_mask, prompt_mask.new_ones(total, self.steps)], dim=1),
            max_new=torch.tensor([self.requests[k].max_new_tokens for k in self.owner], device=self.device),
            eos=torch.tensor(
                [list(eos[k]) + [-1] * (longest - len(eos[k])) for k in self.owner],
                dtype=torch.long,
                device=self.device,
            ),
            sampling=Sampling.of(self.requests, vocab, self.device),
            seen=seen,
        )
        out = torch.full((total, self.steps), self.pad, dtype=torch.long, device=self.device)
        lengths = torch.zeros(total, dtype=torch.long, device=self.device)
        batch = list(range(total))  # each batch row's index among all rows
        done = [False] * total
        for step in range(self.steps):
            drawing = sorted({self.owner[b] for b, ended in zip(batch, done, strict=True) if not ended})
            sampled = self._next_tokens(logits, rows, batch, drawing)
            if rows.seen is not None:
                rows.seen.scatter_(1, sampled[:, None], True)
            rows.token = sampled.masked_fill(rows.done, self.pad)
            out[rows.origin, step] = rows.token
            lengths.index_add_(0, rows.origin, (~rows.done).long())
            rows.done |= (rows.token[:, None] == rows.eos).any(-1) | (rows.max_new <= step + 1)
            done = rows.done.tolist()
            if all(done):
                break
            if sum(done) >= _COMPACT_SHARE * len(done):
                keep = [i for i, ended in enumerate(done) if not ended]
                index = torch.tensor(keep, device=self.device)
                rows = rows.select(index)
                cache.batch_select_indices(index)
                batch, done = [batch[i] for i in keep], [False] * len(keep)
                self._lay_out(batch)
            length = rows.mask.shape[1] - self.steps + step + 1
            logits = self._forward(rows.token[:, None], rows.mask[:, :length], rows.position[:, None], cache)
            rows.position = rows.position + 1
        return out.tolist(), lengths.tolist()

    def _lay_out(self, batch: list[int]) -> None:
        """The gang (and its layer plans) for the batch's rows, ``batch`` their indices among all rows."""
        counts = [0] * len(self.requests)
        for b in batch:
            counts[self.owner[b]] += 1
        present = [k for k, count in enumerate(counts) if count]
        self.gang = Gang([self.requests[k].adapter for k in present], [counts[k] for k in present], [0] * len(present))
        self.plans = layer_plans(self.model, self.gang)
        self.layout += 1
        self.layouts.append(list(self.gang.rows))

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any) -> torch.Tensor:
        """The last position's logits of every row, through its request's adapter; fills ``cache``."""
        with fused_forward(self.model, self.gang, self.plans):
            outputs = self.lm(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                use_cache=True,
                **{self.cache_key: cache},
                **self.keep,
            )
        return outputs.logits[:, -1]

    def _next_tokens(self, logits: torch.Tensor, rows: _Rows, batch: list[int], drawing: list[int]) -> torch.Tensor:
        """Each batch row's next token; ``drawing``: the requests with a row still going, which draw."""
        scores = penalize(logits, rows.seen, rows.sampling.penalty)
        greedy = scores.argmax(dim=-1)
        sampling = [k for k in drawing if self.requests[k].do_sample]
        if not sampling:
            return greedy
        chosen = [self.requests[k] for k in sampling]
        warped = warp(
            scores,
            rows.sampling,
            top_k=any(r.top_k for r in chosen),
            top_p=any(r.top_p < 1 for r in chosen),
            min_p=any(r.min_p for r in chosen),
        )
        index, sampled_rows = self._noise_rows(batch, sampling)
        # Each request draws for all its rows, ended or left, every step until its last row ends: the
        # shape of its draws, hence its tokens, depends on it alone (and equals HF's multinomial).
        noise = warped.new_empty(sum(len(r.prompts) for r in chosen), warped.shape[-1])
        start = 0
        for r in chosen:
            noise[start : start + len(r.prompts)].exponential_(generator=r.generator)
            start += len(r.prompts)
        probs = warped.softmax(dim=-1)
        drawn = (probs / noise.index_select(0, index)).argmax(dim=-1)
        return torch.where(sampled_rows, drawn, greedy)

    def _noise_rows(self, batch: list[int], sampling: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """For each batch row, its row in the stack of the sampling requests' draws (0 for rows of other
        requests), and whether it samples; kept until the batch or the sampling requests change."""
        key = (self.layout, tuple(sampling))
        if self.noise is None or self.noise_key != key:
            offsets, start = {}, 0
            for k in sampling:
                offsets[k] = start
                start += len(self.requests[k].prompts)
            owners = [self.owner[b] for b in batch]
            index = [offsets[k] + b - self.starts[k] if k in offsets else 0 for k, b in zip(owners, batch, strict=True)]
            self.noise = (
                torch.tensor(index, device=self.device),
                torch.tensor([k in offsets for k in owners], device=self.device),
            )
            self.noise_key = key
        return self.noise
