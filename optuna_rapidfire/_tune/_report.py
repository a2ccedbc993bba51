"""What a tuning step hands the next step: ``summary.json``, ``report.md`` and the per-chunk curves' plot.

:func:`summary` reads the study (every trial, whichever run of the step ran it) into one JSON-serialisable
dict; :func:`write` writes it with the report and the plot into the step's output folder. The summary's
``format`` is bumped whenever a key changes meaning, so a pipeline can check what it reads.
"""

from __future__ import annotations

import json
import math
import platform
from typing import TYPE_CHECKING, Any

from optuna_rapidfire._study import _attrs

if TYPE_CHECKING:
    from datetime import datetime
    from pathlib import Path

    import optuna
    from optuna.trial import FrozenTrial

    from optuna_rapidfire._tune._search import Search

FORMAT = 1
"""Version of the summary's layout."""
SUMMARY = "summary.json"
REPORT = "report.md"
PLOT = "curves.png"
_PACKAGES = ("torch", "transformers", "peft", "trl", "datasets", "optuna", "optuna-rapidfire")


def versions() -> dict[str, str]:
    """Python's and the training stack's versions (``"not installed"`` for a missing one)."""
    from importlib.metadata import PackageNotFoundError, version

    found = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "not installed"
    return found


def _number(value: float | None) -> float | None:
    """JSON has no NaN or infinity: a value that is not finite is written as null."""
    return value if value is not None and math.isfinite(value) else None


def _time(moment: datetime | None) -> str | None:
    """Local time with its UTC offset (Optuna records a trial's times as naive local times)."""
    return None if moment is None else moment.astimezone().isoformat()


_ENDED = {"COMPLETE": "complete", "PRUNED": "pruned", "FAIL": "failed"}


def _status(trial: FrozenTrial) -> str | None:
    """The trial's ``rapidfire:status``; for a finished trial that still says it runs (failed by Optuna's own
    heartbeat check under a plain ``study.optimize``, whose storage does not mark stale trials), its end."""
    status = trial.user_attrs.get(_attrs.STATUS)
    if trial.state.is_finished() and status in ("running", "paused"):
        return _ENDED.get(trial.state.name, status)
    return status


def trial_entry(trial: FrozenTrial, continued_by: int | None = None) -> dict[str, Any]:
    """One trial as the summary lists it (``continued_by``: the trial that carries it on, if any)."""
    attrs = trial.user_attrs
    reason = attrs.get(_attrs.FAIL_REASON) or attrs.get(_attrs.PRUNED_REASON)
    seconds = None
    if trial.datetime_start is not None and trial.datetime_complete is not None:
        seconds = (trial.datetime_complete - trial.datetime_start).total_seconds()
    return {
        "number": trial.number,
        "state": trial.state.name,
        "status": _status(trial),
        "value": _number(trial.value) if trial.values else None,
        "params": dict(trial.params),
        "chunks_done": attrs.get(_attrs.CHUNKS_DONE, len(trial.intermediate_values)),
        "total_chunks": attrs.get(_attrs.TOTAL_CHUNKS),
        "reason": reason,
        "curve": [_number(trial.intermediate_values[step]) for step in sorted(trial.intermediate_values)],
        "parent": attrs.get(_attrs.PARENT),
        "retry_of": attrs.get(_attrs.RETRY_OF),
        "continued_by": continued_by,
        "adapter_path": attrs.get(_attrs.ADAPTER_PATH),
        "started": _time(trial.datetime_start),
        "ended": _time(trial.datetime_complete),
        "seconds": seconds,
    }


def summary(
    search: Search,
    study: optuna.Study,
    *,
    status: str,
    error: str | None,
    started: datetime,
    ended: datetime,
    trials_run: int,
    continued_by: dict[int, int],
    best_adapter: Path | None,
    merged: Path | None,
    mlflow_run: str | None,
    plot: bool,
) -> dict[str, Any]:
    """The whole summary (see the README's "Tuning step for pipelines" for each key)."""
    from optuna.trial import TrialState

    trials = [trial_entry(t, continued_by.get(t.number)) for t in study.get_trials(deepcopy=False)]
    complete = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if t.value is not None]
    best = None
    if complete:
        winner = study.best_trial
        best = {
            "number": winner.number,
            "value": _number(winner.value),
            "params": dict(winner.params),
            "adapter_path": None if best_adapter is None else str(best_adapter),
            "trial_adapter_path": winner.user_attrs.get(_attrs.ADAPTER_PATH),
            "merged_path": None if merged is None else str(merged),
        }
    counts = {state.name: sum(t["state"] == state.name for t in trials) for state in TrialState}
    return {
        "format": FORMAT,
        "status": status,
        "error": error,
        "study_name": study.study_name,
        "storage": _hidden(search.storage),
        "model": search.model,
        "trainer": search.trainer,
        "metric": search.metric,
        "direction": search.direction,
        "best": best,
        "budget": {"n_trials": search.n_trials, "timeout": search.timeout},
        "counts": {name: n for name, n in counts.items() if n},
        "trials_run_now": trials_run,
        "trials": trials,
        "times": {
            "started": _time(started),
            "ended": _time(ended),
            "seconds": (ended - started).total_seconds(),
        },
        "versions": versions(),
        "search": {"path": search.source, "sha256": search.sha256},
        "output": search.output,
        "report": REPORT,
        "plot": PLOT if plot else None,
        "mlflow": None if mlflow_run is None else {"run_id": mlflow_run, "artifact_path": "best_adapter"},
    }


