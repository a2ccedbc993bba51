"""The Optuna side of one trial: configure it, follow it on the device, report, prune, obey commands.

One driver runs in the Optuna thread of each trial. It never touches the model: it registers the
trial with the device's scheduler and reacts to the events the device worker sends (built, chunk
done, saved, released, failed), talking to the study (reports, user attrs, pruning decisions,
commands) in between.
"""

from __future__ import annotations

import functools
import math
import os
import queue
import socket
from typing import TYPE_CHECKING, Any

import optuna
from optuna.exceptions import UpdateFinishedTrialError

from optuna_rapidfire import _attrs, _commands
from optuna_rapidfire._checkpoints import CheckpointError
from optuna_rapidfire._engines._base import Branch, ChunkResult, CloneOf, TrialSpec
from optuna_rapidfire._logging import get_logger
from optuna_rapidfire._pruning import prune_decision, resolve_auto_resources
from optuna_rapidfire._scheduler import Entry, Phase
from optuna_rapidfire._trainers._base import ACCELERATE_STATE
from optuna_rapidfire._worker import Built, Failed, Paused, Released, Saved

if TYPE_CHECKING:
    from optuna_rapidfire._checkpoints import Checkpoints
    from optuna_rapidfire._executor import Configure, RapidFireExecutor
    from optuna_rapidfire._snapshot import TrialSnapshot

_logger = get_logger(__name__)


class EndPaused:
    """Event for a paused trial: the study is over, finish as PRUNED."""


class FinishedElsewhere(Exception):
    """The trial was finished from outside the executor (optuna-dashboard's "Fail Trial" button)."""


def _fetch_parent(checkpoints: Checkpoints, study: optuna.Study, parent: int) -> TrialSnapshot:
    """The latest checkpoint of trial ``parent`` (for a warm clone of a trial that ran elsewhere)."""
    storage = study._storage
    try:
        trial_id = storage.get_trial_id_from_study_id_trial_number(study._study_id, parent)
    except KeyError:
        trial_id = None
    link = None if trial_id is None else storage.get_trial(trial_id).system_attrs.get(_attrs.CHECKPOINT)
    if link is None:
        raise CheckpointError(f"trial {parent} has no checkpoint in the artifact store")
    return checkpoints.load(study, link, {parent})


