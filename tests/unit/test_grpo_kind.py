"""The GRPO kind (``_trainers/grpo/_kind.py``): a chunk's prompts laid out as TRL's ``RepeatSampler`` lays them
out, its eval batches, the settings it refuses, and what sets it apart (rewards, no fused loss). Building its
trainer beside other trials: tests/unit/test_trainer_kinds.py."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from datasets import Dataset
from trl import GRPOConfig

from optuna_rapidfire._trainers._base import TrainerExtras
from optuna_rapidfire._trainers.grpo._kind import GRPOKind


def _args(**overrides: Any) -> GRPOConfig:
    return GRPOConfig(**{"bf16": False, "per_device_train_batch_size": 4, "num_generations": 2, **overrides})


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        # 4 rows a generation batch = 2 prompts x 2 completions, used once; the odd last prompt is left out.
        ({}, [[5, 5, 3, 3], [1, 1, 0, 0]]),
        # Each generation batch is reused num_iterations times.
        ({"num_iterations": 2}, [[5, 5, 3, 3], [5, 5, 3, 3], [1, 1, 0, 0], [1, 1, 0, 0]]),
        # Two optimizer-step slices of 2 rows per generation batch of 4: TRL generates once and steps twice.
        ({"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2}, [[5, 5, 3, 3]] * 2 + [[1, 1, 0, 0]] * 2),
        # 3 completions a prompt: 6 rows are 2 prompts.
        ({"per_device_train_batch_size": 6, "num_generations": 3}, [[5, 5, 5, 3, 3, 3], [1, 1, 1, 0, 0, 0]]),
    ],
)
def test_a_chunks_prompts_are_repeated_per_completion_and_each_generation_batch_per_use(
    overrides: dict[str, Any], expected: list[list[int]]
) -> None:
    assert GRPOKind().micro_batches(_args(**overrides), np.array([5, 3, 1, 0, 2])) == expected


def test_a_chunk_with_fewer_prompts_than_a_generation_batch_trains_no_step() -> None:
    assert GRPOKind().micro_batches(_args(), np.array([7])) == []


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"per_device_eval_batch_size": 4}, [[0, 0, 1, 1], [2, 2]]),  # num_generations completions a prompt
        (
            {"per_device_eval_batch_size": 4, "num_generations_eval": 3},
            [[0, 0, 0, 1], [1, 1, 2, 2], [2]],  # its own count for evaluation; a prompt may span two batches
        ),
    ],
)
def test_eval_prompts_are_repeated_per_eval_completion_and_cut_in_eval_batches(
    overrides: dict[str, Any], expected: list[list[int]]
) -> None:
    assert GRPOKind().eval_batches(_args(**overrides), 3) == expected


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"use_vllm": True}, "use_vllm=True is not supported: completions are generated with the shared base"),
        ({"cast_lm_head_to_fp32": True}, "cast_lm_head_to_fp32=True is not supported: it replaces the shared LM head"),
        ({"max_steps": 3}, "max_steps=3 is not supported"),  # and what every kind refuses
    ],
)
def test_settings_that_would_leave_the_shared_model_are_refused(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GRPOKind().check_args(_args(**overrides))


def test_rows_need_a_prompt_column_and_every_trial_shares_the_raw_prompts() -> None:
    kind, extras = GRPOKind(), TrainerExtras()
    assert kind.needed_columns(["prompt", "answer"], _args(), extras) is None
    needed = kind.needed_columns(["question"], _args(), extras)
    assert needed is not None and needed.startswith("a 'prompt' column")
    # Prompts are tokenized in the trainer's generation step: every config shares the raw rows.
    assert kind.data_key(_args()) == kind.data_key(_args(max_completion_length=16, temperature=0.5, num_generations=4))
    rows = Dataset.from_dict({"prompt": ["2+2="]})
    assert kind.prepare(None, rows, "train") is rows  # type: ignore[arg-type]


def test_grpo_trials_need_rewards_sample_completions_report_the_mean_reward_and_train_in_turns() -> None:
    kind = GRPOKind()
    assert kind.needs_rewards and kind.default_metric == "eval_reward"
    assert kind.fused_loss is None
    assert kind.fused_refusal(None, _args()) == "is a GRPO trial (SFT and DPO trials are fused)"  # type: ignore[arg-type]