def _hidden(url: str) -> str:
    from optuna_rapidfire._study._storages import hide_password

    return hide_password(url)


def plot_curves(study: optuna.Study, metric: str, path: Path) -> None:
    """Per-chunk values of every trial, one line each: COMPLETE solid, PRUNED dashed, FAIL dotted, the best
    trial thick. Written with matplotlib's object API (no pyplot, so no global backend is changed)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator
    from optuna.trial import TrialState

    figure = Figure(figsize=(7, 4.2), dpi=110)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    complete = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if t.value is not None]
    best = study.best_trial.number if complete else None
    styles = {TrialState.COMPLETE: "-", TrialState.PRUNED: "--", TrialState.FAIL: ":"}
    for trial in study.get_trials(deepcopy=False):
        steps = sorted(trial.intermediate_values)
        if not steps:
            continue
        is_best = trial.number == best
        axes.plot(
            [s + 1 for s in steps],
            [trial.intermediate_values[s] for s in steps],
            linestyle=styles.get(trial.state, "-."),
            marker="o",
            markersize=3,
            linewidth=2.6 if is_best else 1.1,
            label=f"trial {trial.number} ({trial.state.name.lower()}{', best' if is_best else ''})",
        )
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_xlabel("chunk")
    axes.set_ylabel(metric)
    axes.set_title(f"{study.study_name}: {metric} after each chunk")
    axes.grid(alpha=0.3)
    if axes.lines:
        axes.legend(fontsize=7, ncol=2 if len(axes.lines) > 8 else 1)
    figure.tight_layout()
    figure.savefig(path)


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, dict):
        return ", ".join(f"{k}={_cell(v)}" for k, v in value.items())
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown(data: dict[str, Any]) -> str:
    """``report.md``: the outcome, the best trial, every trial, the curves and how the step ran."""
    best = data["best"]
    lines = [f"# Tuning step: {data['study_name']}", ""]
    if best is not None:
        lines.append(
            f"**{data['status']}**: best trial {best['number']}, {data['metric']} = {_cell(best['value'])} "
            f"({data['direction']}), of {len(data['trials'])} trials."
        )
    else:
        lines.append(f"**{data['status']}**: no trial completed. {data['error'] or ''}".rstrip())
    lines += ["", f"Model `{data['model']}`, trainer {data['trainer']}."]
    if best is not None:
        lines += ["", "| best | |", "|---|---|"]
        lines += [f"| `{name}` | {_cell(value)} |" for name, value in best["params"].items()]
        lines.append(f"| adapter | `{best['adapter_path']}` |")
        if best["merged_path"]:
            lines.append(f"| merged model | `{best['merged_path']}` |")
    lines += ["", "## Trials", "", "| trial | state | chunks | value | params | reason |", "|---|---|---|---|---|---|"]
    for trial in data["trials"]:
        chunks = f"{trial['chunks_done']}/{trial['total_chunks'] or '?'}"
        reason = _cell(trial["reason"])
        if trial["continued_by"] is not None:
            reason += f" (continued by trial {trial['continued_by']})"
        lines.append(
            f"| {trial['number']} | {trial['state']} | {chunks} | {_cell(trial['value'])} | "
            f"{_cell(trial['params'])} | {reason.strip()} |"
        )
    lines += ["", "## Per-chunk curves", ""]
    if data["plot"]:
        lines.append(f"![{data['metric']} after each chunk]({data['plot']})")
    else:
        lines.append("No trial reported a chunk yet.")
    times, search = data["times"], data["search"]
    lines += [
        "",
        "## This run",
        "",
        f"- started {times['started']}, ended {times['ended']} ({times['seconds']:.0f} s); "
        f"{data['trials_run_now']} trial(s) started now",
        f"- storage `{data['storage']}`",
        f"- search {('`' + search['path'] + '`') if search['path'] else '(a dict)'}, sha256 `{search['sha256']}`",
        "- versions: " + ", ".join(f"{name} {version}" for name, version in data["versions"].items()),
    ]
    if data["mlflow"]:
        lines.append(f"- MLflow: best adapter in run `{data['mlflow']['run_id']}` under `best_adapter/`")
    return "\n".join(lines) + "\n"


def write(data: dict[str, Any], output: Path) -> Path:
    """Write ``summary.json`` and ``report.md`` into ``output`` (each replaced whole); return the summary's path."""
    path = output / SUMMARY
    _replace(path, json.dumps(data, indent=2) + "\n")
    _replace(output / REPORT, markdown(data))
    return path


def _replace(path: Path, text: str) -> None:
    """Write through a temporary file, so a reader never sees half a summary."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    partial.replace(path)
