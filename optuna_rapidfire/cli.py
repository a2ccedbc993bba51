"""optuna-rapidfire: run a declared search; list trials and stop, resume, delete or clone them, from any machine.

  optuna-rapidfire tune   search.yaml [--merge]

  optuna-rapidfire ls     --storage sqlite:///rf.db --study-name demo
  optuna-rapidfire stop   --storage sqlite:///rf.db --study-name demo 3
  optuna-rapidfire resume --storage sqlite:///rf.db --study-name demo 3
  optuna-rapidfire delete --storage sqlite:///rf.db --study-name demo 7 --reason diverged
  optuna-rapidfire clone  --storage sqlite:///rf.db --study-name demo 5 --set learning_rate=1e-4 [--from-chunk 2|--cold]
  optuna-rapidfire worker --storage postgresql://user:pw@db/optuna --study-name demo --app tuning:app --study-trials 64

Every command works on a study that already exists (made with optuna create-study or in Python): none
creates a database, its tables or a study. Commands go through the study's storage and take effect before
the trial's next chunk starts, or within a second when the trial is not training (waiting at a rung, or
paused); each waits up to --wait seconds and says what the executor did. A warm clone branches from the
trial's state at its chunks done now (or --from-chunk N).

A worker joins a study from any machine: --app names a function of your
module, called as app(devices=...), that returns (executor, configure) or (executor, configure,
study_kwargs), the last with sampler= and pruner= for optuna.load_study. Workers record heartbeats; the
trials of a worker that dies are retried on a live one from their last per-chunk checkpoint.

tune runs the search a YAML file declares (model, data, trainer, space, objective, budget) and creates or
continues its study: running it again never repeats a finished trial. It writes summary.json, report.md and
best_adapter/ (with --merge also best_merged/) to the search's output folder. Exit status: 0 when a trial
completed, 1 when none did, 2 for bad input, 130 when interrupted (Ctrl-C or SIGTERM; run it again to go on).
"""

# The docstring above is the text of --help, so it is plain text, not reST.

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
import time
from typing import TYPE_CHECKING, Any

from optuna_rapidfire import _compat, control
from optuna_rapidfire._cli_storage import check_study, load_study, open_storage, unreachable
from optuna_rapidfire._study import _attrs, _commands
from optuna_rapidfire._study._storages import hide_password

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    import optuna
    from optuna.trial import FrozenTrial


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("optuna-rapidfire")
    except PackageNotFoundError:  # a source tree that was never installed
        return "unknown (not installed)"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="optuna-rapidfire", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help_text: str, with_trial: bool = True) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_text, description=help_text)
        sub.add_argument(
            "--storage", required=True, help="the study's storage URL (sqlite:///rf.db, postgresql://user:pw@host/db)"
        )
        sub.add_argument("--study-name", required=True)
        if with_trial:
            sub.add_argument("trial", type=int, help="trial number")
            sub.add_argument(
                "--wait",
                type=float,
                default=10.0,
                metavar="SECONDS",
                help="wait this long for the executor to apply it, and say what it did (0: do not wait)",
            )
        return sub

    command("ls", "list trials: state, chunk progress, last value, parent", with_trial=False)
    command("stop", "pause a running trial at its next chunk boundary")
    command("resume", "continue a paused trial")
    command("delete", "stop a trial for good and free its state").add_argument(
        "--reason", default="deleted by user", help="recorded in the trial's user attrs"
    )
    worker = command("worker", "join a study as a worker: pull trials from the storage and train them", False)
    worker.add_argument("--app", required=True, metavar="MODULE:ATTR", help="app(devices=...) -> (executor, configure)")
    worker.add_argument("--devices", default="auto", help="auto, cpu, cuda:0, or cuda:0,cuda:1 (one process each)")
    budget = worker.add_mutually_exclusive_group()
    budget.add_argument("--n-trials", type=int, default=None, help="trials this worker runs")
    budget.add_argument(
        "--study-trials", type=int, default=None, help="run until the study has this many COMPLETE or PRUNED trials"
    )
    worker.add_argument("--timeout", type=float, default=None, help="seconds after which no new trial starts")
    worker.add_argument("--heartbeat-interval", type=int, default=10, help="seconds between a trial's heartbeats")
    worker.add_argument(
        "--grace-period", type=int, default=None, help="seconds without a heartbeat before a trial counts as dead"
    )
    worker.add_argument("--max-retry", type=int, default=3, help="retries of a trial whose worker died")
    tune = commands.add_parser(
        "tune",
        help="run a declared search (YAML): create or continue its study, write summary.json and report.md",
        description="Run the search SEARCH declares; running it again continues its study.",
    )
    tune.add_argument("search", metavar="SEARCH", help="the search file (YAML)")
    tune.add_argument(
        "--merge", action="store_true", help="also save the base model with the best adapter merged in (best_merged/)"
    )
    clone = command("clone", "enqueue a warm (or --cold) clone of a trial")
    clone.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="change a parameter")
    clone.add_argument("--cold", action="store_true", help="start from scratch instead of the parent's state")
    clone.add_argument(
        "--from-chunk",
        type=int,
        default=None,
        metavar="N",
        help="branch from the trial's state after chunk N (default: its chunks done now)",
    )
    return parser