class TrialDriver:
    """Runs one trial's Optuna side; :meth:`run` is the body of the executor's objective."""

    def __init__(self, executor: RapidFireExecutor, trial: optuna.Trial, configure: Configure) -> None:
        self.ex = executor
        self.trial = trial
        self.study = trial.study
        self.configure = configure
        self.entry: Entry | None = None
        self._holds_slot = False
        self._run_id = 0  # the trial's MLflow run handle, when tracking is on
        self._adapter_path: str | None = None
        self._total_chunks = 0

    # -- the trial from start to end -------------------------------------------------------------

    def run(self) -> float:
        ex = self.ex
        if ex._fatal is not None:
            raise ex._fatal
        ex._check_study(self.study)
        ex._claim_slot(self.trial.number)
        self._holds_slot = True
        state, value = "FAIL", None
        try:
            spec = self._spec()
            ex._register_form(self.study)
            self.trial.set_user_attr(_attrs.METRIC, ex.metric)
            self.trial.set_user_attr(_attrs.STATUS, "running")
            self.trial.set_user_attr(_attrs.WORKER, f"{socket.gethostname()}:{os.getpid()}:{ex._worker_label}")
            entry = Entry(number=self.trial.number, trial_id=self.trial._trial_id, spec=spec)
            ex._scheduler.add(entry)
            self.entry = entry
            if ex._tracker is not None:
                self._run_id = ex._tracker.trial_started(self.trial, spec.kind.name, ex.metric)
            value = self._follow()
            state = "COMPLETE" if not math.isnan(value) else "FAIL"
            return value
        except optuna.TrialPruned as pruned:
            state = "PRUNED"
            self._record_end("pruned", (_attrs.PRUNED_REASON, str(pruned)))
            raise
        except FinishedElsewhere:
            raise
        except BaseException as error:
            # Whatever ends the trial with an exception is its fail reason (a bad config, a missing metric...).
            self._record_end("failed", (_attrs.FAIL_REASON, f"{type(error).__name__}: {error}"[:2000]))
            raise
        finally:
            if self.entry is not None and self.entry.phase is not Phase.GONE:
                self._leave(Phase.RELEASE)
            if self._holds_slot:
                ex._slots.release()
            if state == "COMPLETE":
                self._record_end("complete")
            elif state == "FAIL" and value is not None:  # returned NaN: failed on the device, or deleted
                self._record_end("failed")
            ex._progress.trial_ended(self.trial.number, state, value)
            if ex._tracker is not None:
                ex._tracker.trial_ended(self._run_id, state, value, self._adapter_path)

    def _record_end(self, status: str, reason: tuple[str, str] | None = None) -> None:
        """Write the trial's final status (unless a more telling one is set) and why it ended."""
        try:
            current = self.study._storage.get_trial(self.trial._trial_id)
            if current.state.is_finished():
                return
            if current.user_attrs.get(_attrs.STATUS) not in ("deleted", "paused-at-end"):
                self.trial.set_user_attr(_attrs.STATUS, status)
            if reason is not None and reason[0] not in current.user_attrs:
                self.trial.set_user_attr(*reason)
        except Exception:  # the storage is gone: the trial's end is still told by Optuna
            _logger.debug("Trial %d: its final status could not be written.", self.trial.number, exc_info=True)

    def _spec(self) -> TrialSpec:
        ex = self.ex
        try:
            with ACCELERATE_STATE:  # making TrainingArguments must not clear a trainer being built
                peft_config, args, kind = ex._checked_config(self.configure(self.trial), self.study)
        except (TypeError, ValueError) as error:
            # A config no trial can use: stop the study rather than fail trial after trial.
            ex._call_error = ex._call_error or error
            self.study.stop()
            raise
        root = os.path.join(ex.output_dir, self.study.study_name)
        return TrialSpec(
            number=self.trial.number,
            peft_config=peft_config,
            args=args,
            kind=kind,
            adapter_dir=os.path.join(root, f"trial-{self.trial.number}"),
            state_dir=os.path.join(root, "state"),
            clone_of=self._clone_request(),
            checkpoint=ex._checkpoints(self.study) is not None,
        )

    def _clone_request(self) -> CloneOf | None:
        study, checkpoints = self.study, self.ex._checkpoints(self.study)
        system_attrs = study._storage.get_trial(self.trial._trial_id).system_attrs
        # Optuna's RetryHeartbeatStaleTrialCallback re-enqueues a stale trial with the dead one's system
        # attrs (our checkpoint link among them) plus "failed_trial" and "retry_history".
        if "failed_trial" in system_attrs and checkpoints is not None:
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
        fetch = None if checkpoints is None else functools.partial(_fetch_parent, checkpoints, study, parent)
        return CloneOf(parent=parent, warm=bool(request.get("warm", True)), fetch=fetch)

    def _follow(self) -> float:
        entry = self.entry
        assert entry is not None
        while True:
            event = entry.events.get()
            if isinstance(event, Built):
                self._built(event)
                if event.branch is not None and event.branch.step >= event.total_chunks > 0:
                    # A warm clone of a trial that had trained every chunk: it ends where it starts.
                    return self._complete(float(event.branch.history[-1][self.ex.metric]))
            elif isinstance(event, Failed):
                return self._failed(event)
            elif isinstance(event, ChunkResult):
                outcome = self._after_chunk(event)
                if outcome is not None:
                    return outcome

    def _built(self, event: Built) -> None:
        trial = self.trial
        self._total_chunks = event.total_chunks
        trial.set_user_attr(_attrs.TOTAL_CHUNKS, event.total_chunks)
        resolve_auto_resources(self.study.pruner, event.total_chunks)
        if event.branch is not None:
            self._record_branch(event.branch)
            if self.ex._tracker is not None:
                self.ex._tracker.branch(self._run_id, event.branch, self.ex.metric)
        self.ex._progress.trial_started(trial.number, event.total_chunks, done=event.branch.step if event.branch else 0)

    def _record_branch(self, branch: Branch) -> None:
        trial = self.trial
        if branch.resume:
            self._record_resume(branch)
            return
        trial.set_user_attr(_attrs.PARENT, branch.parent)
        trial.set_user_attr(_attrs.BRANCH_STEP, branch.step)
        trial.set_user_attr(_attrs.CLONE, "warm" if branch.warm else "cold")
        if branch.warm:
            # The clone's curve continues its parent's, so pruners compare it at equal progress.
            for step, metrics in enumerate(branch.history):
                trial.report(metrics[self.ex.metric], step)
            trial.set_user_attr(_attrs.CHUNKS_DONE, branch.step)
            _logger.info(
                "Trial %d is a warm clone of trial %d after chunk %d.", trial.number, branch.parent, branch.step
            )
        else:
            trial.set_user_attr(_attrs.COLD_REASON, branch.reason)
            _logger.info("Trial %d is a cold clone of trial %d: %s.", trial.number, branch.parent, branch.reason)

    def _record_resume(self, branch: Branch) -> None:
        trial = self.trial
        trial.set_user_attr(_attrs.RETRY_OF, branch.parent)
        if not branch.warm:
            trial.set_user_attr(_attrs.RESUME_FAILED, branch.reason)
            _logger.warning("Trial %d retries trial %d from scratch: %s.", trial.number, branch.parent, branch.reason)
            return
        # The retry keeps its predecessor's curve (Optuna's retry callback copies no values by default).
        reported = self.study._storage.get_trial(trial._trial_id).intermediate_values
        for step, metrics in enumerate(branch.history):
            if step not in reported:
                trial.report(metrics[self.ex.metric], step)
        trial.set_user_attr(_attrs.CHUNKS_DONE, branch.step)
        trial.set_user_attr(_attrs.RESUMED_FROM_STEP, branch.step)
        _logger.info(
            "Trial %d resumes trial %d (its worker died) from its checkpoint after chunk %d.",
            trial.number,
            branch.parent,
            branch.step,
        )

    def _checkpoint(self, event: ChunkResult, previous: Any) -> None:
        """Save the chunk's state to the artifact store and link it, before the chunk is reported."""
        checkpoints = self.ex._checkpoints(self.study)
        if event.snapshot is None or checkpoints is None:
            return
        try:
            checkpoints.save(self.study, self.trial._trial_id, event.snapshot, previous)
        except Exception as error:  # the trial goes on; a retry would resume from an older checkpoint
            _logger.warning(
                "Trial %d: the checkpoint after chunk %d could not be saved (%s: %s).",
                self.trial.number,
                event.step + 1,
                type(error).__name__,
                error,
            )
        event.snapshot = None

    # -- after each chunk --------------------------------------------------------------------------

    def _after_chunk(self, event: ChunkResult) -> float | None:
        trial, ex = self.trial, self.ex
        entry = self.entry
        assert entry is not None
        value = event.metrics[ex.metric]
        step = event.step
        try:
            stored = self.study._storage.get_trial(trial._trial_id)
            if stored.state.is_finished():
                raise UpdateFinishedTrialError("finished outside the executor")
            self._checkpoint(event, stored.system_attrs.get(_attrs.CHECKPOINT))
            trial.report(value, step)
            trial.set_user_attr(_attrs.CHUNKS_DONE, step + 1)
            for key, attr in (("train_loss", _attrs.TRAIN_LOSS), ("train_learning_rate", _attrs.LEARNING_RATE)):
                if key in event.metrics:
                    trial.set_user_attr(attr, event.metrics[key])
        except UpdateFinishedTrialError:
            return self._finished_elsewhere()
        ex._progress.chunk_done(trial.number, ex.metric, value)
        if ex._tracker is not None:
            ex._tracker.chunk(self._run_id, event)
        pruned, snapshot = self._should_prune(step)
        if pruned:
            self._leave(Phase.RELEASE)
            raise optuna.TrialPruned(self._pruned_reason(step, value))
        pause = False
        for command in _commands.pending(self.study, snapshot):
            if command.op == "delete":
                _commands.mark_done(self.study, trial._trial_id, command, f"deleted after chunk {step + 1}")
                return self._delete(command.reason)
            if command.op == "stop" and pause:
                _commands.mark_done(self.study, trial._trial_id, command, "ignored: already paused")
            elif command.op == "stop" and not event.last:
                pause = True
                _commands.mark_done(self.study, trial._trial_id, command, f"paused after chunk {step + 1}")
            else:
                self._other_command(command, last=event.last)
        if event.last:
            return self._complete(float(value))
        if pause:
            outcome = self._pause(step)
            if outcome is not None:
                return outcome
        ex._scheduler.set_phase(entry, Phase.READY)
        return None

    def _should_prune(self, step: int) -> tuple[bool, optuna.trial.FrozenTrial]:
        """Decide at the round barrier, twice: once to let pruners record the step, once to decide."""
        entry, scheduler = self.entry, self.ex._scheduler
        assert entry is not None
        scheduler.mark(entry, reported=step)
        round_peers = scheduler.wait_for_round(entry, step, stage="reported")
        snapshot = self.study._storage.get_trial(self.trial._trial_id)
        prune_decision(self.study, snapshot, step, round_peers)
        scheduler.mark(entry, screened=step)
        scheduler.wait_for_round(entry, step, stage="screened")
        return prune_decision(self.study, snapshot, step, round_peers), snapshot

    def _pruned_reason(self, step: int, value: float) -> str:
        """What the log and the trial's user attrs say about a pruning: who, when, on what value, against whom."""
        peers = sum(
            step in t.intermediate_values and t.number != self.trial.number
            for t in self.study._storage.get_all_trials(self.study._study_id, deepcopy=False)
        )
        return (
            f"{type(self.study.pruner).__name__} stopped it after chunk {step + 1}/{self._total_chunks} "
            f"(step {step}): {self.ex.metric}={value:.6g}, compared with {peers} other trial(s) at that step."
        )

    def _other_command(self, command: _commands.Command, *, last: bool) -> None:
        trial_id = self.trial._trial_id
        if command.op == "clone":
            from optuna_rapidfire import control

            try:
                child = control.clone(self.study, command.trial, command.params, warm_start=command.warm)
            except (TypeError, ValueError) as error:
                _commands.mark_done(self.study, trial_id, command, f"refused: {error}")
            else:
                _commands.mark_done(self.study, trial_id, command, f"enqueued as trial {child}")
        elif command.op in ("stop", "delete") and last:
            _commands.mark_done(self.study, trial_id, command, "ignored: the trial has trained its last chunk")
        elif command.op == "resume":
            _commands.mark_done(self.study, trial_id, command, "ignored: the trial is not paused")
        else:
            _commands.mark_done(self.study, trial_id, command, f"ignored: {command.reason}")

    # -- ways to end -------------------------------------------------------------------------------

    def _complete(self, value: float) -> float:
        done = self._leave(Phase.FINISH)
        if isinstance(done, Failed):
            return self._failed(done)
        assert isinstance(done, Saved)
        self._adapter_path = os.path.abspath(done.path)
        self.trial.set_user_attr(_attrs.ADAPTER_PATH, self._adapter_path)
        # A request that came while the adapter was being saved: the trial is still RUNNING, so it is answered.
        for command in _commands.pending(self.study, self.study._storage.get_trial(self.trial._trial_id)):
            self._other_command(command, last=True)
        return value

    def _failed(self, event: Failed) -> float:
        if event.fatal:
            self.ex._fatal = event.error
            self.study.stop()
            raise event.error
        reason = f"{type(event.error).__name__}: {event.error}"
        self.trial.set_user_attr(_attrs.FAIL_REASON, reason[:2000])
        _logger.warning("Trial %d failed and was released: %s\n%s", self.trial.number, reason, event.traceback)
        # Optuna marks a trial that returns NaN as FAIL and goes on with the study.
        return math.nan

    def _delete(self, reason: str | None) -> float:
        self._leave(Phase.RELEASE)
        self.trial.set_user_attr(_attrs.STATUS, "deleted")
        self.trial.set_user_attr(_attrs.FAIL_REASON, f"deleted: {reason or 'deleted by user'}")
        _logger.info("Trial %d was deleted (%s); its state is freed.", self.trial.number, reason)
        return math.nan

    def _finished_elsewhere(self) -> float:
        self._leave(Phase.RELEASE)
        self.ex._externally_finished.add(self.trial.number)
        _logger.warning(
            "Trial %d was finished outside the executor (optuna-dashboard's 'Fail Trial'?): its state is released.",
            self.trial.number,
        )
        raise FinishedElsewhere(f"Trial {self.trial.number} was finished outside the executor.")

    def _leave(self, phase: Phase) -> Any:
        """Ask the worker to finish (``FINISH``) or release (``RELEASE``) the trial; wait until it has."""
        entry = self.entry
        assert entry is not None
        self.ex._scheduler.set_phase(entry, phase)
        while True:
            event = entry.events.get()
            if isinstance(event, (Saved, Released, Failed)):
                return event

    # -- pause -------------------------------------------------------------------------------------

    def _pause(self, step: int) -> float | None:
        """Wait, off the device and without a slot, for a resume; ``None`` once resumed."""
        ex, trial, entry = self.ex, self.trial, self.entry
        assert entry is not None
        ex._scheduler.set_phase(entry, Phase.PAUSE)
        while not isinstance(entry.events.get(), Paused):
            pass
        ex._slots.release()
        self._holds_slot = False
        trial.set_user_attr(_attrs.STATUS, "paused")
        ex._progress.trial_paused(trial.number)
        _logger.info("Trial %d paused after chunk %d.", trial.number, step + 1)
        ex._paused.add(entry)
        try:
            while True:
                try:
                    event = entry.events.get(timeout=ex._poll_seconds)
                except queue.Empty:
                    event = None
                if isinstance(event, EndPaused):
                    return self._end_paused(step)
                frozen = self.study._storage.get_trial(trial._trial_id)
                if frozen.state.is_finished():
                    return self._finished_elsewhere()
                for command in _commands.pending(self.study, frozen):
                    if command.op == "resume":
                        _commands.mark_done(self.study, trial._trial_id, command, "resumed")
                        ex._claim_slot(trial.number, resume=True)
                        self._holds_slot = True
                        trial.set_user_attr(_attrs.STATUS, "running")
                        ex._progress.trial_resumed(trial.number)
                        _logger.info("Trial %d resumed after chunk %d.", trial.number, step + 1)
                        return None
                    if command.op == "delete":
                        _commands.mark_done(self.study, trial._trial_id, command, "deleted while paused")
                        return self._delete(command.reason)
                    if command.op == "stop":
                        _commands.mark_done(self.study, trial._trial_id, command, "ignored: already paused")
                    else:
                        self._other_command(command, last=False)
        finally:
            ex._paused.discard(entry)
            ex._slots.notify()

    def _end_paused(self, step: int) -> float:
        self._leave(Phase.RELEASE)
        self.trial.set_user_attr(_attrs.STATUS, "paused-at-end")
        raise optuna.TrialPruned(
            f"Still paused after chunk {step + 1} when the study ended; its state is kept: clone it to continue."
        )
