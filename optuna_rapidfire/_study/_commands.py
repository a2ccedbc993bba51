"""Control commands (stop, resume, delete, clone) carried through the study's storage.

A command is a study system attribute under its own unique key, so commands written by several
clients at once never overwrite each other; once the executor running the trial has applied it, a
second key marks it done, so it is never applied twice. Any process that can open the storage can
issue commands. optuna-dashboard's form writes the same requests as user attributes of the trial.

The dashboard lets a person edit that form only on a RUNNING trial (running or paused here): it greys
it out on a COMPLETE trial and hides it on a PRUNED or FAIL one, and its server cannot write user
attributes of a finished trial. So a clone of a finished trial is asked for on the form of a trial that
still runs, naming the parent (``trial=5``); that trial's driver applies it like its own commands.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.exceptions import UpdateFinishedTrialError
from optuna.trial import TrialState

from optuna_rapidfire import _compat
from optuna_rapidfire._logging import get_logger
from optuna_rapidfire._runtime._schedule import Status
from optuna_rapidfire._study import _attrs

if TYPE_CHECKING:
    from collections.abc import Callable

    import optuna
    from optuna.trial import FrozenTrial

    from optuna_rapidfire._runtime._entry import Entry
    from optuna_rapidfire._runtime._scheduler import Scheduler

_logger = get_logger(__name__)

TRIAL_OPS = ("stop", "resume", "delete")
"""The commands that act on a trial itself (a clone makes another)."""
OPS = (*TRIAL_OPS, "clone")
"""Every command a person can give a running study (``control``, the CLI, the dashboard's form)."""
# How a command's result says where the trial was, before its chunk count.
_WHERE = {
    "chunk": "after chunk",
    "waiting": "while waiting after chunk",
    "paused": "while paused after chunk",
}
# The dashboard's choice widget stores floats; these are the values of its choices. It pre-selects the
# first choice, so that one does nothing: a stray Submit must not pause a trial.
_NO_ACTION = 0.0
_FORM_VALUES = {1.0: "stop", 2.0: "resume", 3.0: "delete", 4.0: "clone"}
_FORM_CHOICES = ["no action", "stop (pause)", "resume", "delete", "clone"]
# In the form's text, ``trial=<n>`` names the trial to clone (by default the form's own trial), and
# ``from_chunk=<k>`` the chunk boundary a warm clone branches from (by default the one it is applied at).
_TARGET = "trial"
_FROM_CHUNK = "from_chunk"
_EMPTY_CLONE = (
    "clone with an empty args field: nothing cloned. optuna-dashboard takes typed text about half a second after "
    "the last keystroke, so a quick Submit can send it empty; wait a moment before Submit. To clone this trial "
    "unchanged, write 'warm'"
)


@dataclass(frozen=True)
class Command:
    """One request about one trial.

    Attributes:
        key: Unique id (the system attribute key, or ``form:<trial>`` for the dashboard form).
        op: ``stop``, ``resume``, ``delete`` or ``clone``.
        trial: The trial number it is about.
        params: Overrides for a clone.
        warm: Whether a clone continues from the parent's state.
        reason: Why (recorded for delete).
        issued_at: When it was written (ordering).
        from_chunk: For a warm clone: the parent's chunk boundary to branch from (``None``: its chunks done
            when the command is applied).
    """

    key: str
    op: str
    trial: int
    params: dict[str, Any] = field(default_factory=dict)
    warm: bool = True
    reason: str | None = None
    issued_at: float = 0.0
    from_chunk: int | None = None

    @property
    def from_form(self) -> bool:
        return self.key.startswith("form:")


def issue(study: optuna.Study, op: str, trial: int, **fields: Any) -> str:
    """Write a command for ``trial``; return its key."""
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, but got {op=}.")
    now = time.time()
    key = f"{_attrs.COMMAND_PREFIX}{time.time_ns():020d}-{uuid.uuid4().hex[:12]}"
    payload: dict[str, Any] = {
        "op": op,
        "trial": trial,
        "issued_at": now,
        "client": f"{socket.gethostname()}:{os.getpid()}",
    }
    payload.update(fields)
    _compat.storage(study).set_study_system_attr(_compat.study_id(study), key, payload)
    return key


def pending(study: optuna.Study, trial: FrozenTrial) -> list[Command]:
    """Commands for ``trial`` not applied yet, oldest first (storage commands, then the dashboard form)."""
    attrs = _compat.storage(study).get_study_system_attrs(_compat.study_id(study))
    # A retry of a trial whose worker died takes the commands sent to the trials it continues.
    targets = {trial.number, *retried(trial)}
    found = []
    for key, payload in attrs.items():
        if not key.startswith(_attrs.COMMAND_PREFIX) or not isinstance(payload, dict):
            continue
        if payload.get("trial") not in targets:
            continue
        if _attrs.DONE_PREFIX + key.removeprefix(_attrs.COMMAND_PREFIX) in attrs:
            continue
        found.append(
            Command(
                key=key,
                op=payload["op"],
                trial=trial.number,
                params=dict(payload.get("params") or {}),
                warm=bool(payload.get("warm", True)),
                reason=payload.get("reason"),
                issued_at=float(payload.get("issued_at", 0.0)),
            )
        )
    found.sort(key=lambda c: (c.issued_at, c.key))
    form = _form_command(trial)
    if form is not None:
        found.append(form)
    return found


def held_for(study: optuna.Study, entry: Entry, scheduler: Scheduler) -> list[Command]:
    """The commands for the trial of ``entry`` while it waits between chunks (READY: at a rung, or for the
    device) or is queued (BUILDING), holding it (:meth:`Scheduler.hold`) so that it trains no chunk before they
    are applied; ``[]``: none, or it is not waiting (they apply after its chunk then).

    Raises:
        UpdateFinishedTrialError: The trial was finished from outside meanwhile.
    """
    if entry.status not in (Status.READY, Status.BUILDING) or entry.request is not None:
        return []
    frozen = _compat.storage(study).get_trial(entry.trial_id)
    if frozen.state.is_finished():
        raise UpdateFinishedTrialError(f"Trial {entry.number} was finished outside the executor.")
    commands = pending(study, frozen)
    return commands if commands and scheduler.hold(entry) else []


def answer_saved(study: optuna.Study, trial_id: int, chunks: int) -> None:
    """Answer the commands that came while a complete trial's adapter was being saved (it is still RUNNING).

    Raises:
        UpdateFinishedTrialError: The trial was finished from outside meanwhile.
    """
    for command in pending(study, _compat.storage(study).get_trial(trial_id)):
        apply(study, trial_id, command, "saved", chunks)


def retried(trial: FrozenTrial) -> list[int]:
    """The trials ``trial`` is Optuna's retry of (``RetryFailedTrialCallback``), oldest first; ``[]`` if none."""
    history = trial.system_attrs.get("retry_history")
    if not isinstance(history, list):
        failed = trial.system_attrs.get("failed_trial")
        history = [failed] if isinstance(failed, int) else []
    return [n for n in history if isinstance(n, int)]


def retry_of(study: optuna.Study, trial_number: int, *, unfinished: bool = True) -> FrozenTrial | None:
    """Optuna's retry of ``trial_number`` (a trial whose worker died), if there is one: only one still to run or
    running (``unfinished``), or any."""
    states = (TrialState.WAITING, TrialState.RUNNING) if unfinished else None
    for trial in study.get_trials(deepcopy=False, states=states):
        if trial_number in retried(trial):
            return trial
    return None


def mark_done(study: optuna.Study, trial_id: int, command: Command, result: str) -> None:
    """Record that ``command`` was applied (or refused), so it is never applied again."""
    now = datetime.datetime.now(datetime.timezone.utc).isoformat()
    if command.from_form:
        # The form can be submitted again with the same values: clearing the action makes the next
        # submission a change the executor notices.
        _compat.storage(study).set_trial_user_attr(trial_id, _attrs.ACTION, "")
        _compat.storage(study).set_trial_user_attr(trial_id, _attrs.ACTION_DONE, f"{command.op}: {result} ({now})")
    else:
        done_key = _attrs.DONE_PREFIX + command.key.removeprefix(_attrs.COMMAND_PREFIX)
        _compat.storage(study).set_study_system_attr(_compat.study_id(study), done_key, {"result": result, "at": now})
    _logger.info("Trial %d: %s command applied (%s).", command.trial, command.op, result)


def apply(
    study: optuna.Study, trial_id: int, command: Command, where: str, chunk: int, *, pausing: bool = False
) -> str | None:
    """Apply one control command to trial ``trial_id`` (or say why it is ignored) and mark it done; the one
    place that does.

    Args:
        command: The command.
        where: Where the trial is: after a ``"chunk"`` (or its ``"last chunk"``), ``"waiting"`` between chunks
            (at a rung, or for the device), ``"queued"`` (not built yet), ``"paused"``, or ``"saved"`` (complete,
            its adapter written).
        chunk: Chunks the trial has trained (for the record).
        pausing: A stop was already applied after this chunk.

    Returns:
        What the trial must do now: ``"pause"``, ``"resume"`` or ``"delete"``; ``None``: carry on.
    """
    op, action = command.op, None
    at = "while queued, before its first chunk" if where == "queued" else f"{_WHERE.get(where, 'after chunk')} {chunk}"
    if op == "delete" and where != "saved":
        result, action = f"deleted {at}", op
    elif op == "stop" and (where == "paused" or pausing):
        result = "ignored: already paused"
    elif op == "stop" and where in ("chunk", "waiting", "queued"):
        result, action = f"paused {at}", "pause"
    elif op in ("stop", "delete"):
        result = "ignored: the trial has trained its last chunk"
    elif op == "resume" and where == "paused":
        result, action = "resumed", op
    elif op == "resume":
        result = "ignored: the trial is not paused"
    elif op == "clone":
        try:
            child = enqueue_clone(
                study, command.trial, command.params, warm_start=command.warm, from_chunk=command.from_chunk
            )
        except (TypeError, ValueError) as error:
            result = f"refused: {error}"
        else:
            result = f"enqueued as trial {child}"
    else:
        result = f"ignored: {command.reason}"
    mark_done(study, trial_id, command, result)
    return action


def _form_command(trial: FrozenTrial) -> Command | None:
    action = trial.user_attrs.get(_attrs.ACTION)
    if action in (None, "", _NO_ACTION):
        return None
    op = _FORM_VALUES.get(float(action)) if isinstance(action, (int, float)) else str(action).strip().lower()
    key = f"form:{trial.number}"
    if op not in OPS:
        return Command(key=key, op="invalid", trial=trial.number, reason=f"unknown action {action!r}")
    text = str(trial.user_attrs.get(_attrs.ACTION_ARGS) or "").strip()
    if op == "clone" and not text:
        # optuna-dashboard takes the typed text about 0.5 s after the last keystroke: an empty field on a clone
        # may be text typed just before Submit, so nothing is cloned on a guess.
        return Command(key=key, op="invalid", trial=trial.number, reason=_EMPTY_CLONE)
    warm = True
    params: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        if part.lower() in ("cold", "warm"):
            warm = part.lower() == "warm"
            continue
        name, _, value = part.partition("=")
        params[name.strip()] = _parse_value(value.strip())
    target = params.pop(_TARGET, trial.number)
    if not isinstance(target, int) or isinstance(target, bool):
        return Command(key=key, op="invalid", trial=trial.number, reason=f"{_TARGET}={target!r} is not a trial number")
    from_chunk = params.pop(_FROM_CHUNK, None)
    if from_chunk is not None and (not isinstance(from_chunk, int) or isinstance(from_chunk, bool)):
        return Command(
            key=key, op="invalid", trial=trial.number, reason=f"{_FROM_CHUNK}={from_chunk!r} is not a chunk number"
        )
    if target != trial.number and op != "clone":
        # The driver of this trial applies the command to itself: only a clone may be about another trial.
        return Command(
            key=key,
            op="invalid",
            trial=trial.number,
            reason=f"only clone can name another trial; {op} trial {target} from its own form",
        )
    return Command(key=key, op=op, trial=target, params=params, warm=warm, reason=text or None, from_chunk=from_chunk)


def _parse_value(text: str) -> Any:
    """``"3"`` → 3, ``"1e-3"`` → 0.001, ``"true"`` → True, anything else stays a string."""
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def register_dashboard_form(study: optuna.Study) -> bool:
    """Add the stop/resume/delete/clone form to running trials in optuna-dashboard.

    Replaces the form an older version of this package registered. Does nothing (and returns False) if
    optuna-dashboard is not installed or the study already has a form of its own.
    """
    try:
        from optuna_dashboard import ChoiceWidget, TextInputWidget, register_user_attr_form_widgets
    except ImportError:
        return False
    # The text comes first: the dashboard writes the widgets' attributes one at a time in this order, so
    # a driver that sees the new action also sees its text.
    widgets = [
        TextInputWidget(
            description=(
                "clone: overrides as name=value, comma separated ('warm' alone: unchanged); trial=<n> clones trial "
                "n, from_chunk=<k> branches from its state after chunk k (default: its latest); add 'cold' for a "
                "cold clone. Wait a moment after typing before Submit"
            ),
            user_attr_key=_attrs.ACTION_ARGS,
            optional=True,
        ),
        ChoiceWidget(
            choices=_FORM_CHOICES,
            values=[_NO_ACTION, *sorted(_FORM_VALUES)],
            description="RapidFire control: applied before the trial's next chunk",
            user_attr_key=_attrs.ACTION,
        ),
    ]
    current = _compat.dashboard_form_json(_compat.storage(study).get_study_system_attrs(_compat.study_id(study)))
    if current is not None:
        keys = {w.get("user_attr_key") for w in current.get("widgets", [])}
        if current.get("output_type") != "user_attr" or keys != {_attrs.ACTION, _attrs.ACTION_ARGS}:
            return False
        if list(current["widgets"]) == [w.to_dict() for w in widgets]:
            return True
    register_user_attr_form_widgets(study, widgets=widgets)
    return True


def enqueue_clone(
    study: optuna.Study,
    trial_number: int,
    params: dict[str, Any] | None = None,
    warm_start: bool = True,
    from_chunk: int | None = None,
) -> int:
    """Enqueue a clone of ``trial_number`` with ``params`` changed (see :func:`optuna_rapidfire.control.clone`).

    Returns:
        The number of the new (WAITING) trial.
    """
    parent = find_trial(study, trial_number)
    if parent.state == TrialState.WAITING:
        raise ValueError(f"Trial {trial_number} has not started: there is nothing to clone.")
    if from_chunk is not None and (not isinstance(from_chunk, int) or isinstance(from_chunk, bool)):
        raise TypeError(f"from_chunk must be a chunk number (an int), but got {from_chunk=!r}.")
    merged = dict(parent.params)
    for name, value in (params or {}).items():
        if name not in parent.distributions:
            raise ValueError(
                f"Trial {trial_number} has no parameter {name!r}; its parameters are {sorted(parent.distributions)}."
            )
        merged[name] = _checked(name, value, parent.distributions[name])
    request: dict[str, Any] = {"parent": trial_number, "warm": bool(warm_start)}
    if warm_start:
        _check_warm_parent(parent)
        request["from_chunk"] = _branch_chunk(study, parent, from_chunk, changed=bool(params), params=merged)
    elif from_chunk is not None:
        raise ValueError(f"from_chunk={from_chunk} names a state to branch from, but a cold clone starts from none.")
    # The token finds this clone among others enqueued at the same moment by other clients.
    request["request"] = uuid.uuid4().hex
    study.enqueue_trial(merged, user_attrs={_attrs.CLONE_OF: request})
    waiting = study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
    return next(t.number for t in waiting if t.user_attrs.get(_attrs.CLONE_OF) == request)


_RUN_LENGTHS: dict[str, Callable[[dict[str, Any]], int | None]] = {}
"""Per study name, how many chunks a trial of these params runs, as the executor running that study in this process
computes it from the user's ``configure`` (``None``: it cannot tell)."""


def learn_run_length(study_name: str, run_length: Callable[[dict[str, Any]], int | None]) -> None:
    """Say how long a run of given params is in study ``study_name`` (the executor does, once it runs it here), so
    that a warm clone with nothing left to train is refused when it is asked for."""
    _RUN_LENGTHS[study_name] = run_length


def _branch_chunk(
    study: optuna.Study, parent: FrozenTrial, from_chunk: int | None, *, changed: bool, params: dict[str, Any]
) -> int:
    """The chunk boundary a warm clone of ``parent`` branches from: ``from_chunk``, or the parent's chunks done
    now (what the person asking saw). Refused at once when there is nothing to branch from (no chunk trained, or
    the named one's state no longer kept), or nothing left to train (the parent's last chunk by default, and no
    changed parameter that could give the clone a longer run; naming that chunk says the run will be longer)."""
    done = parent.user_attrs.get(_attrs.CHUNKS_DONE, 0)
    done = done if isinstance(done, int) else 0
    step = done if from_chunk is None else from_chunk
    if done == 0:
        raise ValueError(
            f"Trial {parent.number} has not trained a chunk yet: there is no state to branch a warm clone from. "
            "Clone it cold, or once it has reported a chunk."
        )
    if not 1 <= step <= done:
        raise ValueError(
            f"from_chunk must be between 1 and {done} (trial {parent.number}'s chunks done), but got {step}."
        )
    if from_chunk is not None and from_chunk != done:
        attrs = _compat.storage(study).get_study_system_attrs(_compat.study_id(study))
        kept = sorted(int(k) for k in attrs.get(f"{_attrs.CHUNK_STATES_PREFIX}{parent.number}") or {})
        if from_chunk not in kept:
            raise ValueError(
                f"Trial {parent.number}'s state after chunk {from_chunk} is no longer kept (kept: after chunks "
                f"{kept or 'none'}); a finished trial keeps its last, a live one as many as keep_checkpoints says."
            )
    total = parent.user_attrs.get(_attrs.TOTAL_CHUNKS)
    if isinstance(total, int) and step >= total and not changed and from_chunk is None:
        raise ValueError(
            f"Trial {parent.number} had trained all {total} chunks at chunk {step}: a warm clone from there would "
            "have nothing left to train. Name an earlier chunk (from_chunk, --from-chunk), clone it cold, or, for "
            f"a run your configure makes longer, name chunk {step} itself."
        )
    # Changed params at the default branch point: whether the run is longer is asked of the configure this process
    # ran the study with. A named last chunk is the person's word that it is (the next run may be configured anew).
    run_length = _RUN_LENGTHS.get(study.study_name) if from_chunk is None else None
    length = None if run_length is None or not (isinstance(total, int) and step >= total) else run_length(params)
    if length is not None and step >= length:
        raise ValueError(
            f"Trial {parent.number} had trained all {total} chunks at chunk {step}, and a run with these params is "
            f"{length} chunks: a warm clone from there would have nothing left to train. Name an earlier chunk "
            "(from_chunk, --from-chunk), or clone it cold."
        )
    return step


def asked_by_hand(trial: FrozenTrial | optuna.Trial) -> bool:
    """Whether ``trial`` is a clone a person asked for (:func:`enqueue_clone`), not one a sampler made."""
    request = trial.user_attrs.get(_attrs.CLONE_OF)
    return isinstance(request, dict) and "request" in request


def _check_warm_parent(parent: FrozenTrial) -> None:
    """Refuse a warm clone of a trial that failed: its state is not one to continue from."""
    if parent.state == TrialState.FAIL:
        raise ValueError(
            f"Trial {parent.number} failed ({parent.user_attrs.get(_attrs.FAIL_REASON, 'no reason recorded')}): "
            "a warm clone would continue from a failed state. Clone it cold (warm_start=False, or 'cold' on the "
            "command line) to train the new config from scratch."
        )


def find_trial(study: optuna.Study, trial_number: int) -> FrozenTrial:
    if not isinstance(trial_number, int) or isinstance(trial_number, bool):
        raise TypeError(f"trial_number must be an int, but got {trial_number!r}.")
    for trial in study.get_trials(deepcopy=False):
        if trial.number == trial_number:
            return trial
    raise ValueError(f"Trial {trial_number} does not exist in study {study.study_name!r}.")


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
