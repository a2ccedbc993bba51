"""Supervised fine-tuning trials, driven through TRL's ``SFTTrainer``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch

from optuna_rapidfire import _compat
from optuna_rapidfire._trainers._base import CollatedKind, TrainerExtras
from optuna_rapidfire._trainers._fused_loss import EvalRows, FusedLoss, mean, ratio
from optuna_rapidfire._trainers._gangs import SHARED_PASSES

if TYPE_CHECKING:
    from collections.abc import Collection, Hashable

    from datasets import Dataset
    from transformers import PreTrainedTokenizerBase, Trainer, TrainingArguments
    from trl import SFTConfig, SFTTrainer

    from optuna_rapidfire._resident._model import ResidentModel

# SFTConfig fields that change how raw rows become token ids (and so which trials share prepared data).
_DATA_FIELDS = (
    "max_length",
    "packing",
    "packing_strategy",
    "padding_free",
    "completion_only_loss",
    "assistant_only_loss",
    "dataset_text_field",
    "truncation_mode",
    "eos_token",
    "chat_template_path",
    "eval_packing",
    "remove_unused_columns",
    "dataset_num_proc",
)


class SFTFusedLoss(FusedLoss):
    """SFT in a shared pass: the shifted labels' negative log-probabilities, summed per trial and divided by
    the tokens of the trial's own accumulated batch (at least 1), as TRL's loss under gradient accumulation."""

    eval_outputs = ("entropy", "is_top1")
    pads_rows = True
    pads_tokens = True

    def eval_metrics(self, trainer: Trainer, args: TrainingArguments, batches: list[EvalRows]) -> dict[str, float]:
        """``SFTTrainer.evaluate``'s metrics: the loss (each micro-batch's mean over its tokens, averaged over
        examples), and the micro-batches' mean entropy and token accuracy, and the trained tokens."""
        examples = sum(batch.examples for batch in batches)
        loss = sum(batch.examples * -sum(batch.log_prob) / max(sum(batch.tokens), 1.0) for batch in batches)
        metrics = {"eval_loss": loss / max(examples, 1)}
        if batches:
            metrics["eval_entropy"] = mean([ratio(sum(b.entropy), sum(b.tokens)) for b in batches])
            metrics["eval_mean_token_accuracy"] = mean([ratio(sum(b.top1), sum(b.tokens)) for b in batches])
            metrics["eval_num_tokens"] = float(_compat.train_tokens(trainer))
        return metrics

    def refusal(self, trainer: Trainer, args: TrainingArguments) -> str | None:
        if getattr(args, "loss_type", "nll") != "nll" or getattr(args, "label_smoothing_factor", 0.0):
            return "uses a loss other than plain NLL"
        return None

    def labels(self, batch: dict[str, Any]) -> torch.Tensor:
        return cast("torch.Tensor", batch["labels"][:, 1:])

    def scale(self, batch: dict[str, Any], tokens: int, count: Any, divisor: int, device: torch.device) -> torch.Tensor:
        # The micro-batch's own tokens when the trainer gives no count.
        total = torch.as_tensor(count if count is not None else tokens, device=device)
        return 1.0 / (total.float().clamp(min=1) * divisor)

    def lay_out(
        self, rows: list[int], token_rows: list[torch.Tensor], args: list[TrainingArguments]
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        # One sum per member: its token losses.
        return torch.cat([torch.full_like(row, j) for j, row in enumerate(token_rows)]), ()

    def losses(
        self,
        nll: torch.Tensor,
        reference: torch.Tensor | None,
        where: torch.Tensor,
        extras: tuple[torch.Tensor, ...],
        rows: int,
        members: int,
    ) -> torch.Tensor:
        return nll.new_zeros(members).index_add_(0, where[1], nll)


class SFTKind(CollatedKind):
    """``SFTConfig`` → TRL's ``SFTTrainer``: loss, collator, data preparation, optimizer and schedule."""

    name = "sft"
    default_metric = "eval_loss"
    gang = SHARED_PASSES
    fused_loss = SFTFusedLoss()

    @classmethod
    def args_type(cls) -> type[TrainingArguments]:
        from trl import SFTConfig

        return SFTConfig

    def needed_columns(self, columns: Collection[str], args: TrainingArguments, extras: TrainerExtras) -> str | None:
        text_field = getattr(args, "dataset_text_field", "text")
        usable = (
            extras.formatting_func is not None
            or text_field in columns
            or "messages" in columns
            or "input_ids" in columns
            or {"prompt", "completion"} <= set(columns)
        )
        if usable:
            return None
        return (
            f"a {text_field!r} column (SFTConfig.dataset_text_field), 'messages' (conversations), 'prompt' and "
            "'completion', or 'input_ids' (tokenized); or pass formatting_func= to the executor"
        )

    def data_key(self, args: TrainingArguments) -> Hashable:
        return ("sft", *(repr(getattr(args, f, None)) for f in _DATA_FIELDS))

    def build_trainer(
        self,
        resident: ResidentModel,
        args: TrainingArguments,
        sample: Dataset,
        extras: TrainerExtras,
    ) -> Trainer:
        from trl import SFTTrainer

        if (
            extras.formatting_func is not None
            and getattr(args, "completion_only_loss", None)
            and ("prompt" in sample.column_names)
        ):
            raise ValueError(
                "formatting_func cannot be combined with completion_only_loss=True: format the dataset "
                "before passing it, or set completion_only_loss=False."
            )
        assert resident.peft is not None, "the trial's adapter is created before its trainer"
        return SFTTrainer(
            model=resident.peft,
            args=args,
            train_dataset=sample,
            processing_class=resident.tokenizer,
            compute_metrics=extras.compute_metrics,
            preprocess_logits_for_metrics=extras.preprocess_logits_for_metrics,
            formatting_func=extras.formatting_func,
        )

    def prepare(self, trainer: Trainer, dataset: Dataset, split: str) -> Dataset:
        sft = cast("SFTTrainer", trainer)
        args = cast("SFTConfig", sft.args)
        packing = args.packing
        if split == "eval" and args.eval_packing is not None:
            packing = args.eval_packing
        processing = cast("PreTrainedTokenizerBase", sft.processing_class)
        prepared = _compat.sft_prepare(sft, dataset, processing, args, packing, split)
        if args.remove_unused_columns:
            signature = _compat.signature_columns(sft)
            prepared = prepared.select_columns([c for c in prepared.column_names if c in signature])
        return cast("Dataset", prepared)
