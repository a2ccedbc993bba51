"""RMS norms in fewer kernels (optuna_rapidfire/_fused/_norms.py): the same values and gradients as the modules."""

from __future__ import annotations

import pytest
import torch
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

from optuna_rapidfire._fused._norms import fused_norms, is_rms_norm, rms_norm, rms_norms

# The same float32 normalization, summing 64 squares in another order: float32 results differ by at most 64 float32
# epsilons (relative); a bfloat16 result rounds that once more, then its product with the weight, so it may differ
# by two bfloat16 epsilons (relative).
FP32 = 64 * torch.finfo(torch.float32).eps
BF16 = 2 * torch.finfo(torch.bfloat16).eps


def _norm(kind: type = LlamaRMSNorm) -> torch.nn.Module:
    torch.manual_seed(0)
    norm = kind(64, eps=1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    return norm


def test_norms_are_recognised_by_their_code_not_their_names() -> None:
    assert is_rms_norm(LlamaRMSNorm) and is_rms_norm(Qwen2RMSNorm)  # Qwen2's is a copy of Llama's
    assert not is_rms_norm(GemmaRMSNorm)  # scales by 1 + weight
    assert not is_rms_norm(torch.nn.LayerNorm)

    class LlamaRMSNormOfMine(LlamaRMSNorm):  # Llama's name, another formula
        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            return 2 * hidden_states

    assert not is_rms_norm(LlamaRMSNormOfMine)
    x = torch.randn(2, 64)
    assert torch.equal(rms_norm(LlamaRMSNormOfMine(64), x), 2 * x)  # run as it is


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, FP32), (torch.bfloat16, BF16)])
def test_rms_norm_computes_what_the_module_computes(dtype: torch.dtype, tolerance: float) -> None:
    module = _norm().to(dtype)
    x = torch.randn(3, 5, 64).to(dtype)
    torch.testing.assert_close(rms_norm(module, x), module(x), rtol=tolerance, atol=FP32)


def test_inside_the_context_the_norms_give_the_modules_values_and_gradients_and_after_it_their_own_code() -> None:
    model = torch.nn.Sequential(_norm(), torch.nn.Linear(64, 64), _norm(GemmaRMSNorm))
    x = torch.randn(4, 7, 64)
    expected = model(x)
    expected.square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad()
    norms = rms_norms(model)
    assert norms == [model[0]]  # Gemma's runs as it is
    calls = []
    original = torch.nn.functional.rms_norm

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return original(*args, **kwargs)  # type: ignore[arg-type]

    torch.nn.functional.rms_norm = counted  # type: ignore[assignment]
    try:
        with fused_norms(norms):
            got = model(x)
        assert len(calls) == 1  # the Llama norm only
        got.square().sum().backward()
        # The normalization's rounding (a sum of 64 squares in another order, on a GPU's fused kernel), compared
        # by norm: the linear layer and the second norm carry it on without adding their own.
        assert torch.linalg.vector_norm(got - expected) <= FP32 * torch.linalg.vector_norm(expected)
        for grad, param in zip(grads, model.parameters(), strict=True):
            assert param.grad is not None
            assert torch.linalg.vector_norm(param.grad - grad) <= FP32 * torch.linalg.vector_norm(grad)
        model(x)
        assert len(calls) == 1  # the module's own forward again
        with pytest.raises(RuntimeError, match="inside"), fused_norms(norms):
            raise RuntimeError("inside")
        assert "forward" not in model[0].__dict__  # restored after an error too
    finally:
        torch.nn.functional.rms_norm = original
