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

from optuna_rapidfire._fused._fused_pass import Gang, fused_forward, layer_plans, lora_layers

if TYPE_CHECKING:
    from collections.abc import Sequence

# Ended rows leave the batch once they are this share of it: each compaction copies the KV cache of the
# rows that stay, so rows leave in a few large groups rather than one by one.
_COMPACT_SHARE = 0.25


@dataclass
class DecodeRequest:
    """One trial's share of a decode: its adapter, its prompts and its sampling settings.

    The settings are those of the trial's ``GenerationConfig`` (TRL's ``GRPOTrainer`` builds it from
    ``GRPOConfig``): ``top_k`` ``None`` or ``0``, ``top_p`` ``1.0``, ``min_p`` ``None`` and
    ``repetition_penalty`` ``1.0`` are off; with ``do_sample=False`` the request decodes greedily
    (after the repetition penalty) and the sampling settings are ignored.

    Args:
        adapter: The trial's adapter in the ``PeftModel``.
        prompts: Token ids, one list per row (a prompt repeated once per generation is several rows).
        max_new_tokens: Most tokens generated per row.
        temperature: Divides the logits before top-k, top-p and min-p (sampling only).
        top_k: Keep the ``top_k`` most likely tokens.
        top_p: Keep the most likely tokens whose probabilities sum to ``top_p``.
        min_p: Keep the tokens at least ``min_p`` times as likely as the most likely one.
        repetition_penalty: Scales down the logits of the tokens already in the row (prompt included).
        do_sample: Sample (``True``) or take the most likely token (``False``).
        generator: The trial's own RNG for its draws, on the model's device (``None``: the global RNG,
            whose draws then depend on the other requests of the decode).
        eos_token_ids: Tokens that end a row.

    Raises:
        ValueError: If a setting is out of its range, or a prompt is missing or empty.
    """

    adapter: str
    prompts: list[list[int]]
    max_new_tokens: int
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    do_sample: bool = True
    generator: torch.Generator | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        where = f"(adapter {self.adapter!r})"
        if not self.prompts:
            raise ValueError(f"A decode request needs at least one prompt, but got prompts={self.prompts} {where}.")
        empty = [i for i, prompt in enumerate(self.prompts) if not prompt]
        if empty:
            raise ValueError(f"Every prompt needs at least one token, but prompts {empty} are empty {where}.")
        if self.max_new_tokens < 1:
            raise ValueError(
                f"max_new_tokens must be at least 1, but got max_new_tokens={self.max_new_tokens} {where}."
            )
        if not self.repetition_penalty > 0:
            raise ValueError(
                f"repetition_penalty must be positive, but got repetition_penalty={self.repetition_penalty} {where}."
            )
        if not self.do_sample:
            return
        if not self.temperature > 0:
            raise ValueError(
                f"temperature must be positive when sampling (do_sample=False decodes greedily), but got "
                f"temperature={self.temperature} {where}."
            )
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"top_k must be None or at least 0, but got top_k={self.top_k} {where}.")
        if not 0 <= self.top_p <= 1:
            raise ValueError(f"top_p must be in [0, 1], but got top_p={self.top_p} {where}.")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be None or in [0, 1], but got min_p={self.min_p} {where}.")


