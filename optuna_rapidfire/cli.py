"""``optuna-rapidfire``: list trials and stop, resume, delete or clone them, from any machine.

    optuna-rapidfire ls     --storage sqlite:///rf.db --study-name demo
    optuna-rapidfire stop   --storage sqlite:///rf.db --study-name demo 3
    optuna-rapidfire resume --storage sqlite:///rf.db --study-name demo 3
    optuna-rapidfire delete --storage sqlite:///rf.db --study-name demo 7 --reason diverged
    optuna-rapidfire clone  --storage sqlite:///rf.db --study-name demo 5 --set learning_rate=1e-4 [--cold]
    optuna-rapidfire worker --storage postgresql://... --study-name demo --app mymodule:app --study-trials 64

Commands go through the study's storage and take effect before the trial's next chunk starts. A worker
joins a study from any machine: ``app`` is a function of the user's module, called as
``app(devices=...)``, that returns ``(executor, configure)`` or ``(executor, configure, study_kwargs)``
(``sampler=``, ``pruner=`` for ``optuna.load_study``). Workers record heartbeats; the trials of a worker
that dies are retried on a live one from their last per-chunk checkpoint.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import TYPE_CHECKING, Any

from optuna_rapidfire import _attrs, control

if TYPE_CHECKING:
    import optuna


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="optuna-rapidfire", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help_text: str, with_trial: bool = True) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_text)
        sub.add_argument("--storage", required=True, help="the study's storage URL (sqlite:///..., postgresql://...)")
        sub.add_argument("--study-name", required=True)
        if with_trial:
            sub.add_argument("trial", type=int, help="trial number")
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
    clone = command("clone", "enqueue a warm (or --cold) clone of a trial")
    clone.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="change a parameter")
    clone.add_argument("--cold", action="store_true", help="start from scratch instead of the parent's state")
    return parser


def _overrides(pairs: list[str]) -> dict[str, Any]:
    from optuna_rapidfire._commands import _parse_value

    params = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise ValueError(f"--set takes NAME=VALUE, but got {pair!r}.")
        params[name.strip()] = _parse_value(value.strip())
    return params


def _table(study: optuna.Study) -> str:
    rows = [("trial", "state", "chunks", "value", "parent", "params")]
    for trial in study.get_trials(deepcopy=False):
        state = trial.state.name
        status = trial.user_attrs.get(_attrs.STATUS)
        if state == "RUNNING" and status:
            state = f"RUNNING ({status})"
        done = trial.user_attrs.get(_attrs.CHUNKS_DONE, len(trial.intermediate_values))
        total = trial.user_attrs.get(_attrs.TOTAL_CHUNKS, "?")
        last = trial.value if trial.value is not None else trial.intermediate_values.get(trial.last_step or 0)
        parent = trial.user_attrs.get(_attrs.PARENT)
        if parent is not None:
            parent = f"{parent}@{trial.user_attrs.get(_attrs.BRANCH_STEP, 0)} {trial.user_attrs.get(_attrs.CLONE, '')}"
        params = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in trial.params.items())
        value = "" if last is None else f"{last:.6g}"
        rows.append((str(trial.number), state, f"{done}/{total}", value, str(parent or ""), params))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row[:5], widths, strict=True)) + "  " + row[5] for row in rows
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``optuna-rapidfire`` command."""
    import optuna

    options = _parser().parse_args(argv)
    if options.command == "worker":
        return _worker(options)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        study = optuna.load_study(study_name=options.study_name, storage=options.storage)
        if options.command == "ls":
            print(_table(study))
        elif options.command == "stop":
            control.stop(study, options.trial)
            print(f"trial {options.trial}: stop requested (applied before its next chunk)")
        elif options.command == "resume":
            control.resume(study, options.trial)
            print(f"trial {options.trial}: resume requested")
        elif options.command == "delete":
            control.delete(study, options.trial, reason=options.reason)
            print(f"trial {options.trial}: delete requested")
        elif options.command == "clone":
            child = control.clone(study, options.trial, _overrides(options.set), warm_start=not options.cold)
            print(f"trial {options.trial}: {'cold' if options.cold else 'warm'} clone enqueued as trial {child}")
    except (ValueError, TypeError, KeyError) as error:
        message = error.args[0] if isinstance(error, KeyError) and error.args else error
        print(f"optuna-rapidfire: error: {message}", file=sys.stderr)
        return 2
    return 0


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
    from optuna_rapidfire._storages import hide_password

    logger = get_logger("optuna_rapidfire.worker")
    for name in ("n_trials", "study_trials", "heartbeat_interval", "max_retry"):
        value = getattr(options, name)
        if value is not None and value < (0 if name == "max_retry" else 1):
            print(f"optuna-rapidfire: error: --{name.replace('_', '-')} must be positive, got {value}", file=sys.stderr)
            return 2
    try:
        scheme = options.storage.split(":", 1)[0].split("+")[0]
        if scheme not in {"sqlite", "postgresql", "mysql", "oracle", "mssql"}:
            shown = hide_password(options.storage)
            raise ValueError(f"--storage must be an RDB URL (postgresql://..., sqlite:///...), got {shown!r}.")
        app = _load_app(options.app)
        storage = optuna.storages.RDBStorage(
            options.storage,
            heartbeat_interval=options.heartbeat_interval,
            grace_period=options.grace_period,
            heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(
                max_retry=options.max_retry
            ),
        )
        made = app(devices=options.devices)
        if not (isinstance(made, tuple) and len(made) in (2, 3) and isinstance(made[0], RapidFireExecutor)):
            raise TypeError(f"--app {options.app!r} must return (executor, configure[, study_kwargs]).")
        executor, configure = made[0], made[1]
        study_kwargs = dict(made[2]) if len(made) == 3 else {}
        study = optuna.load_study(study_name=options.study_name, storage=storage, **study_kwargs)
    except (ValueError, TypeError, KeyError) as error:
        message = error.args[0] if isinstance(error, KeyError) and error.args else error
        print(f"optuna-rapidfire: error: {message}", file=sys.stderr)
        return 2
    logger.info("Worker %s joined study %r on %s.", os.getpid(), options.study_name, hide_password(options.storage))
    with executor:
        executor.optimize(
            study,
            configure,
            n_trials=options.n_trials,
            timeout=options.timeout,
            study_trials=options.study_trials,
        )
    logger.info("Worker %s is done.", os.getpid())
    return 0


if __name__ == "__main__":
    sys.exit(main())
