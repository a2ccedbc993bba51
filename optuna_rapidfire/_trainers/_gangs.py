"""How the fused engine trains a gang of one kind's trials: a strategy object the kind names, the engine calls.

As PEFT's LoRA variants are objects a layer calls, a :class:`GangStrategy` is what a
:class:`~optuna_rapidfire._trainers._base.TrainerKind` brings to the fused engine (its ``gang`` attribute). The
engine hands the strategy itself as a :class:`~optuna_rapidfire._trainers._host.GangEngine` (what it can do:
shared passes, time slicing, one member's chunk) and the strategy chooses; a kind with a way of its own (GRPO's
shared decode) keeps its code with the kind, built on the device the first time one of its trials is. Kinds
never import engines.

:func:`pass_refusal` says what keeps any gang from sharing a forward/backward pass; the engines and the kinds'
strategies ask it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar, TypeVar

from optuna_rapidfire._fused._fused_pass import lora_layers, unsupported

if TYPE_CHECKING:
    from collections.abc import Sequence

    from optuna_rapidfire._resident._model import ResidentModel
    from optuna_rapidfire._trainers._host import GangEngine, GangHost, Member

R = TypeVar("R")


class GangStrategy(ABC):
    """How the fused engine trains a gang of one kind's trials."""

    #: The strategy's gangs may stream (:mod:`optuna_rapidfire._engines._gang_stream`): members join and leave
    #: between shared passes.
    streams: ClassVar[bool] = False

    def install(self, host: GangHost, member: Member) -> None:  # noqa: B027 (a hook: most strategies need none)
        """Prepare a trial of the kind just built on ``host`` (nothing by default)."""

    @abstractmethod
    def run(self, engine: GangEngine[R], members: Sequence[Member]) -> Sequence[R | BaseException]:
        """Train each member's next chunk: each member's result, or the error that failed that member alone."""


class SharedPasses(GangStrategy):
    """One forward/backward pass per step for the whole gang, each member's loss through its kind's
    :attr:`~optuna_rapidfire._trainers._base.TrainerKind.fused_loss` (SFT, DPO); the gang streams."""

    streams = True

    def run(self, engine: GangEngine[R], members: Sequence[Member]) -> Sequence[R | BaseException]:
        return engine.shared_passes(members)


class Alone(GangStrategy):
    """Each member trains its chunk alone, in turn (time-sliced)."""

    def run(self, engine: GangEngine[R], members: Sequence[Member]) -> Sequence[R | BaseException]:
        return engine.alone(members)


SHARED_PASSES = SharedPasses()
ALONE = Alone()


def pass_refusal(resident: ResidentModel, members: Sequence[Member]) -> str | None:
    """What keeps any gang from sharing a forward/backward pass (``None``: nothing): mixed trainer types,
    fp16 (one grad scaler per trial), mixed precision, activation checkpointing or base dropout, and
    LoRA variants the fused pass does not implement."""
    first = members[0]
    settings = _pass_settings(first)
    for member in members:
        if type(member.spec.kind) is not type(first.spec.kind):
            return "the trials differ in trainer type"
        if bool(getattr(member.args, "fp16", False)):
            return f"trial {member.spec.number} trains in fp16 (its grad scaler is per trial)"
        own = _pass_settings(member)
        if own[:2] != settings[:2]:
            return "the trials differ in precision or activation checkpointing"
        if own[2] != settings[2]:
            return "the trials differ in disable_dropout"
    for layer in lora_layers(resident.module):
        for member in members:
            reason = unsupported(layer, member.state.adapter_name)
            if reason is not None:
                return reason
    return None


def _pass_settings(member: Member) -> tuple[bool, bool, bool]:
    """What a shared pass sets for all its members: bf16, activation checkpointing, base dropout off."""
    kind, args = member.spec.kind, member.args
    return bool(args.bf16), kind.checkpointing(args)[0], kind.base_dropout_off(args)