def _overrides(pairs: list[str]) -> dict[str, Any]:
    from optuna_rapidfire._study._commands import _parse_value

    params = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise ValueError(f"--set takes NAME=VALUE, but got {pair!r}.")
        params[name.strip()] = _parse_value(value.strip())
    return params


# -- opening a study that exists ---------------------------------------------------------------------


def _lineage(trial: FrozenTrial, chunks_done: dict[int, int]) -> str:
    """``parent@step warm|cold`` for a clone: where it branched, or for one that has not started yet, where it
    will branch (the chunk it was asked for at)."""
    retried = _commands.retried(trial)
    if retried:
        return f"retry of {retried[-1]}"
    parent = trial.user_attrs.get(_attrs.PARENT)
    if parent is not None:
        return f"{parent}@{trial.user_attrs.get(_attrs.BRANCH_STEP, 0)} {trial.user_attrs.get(_attrs.CLONE, '')}"
    request = trial.user_attrs.get(_attrs.CLONE_OF) or trial.system_attrs.get(_attrs.CLONE_OF)
    if not isinstance(request, dict) or not isinstance(request.get("parent"), int):
        return ""
    warm = bool(request.get("warm", True))
    step = (request.get("from_chunk") or chunks_done.get(request["parent"], 0)) if warm else 0
    return f"{request['parent']}@{step} {'warm' if warm else 'cold'}"


def _table(study: optuna.Study) -> str:
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    chunks_done = {t.number: int(t.user_attrs.get(_attrs.CHUNKS_DONE, len(t.intermediate_values))) for t in trials}
    rows = [("trial", "state", "chunks", "value", "parent", "params")]
    for trial in trials:
        state = trial.state.name
        status = trial.user_attrs.get(_attrs.STATUS)
        if status != "paused":  # what it does now: training, waiting at its rung after chunk k, queued...
            status = trial.user_attrs.get(_attrs.ACTIVITY) or status
        if state == "RUNNING" and status:
            state = f"RUNNING ({status})"
        if not trial.state.is_finished():
            waiting = [c.op for c in _commands.pending(study, trial) if c.op in _commands.TRIAL_OPS]
            if waiting:
                state += f" [pending: {', '.join(waiting)}]"
        if trial.state == TrialState.WAITING:
            # Not started: Optuna keeps an enqueued trial's params (a clone's included) as "fixed_params".
            chunks, params = "-", dict(trial.system_attrs.get("fixed_params") or {})
        else:
            total = trial.user_attrs.get(_attrs.TOTAL_CHUNKS, "?")
            chunks, params = f"{chunks_done[trial.number]}/{total}", trial.params
        last = trial.value if trial.value is not None else trial.intermediate_values.get(trial.last_step or 0)
        shown = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())
        value = "" if last is None else f"{last:.6g}"
        rows.append((str(trial.number), state, chunks, value, _lineage(trial, chunks_done), shown))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row[:5], widths, strict=True)) + "  " + row[5] for row in rows
    )


# -- the commands ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``optuna-rapidfire`` command: the command's function from :data:`COMMANDS`."""
    options = _parser().parse_args(argv)
    try:
        return COMMANDS[options.command](options)
    except _Refused:
        return 2


class _Refused(Exception):
    """Bad input, already said on stderr: the command exits with status 2."""


