"""Tolerances for float32 results computed along different paths, derived from rounding.

Two computations of the same float32 value that sum their terms in another order (another BLAS kernel
or CPU capability, a gang's padded batch instead of one trial's) differ by rounding alone. The rounding
errors of a sum of n products are independent and add up like a random walk: with probability at least
1 - 2n exp(-lambda^2 / 2) the error stays below lambda * sqrt(n) * u times the sum of the terms'
magnitudes, u = eps / 2 (Higham and Mary, "A new approach to probabilistic rounding error analysis",
SIAM J. Sci. Comput. 41(5), 2019), far below the worst case n * u. We take lambda = 8 (a miss below 1e-9
for up to 1e4 terms), so the bound is ``4 * sqrt(terms) * eps``. A value behind a chain of reductions (a
forward and a backward pass) is one random walk over all of them: ``terms`` counts the products of every
reduction on the way (the ``*_terms`` functions count them for a decoder). We compare relative to the
result rather than to the terms' magnitudes, and tensors by norm, ||a - b|| <= bound * ||b||, so that an
element that cancels to nearly zero needs no slack of its own. Measured with AVX-512, AVX2 and default
kernels, the differences stay 13 to 28 times below the bound for gradients, 7 to 18 times for trained
weights and 4.6 times for DPO's values, the most sensitive. A real bug (another trial's rows, a missed
step, a wrong scale) moves a result by 1e-3 and more, against bounds of a few 1e-5.

A decision (pruned or complete, which trial leads) is safe from rounding when the values it compares are
``MARGIN`` bounds apart; ``assert_apart`` states that in the test.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

FLOAT32_EPS = torch.finfo(torch.float32).eps
# A decision's values must be this many rounding bounds apart, so that rounding on another machine
# (or in another engine) cannot swap them.
MARGIN = 10


def rounding_bound(terms: int) -> float:
    """Relative float32 rounding difference of a result whose reductions sum ``terms`` products in all."""
    return 4 * math.sqrt(terms) * FLOAT32_EPS


def forward_terms(config: Any, *, length: int) -> int:
    """Products summed along a decoder's forward pass for one ``length``-token row (``config``: a
    transformers config): per layer, the query projection, attention scores (over a head), their
    weighted sum (over the row), the output projection, the MLP's up and down projections; then the LM
    head and the softmax over the vocabulary."""
    head = config.hidden_size // config.num_attention_heads
    layer = 3 * config.hidden_size + head + length + config.intermediate_size
    return config.num_hidden_layers * layer + config.hidden_size + config.vocab_size


def loss_terms(config: Any, *, rows: int, length: int) -> int:
    """A mean loss over ``rows`` rows: the forward pass, then the sum over the batch's tokens."""
    return forward_terms(config, length=length) + rows * length


def gradient_terms(config: Any, *, rows: int, length: int) -> int:
    """A weight gradient of such a loss: the forward pass, the same reductions transposed in the backward
    pass, then the sum over the batch's tokens. Trained weights, and the values a trial reports from
    them, carry their gradients' rounding (Adam normalizes each step's update, so in a short run it does
    not grow with the steps)."""
    return 2 * forward_terms(config, length=length) + rows * length


def assert_within_rounding(actual: Any, expected: Any, *, terms: int, what: str = "") -> None:
    """``actual`` equals ``expected`` up to float32 rounding over ``terms`` products: tensors by norm,
    numbers relatively, mappings (step -> value) key by key."""
    if isinstance(expected, Mapping):
        assert actual.keys() == expected.keys() and expected, (what, actual, expected)
        for key, value in expected.items():
            assert_within_rounding(actual[key], value, terms=terms, what=f"{what} [{key}]")
        return
    if isinstance(expected, torch.Tensor):
        assert actual.shape == expected.shape and actual.dtype == expected.dtype, what
        error = float((actual.double() - expected.double()).norm())
        scale = float(expected.double().norm())
    else:
        error, scale = abs(float(actual) - float(expected)), abs(float(expected))
    bound = rounding_bound(terms)
    assert error <= bound * scale, (
        f"{what}: differs by {error / scale if scale else error:.3g} relative, more than float32 rounding "
        f"over {terms} terms explains ({bound:.3g})"
    )


def assert_apart(a: float, b: float, *, terms: int, what: str = "") -> None:
    """``a`` and ``b`` (computed over ``terms`` products) are ``MARGIN`` rounding bounds apart."""
    needed = MARGIN * rounding_bound(terms) * max(abs(a), abs(b))
    assert abs(a - b) >= needed, f"{what}: {a} and {b} are closer than {needed:.3g}: rounding could decide"
