"""The fused engine's settings read from the environment: how its launched pass is run, where the executor's
``compile`` keyword does not say, for checks and measurements (as ``TORCH_COMPILE_DEBUG`` is for torch).

Each is ``1`` (on) or ``0`` (off); unset, the engine decides as the ``compile`` keyword says. They are read when a
device's engine is made (a worker process inherits them):

- ``RAPIDFIRE_COMPILE_IN_BACKGROUND``: compile the launched pass in a background thread while the passes run
  uncompiled (unset: on a GPU only);
- ``RAPIDFIRE_RECORD_PASSES``: replay a stream's passes, optimizer steps and evaluations from recordings, one
  per shape (unset: with ``compile="auto"`` on a GPU). A CPU has no CUDA graphs: there a replay runs the
  recorded function again on the static copies of its inputs, which checks that a pass reads nothing else;
- ``RAPIDFIRE_WARM_COMPILER``: the background compiler first compiles each graph in a child process, whose
  caches on disk the training process then compiles from (unset: off);
- ``RAPIDFIRE_SHARED_EVALUATION``: ``0`` evaluates every member of a gang by its own trainer's loop, as a kind
  without shared evaluation does (the shared evaluation's metrics against TRL's own; unset: shared).
"""

from __future__ import annotations

import os

COMPILE_IN_BACKGROUND = "RAPIDFIRE_COMPILE_IN_BACKGROUND"
RECORD_PASSES = "RAPIDFIRE_RECORD_PASSES"
WARM_COMPILER = "RAPIDFIRE_WARM_COMPILER"
SHARED_EVALUATION = "RAPIDFIRE_SHARED_EVALUATION"


def flag(name: str) -> bool | None:
    """The setting ``name`` of the environment: ``True`` (``1``), ``False`` (``0``) or ``None`` (unset)."""
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    if value not in ("0", "1"):
        raise ValueError(f"The environment variable {name} must be 0 or 1 (or unset), but got {name}={value!r}.")
    return value == "1"


def evaluation_refusal() -> str | None:
    """Why gangs are not evaluated in shared passes by the environment's say (``None``: they may be)."""
    return f"{SHARED_EVALUATION}=0" if flag(SHARED_EVALUATION) is False else None
