"""GRPO's gang strategy: the members' TRL steps in turns, decoding together and sharing their policy passes.

The fused engine calls :data:`GENERATION_TURNS` for a gang of GRPO trials (the kind's ``gang``). Each device
gets its :class:`~optuna_rapidfire._trainers.grpo._generation.Generation` the first time a GRPO trial is built
there; trials of other kinds never make one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

from optuna_rapidfire._trainers._gangs import GangStrategy, pass_refusal
from optuna_rapidfire._trainers.grpo._generation import Generation

if TYPE_CHECKING:
    from collections.abc import Sequence

    from optuna_rapidfire._resident._model import ResidentModel
    from optuna_rapidfire._trainers._host import GangEngine, GangHost, Member

R = TypeVar("R")


class GenerationTurns(GangStrategy):
    """Each member trains its chunk and evaluates as alone, in turns; the members waiting to generate decode
    together, in one batch, and those taking a policy step share its forward and backward passes."""

    def install(self, host: GangHost, member: Member) -> None:
        generation(host).install(member)

    def run(self, engine: GangEngine[R], members: Sequence[Member]) -> Sequence[R | BaseException]:
        reason = generation_refusal(members)
        if reason is not None:
            engine.say(f"Generating trial by trial, not together: {reason}.")
            return engine.alone(members)
        # A lone trial goes through the same turns and shared passes: its values do not depend on its gang.
        policy = policy_refusal(engine.host.resident, members)
        if policy is not None:
            engine.say(f"Scoring each GRPO step alone, not in shared passes: {policy}.")
        engine.host.on_device(members)
        return generation(engine.host).run_gang(members, engine.run_chunk, share_policy=policy is None)


GENERATION_TURNS = GenerationTurns()


def generation(host: GangHost) -> Generation:
    """The device's GRPO generation (made the first time a GRPO trial needs it)."""
    return host.part("grpo.generation", lambda: Generation(host))


def generation_refusal(members: Sequence[Member]) -> str | None:
    """Why a gang of trials that sample completions cannot generate together (``None``: it can)."""
    first = members[0]
    precision = (bool(first.args.bf16), bool(getattr(first.args, "fp16", False)))
    for member in members[1:]:
        if type(member.spec.kind) is not type(first.spec.kind):
            return "the trials differ in trainer type"
        if (bool(member.args.bf16), bool(getattr(member.args, "fp16", False))) != precision:
            return "the trials differ in precision"
    return None


def policy_refusal(resident: ResidentModel, members: Sequence[Member]) -> str | None:
    """Why a GRPO gang's steps cannot share their forward and backward passes (``None``: they can)."""
    for member in members:
        if member.spec.kind.checkpointing(member.args)[0]:
            return f"trial {member.spec.number} uses activation checkpointing"
        if getattr(member.trainer, "aux_loss_enabled", False):
            return f"trial {member.spec.number} adds a router auxiliary loss"
    return pass_refusal(resident, members)
