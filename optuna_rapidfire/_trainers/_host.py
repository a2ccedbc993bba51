"""What a trainer kind's device-side code needs of the device that runs it, as protocols.

A kind's gang code (GRPO's shared decode and policy passes) works on built trials and on the device's live
trials without importing the engines that provide them: the engines' ``TrialRuntime`` is a :class:`Member`,
their ``DeviceTrials`` a :class:`GangHost`. Kinds sit below the engines, and these protocols keep it so.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    import contextlib
    from collections.abc import Callable, Sequence

    import torch
    from transformers import Trainer, TrainingArguments

    from optuna_rapidfire._fused._dropout import DropoutStream
    from optuna_rapidfire._resident._model import ResidentModel
    from optuna_rapidfire._resident._state import RngState, SwapState


R_co = TypeVar("R_co", covariant=True)
P = TypeVar("P", bound="DevicePart")


class MemberKind(Protocol):
    """What a kind's device-side code asks of a member's kind (a :class:`~optuna_rapidfire._trainers._base.TrainerKind`
    is one)."""

    def checkpointing(self, args: TrainingArguments) -> tuple[bool, dict[str, Any] | None]: ...

    def base_dropout_off(self, args: TrainingArguments) -> bool: ...

    def autocast(self, args: TrainingArguments, device: torch.device) -> contextlib.AbstractContextManager[Any]: ...


class MemberSpec(Protocol):
    """What a kind reads of a built trial's spec."""

    @property
    def number(self) -> int: ...

    @property
    def kind(self) -> MemberKind: ...


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

    def part(self, key: str, make: Callable[[], P]) -> P:
        """The device's own ``key`` part (a kind's per-device state, such as GRPO's decode), made the first time."""

    def on_device(self, members: Sequence[Member]) -> None:
        """Bring the members' states onto the device (others may be offloaded to fit its budget)."""

    def evaluating(self, adapter: str) -> str | None:
        """``"eval"`` while the trial of ``adapter`` evaluates, ``"check"`` during the one-batch check of the first
        trial's metrics, else ``None`` (it trains)."""

    def keep_on_device(self, gang: Sequence[Member]) -> None:
        """Keep these members' states on the device (none is offloaded while another runs); ``[]``: none."""

    def resume_member(self, member: Member, gang: Sequence[Member], rng: RngState, training: bool) -> None:
        """Set the model up again for ``member``, whose step paused while others of its ``gang`` ran."""

    def dropout_stream(self, member: Member) -> DropoutStream:
        """The member's own adapter-dropout stream for shared passes."""


class DevicePart(Protocol):
    """A kind's per-device state (:meth:`GangHost.part`); its counters add to the engine's stats of the same name."""

    def counters(self) -> dict[str, Any]:
        """Counters named as fields of the engine's stats (``decodes``, ``fused_steps``...); a dict's values
        are summed key by key (``gang_seconds``)."""


class GangEngine(Protocol[R_co]):
    """What the fused engine offers a kind's :class:`~optuna_rapidfire._trainers._gangs.GangStrategy`; ``R_co`` is
    what a member's chunk gives (a gang's results hold, for each member, that or the error that failed it alone)."""

    @property
    def host(self) -> GangHost: ...

    def shared_passes(self, members: Sequence[Member]) -> Sequence[R_co | BaseException]:
        """Train the members' chunks in shared forward/backward passes (time-sliced if they cannot share them)."""

    def alone(self, members: Sequence[Member]) -> Sequence[R_co | BaseException]:
        """Train each member's chunk alone, in turn."""

    def run_chunk(self, member: Member) -> R_co:
        """Train and evaluate one member's next chunk alone (raises what fails it)."""

    def say(self, text: str) -> None:
        """Log ``text`` once per engine."""
