"""TRL trainer types the executor can drive, picked by the class of a trial's training args."""

from __future__ import annotations

from typing import Any

from optuna_rapidfire._trainers._base import TrainerExtras, TrainerKind
from optuna_rapidfire._trainers._dpo import DPOKind
from optuna_rapidfire._trainers._sft import SFTKind
from optuna_rapidfire._trainers.grpo._kind import GRPOKind

TRAINER_KINDS: dict[str, TrainerKind] = {kind.name: kind for kind in (SFTKind(), DPOKind(), GRPOKind())}
"""The trainer kinds, by name: a trial's kind is the one whose TRL config class its training args are. A new
kind is one file in this folder and one entry here."""


def kind_for(args: Any) -> TrainerKind:
    """The trainer kind selected by ``args``; a clear ``TypeError`` for any other type."""
    for kind in TRAINER_KINDS.values():
        if isinstance(args, kind.args_type()):
            return kind
    supported = ", ".join(k.args_type().__name__ for k in TRAINER_KINDS.values())
    raise TypeError(
        f"configure(trial) returned training args of type {type(args).__name__}; RapidFireExecutor "
        f"supports {supported}."
    )


__all__ = ["TRAINER_KINDS", "TrainerExtras", "TrainerKind", "kind_for"]
