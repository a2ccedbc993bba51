"""The DPO kind (``_trainers/_dpo.py``): its fused sigmoid loss and evaluation metrics worked out by hand, which
trials it refuses to fuse, the settings it refuses, and which trials share prepared data. Against TRL's own
loss: tests/unit/test_trainer_kinds.py."""

from __future__ import annotations

import math
import sys
import types
from typing import Any

import pytest
import torch
from _numerics import FLOAT32_EPS, assert_within_rounding
from trl import DPOConfig

from optuna_rapidfire._trainers._base import TrainerExtras
from optuna_rapidfire._trainers._dpo import DPOFusedLoss, DPOKind
from optuna_rapidfire._trainers._fused_loss import EvalRows
from optuna_rapidfire._trainers._sft import SFTFusedLoss

CPU = torch.device("cpu")
DOUBLE_ROUNDING = 8 * sys.float_info.epsilon  # a handful of float64 operations


def _args(**overrides: Any) -> DPOConfig:
    return DPOConfig(**{"bf16": False, "per_device_train_batch_size": 2, **overrides})


def _softplus(x: float) -> float:
    return math.log1p(math.exp(x))


# -- the fused loss ---------------------------------------------------------------------------------

# A pass of two members: member 0 has two pairs (rows: chosen 0, chosen 1, rejected 0, rejected 1), member 1
# one pair (chosen, rejected). Row 3 has two loss tokens, every other row one.
ROWS = [4, 2]
TOKEN_ROWS = [torch.tensor([0, 1, 2, 3, 3]), torch.tensor([0, 1])]


def test_the_lay_out_sums_each_rows_tokens_and_pairs_chosen_row_i_with_rejected_row_i() -> None:
    segment, (row_pairs, pair_members) = DPOFusedLoss().lay_out(ROWS, TOKEN_ROWS, [_args(beta=0.5), _args(beta=2.0)])
    assert segment.tolist() == [0, 1, 2, 3, 3, 4, 5]  # member 1's rows follow member 0's
    assert row_pairs.tolist() == [[0, 1, 0, 1, 2, 2], [1, 1, -1, -1, 1, -1]]  # each row's pair, and its sign
    assert pair_members.tolist() == [[0, 0, 1], [0.5, 0.5, 2.0]]  # each pair's member, and its beta


