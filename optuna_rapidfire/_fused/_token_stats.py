"""Per-token statistics of an LM head without its ``[tokens, vocabulary]`` float32 logits.

The fused engine scores only the loss tokens of a pass, and never needs their logits: each token's
log-probability (the loss), and for evaluation its entropy and whether it is the top-1 prediction (the
token accuracy TRL's ``SFTTrainer`` reports). TRL's ``ChunkedLogProbFunction`` (``trl.kernels``, the kernel
behind TRL's own ``fused_lm_head``: Triton on CUDA, torch elsewhere) computes them tile by tile over the
vocabulary, forward and backward, so a pass's memory no longer grows with tokens x vocabulary in float32;
it also computes exactly what TRL's trainers compute. Where the installed TRL lacks it, the full logits
give the same numbers.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from collections.abc import Sequence

VOCAB_TILE = 32_768
"""Vocabulary columns per tile of the chunked kernel (TRL's own choice for its fused LM head)."""


def head_settings(config: Any) -> tuple[float | None, float]:
    """The final logit soft-capping and logit scale of a model's text config (``None`` and 1.0 where it has
    none), which the LM head's logits get before the softmax, read as TRL's fused LM head reads them
    (``add_fused_lm_head``, TRL 1.16): ``logit_scale``, else ``output_multiplier`` (Muse Glimmer), else
    ``lm_head_multiplier`` (Falcon-H1), else ``logits_scaling`` (Granite and MiniCPM3 divide by it,
    HyperCLOVA X multiplies)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    scale = getattr(text, "logit_scale", None)
    if scale is None:
        scale = getattr(text, "output_multiplier", None)
    if scale is None:
        scale = getattr(text, "lm_head_multiplier", None)
    scaling = getattr(text, "logits_scaling", None)
    if scale is None and scaling is not None:
        scale = scaling if getattr(text, "model_type", None) == "hyperclovax" else 1 / scaling
    return getattr(text, "final_logit_softcapping", None), 1.0 if scale is None else float(scale)


class TokenStats(NamedTuple):
    """Per-token statistics (float32, ``[tokens]``); the optional ones ``None`` unless asked for."""

    log_probs: torch.Tensor
    entropy: torch.Tensor | None = None
    is_top1: torch.Tensor | None = None
    mean_logits: torch.Tensor | None = None


def token_stats(
    hidden: torch.Tensor,
    head: torch.nn.Module,
    targets: torch.Tensor,
    config: Any,
    outputs: Sequence[str] = (),
    temperature: float = 1.0,
    chunked: bool = True,
) -> TokenStats:
    """Each target token's log-probability under ``head`` applied to ``hidden`` (float32, differentiable),
    and, when named in ``outputs``, the entropy of each prediction, whether the target is its first maximum
    and the mean of its logits (``"entropy"``, ``"is_top1"``, ``"mean_logits"``; ``None`` otherwise).

    Args:
        hidden: ``[tokens, hidden]``: the backbone's state at the position predicting each target.
        head: The LM head (a ``Linear``: ``weight`` ``[vocabulary, hidden]``, optional ``bias``).
        targets: ``[tokens]``: the token each position predicts.
        config: The model's config (soft-capping and logit scale, see :func:`head_settings`).
        outputs: Extra statistics to compute.
        temperature: What the logits are divided by (after soft-capping), as in TRL's fused LM head.
        chunked: Through TRL's chunked kernel where the installed TRL has it (no ``[tokens, vocabulary]``
            logits in memory); ``False``: from the full logits (the reference the kernel is tested against).
    """
    softcap, scale = head_settings(config)
    weight, bias = head.weight, getattr(head, "bias", None)
    kernel = _kernel() if chunked else None
    if kernel is not None:
        log_probs, entropy, _, mean_logits, is_top1 = kernel.apply(
            hidden, weight, bias, targets, temperature, VOCAB_TILE, softcap, scale, ("log_probs", *outputs)
        )
        return TokenStats(log_probs, entropy, is_top1, mean_logits)
    logits = head(hidden).float() * scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    logits = logits / temperature
    log_probs = -F.cross_entropy(logits, targets, reduction="none")
    stats = TokenStats(log_probs)
    if "entropy" in outputs:
        log_softmax = logits.log_softmax(-1)
        stats = stats._replace(entropy=-(log_softmax.exp() * log_softmax).sum(-1))
    if "is_top1" in outputs:
        stats = stats._replace(is_top1=logits.argmax(-1) == targets)
    if "mean_logits" in outputs:
        stats = stats._replace(mean_logits=logits.mean(-1))
    return stats


@functools.cache
def _kernel() -> Any:
    """TRL's ``ChunkedLogProbFunction``, or ``None`` where the installed TRL has no such kernel."""
    try:
        from trl.kernels import ChunkedLogProbFunction
    except ImportError:
        return None
    return ChunkedLogProbFunction
