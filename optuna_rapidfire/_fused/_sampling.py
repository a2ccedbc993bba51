"""What a decode is asked for and how its rows sample: the requests, and HF's logits processors vectorised.

Shared by the two decodes (:mod:`~optuna_rapidfire._fused._fused_decode`'s HF forward and
:mod:`~optuna_rapidfire._fused._launched_decode`'s captured step).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from collections.abc import Sequence


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
