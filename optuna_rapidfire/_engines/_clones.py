"""Starting a clone from its parent's state: warm (the parent's weights, optimizer moments, schedule position,
RNG and data position, with the clone's own hyperparameters) when the parent's state fits the clone's
adapter, else cold, with the reason kept in the clone's :class:`Branch`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from optuna_rapidfire import _compat
from optuna_rapidfire._engines._types import Branch
from optuna_rapidfire._resident._snapshot import TrialSnapshot
from optuna_rapidfire._resident._state import Position, RngState

if TYPE_CHECKING:
    from optuna_rapidfire._engines._types import CloneOf, TrialRuntime
    from optuna_rapidfire._resident._model import ResidentModel


def branch_from(
    resident: ResidentModel, runtime: TrialRuntime, clone_of: CloneOf, parent: TrialSnapshot | str
) -> Branch:
    """Make ``runtime`` continue from ``parent`` if it can; say why not otherwise."""
    reason: str | None
    if not clone_of.warm:
        reason = "a cold clone was asked for"
    elif isinstance(parent, str):
        reason = parent
    else:
        shapes = {k: v.shape for k, v in resident.adapter_weights(runtime.state.adapter_name).items()}
        reason = parent.compatible_with(runtime.spec.kind.name, shapes)
    if reason is not None:
        return Branch(parent=clone_of.parent, step=0, warm=False, reason=reason, resume=clone_of.resume)
    assert isinstance(parent, TrialSnapshot)
    restore(resident, runtime, parent)
    return Branch(
        parent=clone_of.parent,
        step=parent.position.chunks_done,
        warm=True,
        history=[dict(h) for h in parent.history],
        resume=clone_of.resume,
    )


def restore(resident: ResidentModel, runtime: TrialRuntime, parent: TrialSnapshot) -> None:
    """Load the parent's weights, moments, schedule position, RNG and data position.

    The clone's own hyperparameters win: its optimizer keeps its param-group settings (learning
    rate, weight decay, betas) and its LR schedule (its own warmup and length) is only moved to the
    parent's position, so a changed learning rate takes effect at once.
    """
    state = runtime.state
    resident.load_adapter_weights(state.adapter_name, parent.weights)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in state.optimizer.param_groups]
    state.optimizer.load_state_dict(parent.optimizer)
    for group, settings in zip(state.optimizer.param_groups, groups, strict=True):
        group.update(settings)
    _compat.seek_lr_scheduler(state.lr_scheduler, parent.scheduler_steps)
    if state.scaler is not None and parent.scaler is not None:
        state.scaler.load_state_dict(parent.scaler)
    state.rng = RngState(
        cpu=parent.rng.cpu.clone(),
        device=None if parent.rng.device is None else parent.rng.device.clone(),
        python=parent.rng.python,
        numpy=parent.rng.numpy,
    )
    state.dropout_rng = None if parent.dropout_rng is None else parent.dropout_rng.clone()
    state.sample_rng = None if parent.sample_rng is None else parent.sample_rng.clone()
    state.position = Position(parent.position.chunks_done, parent.position.optimizer_steps)
    runtime.trainer.state.global_step = parent.position.optimizer_steps
    runtime.history = [dict(h) for h in parent.history]