@contextlib.contextmanager
def _refusing(storage: str | None) -> Iterator[None]:
    """Say bad input (a ``ValueError``, ``TypeError`` or ``KeyError``) or a failing storage in one line and refuse
    (:class:`_Refused`): the one place the commands do. ``storage``: the URL the command opened, if any."""
    from sqlalchemy.exc import SQLAlchemyError

    try:
        yield
    except SQLAlchemyError as error:  # the server went away after the study was opened
        failed = str(getattr(error, "orig", None) or error).splitlines()[0]
        _error(unreachable(storage, error) if storage is not None else f"the study's storage failed: {failed}")
        raise _Refused from None
    except (ValueError, TypeError, KeyError) as error:
        _error(error.args[0] if isinstance(error, KeyError) and error.args else error)
        raise _Refused from None


def _study(options: argparse.Namespace) -> optuna.Study:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return load_study(options.storage, options.study_name)


def _ls(options: argparse.Namespace) -> int:
    with _refusing(options.storage):
        print(_table(_study(options)))
    return 0


def _trial_command(options: argparse.Namespace) -> int:
    """``stop``, ``resume`` or ``delete`` one trial, and say what the executor did."""
    act = control.TRIAL_COMMANDS[options.command]
    with _refusing(options.storage):
        study = _study(options)
        key = act(study, options.trial, **({"reason": options.reason} if options.command == "delete" else {}))
        print(f"trial {options.trial}: {options.command} {_applied(study, key, options.wait)}")
    return 0


def _clone(options: argparse.Namespace) -> int:
    with _refusing(options.storage):
        study = _study(options)
        params = _overrides(options.set)
        child = control.clone(study, options.trial, params, warm_start=not options.cold, from_chunk=options.from_chunk)
        print(f"trial {options.trial}: {_started(study, child, options.wait)}")
    return 0


def _applied(study: optuna.Study, key: str, wait: float) -> str:
    """What the executor did with command ``key``, once it has (waiting up to ``wait`` seconds for it)."""
    done_key = _attrs.DONE_PREFIX + key.removeprefix(_attrs.COMMAND_PREFIX)
    done = _poll(lambda: _compat.storage(study).get_study_system_attrs(_compat.study_id(study)).get(done_key), wait)
    if done is None:
        return "requested: not applied yet (a trial applies it before its next chunk, at once while it waits)"
    return f"applied: {done['result']}"


def _started(study: optuna.Study, child: int, wait: float) -> str:
    """How clone ``child`` started (warm from where, or cold and why), once it has (waiting up to ``wait``)."""

    def branched() -> FrozenTrial | None:
        trial = study.trials[child]
        return trial if _attrs.CLONE in trial.user_attrs or trial.state.is_finished() else None

    trial = branched() if wait <= 0 else _poll(branched, wait)
    if trial is None:
        request = study.trials[child].user_attrs[_attrs.CLONE_OF]
        where = f" after chunk {request['from_chunk']}" if request.get("from_chunk") else ""
        warmth = "warm" if request.get("warm", True) else "cold"
        return f"{warmth} clone enqueued as trial {child}, to branch{where}; not started yet (it takes the next slot)"
    parent, step = trial.user_attrs.get(_attrs.PARENT), trial.user_attrs.get(_attrs.BRANCH_STEP)
    if _attrs.CLONE not in trial.user_attrs:
        return f"clone trial {child} ended {trial.state.name}: {trial.user_attrs.get(_attrs.FAIL_REASON)}"
    if trial.user_attrs[_attrs.CLONE] == "warm":
        return f"trial {child} started warm from trial {parent} after chunk {step}"
    return f"trial {child} started cold: {trial.user_attrs.get(_attrs.COLD_REASON)}"


def _poll(look: Callable[[], Any], wait: float) -> Any:
    """``look()`` until it returns something, for up to ``wait`` seconds; ``None`` if it never did."""
    deadline = time.monotonic() + wait
    while True:
        found = look()
        if found is not None or time.monotonic() >= deadline:
            return found
        time.sleep(0.2)


def _error(message: object) -> int:
    print(f"optuna-rapidfire: error: {message}", file=sys.stderr)
    return 2


