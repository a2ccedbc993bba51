"""TRL trainer types the executor can drive, picked by the class of a trial's training args."""

from __future__ import annotations

from typing import Any

from optuna_rapidfire._trainers._base import TrainerExtras, TrainerKind
from optuna_rapidfire._trainers._dpo import DPOKind
from optuna_rapidfire._trainers._sft import SFTKind
from optuna_rapidfire._trainers.grpo._kind import GRPOKind

_KINDS: tuple[TrainerKind, ...] = (SFTKind(), DPOKind(), GRPOKind())


def kind_for(args: Any) -> TrainerKind:
    """The trainer kind selected by ``args``; a clear ``TypeError`` for any other type."""
    for kind in _KINDS:
        if isinstance(args, kind.args_type()):
            return kind
    supported = ", ".join(k.args_type().__name__ for k in _KINDS)
    raise TypeError(
        f"configure(trial) returned training args of type {type(args).__name__}; RapidFireExecutor "
        f"supports {supported}."
    )


__all__ = ["TrainerExtras", "TrainerKind", "kind_for"]
