"""Act on trials by hand: stop (pause), resume, delete, clone, from Python, another process or machine.

Commands travel through the study's storage, so any process that can open it can issue them; the
executor running the trial applies each one exactly once, before the trial's next chunk starts (the
chunk in progress finishes). A command about a trial that does not exist or has finished raises
``ValueError`` and changes nothing; one about a trial whose worker died reaches Optuna's retry of it
(``RetryFailedTrialCallback``), which applies it at its first chunk boundary.

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

from typing import TYPE_CHECKING, Any

from optuna.trial import TrialState

from optuna_rapidfire._study import _attrs, _commands
from optuna_rapidfire._study._commands import enqueue_clone, find_trial

if TYPE_CHECKING:
    from collections.abc import Callable

    import optuna
    from optuna.trial import FrozenTrial

__all__ = ["clone", "delete", "resume", "stop"]


def stop(study: optuna.Study, trial_number: int) -> str:
    """Pause a running trial: within ``poll_seconds`` if it is not training (queued, or waiting between
    chunks), else at the end of its chunk in flight.

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
    return _commands.issue(study, "stop", trial.number)


def resume(study: optuna.Study, trial_number: int) -> str:
    """Continue a paused trial from where it stopped, as soon as a slot is free."""
    trial = _running(study, trial_number, "resumed")
    if trial.user_attrs.get(_attrs.STATUS) != "paused":
        raise ValueError(
            f"Trial {trial_number} is not paused (it is {trial.user_attrs.get(_attrs.STATUS, 'running')})."
        )
    return _commands.issue(study, "resume", trial.number)


def delete(study: optuna.Study, trial_number: int, reason: str = "deleted by user") -> str:
    """Stop a running or paused trial for good and free its state; it ends as FAIL with ``reason``."""
    trial = _running(study, trial_number, "deleted")
    return _commands.issue(study, "delete", trial.number, reason=reason)


def clone(
    study: optuna.Study,
    trial_number: int,
    params: dict[str, Any] | None = None,
    warm_start: bool = True,
    from_chunk: int | None = None,
) -> int:
    """Enqueue a new trial with ``trial_number``'s params, changed by ``params``.

    A warm clone branches from the parent's state at the chunk boundary at which it was asked for (the
    parent's chunks done now: what you saw), or after chunk ``from_chunk``, whatever the parent does after:
    weights, optimizer moments, LR-schedule position, RNG and data position, with its own hyperparameters;
    it inherits the parent's intermediate values up to there, and without a change continues them exactly.
    The executor keeps each live trial's chunk states for this (``keep_checkpoints``), and a finished
    trial's last one. A change that cannot keep the state (LoRA rank, target modules, trainer type) makes a
    cold clone, said in its ``rapidfire:clone``/``rapidfire:cold_reason`` user attrs. The parent may be
    running, waiting, paused or finished.

    A clone asked for while a study runs trains in it, beyond ``n_trials``, in the next free slot before any
    new sampler config; one asked for after the study ended waits for the next ``optimize`` call.

    Raises:
        ValueError: At once, when the clone could not train: a warm clone of a failed trial or of one that
            has not trained a chunk, a ``from_chunk`` outside the parent's chunks done or no longer kept, or
            an unchanged clone of a finished trial by default (from its last chunk: nothing would be left to
            train). Naming its last chunk says the clone's run is longer (trusted). Changing a parameter
            may make it longer: where this process has run the study, its ``configure`` with the clone's params
            says whether it does (refused at once if not); elsewhere a clone whose run is no longer fails once
            built, recording nothing.

    Returns:
        The number of the new (WAITING) trial.
    """
    return enqueue_clone(study, trial_number, params, warm_start, from_chunk)


TRIAL_COMMANDS: dict[str, Callable[..., str]] = {"stop": stop, "resume": resume, "delete": delete}
"""The commands that act on a trial itself, by the names the CLI, the dashboard's form and the stored commands use
(``_commands.TRIAL_OPS``); :func:`clone` makes another trial."""


def _running(study: optuna.Study, trial_number: int, verb: str) -> FrozenTrial:
    """The running trial a command to ``trial_number`` reaches: the trial itself, or, when its worker died,
    Optuna's retry of it (the retry applies the command at its first chunk boundary)."""
    trial = find_trial(study, trial_number)
    if trial.state == TrialState.FAIL:
        retry = _commands.retry_of(study, trial_number)
        if retry is not None:
            return retry
    if trial.state != TrialState.RUNNING:
        raise ValueError(f"Trial {trial_number} is {trial.state.name}: only a running trial can be {verb}.")
    return trial
