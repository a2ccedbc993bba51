"""Act on trials by hand: stop (pause), resume, delete, clone, from Python, another process or machine.

Commands travel through the study's storage, so any process that can open it can issue them; the
executor running the trial applies each one exactly once, before the trial's next chunk starts (the
chunk in progress finishes). A command about a trial that does not exist or has finished raises
``ValueError`` and changes nothing.

Example:

    .. code-block:: python

        import optuna
        from optuna_rapidfire import control

        study = optuna.load_study(study_name="demo", storage="sqlite:///rf.db")
        control.stop(study, 3)  # pause trial 3; its slot goes to another trial
        control.resume(study, 3)  # it continues where it stopped
        child = control.clone(study, 5, params={"learning_rate": 1e-4})  # warm clone of trial 5
        control.delete(study, 7, reason="diverged")
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState

from optuna_rapidfire import _attrs, _commands

if TYPE_CHECKING:
    import optuna
    from optuna.trial import FrozenTrial

__all__ = ["clone", "delete", "resume", "stop"]


def stop(study: optuna.Study, trial_number: int) -> str:
    """Pause a running trial at its next chunk boundary.

    A paused trial keeps its state (moved off the device), holds no slot (another trial takes it) and
    is not waited for by the others; :func:`resume` continues it where it stopped. A trial still
    paused when the study ends is finished as PRUNED, with user attr ``rapidfire:status`` set to
    ``paused-at-end`` and its state kept, so a warm :func:`clone` can continue it.

    Returns:
        The command's id.
    """
    trial = _running(study, trial_number, "stopped")
    if trial.user_attrs.get(_attrs.STATUS) == "paused":
        raise ValueError(f"Trial {trial_number} is already paused.")
    return _commands.issue(study, "stop", trial_number)


def resume(study: optuna.Study, trial_number: int) -> str:
    """Continue a paused trial from where it stopped, as soon as a slot is free."""
    trial = _running(study, trial_number, "resumed")
    if trial.user_attrs.get(_attrs.STATUS) != "paused":
        raise ValueError(
            f"Trial {trial_number} is not paused (it is {trial.user_attrs.get(_attrs.STATUS, 'running')})."
        )
    return _commands.issue(study, "resume", trial_number)


def delete(study: optuna.Study, trial_number: int, reason: str = "deleted by user") -> str:
    """Stop a running or paused trial for good and free its state; it ends as FAIL with ``reason``."""
    _running(study, trial_number, "deleted")
    return _commands.issue(study, "delete", trial_number, reason=reason)


def clone(
    study: optuna.Study,
    trial_number: int,
    params: dict[str, Any] | None = None,
    warm_start: bool = True,
) -> int:
    """Enqueue a new trial with ``trial_number``'s params, changed by ``params``.

    A warm clone continues from the parent's state at its latest chunk boundary (weights, optimizer
    moments, LR-schedule position, RNG, data position) with its own hyperparameters, and inherits the
    parent's intermediate values up to there. A change that cannot keep the state (LoRA rank, target
    modules, trainer type) makes a cold clone, said in its ``rapidfire:clone``/``rapidfire:cold_reason``
    user attrs. The parent may be running, paused or finished.

    Returns:
        The number of the new (WAITING) trial; the next executor to ask for a trial runs it.
    """
    parent = _find(study, trial_number)
    if parent.state == TrialState.WAITING:
        raise ValueError(f"Trial {trial_number} has not started: there is nothing to clone.")
    merged = dict(parent.params)
    for name, value in (params or {}).items():
        if name not in parent.distributions:
            raise ValueError(
                f"Trial {trial_number} has no parameter {name!r}; its parameters are {sorted(parent.distributions)}."
            )
        merged[name] = _checked(name, value, parent.distributions[name])
    # The token finds this clone among others enqueued at the same moment by other clients.
    request = {"parent": trial_number, "warm": bool(warm_start), "request": uuid.uuid4().hex}
    study.enqueue_trial(merged, user_attrs={_attrs.CLONE_OF: request})
    waiting = study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
    return next(t.number for t in waiting if t.user_attrs.get(_attrs.CLONE_OF) == request)


def _find(study: optuna.Study, trial_number: int) -> FrozenTrial:
    if not isinstance(trial_number, int) or isinstance(trial_number, bool):
        raise TypeError(f"trial_number must be an int, but got {trial_number!r}.")
    for trial in study.get_trials(deepcopy=False):
        if trial.number == trial_number:
            return trial
    raise ValueError(f"Trial {trial_number} does not exist in study {study.study_name!r}.")


def _running(study: optuna.Study, trial_number: int, verb: str) -> FrozenTrial:
    trial = _find(study, trial_number)
    if trial.state != TrialState.RUNNING:
        raise ValueError(f"Trial {trial_number} is {trial.state.name}: only a running trial can be {verb}.")
    return trial


def _checked(name: str, value: Any, distribution: Any) -> Any:
    """``value`` as the parameter's type, if ``distribution`` allows it."""
    if isinstance(distribution, CategoricalDistribution):
        for choice in distribution.choices:
            if choice == value or str(choice) == str(value):
                return choice
        raise ValueError(f"{name}={value!r} is not one of its choices {list(distribution.choices)}.")
    try:
        number = int(value) if isinstance(distribution, IntDistribution) else float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}={value!r} is not a number.") from None
    assert isinstance(distribution, (IntDistribution, FloatDistribution))
    if not distribution.low <= number <= distribution.high:
        raise ValueError(f"{name}={value!r} is outside [{distribution.low}, {distribution.high}].")
    return number
