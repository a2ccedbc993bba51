"""Whether a gang can share its passes: the one place that decides, for every engine path.

A gang's members share a forward/backward pass only when nothing of one member's training depends on the
others': the same trainer kind and precision, no per-trial grad scaler, activation checkpointing and base
dropout set alike, LoRA layers the fused pass implements. What a kind or a layer cannot do is asked of it
(:meth:`TrainerKind.fused_refusal`, :func:`~optuna_rapidfire._fused._fused_pass.unsupported`); what a
launched (compiled) pass needs besides is :meth:`LaunchedPasses.refusal`'s. Each function returns why not,
in words for the log, or ``None``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from optuna_rapidfire._fused._fused_pass import lora_layers
from optuna_rapidfire._trainers._gangs import pass_refusal

if TYPE_CHECKING:
    from collections.abc import Sequence

    from optuna_rapidfire._engines._types import TrialRuntime
    from optuna_rapidfire._resident._model import ResidentModel
    from optuna_rapidfire._trainers._base import TrainerExtras


def train_refusal(resident: ResidentModel, extras: TrainerExtras, runtimes: Sequence[TrialRuntime]) -> str | None:
    """Why these trials cannot share a pass (``None``: they can)."""
    first = runtimes[0]
    for runtime in runtimes:
        reason = runtime.spec.kind.fused_refusal(runtime.trainer, runtime.args)
        if reason is not None:
            return f"trial {runtime.spec.number} {reason}"
        if getattr(runtime.args, "padding_free", False) or getattr(runtime.trainer, "padding_free", False):
            # SFTTrainer packs padding-free by itself with packing=True and its default strategy ("bfd").
            return f"trial {runtime.spec.number} uses padding-free packing"
    reason = pass_refusal(resident, runtimes)
    if reason is not None:
        return reason
    if first.spec.kind.checkpointing(first.args)[0]:
        for layer in lora_layers(resident.module):
            for runtime in runtimes:
                name = runtime.state.adapter_name
                dropout = layer.lora_dropout[name] if name in layer.lora_dropout else None  # noqa: SIM401
                if dropout is not None and float(getattr(dropout, "p", 0.0)) > 0:
                    # Recomputing a checkpointed block would draw other masks from the trial's generator.
                    return "activation checkpointing with lora_dropout > 0"
    if extras.compute_metrics is not None or getattr(first.trainer, "compute_loss_func", None) is not None:
        return "a custom loss or metrics function is set"
    return None
