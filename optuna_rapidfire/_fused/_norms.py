"""RMS norms in fewer kernels, for the passes that run a model's own modules (a GRPO gang's shared passes, the
launched decode's layers).

A Llama-family RMSNorm module computes ``weight * (x / rms(x), in float32, cast back to x's dtype)`` in eight
kernels (a cast, the square, the mean, the epsilon's sum, the reciprocal root, the product, the cast back, the
weight's product) and as many in the backward pass, each reading and writing the whole activation: over a gang's
shared pass (thousands of tokens, 33 norms for a 16-layer model) they are memory-bound kernels that cost more
than their launches. :func:`rms_norm` computes the same normalization with PyTorch's ``rms_norm`` (one fused
kernel on CUDA, forward and backward) between the two casts. Which modules are such norms is decided by their
code, not their names: a module whose ``forward`` is compiled from the same code as Llama's (transformers copies
it into Mistral, Qwen2, Qwen3 and more) normalizes the same way; any other norm (Gemma's ``1 + weight``, a
layer norm) runs as it is.
"""

from __future__ import annotations

import contextlib
import functools
import types
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence


@functools.cache
def _llama_code() -> types.CodeType:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return _unwrapped(LlamaRMSNorm.forward).__code__


def _unwrapped(forward: Any) -> Any:
    """``forward`` without the decorators that wrap it (transformers may wrap a norm for kernels of the hub)."""
    while hasattr(forward, "__wrapped__"):
        forward = forward.__wrapped__
    return forward


_KNOWN: dict[type, bool] = {}  # is_rms_norm's answers, per class


def is_rms_norm(kind: type) -> bool:
    """Whether modules of class ``kind`` are Llama's RMSNorm: the same code in ``forward`` (its bytecode, constants
    and names; file and line numbers aside)."""
    known = _KNOWN.get(kind)
    if known is None:
        code, llama = getattr(_unwrapped(getattr(kind, "forward", None)), "__code__", None), _llama_code()
        same = lambda c: (c.co_code, c.co_consts, c.co_names, c.co_varnames)  # noqa: E731
        known = _KNOWN[kind] = code is not None and same(code) == same(llama)
    return known


def rms_norm(norm: Any, x: torch.Tensor) -> torch.Tensor:
    """``norm(x)``, in fewer kernels where ``norm`` is Llama's RMSNorm (:func:`is_rms_norm`; others run as they are)."""
    return _fused(norm, x) if is_rms_norm(type(norm)) else cast("torch.Tensor", norm(x))


def _fused(norm: Any, x: torch.Tensor) -> torch.Tensor:
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=norm.variance_epsilon)
    return norm.weight * normed.to(x.dtype)


def rms_norms(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of ``model`` that :func:`rms_norm` computes in fewer kernels (a walk of the model: keep them)."""
    return [module for module in model.modules() if is_rms_norm(type(module))]


@contextlib.contextmanager
def fused_norms(norms: Sequence[torch.nn.Module]) -> Iterator[None]:
    """Within the context, each of ``norms`` (:func:`rms_norms` of a model) computes its output with
    :func:`rms_norm`; afterwards (an error included) they run their own ``forward`` again."""
    try:
        for norm in norms:
            norm.forward = types.MethodType(_fused, norm)
        yield
    finally:
        for norm in norms:
            norm.__dict__.pop("forward", None)
