"""Online RL trials (GRPO), driven through TRL's ``GRPOTrainer``: generation uses the shared base with the
trial's adapter, and the metric is the mean reward on the eval prompts."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch

from optuna_rapidfire._trainers._base import TrainerExtras, TrainerKind, reference_is_the_base
from optuna_rapidfire._trainers.grpo._gang import GENERATION_TURNS
from optuna_rapidfire._trainers.grpo._prompts import share_tokenized_prompts

if TYPE_CHECKING:
    from collections.abc import Collection, Hashable

    import numpy as np
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments
    from trl import GRPOConfig, GRPOTrainer

    from optuna_rapidfire._resident._model import ResidentModel


class GRPOKind(TrainerKind):
    """``GRPOConfig`` → TRL's ``GRPOTrainer``; the executor's ``reward_funcs`` score completions.

    A chunk's prompts are visited in generation batches exactly as TRL's ``RepeatSampler`` lays them out:
    each prompt repeated ``num_generations`` times, each generation batch fed ``num_iterations x
    steps_per_generation`` times (TRL generates once and reuses the completions).
    """

    name = "grpo"
    default_metric = "eval_reward"
    needs_rewards = True
    # Generation dominates a GRPO step: the fused engine's GRPO gangs generate together, in one decode
    # batch, and share the forward and backward passes of their policy steps, each member computing TRL's
    # own loss (no fused loss of its own: see _trainers/grpo/_generation.py and _trainers/grpo/_policy_pass.py).
    gang = GENERATION_TURNS

    @classmethod
    def args_type(cls) -> type[TrainingArguments]:
        from trl import GRPOConfig

        return GRPOConfig

    def check_args(self, args: TrainingArguments) -> list[str]:
        grpo = cast("GRPOConfig", args)
        if grpo.use_vllm:
            raise ValueError(
                "GRPOConfig.use_vllm=True is not supported: completions are generated with the shared base model "
                "and the trial's own adapter."
            )
        if grpo.cast_lm_head_to_fp32:
            raise ValueError("GRPOConfig.cast_lm_head_to_fp32=True is not supported: it replaces the shared LM head.")
        return super().check_args(args)

    def needed_columns(self, columns: Collection[str], args: TrainingArguments, extras: TrainerExtras) -> str | None:
        return None if "prompt" in columns else "a 'prompt' column (and the columns the reward functions read)"

    def data_key(self, args: TrainingArguments) -> Hashable:
        return ("grpo",)  # prompts are tokenized on the fly, in the trainer's generation step

    def build_trainer(
        self,
        resident: ResidentModel,
        args: TrainingArguments,
        sample: Dataset,
        extras: TrainerExtras,
    ) -> Trainer:
        from trl import GRPOTrainer

        assert resident.peft is not None, "the trial's adapter is created before its trainer"
        with reference_is_the_base(resident, args):
            trainer = GRPOTrainer(
                model=resident.peft,
                reward_funcs=list(extras.reward_funcs),
                args=cast("GRPOConfig", args),
                train_dataset=sample,
                processing_class=resident.tokenizer,
                reward_processing_classes=list(extras.reward_processing_classes) or None,
            )
        share_tokenized_prompts(trainer)  # the trials of a device tokenize each prompt once
        return trainer

    def prepare(self, trainer: Trainer, dataset: Dataset, split: str) -> Dataset:
        return dataset

    def micro_batches(self, args: TrainingArguments, order: np.ndarray) -> list[list[int]]:
        grpo = cast("GRPOConfig", args)
        generations = grpo.num_generations
        assert generations is not None and grpo.generation_batch_size is not None
        prompts = grpo.generation_batch_size // generations
        repeats = grpo.num_iterations * (grpo.steps_per_generation or 1)
        batches = []
        for start in range(0, len(order) - prompts + 1, prompts):
            rows = [int(i) for i in order[start : start + prompts] for _ in range(generations)]
            batches.extend([rows] * repeats)
        return batches

    def eval_batches(self, args: TrainingArguments, size: int) -> list[list[int]]:
        grpo = cast("GRPOConfig", args)
        generations = grpo.num_generations_eval or grpo.num_generations or 1
        rows = [i for i in range(size) for _ in range(generations)]
        step = args.per_device_eval_batch_size
        return [rows[start : start + step] for start in range(0, len(rows), step)]

    def accumulate(
        self,
        trainer: Trainer,
        model: torch.nn.Module,
        batches: list[list[dict[str, Any]]],
        device: torch.device,
        scaler: torch.amp.GradScaler | None,
    ) -> torch.Tensor:
        grpo = cast("GRPOTrainer", trainer)
        grpo.current_gradient_accumulation_steps = len(batches)
        total = torch.zeros((), device=device)
        for rows in batches:
            # TRL's own step: generate (or reuse buffered completions), score, loss, backward.
            with self.autocast(trainer.args, device):
                total += grpo.training_step(model, rows, None).to(device)
        return total

    def eval_batch(
        self,
        trainer: Trainer,
        model: torch.nn.Module,
        rows: list[dict[str, Any]],
        device: torch.device,
        with_outputs: bool,
    ) -> tuple[torch.Tensor, int, Any, Any]:
        with self.autocast(trainer.args, device):
            inputs = cast("dict[str, Any]", rows)  # GRPO's prediction step takes the rows themselves
            loss, _, _ = trainer.prediction_step(model, inputs, prediction_loss_only=True)
        assert loss is not None
        return loss, len(rows), None, None
