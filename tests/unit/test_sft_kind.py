"""The SFT kind (``_trainers/_sft.py``): which rows it takes, which trials share prepared data, and its fused
loss worked out by hand (token sums, scaling, evaluation metrics). Against TRL's own loss:
tests/unit/test_trainer_kinds.py."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
from datasets import Dataset
from helpers import sft_args

from optuna_rapidfire._trainers._base import TrainerExtras
from optuna_rapidfire._trainers._fused_loss import EvalRows
from optuna_rapidfire._trainers._sft import SFTFusedLoss, SFTKind

CPU = torch.device("cpu")
NO_EXTRAS = TrainerExtras()


def _rows(examples: int, *rows: tuple[float, float, float, float]) -> EvalRows:
    """An eval micro-batch from each row's (log-probability, entropy, top-1 hits, tokens)."""
    return EvalRows.of(examples, [[lp, ent, top1, 0.0, tokens, 0.0] for lp, ent, top1, tokens in rows])


# -- the fused loss ---------------------------------------------------------------------------------


def test_each_members_loss_is_the_sum_of_its_tokens_nll() -> None:
    loss = SFTFusedLoss()
    token_rows = [torch.tensor([0, 0, 1]), torch.tensor([1])]  # member 0: three tokens, member 1: one
    segment, extras = loss.lay_out([2, 2], token_rows, [sft_args(), sft_args()])
    assert segment.tolist() == [0, 0, 0, 1] and extras == ()
    nll = torch.tensor([1.0, 2.0, 0.5, 4.0])
    where = torch.stack([torch.arange(4), segment, torch.zeros(4, dtype=torch.long)])
    assert loss.losses(nll, None, where, extras, rows=4, members=3).tolist() == [3.5, 4.0, 0.0]  # no tokens: 0


def test_the_losses_carry_the_gradient_of_each_token_to_its_own_member() -> None:
    loss = SFTFusedLoss()
    nll = torch.tensor([1.0, 2.0, 0.5], requires_grad=True)
    where = torch.tensor([[0, 1, 2], [1, 0, 1], [0, 0, 0]])
    sums = loss.losses(nll, None, where, (), rows=2, members=2)
    (sums * torch.tensor([10.0, 100.0])).sum().backward()
    assert nll.grad is not None and nll.grad.tolist() == [100.0, 10.0, 100.0]


@pytest.mark.parametrize(
    ("tokens", "count", "divisor", "expected"),
    [
        (8, None, 2, 1 / 16),  # no count from the trainer: the micro-batch's own tokens
        (8, 4, 2, 1 / 8),  # the accumulated batch's count wins over the micro-batch's tokens
        (8, torch.tensor(32), 1, 1 / 32),  # TRL counts in a tensor
        (8, 0, 2, 1 / 2),  # nothing counted: divided by 1, never by 0
    ],
)
def test_a_micro_batch_is_scaled_by_the_accumulated_tokens_and_the_divisor(
    tokens: int, count: Any, divisor: int, expected: float
) -> None:
    assert float(SFTFusedLoss().scale({}, tokens, count, divisor, CPU)) == expected  # powers of 2: exact


def test_the_labels_are_the_next_tokens() -> None:
    batch = {"labels": torch.tensor([[1, 2, 3], [4, 5, -100]]), "input_ids": torch.tensor([[9, 9, 9], [9, 9, 9]])}
    assert SFTFusedLoss().labels(batch).tolist() == [[2, 3], [5, -100]]


def test_eval_metrics_are_sft_trainers_per_micro_batch_means_averaged_over_examples() -> None:
    batches = [
        _rows(2, (-3.0, 1.0, 2.0, 2.0), (-5.0, 2.0, 2.0, 2.0)),  # loss 8/4 = 2, entropy 3/4, accuracy 4/4
        _rows(2, (-4.0, 2.0, 1.0, 4.0)),  # loss 4/4 = 1, entropy 2/4, accuracy 1/4
    ]
    metrics = SFTFusedLoss().eval_metrics(types.SimpleNamespace(), sft_args(), batches)  # type: ignore[arg-type]
    # Powers of 2 throughout: the values are exact.
    assert metrics == {
        "eval_loss": (2 * 2.0 + 2 * 1.0) / 4,
        "eval_entropy": (0.75 + 0.5) / 2,
        "eval_mean_token_accuracy": (1.0 + 0.25) / 2,
        "eval_num_tokens": 0.0,  # nothing trained yet
    }


