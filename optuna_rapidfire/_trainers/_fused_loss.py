"""What a trainer kind computes in the fused engine's shared passes.

The fused engine (:mod:`optuna_rapidfire._engines._fused_engine`) lays out and runs one forward/backward for
a gang of trials of one kind; everything in it that differs between kinds is a method of the kind's
:class:`FusedLoss`, which the engine calls and never compares names (as PEFT's LoRA layer calls its
``LoraVariant``): which trials the pass cannot train, which tokens carry the loss, how a micro-batch's loss
is scaled, and the loss itself, and the kind's evaluation metrics from a shared evaluation pass. A kind
without one (GRPO) shares its passes otherwise (:mod:`optuna_rapidfire._trainers.grpo._policy_pass`).

Conventions of a pass, shared with the engine: a pass holds the micro-batches of its members one after
another (``rows`` each); its loss tokens are listed in ``where`` (3 x tokens, on the device): each token's
flat position in the padded batch, the sum it goes into (laid out by :meth:`FusedLoss.lay_out`) and its
label. ``nll`` is every loss token's negative log-probability (float32), in that order.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    from transformers import Trainer, TrainingArguments


@dataclass
class EvalRows:
    """One eval micro-batch of a trial after a shared evaluation pass: how many examples (eval set rows) it
    holds, and for each of its collated rows, sums over the row's loss tokens of: the log-probability, the
    entropy, top-1 predictions and the mean logit (0 unless the kind asks for them, see
    :attr:`FusedLoss.eval_outputs`), the tokens, and the log-probability with the adapters off (0 unless
    :attr:`FusedLoss.eval_reference`)."""

    examples: int
    log_prob: list[float]
    entropy: list[float]
    top1: list[float]
    mean_logit: list[float]
    tokens: list[float]
    reference: list[float]

    @classmethod
    def of(cls, examples: int, rows: list[list[float]]) -> EvalRows:
        """From each row's six sums, in the order of the fields."""
        columns = [list(column) for column in zip(*rows, strict=True)] if rows else [[] for _ in range(6)]
        return cls(examples, *columns)


def mean(values: list[float]) -> float:
    """The mean of ``values`` (at least one)."""
    return sum(values) / len(values)


def ratio(total: float, count: float) -> float:
    """``total / count``, 0 when nothing was counted (as TRL's trainers report their token metrics)."""
    return total / count if count > 0 else 0.0


class FusedLoss(ABC):
    """A trainer kind's loss in a shared pass; stateless (a trial's own settings come from its args)."""

    #: Per-token statistics besides the log-probability that :meth:`eval_metrics` reads (``"entropy"``,
    #: ``"is_top1"``, ``"mean_logits"``; see :func:`~optuna_rapidfire._fused._token_stats.token_stats`).
    eval_outputs: tuple[str, ...] = ()
    #: Whether :meth:`eval_metrics` compares against the base (a pass with the adapters off).
    eval_reference: bool = False
    #: Whether a training micro-batch may get rows of padding (no loss tokens) without changing its loss; a
    #: loss that reads the rows' layout (DPO's chosen, then rejected halves) may not.
    pads_rows: bool = False
    #: Whether a pass's loss tokens may be padded with tokens summed into one more sum (the last of ``members``
    #: in :meth:`losses`), whose scale is zero: the members' sums stay what they are, and the pass's shapes then
    #: depend on its rows only (a CUDA graph of the pass replays for any tokens).
    pads_tokens: bool = False

    def eval_refusal(self) -> str | None:
        """Why the kind's trials evaluate one by one rather than in the gang's shared forward passes
        (``None``: they evaluate together, and :meth:`eval_metrics` gives their metrics). The text completes
        "Evaluating trial by trial, not in shared passes: ..." in the log."""
        return None

    @abstractmethod
    def eval_metrics(self, trainer: Trainer, args: TrainingArguments, batches: list[EvalRows]) -> dict[str, float]:
        """The trial's eval metrics, as its trainer's own evaluation reports them, from its eval micro-batches'
        sums (:class:`EvalRows`)."""

    def refusal(self, trainer: Trainer, args: TrainingArguments) -> str | None:
        """Why the trial's settings ask for a loss this one does not compute (``None``: they do not).

        The text completes "trial N ..." in the log line that says why a gang trains time-sliced.
        """
        return None

    def collate(self, trainer: Trainer, rows: list[dict[str, Any]]) -> dict[str, Any]:
        """The trial's micro-batch as its trainer's collator makes it."""
        return cast("dict[str, Any]", trainer.data_collator(rows))

    @abstractmethod
    def labels(self, batch: dict[str, Any]) -> torch.Tensor:
        """Each position's next-token label in a collated micro-batch (rows x length - 1), -100 where no loss."""

    @abstractmethod
    def scale(self, batch: dict[str, Any], tokens: int, count: Any, divisor: int, device: torch.device) -> torch.Tensor:
        """What a micro-batch's loss sum is multiplied by, as TRL scales its loss under gradient accumulation.

        Args:
            batch: The collated micro-batch.
            tokens: Its loss tokens.
            count: The trainer's item count of the accumulated batch (``None`` when it gives none).
            divisor: What TRL divides the loss by under gradient accumulation (1 when already normalized).
            device: The device of the pass.
        """

    @abstractmethod
    def lay_out(
        self, rows: list[int], token_rows: list[torch.Tensor], args: list[TrainingArguments]
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """How a pass's loss tokens are summed, worked out on the host once per chunk.

        Args:
            rows: Each member's rows in the pass, in order.
            token_rows: For each member, the row (within its own micro-batch) of each of its loss tokens.
            args: Each member's training args.

        Returns:
            The sum each loss token goes into (over all members, in order), and this loss's own tensors
            for the pass (the engine copies them to the device and hands them to :meth:`losses`).
        """

    def reference(self, base_nll: Callable[[], torch.Tensor], where: torch.Tensor, rows: int) -> torch.Tensor | None:
        """What the pass's loss compares against, computed before it (``None``: nothing).

        ``base_nll`` runs the pass with the adapters off and without gradients; only a loss that calls it
        pays for that pass.
        """
        return None

    @abstractmethod
    def losses(
        self,
        nll: torch.Tensor,
        reference: torch.Tensor | None,
        where: torch.Tensor,
        extras: tuple[torch.Tensor, ...],
        rows: int,
        members: int,
    ) -> torch.Tensor:
        """Each member's loss sum in the pass (``members``), before its scale; differentiable.

        Runs inside the pass's mixed-precision context with the gang's adapters applied, once per pass:
        device work only, no host synchronisation.
        """
