"""Per-chunk MLflow tracking: one MLflow run per trial, nested under one run for the study.

Written with ``MlflowClient`` and explicit run ids (no fluent, process-global "active run"). Calls go
to a background thread in the order they were made, so no trial ever waits for the tracking server
(a slow or failing server cannot slow the study down), and :meth:`MlflowTracker.flush` waits for them
at the end of ``optimize``. Tracking is best effort: an MLflow error is logged and never fails a trial
(everything is also in the Optuna study). The server is checked once, up front.
"""

from __future__ import annotations

import itertools
import math
import os
import queue
import threading
import time
from typing import TYPE_CHECKING, Any

from optuna_rapidfire import events
from optuna_rapidfire._logging import get_logger

if TYPE_CHECKING:
    from collections.abc import Callable

    import optuna
    from mlflow.tracking import MlflowClient

_logger = get_logger(__name__)

# Optuna's final states as MLflow run statuses.
_STATUS = {"COMPLETE": "FINISHED", "PRUNED": "KILLED", "FAIL": "FAILED"}


class MlflowTracker:
    """Logs trials to an MLflow tracking server.

    Args:
        tracking: Where MLflow runs go (a tracking URI: ``http://host:port``, ``sqlite:///mlflow.db``...), or the
            ``MlflowClient`` to log through (one made with settings of your own, or anything with its methods).
        experiment: Experiment name; by default the study's name.
    """

    def __init__(self, tracking: str | MlflowClient, experiment: str | None = None) -> None:
        if isinstance(tracking, str):
            from mlflow.tracking import MlflowClient

            _check_reachable(tracking)
            self.client = MlflowClient(tracking_uri=tracking)
        else:
            _check_reachable(str(getattr(tracking, "tracking_uri", "")))
            self.client = tracking
        self.experiment = experiment
        self._lock = threading.Lock()
        self._parents: dict[str, tuple[str, str]] = {}
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._runs: dict[int, str] = {}  # handle -> MLflow run id, filled in by the background thread
        self._handles = itertools.count()
        self._trials: dict[tuple[str, int], tuple[int, str]] = {}  # (study, trial) -> (its run's handle, its metric)
        self._trials_lock = threading.Lock()  # never self._lock: that one is held while the server is asked
        self._closed = False
        self._thread = threading.Thread(target=self._drain, name="rapidfire-mlflow", daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        while (task := self._queue.get()) is not None:
            try:
                task()
            except Exception:
                _logger.warning("MLflow: a tracking call failed; the study goes on.", exc_info=True)
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def _submit(self, task: Callable[[], None]) -> None:
        self._queue.put(task)

    def flush(self, timeout: float = 120.0) -> None:
        """Wait (up to ``timeout`` seconds) until every call so far has reached the server."""
        done = threading.Event()
        self._submit(done.set)
        if not done.wait(timeout):
            _logger.warning("MLflow: tracking calls still pending after %.0f s; not waiting longer.", timeout)

    def close(self, timeout: float = 120.0) -> None:
        """Wait (up to ``timeout`` seconds) for the calls so far, drop any left (the server is gone or too
        slow: this is logged) and stop the tracker's thread once its call in flight returns."""
        if self._closed:
            return
        self._closed = True
        self.flush(timeout)
        dropped = 0
        while True:
            try:
                task = self._queue.get_nowait()
            except queue.Empty:
                break
            self._queue.task_done()
            dropped += task is not None
        if dropped:
            _logger.warning("MLflow: %d tracking call(s) dropped when the executor closed.", dropped)
        self._queue.put(None)

    def _parent(self, study: optuna.Study) -> tuple[str, str]:
        """``(experiment id, parent run id)`` of ``study`` (created once, found again by tag)."""
        with self._lock:
            known = self._parents.get(study.study_name)
            if known is not None:
                return known
            experiment_id, run_id = study_run(self.client, study, self.experiment or study.study_name)
            self._parents[study.study_name] = (experiment_id, run_id)
            return experiment_id, run_id

    def hear(self, event: events.Event) -> None:
        """Log a study event of an ``optimize`` call's trials (a listener of its ``Run``): a trial's run starts,
        takes its parent and inherited curve, its chunks' metrics, and its end (in the background)."""
        if isinstance(event, events.TrialStarted):
            handle = self.trial_started(event.study, event.trial, event.params, event.kind, event.metric)
            with self._trials_lock:
                self._trials[(event.study.study_name, event.trial)] = (handle, event.metric)
            return
        if not isinstance(event, (events.TrialReady, events.ChunkReported, events.TrialEnded)):
            return
        with self._trials_lock:
            known = self._trials.get((event.study.study_name, event.trial))
            if known is not None and isinstance(event, events.TrialEnded):
                del self._trials[(event.study.study_name, event.trial)]
        if known is None:
            return
        handle, metric = known
        if isinstance(event, events.TrialReady):
            if event.parent is not None:
                self.branch(handle, event.parent, event.start, event.warm, event.inherited, metric)
        elif isinstance(event, events.ChunkReported):
            self.chunk(handle, event.step, {**event.metrics, "chunk_seconds": event.seconds})
        else:
            self.trial_ended(handle, event.state, event.value, event.adapter)

    def trial_started(self, study: optuna.Study, number: int, params: dict[str, Any], kind: str, metric: str) -> int:
        """Start the trial's run (in the background); return a handle for the other calls."""
        handle = next(self._handles)

        def start() -> None:
            from mlflow.entities import Param

            experiment_id, parent = self._parent(study)
            run = self.client.create_run(
                experiment_id,
                run_name=f"trial-{number}",
                tags={
                    "mlflow.parentRunId": parent,
                    "rapidfire.role": "trial",
                    "optuna.study_name": study.study_name,
                    "optuna.trial_number": str(number),
                    "rapidfire.trainer": kind,
                    "rapidfire.metric": metric,
                },
            )
            self._runs[handle] = run.info.run_id
            if params:
                self.client.log_batch(run.info.run_id, params=[Param(k, str(v)) for k, v in params.items()])

        self._submit(start)
        return handle

    def _on_run(self, handle: int, call: Callable[[str], None]) -> None:
        def task() -> None:
            run_id = self._runs.get(handle)
            if run_id is not None:  # its run could not be created: that was logged already
                call(run_id)

        self._submit(task)

    def branch(
        self, handle: int, parent: int, step: int, warm: bool, inherited: tuple[float, ...], metric: str
    ) -> None:
        """Tag a clone with its parent; a warm clone's run gets the inherited curve too."""

        def call(run_id: str) -> None:
            self.client.set_tag(run_id, "rapidfire.parent_trial", str(parent))
            self.client.set_tag(run_id, "rapidfire.branch_step", str(step))
            self.client.set_tag(run_id, "rapidfire.clone", "warm" if warm else "cold")
            for index, value in enumerate(inherited):
                self.log_metrics(run_id, {metric: value}, index)

        self._on_run(handle, call)

    def chunk(self, handle: int, step: int, metrics: dict[str, float]) -> None:
        """Log one chunk's metrics at ``step`` = the chunk index."""
        numbers = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
        self._on_run(handle, lambda run_id: self.log_metrics(run_id, numbers, step))

    def log_metrics(self, run_id: str, metrics: dict[str, float], step: int) -> None:
        """Log ``metrics`` at ``step`` in one call to the tracking server (on the tracker's own thread)."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(_metric_name(k), float(v), now, step) for k, v in metrics.items()]
        self.client.log_batch(run_id, metrics=batch)

    def trial_ended(self, handle: int, state: str, value: float | None, adapter_dir: str | None) -> None:
        """Record the final state (and the final adapter of a COMPLETE trial), then close the run."""

        def call(run_id: str) -> None:
            self.client.set_tag(run_id, "optuna.state", state)
            if value is not None and math.isfinite(value):
                self.client.log_metric(run_id, "final_value", float(value))
            if adapter_dir is not None and os.path.isdir(adapter_dir):
                self.client.log_artifacts(run_id, adapter_dir, artifact_path="adapter")
            self.client.set_terminated(run_id, status=_STATUS.get(state, "FAILED"))

        self._on_run(handle, call)


def _check_reachable(uri: str) -> None:
    """Fail before any training if an HTTP tracking server does not answer."""
    if not uri.startswith(("http://", "https://")):
        return
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=10).read()
    except (OSError, urllib.error.URLError) as error:
        raise ValueError(f"mlflow_tracking_uri={uri!r}: no MLflow server answers there ({error}).") from None


def _metric_name(name: str) -> str:
    allowed = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-. /")
    return "".join(c if c in allowed else "_" for c in name)


def study_run(client: Any, study: optuna.Study, experiment: str) -> tuple[str, str]:
    """``(experiment id, run id)`` of the study's parent run in ``experiment`` (made when missing): the run
    tagged ``rapidfire.role=study`` that the trials' runs nest under, found again by its tags."""
    found = client.get_experiment_by_name(experiment)
    experiment_id = found.experiment_id if found else client.create_experiment(experiment)
    runs = client.search_runs(
        [experiment_id],
        filter_string=f"tags.`rapidfire.role` = 'study' and tags.`optuna.study_name` = '{study.study_name}'",
        max_results=1,
    )
    if runs:
        return experiment_id, runs[0].info.run_id
    tags = {"rapidfire.role": "study", "optuna.study_name": study.study_name, "optuna.direction": study.direction.name}
    return experiment_id, client.create_run(experiment_id, run_name=study.study_name, tags=tags).info.run_id