def decode(model: torch.nn.Module, requests: Sequence[DecodeRequest], pad_token_id: int) -> list[list[list[int]]]:
    """Each request's completions, sampled in one decode batch, each row through its request's adapter.

    ``model`` is a PEFT ``PeftModel`` (or its LoRA-injected base) that holds every request's adapter;
    it runs in eval mode without gradients, and gets its modes back after. A request's completions do
    not depend on the other requests (see the module's docstring).

    Args:
        model: The model with the requests' LoRA adapters.
        requests: One request per trial, each with a different adapter.
        pad_token_id: Left-pads the prompts and fills the rows that have ended.

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
    held = {name for layer in lora_layers(model) for name in layer.lora_A}
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
class Sampling:
    """Each row's sampling settings as tensors, for :func:`warp`; off settings are neutral values.

    ``top_k``: the vocabulary size when off; ``top_p_cut``: ``1 - top_p`` (HF removes the tokens whose
    cumulative probability, from the least likely, is at most that), ``-1`` when off; ``min_p``: ``0``
    when off. Greedy rows carry neutral settings: only their penalized scores are used.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p_cut: torch.Tensor
    min_p: torch.Tensor
    penalty: torch.Tensor

    @classmethod
    def of(cls, requests: Sequence[DecodeRequest], vocab: int, device: torch.device) -> Sampling:
        """The settings of every row of ``requests``, in order."""

        def column(value: Any, dtype: torch.dtype) -> torch.Tensor:
            values = [value(r) for r in requests for _ in r.prompts]
            return torch.tensor(values, dtype=dtype, device=device)

        def sampled(r: DecodeRequest, value: Any, off: Any) -> Any:
            return value if r.do_sample else off

        return cls(
            temperature=column(lambda r: sampled(r, r.temperature, 1.0), torch.float32),
            top_k=column(lambda r: min(sampled(r, r.top_k, None) or vocab, vocab), torch.long),
            # 1 - top_p in double, then float32, as HF compares its float32 sums with the Python float.
            top_p_cut=column(lambda r: 1 - r.top_p if r.do_sample and r.top_p < 1 else -1.0, torch.float32),
            min_p=column(lambda r: sampled(r, r.min_p, None) or 0.0, torch.float32),
            penalty=column(lambda r: r.repetition_penalty, torch.float32),
        )

    def select(self, index: torch.Tensor) -> Sampling:
        """The settings of the rows at ``index``."""
        return Sampling(**{f.name: getattr(self, f.name).index_select(0, index) for f in fields(self)})


def penalize(logits: torch.Tensor, seen: torch.Tensor | None, penalty: torch.Tensor) -> torch.Tensor:
    """The logits as float32 scores, with HF's repetition penalty on each row's ``seen`` tokens (the
    tokens in the row so far; ``None``: no row has a penalty). Greedy rows take the argmax of these."""
    scores = logits.float()
    if seen is None:
        return scores
    factor = penalty[:, None]
    return torch.where(seen, torch.where(scores < 0, scores * factor, scores / factor), scores)


def warp(scores: torch.Tensor, sampling: Sampling, *, top_k: bool, top_p: bool, min_p: bool) -> torch.Tensor:
    """Each row's penalized scores warped with its own settings, as HF's warpers would warp them alone.

    HF's order: temperature, top-k, top-p, min-p (``top_k``, ``top_p``, ``min_p``: whether any row uses
    it; rows that do not carry neutral settings). Top-k and top-p share one sort of the vocabulary; top-p
    sums the same sorted values as HF, in the same order. Removed tokens are at ``-inf``; sampled rows
    sample from the softmax.
    """
    warped = scores / sampling.temperature[:, None]
    if top_k or top_p:
        ordered, order = warped.sort(dim=-1, descending=True)
        # HF keeps every token at least as likely as the k-th (ties at the k-th included).
        kth = ordered.gather(1, sampling.top_k[:, None] - 1)
        warped = warped.masked_fill(warped < kth, -torch.inf)
        if top_p:
            ascending = ordered.masked_fill(ordered < kth, -torch.inf).flip(-1)  # HF's ascending sort
            remove = ascending.softmax(dim=-1).cumsum(dim=-1) <= sampling.top_p_cut[:, None]
            remove[:, -1] = False  # the most likely token stays
            warped = warped.masked_fill(torch.zeros_like(remove).scatter(1, order.flip(-1), remove), -torch.inf)
    if min_p:
        # The most likely token is never below min_p (<= 1) times itself: it stays, as HF ensures.
        probs = warped.softmax(dim=-1)
        warped = warped.masked_fill(probs < sampling.min_p[:, None] * probs.amax(dim=-1, keepdim=True), -torch.inf)
    return warped


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
        self.noise_key: tuple[int, tuple[int, ...]] | None = None
        self.noise: tuple[torch.Tensor, torch.Tensor] | None = None

    def run(self) -> tuple[list[list[int]], list[int]]:
        """Every row's tokens (pad after it ended) and how many of them are its completion."""
        from transformers import DynamicCache

        prompts = [p for r in self.requests for p in r.prompts]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts], device=self.device)
        prompt_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
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
