"""Running a declared search: one step of a pipeline that can be run again.

:func:`tune` validates the search, loads the data, makes the executor (which checks its settings), then
creates the study or opens it again. Running the same step again continues the study and never repeats a
finished trial:

- trials a killed run left RUNNING are failed once their heartbeats stop (Optuna's grace period) and
  retried from their last per-chunk checkpoint (``RetryHeartbeatStaleTrialCallback``);
- trials an interrupted run (Ctrl-C, SIGTERM) ended as PRUNED with ``rapidfire:status=interrupted`` are
  continued as warm clones, which inherit their curves and train the chunks they had left;
- ``budget.n_trials`` counts the study's COMPLETE and PRUNED trials, a continued trial once (FAIL trials
  are retried or replaced); only the rest run, and when the budget is met nothing trains and the outputs
  are written again.

The model and what every trial builds are checked before anything is created. A search whose model,
trainer, objective or space differ from the study's is refused once the study has results (a study without
any takes it, saying what changed); any other change is allowed with a warning. Whatever happens once the
study is open, ``summary.json`` and ``report.md`` are written, then the error (if any) is raised.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from optuna_rapidfire._logging import get_logger
from optuna_rapidfire._study import _attrs, _commands
from optuna_rapidfire._tune import _export, _report
from optuna_rapidfire._tune._inputs import (
    build_named,
    check_model,
    check_trials,
    load_data,
    make_configure,
    model_path,
    open_storage,
    reward_funcs,
    trials_in_study,
)
from optuna_rapidfire._tune._search import load_search

if TYPE_CHECKING:
    from collections.abc import Mapping

    import optuna

    from optuna_rapidfire._executor import RapidFireExecutor
    from optuna_rapidfire._tune._search import Search

_logger = get_logger(__name__)

SEARCH_ATTR = "rapidfire:tune:search"
"""Study user attr: the search as last run (JSON), with its hash under :data:`SHA256_ATTR`."""
SHA256_ATTR = "rapidfire:tune:sha256"
DEFINITION_ATTR = "rapidfire:tune:definition"
"""Study user attr: what makes trials comparable (model, trainer, objective, space); a change is refused."""
CONTINUED_ATTR = "rapidfire:tune:continued"
"""Study user attr: ``{interrupted trial: the warm clone that continues it}``."""
_WAIT_POLL_S = 1.0


class NoCompleteTrialError(RuntimeError):
    """The search ended without a COMPLETE trial (``summary.json`` says why each trial ended)."""


@dataclass(frozen=True)
class TuneResult:
    """What a tuning step produced (all of it is also in ``summary.json``).

    Attributes:
        study: The study, in its storage.
        summary: The content of ``summary.json``.
        summary_path: Where ``summary.json`` was written (``report.md`` and ``curves.png`` are beside it).
        best_adapter: The best trial's adapter, copied to ``<output>/best_adapter``.
        merged: ``<output>/best_merged`` when the best adapter was merged into the base, else ``None``.
    """

    study: optuna.Study
    summary: dict[str, Any]
    summary_path: Path
    best_adapter: Path
    merged: Path | None

    @property
    def best_params(self) -> dict[str, Any]:
        """The best trial's parameters, by their names in the search (``training.learning_rate``...)."""
        return dict(self.summary["best"]["params"])

    @property
    def best_value(self) -> float:
        """The best trial's value of the objective's metric."""
        return float(self.summary["best"]["value"])


