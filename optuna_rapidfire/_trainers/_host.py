"""What a trainer kind's device-side code needs of the device that runs it, as protocols.

A kind's gang code (GRPO's shared decode and policy passes) works on built trials and on the device's live
trials without importing the engines that provide them: the engines' ``TrialRuntime`` is a :class:`Member`,
their ``DeviceTrials`` a :class:`GangHost`. Kinds sit below the engines, and these protocols keep it so.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch
    from transformers import Trainer, TrainingArguments

    from optuna_rapidfire._fused._dropout import DropoutStream
    from optuna_rapidfire._resident._model import ResidentModel
    from optuna_rapidfire._resident._state import RngState, SwapState
    from optuna_rapidfire._trainers._base import TrainerKind


class MemberSpec(Protocol):
    """What a kind reads of a built trial's spec."""

    @property
    def number(self) -> int: ...

    @property
    def kind(self) -> TrainerKind: ...


class Member(Protocol):
    """A built trial, as a kind sees it: its spec, its (effective) args, its TRL trainer and its swappable state."""

    @property
    def spec(self) -> MemberSpec: ...

    @property
    def args(self) -> TrainingArguments: ...

    @property
    def trainer(self) -> Trainer: ...

    @property
    def state(self) -> SwapState: ...


class GangHost(Protocol):
    """The device's live trials, as a kind's gang code uses them."""

    @property
    def device(self) -> torch.device: ...

    @property
    def resident(self) -> ResidentModel: ...

    def keep_on_device(self, gang: Sequence[Member]) -> None:
        """Keep these members' states on the device (none is offloaded while another runs); ``[]``: none."""

    def resume_member(self, member: Member, gang: Sequence[Member], rng: RngState, training: bool) -> None:
        """Set the model up again for ``member``, whose step paused while others of its ``gang`` ran."""

    def dropout_stream(self, member: Member) -> DropoutStream:
        """The member's own adapter-dropout stream for shared passes."""
