"""What a trial's record in the study says about it, written by its driver: how it started (a clone, a
retry resuming a dead worker's trial), its checkpoints, why it was pruned, and how it ended.

Every write goes through Optuna's trial API (user attrs, reports) or the storage the study already uses.
"""

from __future__ import annotations

import functools
import math
import time
from typing import TYPE_CHECKING, Any, NoReturn

import optuna
from optuna.exceptions import UpdateFinishedTrialError

from optuna_rapidfire import _compat, events
from optuna_rapidfire._engines._types import CloneOf
from optuna_rapidfire._logging import explained, get_logger
from optuna_rapidfire._study import _attrs, _commands
from optuna_rapidfire._study._storages import StorageUnavailableError

if TYPE_CHECKING:
    from optuna_rapidfire._engines._types import Branch, ChunkResult
    from optuna_rapidfire._study._services import StudyServices

_logger = get_logger(__name__)


class TrialRecord:
    """The study's record of one trial (``trial`` of ``study``), as its driver writes it."""

    def __init__(self, study: optuna.Study, trial: optuna.Trial, services: StudyServices) -> None:
        self.study = study
        self.trial = trial
        self.services = services
        self._activity = ""

    def started(self, metric: str, worker: str) -> None:
        """Say the trial runs: its metric, its status, the worker (``host:pid:device``) it runs on."""
        trial = self.trial
        trial.set_user_attr(_attrs.METRIC, metric)
        trial.set_user_attr(_attrs.STATUS, "running")
        if trial.user_attrs.get(_attrs.FAIL_REASON) is not None:  # copied by Optuna's retry from the dead one
            trial.set_user_attr(_attrs.FAIL_REASON, None)
        trial.set_user_attr(_attrs.WORKER, worker)

    def activity(self, activity: str) -> bool:
        """Record what the trial does now, if it changed (``""``: between two states, nothing to say); whether
        it did."""
        if not activity or activity == self._activity:
            return False
        self._activity = activity
        try:
            self.trial.set_user_attr(_attrs.ACTIVITY, activity)
        except Exception:  # finished elsewhere meanwhile, or the storage is down: the driver learns it otherwise
            _logger.debug("Trial %d: its activity could not be written.", self.trial.number, exc_info=True)
        return True

    def chunk(self, event: ChunkResult, value: float) -> None:
        """Report the chunk's ``value`` at its step, and what it trained (chunks done, train loss, learning rate)."""
        self.trial.report(value, event.step)
        self.trial.set_user_attr(_attrs.CHUNKS_DONE, event.step + 1)
        for key, attr in (("train_loss", _attrs.TRAIN_LOSS), ("train_learning_rate", _attrs.LEARNING_RATE)):
            if key in event.metrics:
                self.trial.set_user_attr(attr, event.metrics[key])

    def end(self, status: str, reason: tuple[str, str] | None = None) -> None:
        """Write the trial's final status (unless a more telling one is set) and why it ended."""
        try:
            current = _compat.storage(self.study).get_trial(_compat.trial_id(self.trial))
            if current.state.is_finished():
                return
            if current.user_attrs.get(_attrs.STATUS) not in ("deleted", "paused-at-end", "interrupted"):
                self.trial.set_user_attr(_attrs.STATUS, status)
            if reason is not None and current.user_attrs.get(reason[0]) is None:
                self.trial.set_user_attr(*reason)
        except Exception:  # the storage is gone: the trial's end is still told by Optuna
            _logger.debug("Trial %d: its final status could not be written.", self.trial.number, exc_info=True)

    def clone_request(self) -> CloneOf | None:
        """What the trial starts from: its dead predecessor's checkpoint (Optuna's retry of a trial whose
        worker died), the parent a clone request names, or nothing (``None``)."""
        study, checkpoints = self.study, self.services.checkpoints(self.study)
        system_attrs = _compat.storage(study).get_trial(_compat.trial_id(self.trial)).system_attrs
        # Optuna's RetryHeartbeatStaleTrialCallback re-enqueues a stale trial with the dead one's system
        # attrs (our checkpoint link among them) plus "failed_trial" and "retry_history".
        if "failed_trial" in system_attrs and checkpoints.shared:
            history = [
                n for n in system_attrs.get("retry_history") or [system_attrs["failed_trial"]] if isinstance(n, int)
            ]
            link = system_attrs.get(_attrs.CHECKPOINT)
            if history and link is not None:
                return CloneOf(
                    parent=history[-1],
                    warm=True,
                    resume=True,
                    fetch=functools.partial(checkpoints.load, study, link, set(history)),
                )
        request = self.trial.user_attrs.get(_attrs.CLONE_OF) or system_attrs.get(_attrs.CLONE_OF)
        if not isinstance(request, dict) or not isinstance(request.get("parent"), int):
            return None
        parent = request["parent"]
        step = request.get("from_chunk")
        step = step if isinstance(step, int) and not isinstance(step, bool) else None
        fetch = functools.partial(checkpoints.load_chunk, study, parent, step)
        return CloneOf(parent=parent, warm=bool(request.get("warm", True)), step=step, fetch=fetch)

    def branch(self, branch: Branch) -> None:
        """Record how a clone (or a retry) started: its parent, its first step, warm or cold and why."""
        trial = self.trial
        if branch.resume:
            self._resume(branch)
            return
        trial.set_user_attr(_attrs.PARENT, branch.parent)
        trial.set_user_attr(_attrs.BRANCH_STEP, branch.step)
        trial.set_user_attr(_attrs.CLONE, "warm" if branch.warm else "cold")
        if branch.warm:
            # The clone's curve continues its parent's, so pruners compare it at equal progress.
            for step, metrics in enumerate(branch.history):
                trial.report(metrics[self.services.metric], step)
            trial.set_user_attr(_attrs.CHUNKS_DONE, branch.step)
            _logger.info(
                "Trial %d is a warm clone of trial %d after chunk %d.", trial.number, branch.parent, branch.step
            )
        else:
            trial.set_user_attr(_attrs.COLD_REASON, branch.reason)
            _logger.info("Trial %d is a cold clone of trial %d: %s.", trial.number, branch.parent, branch.reason)

    def _resume(self, branch: Branch) -> None:
        trial = self.trial
        trial.set_user_attr(_attrs.RETRY_OF, branch.parent)
        # Optuna's retry copied the dead trial's user attrs: what they said of its progress is not this one's.
        inherited = trial.user_attrs
        stale = _attrs.RESUMED_FROM_STEP if not branch.warm else _attrs.RESUME_FAILED
        if stale in inherited:
            trial.set_user_attr(stale, None)
        if not branch.warm:
            trial.set_user_attr(_attrs.CHUNKS_DONE, 0)
            trial.set_user_attr(_attrs.RESUME_FAILED, branch.reason)
            _logger.warning("Trial %d retries trial %d from scratch: %s.", trial.number, branch.parent, branch.reason)
            return
        # The retry keeps its predecessor's curve (Optuna's retry callback copies no values by default).
        reported = _compat.storage(self.study).get_trial(_compat.trial_id(trial)).intermediate_values
        for step, metrics in enumerate(branch.history):
            if step not in reported:
                trial.report(metrics[self.services.metric], step)
        trial.set_user_attr(_attrs.CHUNKS_DONE, branch.step)
        trial.set_user_attr(_attrs.RESUMED_FROM_STEP, branch.step)
        _logger.info(
            "Trial %d resumes trial %d (its worker died) from its checkpoint after chunk %d.",
            trial.number,
            branch.parent,
            branch.step,
        )

    def checkpoint(self, event: ChunkResult, previous: Any) -> None:
        """Save the chunk's state to the artifact store and link it, before the chunk is reported."""
        checkpoints = self.services.checkpoints(self.study)
        if event.snapshot is None:
            return
        try:
            link = checkpoints.save(self.study, _compat.trial_id(self.trial), event.snapshot, previous)
            if events.listening(events.Checkpointed):
                where = "memory" if not checkpoints.shared else "artifact store"
                size, seconds = int(link["bytes"]), event.snapshot_seconds
                events.emit(events.Checkpointed(self.trial.number, event.step, size, where, seconds))
        except (UpdateFinishedTrialError, StorageUnavailableError):  # the trial's end, told by the caller
            raise
        except Exception as error:  # the trial goes on; a retry would resume from an older checkpoint
            _logger.warning(
                "Trial %d: the checkpoint after chunk %d could not be saved (%s: %s).",
                self.trial.number,
                event.step + 1,
                type(error).__name__,
                error,
            )
        event.snapshot = None

    def keep_chunk_states(self, *, last: bool) -> None:
        """Once the trial has ended: keep its ``last`` chunk state for clones (none for a failed or deleted
        trial, whose state is not one to continue from), and any a waiting clone branches from."""
        try:
            self.services.checkpoints(self.study).trim(
                self.study, self.trial.number, finished=True, keep=None if last else 0
            )
        except Exception:  # the storage is gone: the states stay (orphans are harmless)
            _logger.debug("Trial %d: its chunk states could not be trimmed.", self.trial.number, exc_info=True)

    def interrupted(self, chunks: int, total_chunks: int, cause: str) -> NoReturn:
        """End the trial after an interrupt (``cause``: Ctrl-C, SIGTERM), as PRUNED: what it reported and its state
        stay."""
        self.trial.set_user_attr(_attrs.STATUS, "interrupted")
        if not total_chunks:  # not built yet: nothing trained, nothing kept
            raise optuna.TrialPruned(f"Interrupted ({cause}) before it started training.")
        raise optuna.TrialPruned(
            f"Interrupted ({cause}) after chunk {chunks}/{total_chunks}; its state is kept: clone it to continue."
        )

    def paused_at_end(self, chunks: int) -> NoReturn:
        """End a trial still paused when the study ends, as PRUNED: its state stays for clones."""
        self.trial.set_user_attr(_attrs.STATUS, "paused-at-end")
        raise optuna.TrialPruned(
            f"Still paused after chunk {chunks} when the study ended; its state is kept: clone it to continue."
        )

    def pruned_reason(self, step: int, value: float, total_chunks: int) -> str:
        """What the log and the trial's user attrs say about a pruning: who, when, on what value, against whom."""
        peers = sum(
            step in t.intermediate_values and t.number != self.trial.number
            for t in _compat.storage(self.study).get_all_trials(_compat.study_id(self.study), deepcopy=False)
        )
        return (
            f"{type(self.study.pruner).__name__} stopped it after chunk {step + 1}/{total_chunks} "
            f"(step {step}): {self.services.metric}={value:.6g}, compared with {peers} other trial(s) at that step."
        )

    def fail(self, reason: str) -> float:
        """End the trial as FAIL with ``reason``, said in one line (Optuna marks a trial that returns NaN as FAIL
        and goes on with the study); returns that NaN."""
        self.trial.set_user_attr(_attrs.FAIL_REASON, reason[:2000])
        _logger.warning("Trial %d failed: %s", self.trial.number, reason.splitlines()[0] if reason else reason)
        explained(self.trial.number)
        return math.nan

    def nothing_left(self, parent: int, total_chunks: int) -> float:
        """End a warm clone of a trial that trained every chunk, whose own run is no longer: nothing of its config
        would be trained, so it records no result (not even the inherited curve). Returns the NaN it returns."""
        return self.fail(
            f"Warm clone of trial {parent}, which had trained all {total_chunks} chunks: nothing is left to train "
            "under the new parameters. Clone it cold, or give the clone a longer run (more epochs)."
        )

    def finished_in_storage(self) -> bool:
        """Whether the stored trial is finished (failed from outside: another worker's check, the dashboard)."""
        return _compat.storage(self.study).get_trial(_compat.trial_id(self.trial)).state.is_finished()

    def deleted(self, reason: str | None) -> float:
        """Record a delete command's end (FAIL, with the command's reason); returns the NaN the trial returns."""
        self.trial.set_user_attr(_attrs.STATUS, "deleted")
        self.trial.set_user_attr(_attrs.FAIL_REASON, f"deleted: {reason or 'deleted by user'}")
        _logger.info("Trial %d was deleted (%s); its state is freed.", self.trial.number, reason)
        explained(self.trial.number)
        return math.nan

    def finished_elsewhere(self) -> None:
        """Say who finished the trial outside this executor: another worker's heartbeat check (it has a retry),
        or someone else (optuna-dashboard's "Fail Trial")."""
        number = self.trial.number
        retry = self._retry_of_self()
        if retry is not None:
            # This worker's heartbeats did not reach the storage for longer than the grace period (an outage, a
            # stalled process): another worker failed the trial, and its retry continues it there.
            _logger.warning(
                "Trial %d was failed by another worker's heartbeat check (this worker's heartbeats did not reach "
                "the storage within the grace period) and was retried there as trial %d; its state here is released.",
                number,
                retry.number,
            )
        else:
            _logger.warning(
                "Trial %d was finished outside the executor (optuna-dashboard's 'Fail Trial'?): its state is released.",
                number,
            )
        explained(number)  # Optuna would add its own two lines and a traceback

    def _retry_of_self(self, wait: float = 2.0) -> Any:
        """Optuna's retry of this trial, if another worker's heartbeat check failed it (which sets FAIL, then
        enqueues the retry: it is waited for a moment), else ``None``."""
        deadline = time.monotonic() + wait
        while True:
            try:
                retry = _commands.retry_of(self.study, self.trial.number, unfinished=False)
            except Exception:  # the storage is failing: say what is known
                _logger.debug("Looking for a retry of trial %d failed.", self.trial.number, exc_info=True)
                return None
            if retry is not None or time.monotonic() >= deadline:
                return retry
            time.sleep(0.1)
