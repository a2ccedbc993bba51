"""Per-token statistics of an LM head: TRL's chunked kernel and the full logits agree, forward and backward."""

from __future__ import annotations

import types

import pytest
import torch
from _numerics import assert_within_rounding

from optuna_rapidfire._fused import _token_stats
from optuna_rapidfire._fused._token_stats import token_stats

HIDDEN, VOCAB, TOKENS = 16, 300, 40


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_the_chunked_kernel_gives_what_the_full_logits_give(softcap) -> None:
    torch.manual_seed(0)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    config = types.SimpleNamespace(final_logit_softcapping=softcap, logit_scale=0.5)
    targets = torch.randint(0, VOCAB, (TOKENS,))
    results = []
    for chunked in (True, False):
        hidden = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(1), requires_grad=True)
        log_probs, entropy, top1, mean = token_stats(
            hidden, head, targets, config, ("entropy", "is_top1", "mean_logits"), chunked=chunked
        )
        log_probs.sum().backward()
        results.append((log_probs.detach(), entropy, top1, mean, hidden.grad))
    (kernel_lp, kernel_ent, kernel_top1, kernel_mean, kernel_grad) = results[0]
    (full_lp, full_ent, full_top1, full_mean, full_grad) = results[1]
    terms = HIDDEN + VOCAB  # a logit's products, then the softmax's sum over the vocabulary
    assert_within_rounding(kernel_lp, full_lp, terms=terms, what="log-probabilities")
    assert_within_rounding(kernel_ent, full_ent, terms=terms, what="entropy")
    assert_within_rounding(kernel_mean, full_mean, terms=terms, what="mean logits")
    assert_within_rounding(kernel_grad, full_grad, terms=2 * terms, what="gradient")
    assert torch.equal(kernel_top1, full_top1)
    assert bool((full_lp < 0).all())  # real log-probabilities: the comparison can fail


@pytest.mark.parametrize(
    ("settings", "scale"),
    [
        ({}, 1.0),
        ({"logit_scale": 0.5, "logits_scaling": 4.0}, 0.5),
        ({"output_multiplier": 2.0}, 2.0),
        ({"lm_head_multiplier": 3.0}, 3.0),
        ({"logits_scaling": 4.0, "model_type": "granite"}, 0.25),
        ({"logits_scaling": 4.0, "model_type": "hyperclovax"}, 4.0),
    ],
)
def test_the_logit_scale_is_read_as_trls_fused_head_reads_it(settings, scale) -> None:
    assert _token_stats.head_settings(types.SimpleNamespace(**settings)) == (None, scale)


def test_only_the_statistics_asked_for_are_computed() -> None:
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    config = types.SimpleNamespace()
    stats = token_stats(torch.randn(3, HIDDEN), head, torch.tensor([0, 1, 2]), config)
    assert stats.entropy is None and stats.is_top1 is None and stats.mean_logits is None
