"""The Triton kernel behind :func:`~optuna_rapidfire._fused._dropout.dropped` (imported only where Triton is).

Each element's keep-or-drop bit is :func:`~optuna_rapidfire._fused._dropout.keep_scale`'s: the 32-bit mixer of
the row's key (already mixed with the layer's salt), then the token's, then the feature's, in uint32 (whose
products wrap as the int64 code's ``& 0xFFFFFFFF`` does); the keep scale ``1 / (1 - p)`` divided with IEEE
rounding, as torch divides. The element is multiplied in float32 and rounded once to its dtype.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _mix32(x):  # type: ignore[no-untyped-def]
    x = ((x >> 16) ^ x) * 0x45D9F3B
    x = ((x >> 16) ^ x) * 0x45D9F3B
    return (x >> 16) ^ x


@triton.jit
def kernel(  # type: ignore[no-untyped-def]
    x_ptr, out_ptr, row_ptr, drop_ptr, token_ptr, feature_ptr, count, tokens, features, BLOCK: tl.constexpr
):
    """``out = x * scale`` over ``[rows, tokens, features]`` elements (contiguous), ``BLOCK`` per program."""
    index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = index < count
    feature = index % features
    token = (index // features) % tokens
    row = index // (features * tokens)
    row_key = tl.load(row_ptr + row, mask=inside, other=0).to(tl.uint32)
    token_key = tl.load(token_ptr + token, mask=inside, other=0).to(tl.uint32)
    feature_key = tl.load(feature_ptr + feature, mask=inside, other=0).to(tl.uint32)
    bits = _mix32(_mix32(row_key ^ token_key) ^ feature_key) & 0xFFFFFF
    uniform = bits.to(tl.float32) * 5.9604644775390625e-08  # 2**-24
    p = tl.load(drop_ptr + row, mask=inside, other=0.0)
    keep = tl.div_rn(tl.full(p.shape, 1.0, tl.float32), tl.maximum(1.0 - p, 5.9604644775390625e-08))
    scale = tl.where(uniform >= p, keep, 0.0)
    value = tl.load(x_ptr + index, mask=inside, other=0.0).to(tl.float32)
    result = (value * scale).to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
    tl.store(out_ptr + index, result, mask=inside)