def tune(search: str | os.PathLike[str] | Mapping[str, Any], *, merge: bool = False) -> TuneResult:
    """Run a declared search: create or continue its study, then write what the next step reads.

    The search (a YAML file, or the same as a dict) names the base model, the data, the trainer kind, the space,
    the objective and the budget; the README's "Tuning step for pipelines" section describes every key. It is
    validated before any work. Running the same search again continues the study (see
    :mod:`optuna_rapidfire._tune._run`). The output folder then holds ``summary.json`` (the best trial, every
    trial's state, chunks, value and reason, times, versions, the search file's hash), ``report.md`` with
    ``curves.png``, and ``best_adapter/``.

    Example:

        .. code-block:: python

            import optuna_rapidfire

            result = optuna_rapidfire.tune("search.yaml")
            print(result.best_params, result.best_adapter)  # PeftModel.from_pretrained(base, result.best_adapter)

    Args:
        search: Path of the search file, or the search as a dict.
        merge: Also write the base model with the best adapter merged in to ``<output>/best_merged`` (as the
            search's ``merge: true``).

    Returns:
        The study, the summary, and the paths of the exported best adapter (and merged model).

    Raises:
        ValueError: Bad input (a key of the search, the data, a study whose space differs); the message names it.
        NoCompleteTrialError: The search ended without a COMPLETE trial (a ``RuntimeError``).
        KeyboardInterrupt: Ctrl-C (or SIGTERM under the CLI); live trials ended after their chunk in flight and
            are continued when the step runs again.
    """
    import optuna
    from optuna.trial import TrialState

    from optuna_rapidfire._executor import RapidFireExecutor

    spec = load_search(search)
    started = datetime.now(timezone.utc)
    output = Path(spec.output)
    # Everything that can be checked is, before anything is created or changed (no study, no output folder).
    model = model_path(spec.model)
    model_config = check_model(model)
    train = load_data(spec.train, spec.trainer, "data.train")
    evaluation = load_data(spec.eval, spec.trainer, "data.eval")
    rewards = reward_funcs(spec)
    check_trials(spec, model_config, train, evaluation, rewards)
    executor = RapidFireExecutor(
        model=model,
        model_kwargs=dict(spec.model_kwargs),
        train_dataset=train,
        eval_dataset=evaluation,
        metric=spec.metric,
        reward_funcs=rewards or None,
        mlflow_tracking_uri=spec.mlflow_tracking_uri,
        output_dir=output / "adapters",
        schedule=spec.schedule,
        **spec.executor,
    )
    with executor:
        output.mkdir(parents=True, exist_ok=True)
        storage = open_storage(spec)
        existing = trials_in_study(storage, spec.study_name)
        study = optuna.create_study(
            storage=storage,
            study_name=spec.study_name,
            direction=spec.direction,
            sampler=build_named(spec.sampler, "sampler", seed_offset=existing),
            pruner=build_named(spec.pruner, "pruner"),
            load_if_exists=True,
        )
        _check_same_search(study, spec)
        _wait_for_earlier_run(study, spec.heartbeat_interval)
        started_before = {t.number for t in study.trials if t.state != TrialState.WAITING}
        error: BaseException | None = None
        try:
            _continue_interrupted(study)
            left = trials_left(study, spec.n_trials)
            if left == 0:
                _logger.info("The study has its %d trials: nothing to run; writing the outputs again.", spec.n_trials)
            else:
                if left is None:
                    _logger.info("Tuning step %r: running trials for %.0f s.", spec.study_name, spec.timeout)
                else:
                    assert spec.n_trials is not None
                    done = spec.n_trials - left
                    _logger.info(
                        "Tuning step %r: %d of %d trials done, %d to run.", spec.study_name, done, spec.n_trials, left
                    )
                _run_budget(executor, study, make_configure(spec), spec, left)
        except BaseException as caught:
            error = caught
    started_now = sum(t.state != TrialState.WAITING and t.number not in started_before for t in study.trials)
    return _finish(spec, study, started, started_now, error, merge=merge or spec.merge)


def _run_budget(
    executor: RapidFireExecutor, study: optuna.Study, configure: Any, spec: Search, left: int | None
) -> None:
    """Run the trials ``left`` (``None``: until the timeout). A trial that FAILs does not count toward
    ``n_trials``: once the run has ended, as many new configs as failed run in their place, in rounds, up to as
    many replacements as the run had trials to run; none once no trial of the study has a result (a set-up every
    trial fails on: replacing its trials would only repeat the failure; the next run after a fix takes them)."""
    import time

    from optuna.trial import TrialState

    start, replaced = time.monotonic(), 0
    cap = left or 0
    while True:
        timeout = None if spec.timeout is None else spec.timeout - (time.monotonic() - start)
        if timeout is not None and timeout <= 0:
            return
        executor.optimize(study, configure, n_trials=left, timeout=timeout)
        if left is None or (spec.timeout is not None and time.monotonic() - start >= spec.timeout):
            return  # trials the timeout kept from starting are not failures to replace
        short = trials_left(study, spec.n_trials) or 0
        results = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
        if short == 0 or not results or replaced >= cap:
            if short:
                _logger.warning(
                    "%d trial(s) of the budget failed%s; the next run of this step runs new configs in their place.",
                    short,
                    "" if results else " and no trial has a result yet",
                )
            return
        left = min(short, cap - replaced)
        replaced += left
        _logger.info(
            "%d trial(s) failed; running %d new config(s) in their place (failed trials do not count toward n_trials).",
            short,
            left,
        )


