"""Adapter dropout for shared passes: counter-based masks, one batched draw per layer, each trial's own stream.

A trial's dropout masks must not depend on its gang (so that it reports the same values alone or with
others), and a shared pass must not draw them adapter by adapter. So masks are not drawn from a random
generator but computed: every kept-or-dropped decision is a hash of the trial's stream key, its pass
counter, the layer, and the element's position within the trial's own micro-batch (row, token,
feature). One vectorised computation per layer gives every row of a pass its mask, whatever trials the
rows belong to, and a position's mask does not depend on how long the gang padded the row. ``torch.compile``
fuses it into the kernel that applies it, and may recompute it in the backward pass instead of keeping it.

The hash is a 32-bit integer mixer (Thomas Mueller's ``0x45d9f3b`` finalizer) computed in int64, with
every product below 2**63: the same bits on every device, compiled or not, with no integer overflow.
A trial's stream is its key (from its ``seed``) and the number of passes it has taken part in; the state
it saves (:meth:`DropoutStream.state`) is those two numbers.
"""

from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass
from typing import Any

import torch

_M32 = 0xFFFFFFFF
_MIX = 0x45D9F3B
_GOLDEN = 0x9E3779B1
_UNIT = 2.0**-24  # a uniform draw from the low 24 bits of a hash


def mix(x: int) -> int:
    """The 32-bit mixer on a Python integer (host side: stream keys)."""
    x &= _M32
    x = (((x >> 16) ^ x) * _MIX) & _M32
    x = (((x >> 16) ^ x) * _MIX) & _M32
    return (x >> 16) ^ x


def mix_tensor(x: torch.Tensor) -> torch.Tensor:
    """:func:`mix` elementwise on an int64 tensor of values in ``[0, 2**32)``."""
    x = (torch.bitwise_xor(x >> 16, x) * _MIX) & _M32
    x = (torch.bitwise_xor(x >> 16, x) * _MIX) & _M32
    return torch.bitwise_xor(x >> 16, x)


def layer_salt(name: str) -> int:
    """A LoRA layer's own salt: a hash of the base module's name (``model.layers.0.self_attn.q_proj``), so a
    layer draws the same masks whichever other layers have adapters."""
    return zlib.crc32(name.encode()) & _M32


@dataclass
class DropoutStream:
    """A trial's dropout stream: ``key`` (from its seed) and ``passes`` taken so far; each pass the trial
    takes part in gets the next key (:meth:`next_key`)."""

    key: int
    passes: int = 0

    @classmethod
    def seeded(cls, seed: int) -> DropoutStream:
        return cls(key=mix(seed + 0x5EED))

    @classmethod
    def of(cls, state: torch.Tensor | None, seed: int) -> DropoutStream:
        """The stream a trial saved (:meth:`state`), or a fresh one from ``seed``. A state in an older format
        (a generator's bytes) starts a stream keyed by those bytes."""
        if state is None:
            return cls.seeded(seed)
        if state.dtype == torch.int64 and state.numel() == 2:
            key, passes = (int(v) for v in state.tolist())
            return cls(key=key, passes=passes)
        return cls(key=mix(zlib.crc32(state.cpu().numpy().tobytes())))

    def next_key(self) -> int:
        """The key of the trial's next pass (32 bits)."""
        key = mix(self.key ^ mix(self.passes))
        self.passes += 1
        return key

    def state(self) -> torch.Tensor:
        """What a trial saves to continue its stream (two int64)."""
        return torch.tensor([self.key, self.passes], dtype=torch.int64)


def row_keys(keys: list[int], rows: list[int]) -> torch.Tensor:
    """Each row's key for a pass (int64, host): its member's pass key mixed with the row's index within the
    member's own micro-batch. ``keys`` and ``rows``: the members' pass keys and row counts, in order."""
    values = [
        mix(key ^ ((row * _GOLDEN) & _M32)) for key, count in zip(keys, rows, strict=True) for row in range(count)
    ]
    return torch.tensor(values, dtype=torch.int64)


@functools.cache
def position_keys(count: int, device: torch.device) -> torch.Tensor:
    """Each token position's key (int64 ``[count]``), computed once per length and device.

    Tables rather than ``arange`` inside the compiled graph: the compiler makes an ``arange`` an int32 index,
    which a 32-bit hash constant overflows (Triton refuses the kernel)."""
    return mix_tensor((torch.arange(count, dtype=torch.int64) * _GOLDEN) & _M32).to(device)