def _load_app(spec: str) -> Any:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--app takes MODULE:ATTR (e.g. mypackage.tuning:app), but got {spec!r}.")
    sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"--app {spec!r}: cannot import {module_name!r} ({error}).") from None
    target = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ValueError(f"--app {spec!r}: {module_name!r} has no attribute {attr!r}.")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"--app {spec!r} must name a function returning (executor, configure).")
    return target


def _worker(options: argparse.Namespace) -> int:
    """``optuna-rapidfire worker``: one executor joined to a shared study, with heartbeats."""
    import optuna

    from optuna_rapidfire._executor import RapidFireExecutor
    from optuna_rapidfire._logging import get_logger

    logger = get_logger("optuna_rapidfire.worker")
    for name in ("n_trials", "study_trials", "heartbeat_interval", "max_retry"):
        value = getattr(options, name)
        if value is not None and value < (0 if name == "max_retry" else 1):
            return _error(f"--{name.replace('_', '-')} must be positive, got {value}")
    with _refusing(options.storage):
        app = _load_app(options.app)
        # The storage and the study are checked before app() builds the executor (it may load a model).
        storage = open_storage(
            options.storage,
            heartbeat_interval=options.heartbeat_interval,
            grace_period=options.grace_period,
            heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(
                max_retry=options.max_retry
            ),
        )
        check_study(storage, options.study_name, options.storage)
        made = app(devices=options.devices)
        if not (isinstance(made, tuple) and len(made) in (2, 3) and isinstance(made[0], RapidFireExecutor)):
            raise TypeError(f"--app {options.app!r} must return (executor, configure[, study_kwargs]).")
        executor, configure = made[0], made[1]
        study_kwargs = dict(made[2]) if len(made) == 3 else {}
        study = optuna.load_study(study_name=options.study_name, storage=storage, **study_kwargs)
    logger.info("Worker %s joined study %r on %s.", os.getpid(), options.study_name, hide_password(options.storage))
    callbacks = []
    if options.study_trials is not None:
        finished = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
        callbacks.append(optuna.study.MaxTrialsCallback(options.study_trials, states=finished))
    try:
        with _sigterm_as_interrupt(), executor:
            executor.optimize(study, configure, n_trials=options.n_trials, timeout=options.timeout, callbacks=callbacks)
    except KeyboardInterrupt as error:
        print(
            f"optuna-rapidfire: worker {os.getpid()} interrupted ({_cause(error)}); its live trials ended (PRUNED).",
            file=sys.stderr,
        )
        return 130
    logger.info("Worker %s is done.", os.getpid())
    return 0


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """While inside, SIGTERM (a pipeline's or scheduler's cancel) ends the study as Ctrl-C does, cleanly: it
    raises :class:`~optuna_rapidfire._study._optimize.Terminated` in the main thread (elsewhere: nothing
    changes, signals reach only the main thread)."""
    import signal
    import threading

    from optuna_rapidfire._study._optimize import Terminated

    def interrupt(signum: int, frame: object) -> None:
        raise Terminated

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _cause(error: KeyboardInterrupt) -> str:
    from optuna_rapidfire._study._optimize import Terminated

    return "SIGTERM" if isinstance(error, Terminated) else "Ctrl-C"


def _tune(options: argparse.Namespace) -> int:
    """``optuna-rapidfire tune``: 0 with a COMPLETE trial, 1 without, 2 for bad input, 130 when interrupted."""
    from optuna_rapidfire._tune import NoCompleteTrialError, tune

    try:
        with _sigterm_as_interrupt(), _refusing(None):
            result = tune(options.search, merge=options.merge)
    except NoCompleteTrialError as error:
        print(f"optuna-rapidfire: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as error:
        print(
            f"optuna-rapidfire: the tuning step was interrupted ({_cause(error)}); run it again to go on.",
            file=sys.stderr,
        )
        return 130
    best = result.summary["best"]
    print(f"best trial {best['number']}: {result.summary['metric']} = {best['value']}, params {best['params']}")
    print(f"best adapter: {result.best_adapter}")
    if result.merged is not None:
        print(f"merged model: {result.merged}")
    print(f"summary: {result.summary_path}")
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "tune": _tune,
    "ls": _ls,
    **dict.fromkeys(control.TRIAL_COMMANDS, _trial_command),
    "clone": _clone,
    "worker": _worker,
}
"""Each command of ``optuna-rapidfire`` and its function."""


if __name__ == "__main__":
    sys.exit(main())