def successors(study: optuna.Study) -> dict[int, int]:
    """``{trial: the trial that carries it on}``: Optuna's retry of a trial whose run was killed, or the warm
    clone that continues an interrupted one."""
    found = {int(number): int(child) for number, child in study.user_attrs.get(CONTINUED_ATTR, {}).items()}
    for trial in study.get_trials(deepcopy=False):
        for number in _commands.retried(trial):
            found.setdefault(number, trial.number)
    return found


def trials_left(study: optuna.Study, n_trials: int | None) -> int | None:
    """Trials still to start for ``n_trials`` in the study (``None``: no count, only the timeout).

    COMPLETE and PRUNED trials count, once: an interrupted trial continued by a warm clone is counted through
    its successor. FAIL trials do not count (a killed run's are retried; a config that failed is replaced by a
    new one, as Optuna users expect of a budget of results). Trials waiting in the queue (retries,
    continuations, clones asked for by hand) are among those left, and run first.
    """
    from optuna.trial import TrialState

    if n_trials is None:
        return None
    succeeded = successors(study)
    counted = (TrialState.COMPLETE, TrialState.PRUNED)
    done = [t for t in study.get_trials(deepcopy=False, states=counted) if t.number not in succeeded]
    return max(0, n_trials - len(done))


def _definition(spec: Search) -> dict[str, Any]:
    from optuna.distributions import distribution_to_json

    return {
        "model": spec.model,
        "trainer": spec.trainer,
        "objective": f"{spec.direction} {spec.metric}",
        "space": {name: json.loads(distribution_to_json(d)) for name, d in sorted(spec.space.items())},
    }


def _check_same_search(study: optuna.Study, spec: Search) -> None:
    """Refuse a search whose trials would not be comparable with the study's results (a study without any takes
    it, saying what changed); warn about other changes."""
    from optuna.trial import TrialState

    definition = _definition(spec)
    previous = study.user_attrs.get(DEFINITION_ATTR)
    if previous is None and study.trials:
        _logger.warning(
            "Study %r was not made by a tuning step; its %d trials count.", spec.study_name, len(study.trials)
        )
    if previous is not None and previous != definition:
        changed = sorted(k for k in definition if previous.get(k) != definition[k])
        if "space" in changed:
            names = set(previous["space"]) | set(definition["space"])
            detail = sorted(n for n in names if previous["space"].get(n) != definition["space"].get(n))
            changed[changed.index("space")] = f"space ({', '.join(detail)})"
        results = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
        if not results:  # nothing to compare with yet (a first run that failed): the fixed search is taken
            _check_compatible_space(study, spec)
            _logger.warning(
                "Study %r has no COMPLETE or PRUNED trial: its %s changed, and the new search is taken.",
                spec.study_name,
                ", ".join(changed),
            )
        else:
            raise ValueError(
                f"study {spec.study_name!r} in {_report._hidden(spec.storage)} was run with another "
                f"{', '.join(changed)}: its trials would not compare with the new ones. Give the search a new "
                "study_name (or output), or restore the search it was run with."
            )
    raw = study.user_attrs.get(SEARCH_ATTR)
    if raw is not None and study.user_attrs.get(SHA256_ATTR) != spec.sha256:
        changed = sorted(k for k in set(raw) | set(spec.raw) if raw.get(k) != spec.raw.get(k))
        if set(changed) - {"budget"}:
            _logger.warning(
                "The search changed since study %r last ran (%s); its trials are kept, its COMPLETE and PRUNED "
                "ones counted toward n_trials.",
                spec.study_name,
                ", ".join(changed),
            )
        else:
            _logger.info("The budget changed since study %r last ran.", spec.study_name)
    study.set_user_attr(DEFINITION_ATTR, definition)
    study.set_user_attr(SEARCH_ATTR, dict(spec.raw))
    study.set_user_attr(SHA256_ATTR, spec.sha256)


def _check_compatible_space(study: optuna.Study, spec: Search) -> None:
    """Optuna refuses a parameter whose type or log scale differs from the one its trials have (even failed
    ones) at the first trial; say so here, naming the parameter, instead."""
    from optuna.distributions import check_distribution_compatibility

    for trial in study.get_trials(deepcopy=False):
        for name, old in trial.distributions.items():
            new = spec.space.get(name)
            if new is None:
                continue
            try:
                check_distribution_compatibility(old, new)
            except ValueError as error:
                raise ValueError(
                    f"space.{name}: {error} (in study {spec.study_name!r}, whose trial {trial.number} has {old}); "
                    "give the search a new study_name."
                ) from None


