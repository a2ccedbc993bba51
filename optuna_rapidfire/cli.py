"""``optuna-rapidfire``: list trials and stop, resume, delete or clone them, from any machine.

    optuna-rapidfire ls     --storage sqlite:///rf.db --study-name demo
    optuna-rapidfire stop   --storage sqlite:///rf.db --study-name demo 3
    optuna-rapidfire resume --storage sqlite:///rf.db --study-name demo 3
    optuna-rapidfire delete --storage sqlite:///rf.db --study-name demo 7 --reason diverged
    optuna-rapidfire clone  --storage sqlite:///rf.db --study-name demo 5 --set learning_rate=1e-4 [--cold]

Commands go through the study's storage and take effect before the trial's next chunk starts.
"""

from __future__ import annotations

import argparse
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


if __name__ == "__main__":
    sys.exit(main())
