"""Preference trials (DPO), driven through TRL's ``DPOTrainer``; the reference is the shared base."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from optuna_rapidfire._trainers._base import CollatedKind, TrainerExtras, reference_is_the_base

if TYPE_CHECKING:
    from collections.abc import Collection, Hashable

    from datasets import Dataset
    from transformers import PreTrainedTokenizerBase, Trainer, TrainingArguments
    from trl import DPOConfig, DPOTrainer

    from optuna_rapidfire._model import ResidentModel

# DPOConfig fields that change how raw rows become token ids.
_DATA_FIELDS = ("max_length", "truncation_mode", "dataset_num_proc", "remove_unused_columns")


class DPOKind(CollatedKind):
    """``DPOConfig`` → TRL's ``DPOTrainer`` (prompt/chosen/rejected rows; metric ``eval_loss`` by default).

    TRL's reward metrics are reported too: ``eval_rewards/accuracies``, ``eval_rewards/margins``...
    """

    name = "dpo"
    default_metric = "eval_loss"

    @classmethod
    def args_type(cls) -> type[TrainingArguments]:
        from trl import DPOConfig

        return DPOConfig

    def check_args(self, args: TrainingArguments) -> list[str]:
        dpo = cast("DPOConfig", args)
        if dpo.precompute_ref_log_probs:
            raise ValueError(
                "DPOConfig.precompute_ref_log_probs=True is not supported: the executor computes reference "
                "log-probabilities with the shared base model (adapters disabled) in each step."
            )
        if dpo.sync_ref_model:
            raise ValueError("DPOConfig.sync_ref_model=True is not supported with LoRA adapters (TRL neither).")
        return super().check_args(args)

    def needed_columns(self, columns: Collection[str], args: TrainingArguments, extras: TrainerExtras) -> str | None:
        if {"chosen", "rejected"} <= set(columns):
            return None
        return "'prompt', 'chosen' and 'rejected' columns ('prompt' may be left out when both answers begin with it)"

    def data_key(self, args: TrainingArguments) -> Hashable:
        return ("dpo", *(repr(getattr(args, f, None)) for f in _DATA_FIELDS))

    def build_trainer(
        self,
        resident: ResidentModel,
        args: TrainingArguments,
        sample: Dataset,
        extras: TrainerExtras,
    ) -> Trainer:
        from trl import DPOTrainer

        assert resident.peft is not None, "the trial's adapter is created before its trainer"
        with reference_is_the_base(resident, args):
            return DPOTrainer(
                model=resident.peft,
                args=cast("DPOConfig", args),
                train_dataset=sample,
                processing_class=resident.tokenizer,
                compute_metrics=extras.compute_metrics,
            )

    def prepare(self, trainer: Trainer, dataset: Dataset, split: str) -> Dataset:
        dpo = cast("DPOTrainer", trainer)
        args = cast("DPOConfig", dpo.args)
        processing = cast("PreTrainedTokenizerBase", dpo.processing_class)
        prepared = dpo._prepare_dataset(dataset, processing, args, split)
        if args.remove_unused_columns:
            dpo._set_signature_columns_if_needed()
            signature: list[str] = dpo._signature_columns or []
            prepared = prepared.select_columns([c for c in prepared.column_names if c in signature])
        return cast("Dataset", prepared)
