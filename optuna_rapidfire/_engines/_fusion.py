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

from optuna_rapidfire._fused._fused_pass import lora_layers, unsupported

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


def policy_refusal(resident: ResidentModel, runtimes: Sequence[TrialRuntime]) -> str | None:
    """Why a GRPO gang's steps cannot share their forward and backward passes (``None``: they can)."""
    for runtime in runtimes:
        if runtime.spec.kind.checkpointing(runtime.args)[0]:
            return f"trial {runtime.spec.number} uses activation checkpointing"
        if getattr(runtime.trainer, "aux_loss_enabled", False):
            return f"trial {runtime.spec.number} adds a router auxiliary loss"
    return pass_refusal(resident, runtimes)


def pass_refusal(resident: ResidentModel, runtimes: Sequence[TrialRuntime]) -> str | None:
    """What keeps any gang from sharing a forward/backward pass (``None``: nothing): mixed trainer types,
    fp16 (one grad scaler per trial), mixed precision, activation checkpointing or base dropout, and
    LoRA variants the fused pass does not implement."""
    first = runtimes[0]
    settings = _pass_settings(first)
    for runtime in runtimes:
        if type(runtime.spec.kind) is not type(first.spec.kind):
            return "the trials differ in trainer type"
        if bool(getattr(runtime.args, "fp16", False)):
            return f"trial {runtime.spec.number} trains in fp16 (its grad scaler is per trial)"
        own = _pass_settings(runtime)
        if own[:2] != settings[:2]:
            return "the trials differ in precision or activation checkpointing"
        if own[2] != settings[2]:
            return "the trials differ in disable_dropout"
    for layer in lora_layers(resident.module):
        for runtime in runtimes:
            reason = unsupported(layer, runtime.state.adapter_name)
            if reason is not None:
                return reason
    return None


def generation_refusal(runtimes: Sequence[TrialRuntime]) -> str | None:
    """Why a gang of trials that sample completions cannot generate together (``None``: it can)."""
    first = runtimes[0]
    precision = (bool(first.args.bf16), bool(getattr(first.args, "fp16", False)))
    for runtime in runtimes[1:]:
        if type(runtime.spec.kind) is not type(first.spec.kind):
            return "the trials differ in trainer type"
        if (bool(runtime.args.bf16), bool(getattr(runtime.args, "fp16", False))) != precision:
            return "the trials differ in precision"
    return None


def _pass_settings(runtime: TrialRuntime) -> tuple[bool, bool, bool]:
    """What a shared pass sets for all its members: bf16, activation checkpointing, base dropout off."""
    kind, args = runtime.spec.kind, runtime.args
    return bool(args.bf16), kind.checkpointing(args)[0], kind.base_dropout_off(args)
