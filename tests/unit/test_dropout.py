"""Counter-based adapter dropout: a row's mask depends on its own key and position only."""

from __future__ import annotations

import pytest
import torch

from optuna_rapidfire._fused._dropout import (
    DropoutStream,
    apply,
    feature_keys,
    keep_scale,
    layer_salt,
    mix,
    mix_tensor,
    position_keys,
    row_keys,
)

CPU = torch.device("cpu")


def _scale(keys, salt, drop, length, features):
    return keep_scale(keys, salt, drop, position_keys(length, CPU), feature_keys(features, CPU))


def test_the_mixer_is_the_same_on_the_host_and_on_tensors() -> None:
    values = [0, 1, 2**31, 2**32 - 1, 123456789]
    assert mix_tensor(torch.tensor(values)).tolist() == [mix(v) for v in values]


def test_a_rows_mask_does_not_depend_on_its_gang_or_padding() -> None:
    keys = row_keys([11, 22], [2, 3])
    drop = torch.tensor([0.3] * 5)
    gang = _scale(keys, layer_salt("model.layers.0.self_attn.q_proj"), drop, 40, 16)
    # The second member alone, its rows padded to another length: the same masks on its own positions.
    alone = _scale(row_keys([22], [3]), layer_salt("model.layers.0.self_attn.q_proj"), drop[:3], 24, 16)
    assert torch.equal(gang[2:, :24], alone)
    # Another layer, another mask.
    other = _scale(keys, layer_salt("model.layers.0.self_attn.v_proj"), drop, 40, 16)
    assert not torch.equal(gang, other)


@pytest.mark.parametrize("p", [0.05, 0.3])
def test_masks_drop_at_the_asked_rate_and_keep_the_expectation(p: float) -> None:
    scale = _scale(row_keys([5], [64]), 7, torch.full((64,), p), 128, 64)
    dropped = float((scale == 0).float().mean())
    # 524k draws: the share is p within 6 standard deviations of a binomial.
    assert abs(dropped - p) < 6 * (p * (1 - p) / scale.numel()) ** 0.5
    kept = scale[scale > 0]
    assert torch.allclose(kept, torch.full_like(kept, 1 / (1 - p)))


def test_no_dropout_leaves_the_input_unchanged() -> None:
    x = torch.randn(3, 5, 8, dtype=torch.bfloat16)
    scale = _scale(row_keys([1, 2], [1, 2]), 3, torch.zeros(3), 5, 8)
    assert torch.equal(apply(x, scale), x)


def test_a_stream_continues_from_its_state_and_differs_by_seed() -> None:
    stream = DropoutStream.seeded(11)
    first = [stream.next_key() for _ in range(3)]
    resumed = DropoutStream.of(stream.state(), seed=11)
    again = DropoutStream.of(None, seed=11)
    assert [again.next_key() for _ in range(3)] == first
    assert resumed.next_key() == again.next_key()  # both took three keys
    assert DropoutStream.seeded(12).next_key() != first[0]
    assert len(set(first)) == 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernel runs on a GPU (run on the H200)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gpu_kernel_drops_and_scales_exactly_as_the_torch_code(dtype: torch.dtype) -> None:
    """The uncompiled GPU path's Triton kernel: the same output and input gradient bits as the torch code, for
    rows of two members with other probabilities (one of them zero), lengths and widths no block divides."""
    from optuna_rapidfire._fused._dropout import dropped

    gpu = torch.device("cuda")
    torch.manual_seed(0)
    keys = row_keys([mix(5), mix(9), mix(13)], [4, 3, 2]).to(gpu)
    drop = torch.tensor([0.1] * 4 + [0.35] * 3 + [0.0] * 2, device=gpu)
    salt = torch.tensor(layer_salt("model.layers.3.mlp.down_proj"), device=gpu)
    tokens, features = position_keys(77, gpu), feature_keys(333, gpu)
    x = torch.randn(9, 77, 333, dtype=dtype, device=gpu, requires_grad=True)
    grad = torch.randn_like(x)
    reference = apply(x, keep_scale(keys, salt, drop, tokens, features))
    (expected,) = torch.autograd.grad(reference, x, grad)
    out = dropped(x, keys, salt, drop, tokens, features)
    (got,) = torch.autograd.grad(out, x, grad)
    assert torch.equal(out, reference) and torch.equal(got, expected)
    assert torch.equal(out[7:], x[7:])  # p = 0 keeps the rows unchanged