@functools.cache
def feature_keys(count: int, device: torch.device) -> torch.Tensor:
    """Each input feature's key (int64 ``[count]``), computed once per width and device."""
    return mix_tensor(torch.arange(count, dtype=torch.int64) + _GOLDEN).to(device)


def keep_scale(
    rows: torch.Tensor, salt: torch.Tensor | int, drop: torch.Tensor, tokens: torch.Tensor, features: torch.Tensor
) -> torch.Tensor:
    """The mask an input ``[len(rows), len(tokens), len(features)]`` is multiplied by (float32): ``1 / (1 - p)``
    where kept, ``0`` where dropped, with ``p`` each row's dropout probability (``drop``, ``[rows]``). Multiply
    in float32 and round once to the input's dtype (:func:`apply`), as ``torch.nn.Dropout`` does.

    Args:
        rows: Each row's key (:func:`row_keys`), int64 on the device.
        salt: The layer's salt (:func:`layer_salt`), an int or an int64 tensor.
        drop: Each row's dropout probability; 0 keeps every element unchanged (the scale is exactly 1).
        tokens: The positions' keys (:func:`position_keys` of the row length).
        features: The input features' keys (:func:`feature_keys` of the layer's input width).
    """
    row = mix_tensor(torch.bitwise_xor(rows, salt))  # [rows]
    token = mix_tensor(torch.bitwise_xor(row[:, None], tokens))  # [rows, length]
    bits = mix_tensor(torch.bitwise_xor(token[:, :, None], features)) & 0xFFFFFF  # [rows, length, features]
    uniform = bits.to(torch.float32) * _UNIT
    p = drop.to(torch.float32)[:, None, None]
    return torch.where(uniform >= p, 1.0 / (1.0 - p).clamp(min=_UNIT), torch.zeros_like(p))


def apply(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` times a :func:`keep_scale` mask, computed in float32 and rounded once to ``x``'s dtype."""
    return (x.float() * scale).to(x.dtype)


def dropped(
    x: torch.Tensor,
    rows: torch.Tensor,
    salt: torch.Tensor | int,
    drop: torch.Tensor,
    tokens: torch.Tensor,
    features: torch.Tensor,
) -> torch.Tensor:
    """``x`` (``[rows, tokens, features]``) times its :func:`keep_scale` mask (:func:`apply`), differentiable.

    Uncompiled on a GPU, one Triton kernel computes each element's mask where it applies it (and again in the
    backward pass): kernel by kernel the mask is some twenty int64 passes over the whole input, which made the
    dropping layers' masks most of an uncompiled pass's device time on an H200. The bits are the same (the
    32-bit mixer wraps in uint32 as :func:`mix` masks in int64; the keep scale is divided with IEEE rounding).
    Compiled, or elsewhere, the torch code (which the compiler fuses)."""
    kernel = _kernel() if x.is_cuda and not torch.compiler.is_compiling() else None
    if kernel is None:
        return apply(x, keep_scale(rows, salt, drop, tokens, features))
    row = mix_tensor(torch.bitwise_xor(rows, salt))
    return _Dropped.apply(x, row, drop.to(torch.float32), tokens, features)


class _Dropped(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, row: torch.Tensor, drop: torch.Tensor, tokens: torch.Tensor, features: torch.Tensor
    ) -> torch.Tensor:
        ctx.save_for_backward(row, drop, tokens, features)
        return _launch(x, row, drop, tokens, features)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        row, drop, tokens, features = ctx.saved_tensors
        # y = (x * s) rounded, so dx = (dy * s) rounded to x's dtype: the same kernel on the gradient.
        return _launch(grad, row, drop, tokens, features), None, None, None, None


def _launch(
    x: torch.Tensor, row: torch.Tensor, drop: torch.Tensor, tokens: torch.Tensor, features: torch.Tensor
) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    count = x.numel()
    block = 1024
    _kernel()[((count + block - 1) // block,)](
        x, out, row, drop, tokens, features, count, tokens.numel(), features.numel(), BLOCK=block
    )
    return out


@functools.cache
def _kernel() -> Any:
    """The Triton kernel of :func:`dropped` (``None`` without Triton)."""
    try:
        from optuna_rapidfire._fused._dropout_kernel import kernel
    except ImportError:
        return None
    return kernel
