"""Shared prompts in GRPO policy passes: packed rows score every completion token as TRL's rows do."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from _numerics import assert_within_rounding, forward_terms, gradient_terms
from helpers import small_llama_config
from transformers import LlamaForCausalLM

from optuna_rapidfire._trainers.grpo import _prefix
from optuna_rapidfire._trainers.grpo._prefix import pair_work, prefix_layout, refusal

PAD = 0


@dataclass
class _Rows:
    """What the layout reads of a request: TRL's rows (prompt left-padded, completion right-padded)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    logits_to_keep: int


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = small_llama_config(
        vocab_size=48, max_position_embeddings=128, pad_token_id=PAD, attn_implementation="sdpa"
    )
    return LlamaForCausalLM(config).eval()


def _request(seed: int, prompts: list[int], generations: int, keep: int) -> _Rows:
    """Rows of ``len(prompts)`` prompts (of those lengths) times ``generations`` completions of up to ``keep``
    tokens, as TRL lays them out: prompts left-padded to the longest, completions right-padded (some short)."""
    generator = torch.Generator().manual_seed(seed)
    width = max(prompts)
    ids, mask = [], []
    for length in prompts:
        prompt = torch.randint(3, 48, (length,), generator=generator).tolist()
        for g in range(generations):
            real = keep - (g % 3)  # completions ending early (after their EOS)
            completion = torch.randint(3, 48, (real,), generator=generator).tolist()
            ids.append([PAD] * (width - length) + prompt + completion + [PAD] * (keep - real))
            mask.append([0] * (width - length) + [1] * (length + real) + [0] * (keep - real))
    return _Rows(torch.tensor(ids), torch.tensor(mask), keep)


def _scores(model: LlamaForCausalLM, requests: list[_Rows], layout: Any) -> list[torch.Tensor]:
    """Each request's completion tokens' log-probabilities (0 where masked), from TRL's rows (``layout`` None,
    each request a pass of its own) or from the packed rows."""
    if layout is not None:
        hidden = model.model(
            input_ids=layout.input_ids, attention_mask=layout.attention_mask, position_ids=layout.position_ids
        ).last_hidden_state
    out = []
    for index, request in enumerate(requests):
        rows, keep, width = len(request.input_ids), request.logits_to_keep, request.input_ids.shape[1]
        if layout is None:
            own = model.model(input_ids=request.input_ids, attention_mask=request.attention_mask).last_hidden_state
            states = own[:, width - keep - 1 : width - 1]
        else:
            states = hidden.reshape(-1, hidden.shape[-1]).index_select(0, layout.states[index].view(-1))
            states = states.view(rows, keep, -1)
        targets = request.input_ids[:, width - keep :]
        log_probs = model.lm_head(states).log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)
        out.append(log_probs.masked_fill(~request.attention_mask[:, width - keep :].bool(), 0.0))
    return out


@pytest.mark.numerics
@pytest.mark.parametrize("order", [(0, 1, 2), (2, 0, 1), (0, 2, 1)])
def test_packed_rows_give_trls_log_probabilities_and_gradients(model: LlamaForCausalLM, order: tuple[int, ...]) -> None:
    """Requests of different prompt widths, completion lengths and generations; one keeps TRL's rows (its
    adapter would draw dropout), wherever it stands. Values and the gradients of their sum match TRL's rows
    within rounding."""
    made = [_request(1, [9, 12, 10], 4, 3), _request(2, [11, 8], 2, 5), _request(3, [6, 6], 3, 4)]
    requests = [made[i] for i in order]
    layout = prefix_layout(requests, [i != 2 for i in order], PAD, torch.device("cpu"))
    assert layout is not None
    # A packed row per prompt; the third request's rows stay their own.
    assert layout.rows == [[3, 2, 6][i] for i in order]
    assert layout.input_ids.shape == (11, 12 + 4 * 3)  # the longest: a prompt 12 wide, then 4 completions of 3
    assert layout.input_ids.numel() < 0.8 * 16 * (12 + 4 + 6)  # TRL's rows: 22 rows of 16 tokens

    model.zero_grad()
    packed = _scores(model, requests, layout)
    torch.stack([p.sum() for p in packed]).sum().backward()
    packed_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    alone = _scores(model, requests, None)
    torch.stack([a.sum() for a in alone]).sum().backward()
    config = model.config
    for mine, theirs in zip(packed, alone, strict=True):
        assert_within_rounding(mine.detach(), theirs.detach(), terms=forward_terms(config, length=24))
    terms = gradient_terms(config, rows=22, length=24)
    for mine, param in zip(packed_grads, model.parameters(), strict=True):
        assert_within_rounding(mine, param.grad, terms=terms)


def test_rows_without_repeated_prompts_are_not_packed() -> None:
    """Packing saves nothing without repeated prompts (or with every request keeping TRL's rows): no layout."""
    assert prefix_layout([_request(4, [5, 7, 6], 1, 4)], [True], PAD, torch.device("cpu")) is None
    assert prefix_layout([_request(5, [5, 7], 4, 4)], [False], PAD, torch.device("cpu")) is None
    assert prefix_layout([_request(5, [5, 7], 4, 4)], [True], PAD, torch.device("cpu")) is not None


def test_packing_that_saves_tokens_but_not_attention_or_keeps_too_many_masks_is_refused(
    model: LlamaForCausalLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompts of 50 with 2 completions of 20: packing computes 36 % fewer tokens (2 rows of 90 against 4 of 70)
    and 83 % of the query-key pairs, so it packs unless a pair weighs as much as a token. Prompts of 40 with 4
    completions of 40 save 37.5 % of the tokens but hold more pairs than TRL's rows (2 x 200^2 against 8 x 80^2):
    packed while the masks the layers keep for the backward stay within the allowance, not beyond it."""
    cpu = torch.device("cpu")
    assert pair_work(model.config) == 2 / (4 * 32 + 3 * 64)
    requests = [_request(7, [50, 50], 2, 20)]
    assert prefix_layout(requests, [True], PAD, cpu) is not None
    assert prefix_layout(requests, [True], PAD, cpu, 1.0) is None
    longer = [_request(6, [40, 40], 4, 40)]
    assert prefix_layout(longer, [True], PAD, cpu, layers=32) is not None
    monkeypatch.setattr(_prefix, "MASK_BYTES", 2 * 32 * 2 * 200**2 - 1)  # a byte short of 32 layers' masks
    assert prefix_layout(longer, [True], PAD, cpu, layers=32) is None
    assert prefix_layout(requests, [True], PAD, cpu, layers=32) is not None  # fewer pairs than TRL's: no bound


def test_models_that_cannot_take_a_packed_mask_are_refused(model: LlamaForCausalLM) -> None:
    assert refusal(model) is None
    eager = LlamaForCausalLM(small_llama_config(vocab_size=48, attn_implementation="eager"))
    assert "'eager' is not 'sdpa'" in str(refusal(eager))
    dropping = LlamaForCausalLM(small_llama_config(vocab_size=48, attn_implementation="sdpa", attention_dropout=0.1))
    assert "dropout" in str(refusal(dropping))
