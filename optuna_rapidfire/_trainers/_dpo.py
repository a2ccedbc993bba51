"""Preference trials (DPO), driven through TRL's ``DPOTrainer``; the reference is the shared base."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F

from optuna_rapidfire import _compat
from optuna_rapidfire._trainers._base import CollatedKind, TrainerExtras, reference_is_the_base
from optuna_rapidfire._trainers._fused_loss import EvalRows, FusedLoss, mean, ratio
from optuna_rapidfire._trainers._gangs import SHARED_PASSES

if TYPE_CHECKING:
    from collections.abc import Callable, Collection, Hashable

    from datasets import Dataset
    from transformers import PreTrainedTokenizerBase, Trainer, TrainingArguments
    from trl import DPOConfig, DPOTrainer

    from optuna_rapidfire._resident._model import ResidentModel

# DPOConfig fields that change how raw rows become token ids.
_DATA_FIELDS = ("max_length", "truncation_mode", "dataset_num_proc", "remove_unused_columns")


class DPOFusedLoss(FusedLoss):
    """DPO's sigmoid loss in a shared pass, as TRL's ``DPOTrainer`` with a PEFT model computes it.

    The reference is the base (a pass of the whole gang with the adapters off, no gradients); each row's
    log-probability is the sum over its completion tokens; a pair's loss is
    ``-logsigmoid(beta * ((chosen - ref_chosen) - (rejected - ref_rejected)))`` with the trial's own beta,
    averaged over the micro-batch's pairs. A micro-batch holds its chosen rows, then its rejected rows.
    """

    eval_outputs = ("entropy", "is_top1", "mean_logits")
    eval_reference = True

    def eval_metrics(self, trainer: Trainer, args: TrainingArguments, batches: list[EvalRows]) -> dict[str, float]:
        """``DPOTrainer.evaluate``'s metrics: the sigmoid loss (each micro-batch's mean over its pairs, averaged
        over pairs), and per micro-batch, averaged: the entropy, the chosen and rejected completions' mean
        logits, the chosen completions' token accuracy, the implicit rewards (``beta`` times the log-ratio to
        the base), their accuracy and margin, the log-probabilities; and the trained tokens."""
        beta = float(cast("DPOConfig", args).beta)
        examples = sum(batch.examples for batch in batches)
        loss = 0.0
        per_batch: dict[str, list[float]] = {}
        for batch in batches:
            half = len(batch.log_prob) // 2  # the chosen rows, then the rejected rows
            ratios = [p - r for p, r in zip(batch.log_prob, batch.reference, strict=True)]
            chosen, rejected = [beta * x for x in ratios[:half]], [beta * x for x in ratios[half:]]
            losses = [_softplus(r - c) for c, r in zip(chosen, rejected, strict=True)]  # -logsigmoid(c - r)
            loss += batch.examples * mean(losses)
            found = {
                "entropy": ratio(sum(batch.entropy), sum(batch.tokens)),
                "logits/chosen": ratio(sum(batch.mean_logit[:half]), sum(batch.tokens[:half])),
                "logits/rejected": ratio(sum(batch.mean_logit[half:]), sum(batch.tokens[half:])),
                "mean_token_accuracy": ratio(sum(batch.top1[:half]), sum(batch.tokens[:half])),
                "rewards/chosen": mean(chosen),
                "rewards/rejected": mean(rejected),
                "rewards/accuracies": mean([float(c > r) for c, r in zip(chosen, rejected, strict=True)]),
                "rewards/margins": mean([c - r for c, r in zip(chosen, rejected, strict=True)]),
                "logps/chosen": mean(batch.log_prob[:half]),
                "logps/rejected": mean(batch.log_prob[half:]),
            }
            for key, value in found.items():
                per_batch.setdefault(key, []).append(value)
        metrics = {"eval_loss": loss / max(examples, 1)}
        metrics.update({f"eval_{key}": mean(values) for key, values in per_batch.items()})
        if batches:
            metrics["eval_num_tokens"] = float(_compat.train_tokens(trainer))
        return metrics

    def refusal(self, trainer: Trainer, args: TrainingArguments) -> str | None:
        loss_types = list(getattr(trainer, "loss_types", ["sigmoid"]))
        if loss_types != ["sigmoid"]:
            return f"uses DPO loss_type {loss_types} (the fused pass computes 'sigmoid')"
        weights = getattr(trainer, "loss_weights", None)
        if weights is not None and list(weights) != [1.0]:
            return "weights its DPO losses"
        if str(getattr(trainer, "f_divergence_type", "reverse_kl")) != "reverse_kl":
            return "uses an f-divergence other than reverse KL"
        if getattr(trainer, "ld_alpha", None) is not None or getattr(trainer, "use_weighting", False):
            return "uses ld_alpha or WPO weighting"
        if getattr(trainer, "aux_loss_enabled", False):
            return "adds a router auxiliary loss"
        return None

    def labels(self, batch: dict[str, Any]) -> torch.Tensor:
        # The completion tokens of each chosen / rejected row, as TRL's labels.
        return cast("torch.Tensor", batch["input_ids"][:, 1:].masked_fill(batch["completion_mask"][:, 1:] == 0, -100))

    def scale(self, batch: dict[str, Any], tokens: int, count: Any, divisor: int, device: torch.device) -> torch.Tensor:
        # The mean of the micro-batch's pairs' losses, over the divisor.
        return torch.full((), 1.0 / (len(batch["input_ids"]) // 2 * divisor), device=device)

    def lay_out(
        self, rows: list[int], token_rows: list[torch.Tensor], args: list[TrainingArguments]
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """One sum per row (its log-probability); the extras give each row's pair and sign (+1 chosen, -1
        rejected; 2 x rows) and each pair's member and beta (2 x pairs)."""
        segments: list[torch.Tensor] = []
        pairs: list[torch.Tensor] = []
        members: list[torch.Tensor] = []
        betas: list[float] = []
        offset = 0
        for j, (count, row, trial_args) in enumerate(zip(rows, token_rows, args, strict=True)):
            segments.append(row + offset)
            half = count // 2  # chosen row i and rejected row half + i share pair i
            pairs.append(len(betas) + torch.arange(count) % half)
            members.append(torch.full((half,), j))
            betas.extend([float(cast("DPOConfig", trial_args).beta)] * half)
            offset += count
        signs = torch.cat([torch.cat([torch.ones(r // 2), -torch.ones(r // 2)]) for r in rows])
        row_pairs = torch.stack([torch.cat(pairs).float(), signs])
        pair_members = torch.stack([torch.cat(members).float(), torch.tensor(betas)])
        return torch.cat(segments), (row_pairs, pair_members)

    def reference(self, base_nll: Callable[[], torch.Tensor], where: torch.Tensor, rows: int) -> torch.Tensor:
        """Each row's log-probability under the base."""
        reference = -base_nll()
        return reference.new_zeros(rows).index_add_(0, where[1], reference)

    def losses(
        self,
        nll: torch.Tensor,
        reference: torch.Tensor | None,
        where: torch.Tensor,
        extras: tuple[torch.Tensor, ...],
        rows: int,
        members: int,
    ) -> torch.Tensor:
        assert reference is not None
        row_pairs, pair_members = extras
        pair_of_row, sign = row_pairs[0].long(), row_pairs[1]
        member_of_pair, beta = pair_members[0].long(), pair_members[1]
        policy = -nll
        policy_rows = policy.new_zeros(rows).index_add_(0, where[1], policy)
        ratios = (policy_rows - reference) * sign
        delta = ratios.new_zeros(len(beta)).index_add_(0, pair_of_row, ratios)
        pair_losses = -F.logsigmoid(beta * delta)
        return pair_losses.new_zeros(members).index_add_(0, member_of_pair, pair_losses)


def _softplus(x: float) -> float:
    """``log(1 + exp(x))``, without overflow."""
    return x + math.log1p(math.exp(-x)) if x > 0 else math.log1p(math.exp(x))


class DPOKind(CollatedKind):
    """``DPOConfig`` → TRL's ``DPOTrainer`` (prompt/chosen/rejected rows; metric ``eval_loss`` by default).

    TRL's reward metrics are reported too: ``eval_rewards/accuracies``, ``eval_rewards/margins``...
    """

    name = "dpo"
    default_metric = "eval_loss"
    gang = SHARED_PASSES
    fused_loss = DPOFusedLoss()

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
        prepared = _compat.dpo_prepare(dpo, dataset, processing, args, split)
        if args.remove_unused_columns:
            signature = _compat.signature_columns(dpo)
            prepared = prepared.select_columns([c for c in prepared.column_names if c in signature])
        return cast("Dataset", prepared)