def test_a_micro_batch_without_loss_tokens_counts_zero_entropy_and_accuracy() -> None:
    batches = [_rows(1, (-2.0, 1.0, 1.0, 2.0)), _rows(1, (0.0, 0.0, 0.0, 0.0))]
    metrics = SFTFusedLoss().eval_metrics(types.SimpleNamespace(), sft_args(), batches)  # type: ignore[arg-type]
    assert (
        metrics["eval_loss"] == 0.5 and metrics["eval_entropy"] == 0.25 and metrics["eval_mean_token_accuracy"] == 0.25
    )


@pytest.mark.parametrize(
    ("overrides", "refused"),
    [({}, False), ({"loss_type": "dft"}, True), ({"label_smoothing_factor": 0.1}, True)],
)
def test_only_plain_nll_trains_in_a_shared_pass(overrides: dict[str, Any], refused: bool) -> None:
    args = sft_args(**overrides)
    expected = "uses a loss other than plain NLL" if refused else None
    assert SFTKind().fused_refusal(types.SimpleNamespace(), args) == expected  # type: ignore[arg-type]


# -- rows, data and arguments -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "columns",
    [["text"], ["messages"], ["prompt", "completion", "id"], ["input_ids", "attention_mask"]],
)
def test_rows_of_any_format_sft_trainer_prepares_are_accepted(columns: list[str]) -> None:
    assert SFTKind().needed_columns(columns, sft_args(), NO_EXTRAS) is None


def test_rows_it_cannot_prepare_are_refused_naming_the_formats_it_takes() -> None:
    needed = SFTKind().needed_columns(["prompt", "answer"], sft_args(), NO_EXTRAS)
    assert needed is not None and "a 'text' column (SFTConfig.dataset_text_field)" in needed
    assert "'prompt' and 'completion'" in needed and "formatting_func=" in needed


def test_the_text_column_is_the_one_the_args_name_and_a_formatting_func_takes_any_rows() -> None:
    body = sft_args(dataset_text_field="body")
    assert SFTKind().needed_columns(["body"], body, NO_EXTRAS) is None
    needed = SFTKind().needed_columns(["text"], body, NO_EXTRAS)
    assert needed is not None and needed.startswith("a 'body' column")
    formatted = TrainerExtras(formatting_func=lambda row: str(row["question"]))
    assert SFTKind().needed_columns(["question"], sft_args(), formatted) is None


def test_a_bad_dataset_is_named_with_the_columns_it_has_before_any_trial_trains() -> None:
    good, bad = Dataset.from_dict({"text": ["a"]}), Dataset.from_dict({"question": ["a"]})
    SFTKind().check_columns(good, good, sft_args(), NO_EXTRAS)
    with pytest.raises(ValueError, match=r"eval_dataset has the columns \['question'\], but SFTConfig trials need"):
        SFTKind().check_columns(good, bad, sft_args(), NO_EXTRAS)


def test_trials_share_prepared_data_unless_a_setting_of_the_preparation_differs() -> None:
    key = SFTKind().data_key
    base = key(sft_args())
    assert key(sft_args(learning_rate=3e-4, seed=7, per_device_train_batch_size=2, num_train_epochs=2)) == base
    for overrides in (
        {"max_length": 64},
        {"packing": True},
        {"completion_only_loss": False},
        {"dataset_text_field": "x"},
    ):
        assert key(sft_args(**overrides)) != base, overrides


def test_effective_args_keep_the_users_dataset_kwargs_and_skip_trls_own_preparation_and_shuffling(
    tmp_path: Any,
) -> None:
    args = sft_args(dataset_kwargs={"add_special_tokens": False}, shuffle_dataset=True)
    effective = SFTKind().effective_args(args, str(tmp_path), CPU)
    assert effective.dataset_kwargs == {"add_special_tokens": False, "skip_prepare_dataset": True}
    assert args.dataset_kwargs == {"add_special_tokens": False}
    assert effective.shuffle_dataset is False


def test_a_formatting_func_with_completion_only_loss_on_prompt_rows_is_refused_before_building() -> None:
    rows = Dataset.from_dict({"prompt": ["2+2="], "completion": ["4"]})
    extras = TrainerExtras(formatting_func=lambda row: row["prompt"] + row["completion"])
    unused = types.SimpleNamespace(peft=None)  # refused before the model is looked at
    with pytest.raises(ValueError, match="formatting_func cannot be combined with completion_only_loss=True"):
        SFTKind().build_trainer(unused, sft_args(completion_only_loss=True), rows, extras)  # type: ignore[arg-type]
