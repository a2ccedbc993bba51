"""The Optuna side of one trial: configure it, follow it on the device, report, prune, obey commands.

One driver runs in the Optuna thread of each trial. It never touches the model: it registers the
trial with the device's scheduler and reacts to the events the device worker sends (built, chunk
done, saved, released, failed), talking to the study (reports, user attrs, pruning decisions,
commands) in between.
"""

from __future__ import annotations

import math
import os
import queue
import socket
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn, cast

import optuna
from optuna.exceptions import UpdateFinishedTrialError

from optuna_rapidfire import _compat, events
from optuna_rapidfire._engines._types import ChunkResult, TrialSpec
from optuna_rapidfire._logging import explained, get_logger
from optuna_rapidfire._runtime._entry import Decision, Entry, Stopped
from optuna_rapidfire._runtime._schedule import Status
from optuna_rapidfire._runtime._worker import Built, Failed, Paused, Released, Saved
from optuna_rapidfire._study import _attrs, _commands
from optuna_rapidfire._study._pruning import resolve_auto_resources, should_prune
from optuna_rapidfire._study._trial_record import TrialRecord
from optuna_rapidfire._trainers import kind_for
from optuna_rapidfire._trainers._base import ACCELERATE_STATE

if TYPE_CHECKING:
    from collections.abc import Callable

    from optuna_rapidfire._runtime._slots import Lease
    from optuna_rapidfire._study._config import Configure
    from optuna_rapidfire._study._run import Run

_logger = get_logger(__name__)


class EndPaused:
    """Event for a paused trial: the study is over, finish as PRUNED."""


@dataclass(frozen=True)
class Interrupted:
    """Event for a live trial: the study was interrupted (``cause``: Ctrl-C, or SIGTERM under the CLI); end after
    the chunk in flight, if any."""

    cause: str = "Ctrl-C"


class StorageWasLost:
    """Event for a live trial: the storage was unreachable for longer than the heartbeat grace period; look
    whether another worker failed the trial meanwhile (its retry then continues it there)."""


class FinishedElsewhere(Exception):
    """The trial was finished from outside the executor (optuna-dashboard's "Fail Trial" button)."""


