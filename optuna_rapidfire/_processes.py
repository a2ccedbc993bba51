"""One worker process per device, all pulling trials from the study's storage.

Each worker is a fresh process (no shared GIL) that sees one GPU (``CUDA_VISIBLE_DEVICES``), loads the
base model once, and runs its own executor on its share of the trials; a trial lives on one device.
The processes share nothing but the storage, so the study must live in one they can all open: an RDB
URL (SQLite, PostgreSQL...) or a ``JournalStorage`` on a file.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import queue
import tempfile
import time
import traceback
from typing import TYPE_CHECKING, Any

import optuna
from optuna.storages import JournalStorage, RDBStorage
from optuna.storages.journal import JournalFileBackend

from optuna_rapidfire import _compat
from optuna_rapidfire._logging import get_logger
from optuna_rapidfire._resident._model import resolve_devices
from optuna_rapidfire._runtime._device import DeviceRuntime
from optuna_rapidfire._study._optimize import end_paused, optimize
from optuna_rapidfire._study._progress import Progress
from optuna_rapidfire._study._services import StudyServices

if TYPE_CHECKING:
    from collections.abc import Iterator

    import torch

    from optuna_rapidfire._study._config import ExecutorConfig

_logger = get_logger(__name__)


def storage_spec(study: optuna.Study) -> tuple[str, str, dict[str, Any]]:
    """How another process opens ``study``'s storage: ``("rdb", url, settings)`` or ``("journal", path, {})``.

    An RDB storage's heartbeat settings (interval, grace period, retry callback) travel with it.
    """
    storage = _compat.backend_storage(study)
    if isinstance(storage, RDBStorage):
        settings = {
            "heartbeat_interval": storage.heartbeat_interval,
            "grace_period": storage.grace_period,
            "heartbeat_stale_trial_callback": storage.heartbeat_stale_trial_callback,
        }
        return "rdb", storage.url, settings
    journal = _compat.journal_file(storage)
    if journal is not None:
        return "journal", journal, {}
    raise ValueError(
        "Several devices run one worker process each, so the study needs a storage they can all open: an "
        "RDB URL (sqlite:///study.db, postgresql://...) or a JournalStorage on a file, not "
        f"{type(storage).__name__}."
    )


def open_storage(spec: tuple[str, str, dict[str, Any]]) -> Any:
    backend, where, settings = spec
    if backend == "rdb":
        return RDBStorage(where, **settings)
    return JournalStorage(JournalFileBackend(where))


class Tickets:
    """The number of trials left to start, shared by the worker processes: each takes one per trial.

    A worker that loads its model late (or trains a slower device) simply takes fewer trials.
    """

    def __init__(self, context: Any, n_trials: int) -> None:
        self._left = context.Value("q", n_trials)

    def take(self) -> bool:
        with self._left.get_lock():
            if self._left.value <= 0:
                return False
            self._left.value -= 1
            return True


@contextlib.contextmanager
def _environ(changes: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def run_workers(
    config: ExecutorConfig,
    devices: list[torch.device],
    study: optuna.Study,
    optimize_kwargs: dict[str, Any],
) -> None:
    """Run ``optimize(study, **optimize_kwargs)`` with ``config`` in one process per device; wait for all.

    Raises:
        ValueError: If the storage cannot be shared or an argument cannot be sent to another process.
        RuntimeError: If a worker failed (with its traceback).
    """
    spec = storage_spec(study)
    payload = {
        "config": config.replace(show_progress_bar=False),
        "spec": spec,
        "study_name": study.study_name,
        "sampler": study.sampler,
        "pruner": study.pruner,
        **optimize_kwargs,
    }
    for name, value in payload.items():
        try:
            pickle.dumps(value)
        except Exception as error:
            raise ValueError(
                f"{name} must be picklable to reach the worker processes (one per device): {error}. "
                "Define functions at module level and pass the model as a path or a module-level factory."
            ) from None
    context = multiprocessing.get_context("spawn")
    results: Any = context.Queue()
    n_trials = optimize_kwargs["n_trials"]
    tickets = Tickets(context, n_trials) if n_trials is not None else None
    started = time.time()
    processes = []
    # The job goes through a file: a large one (datasets, a model object) sent through the process's
    # pipe would hold its start() until the child had imported torch, so workers would start in turn.
    with tempfile.TemporaryDirectory(prefix="rapidfire-workers-") as folder:
        job_path = os.path.join(folder, "job.pkl")
        with open(job_path, "wb") as handle:
            pickle.dump(payload, handle)
        for index, device in enumerate(devices):
            visible = {"CUDA_VISIBLE_DEVICES": str(device.index)} if device.type == "cuda" else {}
            local = "cuda:0" if device.type == "cuda" else "cpu"
            job = {"path": job_path, "device": local, "label": str(device)}
            with _environ(visible):
                process = context.Process(
                    target=_worker_main, args=(index, job, tickets, results), name=f"rapidfire-{device}"
                )
                process.start()
            processes.append((index, device, process))
            _logger.info("Worker %d started on %s (pid %d).", index, device, process.pid)
        _wait(processes, results, study, started, config.show_progress_bar)


def _wait(
    processes: list[tuple[int, torch.device, Any]],
    results: Any,
    study: optuna.Study,
    started: float,
    show_progress_bar: bool,
) -> None:
    progress = Progress(show_progress_bar)
    seen: set[int] = set()
    errors: list[str] = []
    pending = {index for index, _, _ in processes}
    while pending:
        try:
            index, failure = results.get(timeout=1.0)
            pending.discard(index)
            if failure is not None:
                errors.append(f"worker {index}: {failure}")
        except queue.Empty:
            for index, device, process in processes:
                if index in pending and not process.is_alive():
                    pending.discard(index)
                    errors.append(f"worker {index} on {device} died with exit code {process.exitcode}")
        if progress.enabled:
            for trial in study.get_trials(deepcopy=False, states=_FINISHED):
                if trial.number not in seen and trial.datetime_start and trial.datetime_start.timestamp() >= started:
                    seen.add(trial.number)
                    progress.trial_ended(trial.number, trial.state.name, trial.value)
    for _, _, process in processes:
        process.join()
    progress.close()
    if errors:
        raise RuntimeError("A worker process failed:\n" + "\n".join(errors))


_FINISHED = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED, optuna.trial.TrialState.FAIL)


def _worker_main(index: int, job: dict[str, Any], tickets: Tickets | None, results: Any) -> None:
    """Body of a worker process: one executor on one device, taking trials while any are left."""
    try:
        with open(job["path"], "rb") as handle:
            payload = pickle.load(handle)
        study = optuna.load_study(
            study_name=payload["study_name"],
            storage=open_storage(payload["spec"]),
            sampler=payload["sampler"],
            pruner=payload["pruner"],
        )
        config: ExecutorConfig = payload["config"]
        services = StudyServices(config)
        device = DeviceRuntime(services.device_settings(), resolve_devices(job["device"])[0], label=job["label"])
        try:
            optimize(
                device,
                services,
                study,
                payload["configure"],
                n_trials=payload["n_trials"],
                timeout=payload["timeout"],
                callbacks=payload["callbacks"],
                catch=payload["catch"],
                gc_after_trial=payload["gc_after_trial"],
                target=payload["target"],
                take_ticket=tickets.take if tickets is not None else None,
            )
        finally:
            end_paused(device)
            device.close()
        results.put((index, None))
    except BaseException:
        results.put((index, traceback.format_exc()))