def _wait_for_earlier_run(study: optuna.Study, heartbeat_interval: int) -> None:
    """Trials an earlier run left RUNNING: wait until their heartbeats are stale (they are then retried from
    their checkpoints); trials whose heartbeats go on belong to a run still going, which is an error."""
    import time

    from optuna.trial import TrialState

    from optuna_rapidfire._study._pool import fail_stale_trials

    deadline = time.monotonic() + 3 * heartbeat_interval + 5  # Optuna's grace period is twice the interval
    told = False
    while True:
        fail_stale_trials(study)
        running = [t.number for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))]
        if not running:
            return
        if time.monotonic() > deadline:
            raise ValueError(
                f"study {study.study_name!r}: trials {running} are RUNNING with live heartbeats: another run of "
                "this step is still going. Wait for it to end, or stop it, before running the step again."
            )
        if not told:
            told = True
            _logger.info(
                "Trials %s of an earlier run are still RUNNING; waiting up to %d s for their heartbeats to lapse "
                "(they are then retried from their last chunk).",
                running,
                int(deadline - time.monotonic()),
            )
        time.sleep(_WAIT_POLL_S)


def _continue_interrupted(study: optuna.Study) -> None:
    """Enqueue a warm clone of every trial an interrupted run ended early (once each)."""
    from optuna.trial import TrialState

    from optuna_rapidfire import control

    continued = dict(study.user_attrs.get(CONTINUED_ATTR, {}))
    for trial in study.get_trials(deepcopy=False, states=(TrialState.PRUNED,)):
        if trial.user_attrs.get(_attrs.STATUS) == "interrupted" and str(trial.number) not in continued:
            child = control.clone(study, trial.number)
            continued[str(trial.number)] = child
            _logger.info(
                "Trial %d was interrupted after chunk %s: trial %d continues it.",
                trial.number,
                trial.user_attrs.get(_attrs.CHUNKS_DONE, "?"),
                child,
            )
    if continued:
        study.set_user_attr(CONTINUED_ATTR, continued)


def _finish(
    spec: Search,
    study: optuna.Study,
    started: datetime,
    trials_run: int,
    error: BaseException | None,
    *,
    merge: bool,
) -> TuneResult:
    """Export the best trial, write the summary and the report, then raise ``error`` or a missing result."""
    from optuna.trial import TrialState

    output = Path(spec.output)
    complete = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if t.value is not None]
    best_adapter = merged = None
    mlflow_run = None
    if complete:
        best = study.best_trial
        trial_adapter = best.user_attrs.get(_attrs.ADAPTER_PATH)
        if trial_adapter is not None and os.path.isdir(trial_adapter):
            best_adapter = _export.copy_best_adapter(trial_adapter, output)
        elif error is None:
            error = ValueError(f"trial {best.number} is the best but its adapter is not at {trial_adapter!r}.")
        if best_adapter is not None and merge and error is None:
            merged = _export.merge_best(spec, best_adapter, output)
        if best_adapter is not None and spec.mlflow_tracking_uri:
            mlflow_run = _export.log_to_mlflow(spec.mlflow_tracking_uri, study, best.number, best_adapter)
    plotted = False
    if any(t.intermediate_values for t in study.get_trials(deepcopy=False)):
        _report.plot_curves(study, spec.metric, output / _report.PLOT)
        plotted = True
    message: str | None = None
    if isinstance(error, KeyboardInterrupt):
        status, message = "interrupted", "interrupted: run the step again to continue"
    elif error is not None:
        status, message = "error", f"{type(error).__name__}: {error}"
    elif best_adapter is not None:
        status = "ok"
    else:
        status, message = "failed", "no trial completed"
    data = _report.summary(
        spec,
        study,
        status=status,
        error=message,
        started=started,
        ended=datetime.now(timezone.utc),
        trials_run=trials_run,
        continued_by=successors(study),
        best_adapter=best_adapter,
        merged=merged,
        mlflow_run=mlflow_run,
        plot=plotted,
    )
    path = _report.write(data, output)
    if mlflow_run is not None and spec.mlflow_tracking_uri:
        files = [path, output / _report.REPORT, output / _report.PLOT]
        _export.log_files_to_mlflow(spec.mlflow_tracking_uri, mlflow_run, files)
    _logger.info("Tuning step %r: %s; summary in %s.", spec.study_name, status, path)
    if error is not None:
        raise error
    if best_adapter is None:
        reasons = {t["number"]: t["reason"] for t in data["trials"] if t["reason"]}
        raise NoCompleteTrialError(
            f"study {spec.study_name!r} has no COMPLETE trial ({len(data['trials'])} trials; reasons: "
            f"{reasons or 'none recorded'}); see {path}."
        )
    return TuneResult(study=study, summary=data, summary_path=path, best_adapter=best_adapter, merged=merged)