class TrialDriver:
    """Runs one trial's Optuna side; :meth:`run` is the body of the executor's objective."""

    def __init__(self, run: Run, trial: optuna.Trial, configure: Configure) -> None:
        self.shared = run
        self.device = run.device
        self.services = run.services
        self.trial = trial
        self.study = trial.study
        self.configure = configure
        self.entry: Entry | None = None
        self._lease: Lease | None = None
        self._adapter_path: str | None = None
        self._total_chunks = 0
        self._interrupted = ""  # what interrupted the study (Ctrl-C, SIGTERM), once it was
        self.record = TrialRecord(self.study, trial, self.services)

    # -- the trial from start to end -------------------------------------------------------------

    def run(self) -> float:
        state, value, elsewhere = "FAIL", None, False
        try:
            if self.device.fatal is not None:  # an earlier trial's error no trial survives
                raise self.device.fatal
            self.services.check_study(self.study)
            self._lease = self.shared.lease(self.trial.number, by_hand=_commands.asked_by_hand(self.trial))
            spec = trial_spec(self.shared, self.trial, self.configure, self.record)
            self.services.prepare_study(self.study)
            self.record.started(self.services.metric, f"{socket.gethostname()}:{os.getpid()}:{self.device.label}")
            entry = Entry(number=self.trial.number, trial_id=_compat.trial_id(self.trial), spec=spec)
            maximize = self.study.direction == optuna.study.StudyDirection.MAXIMIZE
            self.device.scheduler.study(
                (id(_compat.storage(self.study)), _compat.study_id(self.study)), maximize=maximize
            )
            self.device.scheduler.add(entry)
            self._lease.registered()
            self.entry = entry
            trial, metric = self.trial, self.services.metric
            self.shared.tell(events.TrialStarted(self.study, trial.number, trial.params, spec.kind.name, metric))
            value = self._follow()
            state = "COMPLETE" if not math.isnan(value) else "FAIL"
            return value
        except optuna.TrialPruned as pruned:
            state = "PRUNED"
            self.record.end("pruned", (_attrs.PRUNED_REASON, str(pruned)))
            raise
        except FinishedElsewhere:
            elsewhere = True
            raise
        except UpdateFinishedTrialError:  # failed elsewhere while it was being set up or recorded
            elsewhere = True
            self._finished_elsewhere()
        except BaseException as error:
            # Whatever ends the trial with an exception is its fail reason (a bad config, a missing metric...).
            self.record.end("failed", (_attrs.FAIL_REASON, f"{type(error).__name__}: {error}"[:2000]))
            raise
        finally:
            if self.entry is not None and not self.entry.leaving:
                self._leave(Decision.STOP)
            if self._lease is not None and not self._lease.pooled:  # the pool's: given back once the trial is told
                self._lease.release()
            # A retry elsewhere resumes from the last state (its checkpoint); a failed state is not kept.
            self.record.keep_chunk_states(last=state != "FAIL" or elsewhere)
            if state == "COMPLETE":
                self.record.end("complete")
            elif state == "FAIL" and value is not None:  # returned NaN: failed on the device, or deleted
                self.record.end("failed")
            self.shared.tell(events.TrialEnded(self.study, self.trial.number, state, value, self._adapter_path))

    def _follow(self) -> float:
        entry = self.entry
        assert entry is not None
        while True:
            if self.record.activity(activity := self.device.scheduler.activity(entry)):
                self.shared.tell(events.TrialActivity(self.study, self.trial.number, activity))
            try:
                event = entry.events.get(timeout=self.services.config.poll_seconds)
            except queue.Empty:  # not training meanwhile, perhaps: a person's command applies now
                outcome = self._commands_while_waiting()
                if outcome is not None:
                    return outcome
                continue
            if isinstance(event, Built):
                branch = event.branch
                if branch is not None and not branch.resume and branch.step >= event.total_chunks > 0:
                    self._leave(Decision.STOP)
                    return self.record.nothing_left(branch.parent, event.total_chunks)
                self._built(event)
                if branch is not None and branch.step >= event.total_chunks > 0:
                    # A retry of a trial whose worker died after its last chunk: it ends where it was.
                    return self._complete(float(branch.history[-1][self.services.metric]))
            elif isinstance(event, Interrupted):
                self._interrupted = event.cause
                if entry.status is not Status.TRAINING:  # else it ends once its chunk in flight is reported
                    return self._end_interrupted(entry.chunks_done)
            elif isinstance(event, StorageWasLost):
                # Training: the chunk's result looks at the stored trial before anything is written.
                if entry.status is not Status.TRAINING and self.record.finished_in_storage():
                    return self._finished_elsewhere()
            elif isinstance(event, Failed):
                return self._failed(event)
            elif isinstance(event, Stopped):  # its schedule will never promote it (ASHA's stop)
                self._leave(Decision.STOP)
                raise optuna.TrialPruned(event.reason)
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
            self.record.branch(event.branch)
        self.shared.tell(_ready(self.study, trial.number, event, self.services.metric))

    # -- after each chunk --------------------------------------------------------------------------

    def _after_chunk(self, event: ChunkResult) -> float | None:
        trial = self.trial
        entry = self.entry
        assert entry is not None
        value = event.metrics[self.services.metric]
        step = event.step
        try:
            stored = _compat.storage(self.study).get_trial(_compat.trial_id(trial))
            if stored.state.is_finished():
                raise UpdateFinishedTrialError("finished outside the executor")
            self.record.checkpoint(event, stored.system_attrs.get(_attrs.CHECKPOINT))
            self.record.chunk(event, value)
        except UpdateFinishedTrialError:
            return self._finished_elsewhere()
        self.shared.tell(_reported(self.study, trial.number, event, self.services.metric))
        if self._interrupted and not event.last:  # an interrupt during its last chunk: it completes
            return self._end_interrupted(step + 1)
        pruned, frozen = should_prune(self.device.scheduler, entry, self.study, self.trial, step, float(value))
        if pruned:
            if event.last:  # it trained every chunk: its adapter is kept, pruned or not
                self._complete(float(value))
            else:
                self._leave(Decision.STOP)
            raise optuna.TrialPruned(self.record.pruned_reason(step, value, self._total_chunks))
        deleted, asked = self._obey(_commands.pending(self.study, frozen), "last chunk" if event.last else "chunk")
        if deleted is not None:
            return deleted
        if event.last:
            return self._complete(float(value))
        if asked == "pause" and (outcome := self._pause(step + 1)) is not None:
            return outcome
        self.device.scheduler.decide(entry, Decision.CONTINUE)
        return None

    def _commands_while_waiting(self) -> float | None:
        """Apply a person's commands while the trial waits between chunks (``None``: it goes on waiting)."""
        entry = self.entry
        assert entry is not None
        try:
            commands = _commands.held_for(self.study, entry, self.device.scheduler)
        except UpdateFinishedTrialError:
            return self._finished_elsewhere()
        if not commands:
            return None
        deleted, asked = self._obey(commands, "queued" if entry.held else "waiting")
        if deleted is not None:
            return deleted
        if asked == "pause" and (outcome := self._pause(entry.chunks_done)) is not None:
            return outcome
        self.device.scheduler.decide(entry, Decision.CONTINUE)
        return None

    def _obey(self, commands: list[_commands.Command], where: str) -> tuple[float | None, str | None]:
        """Apply ``commands`` ``where`` the trial is, up to a resume: (its value if deleted, "pause"/"resume")."""
        assert self.entry is not None
        asked, trial_id, chunks = None, _compat.trial_id(self.trial), self.entry.chunks_done
        for command in commands:
            action = _commands.apply(self.study, trial_id, command, where, chunks, pausing=asked == "pause")
            if action == "delete":
                return self._delete(command.reason), asked
            asked = action if action in ("pause", "resume") else asked
            if asked == "resume":
                break
        return None, asked

    def _complete(self, value: float) -> float:
        done = self._leave(Decision.FINISH)
        if isinstance(done, Failed):
            return self._failed(done)
        assert isinstance(done, Saved)
        try:
            done.write()  # the adapter's files, written here while the device trains the others
        except Exception as error:  # this trial's failure only
            return self._failed(Failed(error, traceback.format_exc()))
        self._adapter_path = os.path.abspath(done.path)
        try:
            self.trial.set_user_attr(_attrs.ADAPTER_PATH, self._adapter_path)
            _commands.answer_saved(self.study, _compat.trial_id(self.trial), self._total_chunks)
        except UpdateFinishedTrialError:  # optuna-dashboard's "Fail Trial" while the adapter was being saved
            return self._finished_elsewhere()
        return value

    def _failed(self, event: Failed) -> float:
        if event.fatal:
            self.device.fatal = event.error
            self.shared.stop_study(self.study)
            raise event.error
        _logger.debug("Trial %d's error, in full:\n%s", self.trial.number, event.traceback)
        return self.record.fail(f"{type(event.error).__name__}: {event.error}")

    def _delete(self, reason: str | None) -> float:
        self._leave(Decision.STOP)
        return self.record.deleted(reason)

    def _finished_elsewhere(self) -> NoReturn:
        if self.entry is not None and not self.entry.leaving:
            self._leave(Decision.STOP)
        self.shared.externally_finished.add(self.trial.number)
        self.record.finished_elsewhere()
        raise FinishedElsewhere(f"Trial {self.trial.number} was finished outside the executor.")

    def _leave(self, decision: Decision) -> Any:
        """Tell the device the trial is done (``FINISH``: save its adapter; ``STOP``: release it); wait until it is."""
        entry = self.entry
        assert entry is not None
        if self.device.scheduler.decide(entry, decision):  # a queued trial: nothing on the device to release
            return Released()
        while True:
            event = entry.events.get()
            if isinstance(event, (Saved, Released, Failed)):
                return event

    # -- pause -------------------------------------------------------------------------------------

    def _pause(self, chunks: int) -> float | None:
        """Wait, off the device and without a slot, for a resume (``None`` once resumed), after ``chunks``."""
        trial, entry = self.trial, self.entry
        assert entry is not None
        built: list[Built] = []  # paused while it was being built: its Built is handled once it resumes
        queued = self.device.scheduler.decide(entry, Decision.PAUSE)  # a queued trial pauses at once
        while not queued:  # the device moves the trial off, or fails it (then it is gone from the device)
            event = entry.events.get()
            if isinstance(event, Failed):
                return self._failed(event)
            if isinstance(event, Interrupted):
                self._interrupted = event.cause
            if isinstance(event, Built):
                built.append(event)
            if isinstance(event, Paused):
                break
        if self._interrupted:  # interrupted while it moved off: it ends as an interrupted trial, not a paused one
            return self._end_interrupted(chunks)
        assert self._lease is not None
        self._lease.release()
        self._lease = None
        trial.set_user_attr(_attrs.STATUS, "paused")
        self.shared.tell(events.TrialActivity(self.study, trial.number, "paused"))
        _logger.info("Trial %d paused %s.", trial.number, f"after chunk {chunks}" if chunks else "before it trained")
        self.device.paused.add(entry)
        self.record.activity("paused")
        try:
            while True:
                try:
                    event = entry.events.get(timeout=self.services.config.poll_seconds)
                except queue.Empty:
                    event = None
                if isinstance(event, (EndPaused, Interrupted)):  # the study is over, or interrupted
                    return self._end_paused(chunks)
                frozen = _compat.storage(self.study).get_trial(_compat.trial_id(trial))
                if frozen.state.is_finished():
                    return self._finished_elsewhere()
                deleted, asked = self._obey(_commands.pending(self.study, frozen), "paused")
                if deleted is not None:
                    return deleted
                if asked == "resume":
                    self._lease = self.shared.lease(trial.number, resume=True)
                    trial.set_user_attr(_attrs.STATUS, "running")
                    self.shared.tell(events.TrialActivity(self.study, trial.number, "training"))
                    _logger.info("Trial %d resumed after chunk %d.", trial.number, chunks)
                    for event in built:
                        entry.events.put(event)
                    return None
        finally:
            self.device.paused.discard(entry)

    def _end_interrupted(self, chunks: int) -> NoReturn:
        """End the trial after an interrupt: its state is saved for clones, what it reported stays."""
        self._leave(Decision.STOP)
        self.record.interrupted(chunks, self._total_chunks, self._interrupted)

    def _end_paused(self, chunks: int) -> NoReturn:
        self._leave(Decision.STOP)
        self.record.paused_at_end(chunks)