def test_each_members_loss_is_the_sum_of_its_pairs_sigmoid_losses_with_its_own_beta() -> None:
    loss = DPOFusedLoss()
    segment, extras = loss.lay_out(ROWS, TOKEN_ROWS, [_args(beta=0.5), _args(beta=2.0)])
    where = torch.stack([torch.arange(7), segment, torch.zeros(7, dtype=torch.long)])
    nll = torch.tensor([1.0, 2.0, 1.0, 1.0, 1.0, 3.0, 1.0], requires_grad=True)
    # Rows' log-probabilities: policy [-1, -2, -1, -2, -3, -1], base [-1, -3, -1, -2, -1, -1]; log-ratios
    # [0, 1, 0, 0, -2, 0]; pairs' chosen minus rejected: [0, 1] (member 0), [-2] (member 1).
    base_nll = torch.tensor([1.0, 3.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    reference = loss.reference(lambda: base_nll, where, rows=6)
    assert reference is not None and reference.tolist() == [-1.0, -3.0, -1.0, -2.0, -1.0, -1.0]
    sums = loss.losses(nll, reference, where, extras, rows=6, members=2)
    expected = [_softplus(-0.5 * 0) + _softplus(-0.5 * 1), _softplus(-2.0 * -2)]
    for value, hand in zip(sums.tolist(), expected, strict=True):
        assert_within_rounding(value, hand, terms=len(nll), what="pair losses")
    # A better chosen row lowers the loss: the gradient of a chosen token's nll is positive, a rejected one's negative.
    sums.sum().backward()
    assert nll.grad is not None
    assert nll.grad[1] > 0 and nll.grad[3] < 0 and nll.grad[5] > 0 and nll.grad[6] < 0


def test_only_a_loss_that_compares_with_the_base_pays_for_the_base_pass() -> None:
    calls: list[int] = []

    def base_nll() -> torch.Tensor:
        calls.append(1)
        return torch.tensor([1.0, 2.0])

    where = torch.tensor([[0, 1], [0, 1], [0, 0]])
    assert SFTFusedLoss().reference(base_nll, where, 2) is None and calls == []
    assert DPOFusedLoss().reference(base_nll, where, 2).tolist() == [-1.0, -2.0]  # type: ignore[union-attr]
    assert calls == [1]


@pytest.mark.parametrize(("rows", "divisor", "expected"), [(4, 2, 1 / 4), (4, 1, 1 / 2), (6, 1, 1 / 3)])
def test_a_micro_batch_is_scaled_to_the_mean_over_its_pairs_and_the_divisor(
    rows: int, divisor: int, expected: float
) -> None:
    batch = {"input_ids": torch.zeros(rows, 5, dtype=torch.long)}
    for tokens, count in ((17, None), (3, 40)):  # tokens and the trainer's count play no part
        scale = float(DPOFusedLoss().scale(batch, tokens, count, divisor, CPU))
        assert scale == pytest.approx(expected, rel=FLOAT32_EPS)


def test_the_labels_are_the_next_tokens_of_the_completions_only() -> None:
    batch = {
        "input_ids": torch.tensor([[5, 6, 7, 8], [5, 6, 9, 0]]),
        "completion_mask": torch.tensor([[0, 0, 1, 1], [0, 0, 1, 0]]),
    }
    assert DPOFusedLoss().labels(batch).tolist() == [[-100, 7, 8], [-100, 9, -100]]


def test_eval_metrics_are_dpo_trainers_per_micro_batch_metrics_averaged_and_its_loss_over_pairs() -> None:
    def batch(examples: int, rows: list[tuple[float, ...]]) -> EvalRows:
        """Each row's (log-probability, base log-probability, entropy, top-1 hits, logit sum, tokens)."""
        return EvalRows.of(
            examples, [[lp, ent, top1, logit, tokens, ref] for lp, ref, ent, top1, logit, tokens in rows]
        )

    batches = [
        # chosen 0, chosen 1, rejected 0, rejected 1; log-ratios [1, 0, -2, 0]; rewards (beta 0.5) chosen
        # [0.5, 0], rejected [-1, 0]: margins [1.5, 0], the first pair right, the second a tie.
        batch(2, [(-2, -3, 1, 1, 1, 2), (-4, -4, 2, 1, 3, 2), (-6, -4, 3, 0, 2, 4), (-4, -4, 2, 0, 0, 0)]),
        # One tied pair.
        batch(1, [(-1, -1, 1, 2, 4, 2), (-1, -1, 1, 0, 2, 2)]),
    ]
    metrics = DPOFusedLoss().eval_metrics(types.SimpleNamespace(), _args(beta=0.5), batches)  # type: ignore[arg-type]
    loss = metrics.pop("eval_loss")
    first = (_softplus(-1.5) + math.log(2)) / 2  # the mean of the first micro-batch's pairs
    assert math.isclose(loss, (2 * first + 1 * math.log(2)) / 3, rel_tol=DOUBLE_ROUNDING)
    # Powers of 2 throughout: the values are exact.
    assert metrics == {
        "eval_entropy": (8 / 8 + 2 / 4) / 2,
        "eval_logits/chosen": (4 / 4 + 4 / 2) / 2,
        "eval_logits/rejected": (2 / 4 + 2 / 2) / 2,
        "eval_mean_token_accuracy": (2 / 4 + 2 / 2) / 2,
        "eval_rewards/chosen": (0.25 + 0.0) / 2,
        "eval_rewards/rejected": (-0.5 + 0.0) / 2,
        "eval_rewards/accuracies": (0.5 + 0.0) / 2,  # a tie is not a win
        "eval_rewards/margins": (0.75 + 0.0) / 2,
        "eval_logps/chosen": (-3.0 + -1.0) / 2,
        "eval_logps/rejected": (-5.0 + -1.0) / 2,
        "eval_num_tokens": 0.0,  # nothing trained yet
    }


def test_a_large_log_ratio_gives_a_finite_loss() -> None:
    rows = EvalRows.of(
        1, [[-1.0, 0, 0, 0, 1, -1.0], [-2000.0, 0, 0, 0, 1, -1.0]]
    )  # the rejected row: -1999 below the base
    metrics = DPOFusedLoss().eval_metrics(types.SimpleNamespace(), _args(beta=1.0), [rows])  # type: ignore[arg-type]
    assert metrics["eval_loss"] == 0.0  # log(1 + exp(-1999)) underflows to 0, as it should
    rows = EvalRows.of(1, [[-2000.0, 0, 0, 0, 1, -1.0], [-1.0, 0, 0, 0, 1, -1.0]])
    metrics = DPOFusedLoss().eval_metrics(types.SimpleNamespace(), _args(beta=1.0), [rows])  # type: ignore[arg-type]
    assert metrics["eval_loss"] == 1999.0  # log(1 + exp(1999)) without overflowing


@pytest.mark.parametrize(
    ("trainer", "refusal"),
    [
        ({}, None),
        ({"loss_types": ["sigmoid"], "loss_weights": [1.0]}, None),
        ({"loss_types": ["hinge"]}, "uses DPO loss_type ['hinge'] (the fused pass computes 'sigmoid')"),
        (
            {"loss_types": ["sigmoid", "sft"]},
            "uses DPO loss_type ['sigmoid', 'sft'] (the fused pass computes 'sigmoid')",
        ),
        ({"loss_weights": [0.5]}, "weights its DPO losses"),
        ({"f_divergence_type": "js_divergence"}, "uses an f-divergence other than reverse KL"),
        ({"ld_alpha": 0.5}, "uses ld_alpha or WPO weighting"),
        ({"use_weighting": True}, "uses ld_alpha or WPO weighting"),
        ({"aux_loss_enabled": True}, "adds a router auxiliary loss"),
    ],
)
def test_trials_whose_loss_is_not_the_plain_sigmoid_loss_are_not_fused(
    trainer: dict[str, Any], refusal: str | None
) -> None:
    assert DPOKind().fused_refusal(types.SimpleNamespace(**trainer), _args()) == refusal  # type: ignore[arg-type]


# -- rows, data and arguments -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"precompute_ref_log_probs": True}, "precompute_ref_log_probs=True is not supported"),
        ({"sync_ref_model": True}, "sync_ref_model=True is not supported with LoRA adapters"),
        ({"max_steps": 3}, "max_steps=3 is not supported"),  # and what every kind refuses
    ],
)
def test_reference_settings_the_shared_base_cannot_honour_are_refused(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DPOKind().check_args(_args(**overrides))


def test_rows_need_chosen_and_rejected_answers_and_may_leave_the_prompt_in_them() -> None:
    kind, args, extras = DPOKind(), _args(), TrainerExtras()
    assert kind.needed_columns(["prompt", "chosen", "rejected"], args, extras) is None
    assert kind.needed_columns(["chosen", "rejected"], args, extras) is None
    needed = kind.needed_columns(["prompt", "chosen"], args, extras)
    assert needed is not None and "'prompt', 'chosen' and 'rejected' columns" in needed


def test_trials_share_prepared_pairs_unless_their_tokenization_differs() -> None:
    key = DPOKind().data_key
    base = key(_args())
    assert key(_args(beta=0.5, learning_rate=1e-3, loss_type=["hinge"], seed=3)) == base
    for overrides in ({"max_length": 32}, {"truncation_mode": "keep_end"}, {"remove_unused_columns": False}):
        assert key(_args(**overrides)) != base, overrides