def run_length_of(configure: Configure, num_chunks: int) -> Callable[[dict[str, Any]], int | None]:
    """How many chunks a trial of given params runs: the user's ``configure`` on those params (``None`` if it
    cannot say, e.g. it suggests a parameter they lack)."""

    def run_length(params: dict[str, Any]) -> int | None:
        try:
            with ACCELERATE_STATE:
                _, args = configure(cast("optuna.Trial", optuna.trial.FixedTrial(params)))  # a Trial's suggest API
            return kind_for(args).total_chunks(args, num_chunks)
        except Exception:
            return None

    return run_length


def _ready(study: optuna.Study, number: int, event: Built, metric: str) -> events.TrialReady:
    """The study event of a trial built: its run's length, and where it starts (a clone's or retry's branch)."""
    branch = event.branch
    return events.TrialReady(
        study,
        number,
        event.total_chunks,
        start=0 if branch is None else branch.step,
        parent=None if branch is None else branch.parent,
        warm=branch is not None and branch.warm,
        inherited=() if branch is None or not branch.warm else tuple(h[metric] for h in branch.history),
    )


def _reported(study: optuna.Study, number: int, result: ChunkResult, metric: str) -> events.ChunkReported:
    """The study event of a chunk's value reported to Optuna, with its numeric metrics and seconds."""
    numbers = {k: float(v) for k, v in result.metrics.items() if isinstance(v, (int, float))}
    seconds = result.train_seconds + result.eval_seconds
    return events.ChunkReported(study, number, result.step, metric, float(result.metrics[metric]), numbers, seconds)


def trial_spec(run: Run, trial: optuna.Trial, configure: Configure, record: TrialRecord) -> TrialSpec:
    """What the device builds for ``trial``: ``configure(trial)``'s config, checked, with where the trial's
    files go and what it starts from. A config no trial can use (a ``TypeError`` or ``ValueError``) stops the
    study rather than fail trial after trial; it is raised by ``optimize`` once, and Optuna's own lines about
    each trial it failed would repeat it."""
    services, study = run.services, trial.study
    try:
        with ACCELERATE_STATE:  # making TrainingArguments must not clear a trainer being built
            peft_config, args, kind = services.check_config(configure(trial), study)
    except (TypeError, ValueError) as error:
        first = run.error is None
        run.stop_study(study, error)
        if first:
            _logger.warning("Trial %d failed, and the study stops: %s", trial.number, error)
        explained(trial.number)
        raise
    root = os.path.join(services.config.output_dir, study.study_name)
    return TrialSpec(
        number=trial.number,
        peft_config=peft_config,
        args=args,
        kind=kind,
        adapter_dir=os.path.join(root, f"trial-{trial.number}"),
        state_dir=os.path.join(root, "state"),
        clone_of=record.clone_request(),
        checkpoint=True,
        study_name=study.study_name,
    )
