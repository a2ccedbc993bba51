"""The trial driver (the Optuna side of one trial) in a real in-memory study, against a scripted device: no model,
no engine, no worker thread.

The fake device's scheduler is the real one; what the device's worker would do with the tasks it hands out (build,
train a chunk, pause, save, release, fail) the fake does at once, in the driver's own thread, when the driver
registers the trial or decides about it, and sends the worker's events. Tests act while a chunk trains (issue a
command, fail the trial from outside, press Ctrl-C) through the script's ``during`` hooks, and while a trial is
paused through the device's paused list.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import socket
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import optuna
import pytest
from datasets import Dataset
from helpers import lora, sft_args
from optuna.trial import FrozenTrial, TrialState
from peft import LoraConfig
from trl import SFTConfig

from optuna_rapidfire import _compat, control
from optuna_rapidfire._engines._types import Branch, ChunkResult
from optuna_rapidfire._runtime._device import DeviceRuntime
from optuna_rapidfire._runtime._entry import Decision, Entry, Task
from optuna_rapidfire._runtime._scheduler import Scheduler
from optuna_rapidfire._runtime._slots import PausedTrials, Slots
from optuna_rapidfire._runtime._worker import Built, DivergedError, Failed, Paused, Released, Saved, SetupError
from optuna_rapidfire._study import _attrs
from optuna_rapidfire._study._config import ExecutorConfig
from optuna_rapidfire._study._optimize import end_paused, interrupt
from optuna_rapidfire._study._progress import Progress
from optuna_rapidfire._study._run import Run
from optuna_rapidfire._study._services import StudyServices
from optuna_rapidfire._study._trial_driver import FinishedElsewhere, StorageWasLost, TrialDriver
from optuna_rapidfire.schedules import LockstepSchedule, Status

pytestmark = pytest.mark.timeout(60)  # a driver waiting for an event the script never sends would hang

LR = 1e-4  # every chunk's train_learning_rate


@dataclass
class Script:
    """What the device does with one trial.

    Attributes:
        values: The metric after each chunk, by step; its length is the trial's run length.
        branch: How the trial started, for a clone or a retry.
        during: Run while the chunk of that step trains, before its result is sent.
        fail_at: The chunk of that step fails with this error.
        build_error: The build fails with this error.
        save_error: Saving the final adapter fails with this error.
        pause_error: Moving the trial off the device to pause it fails with this error.
        on_pause: Run once the device has taken the trial's pause task, before the trial is off the device.
        on_add: Run once the trial is registered, before it is built.
    """

    values: list[float]
    branch: Branch | None = None
    during: Mapping[int, Callable[[Entry], object]] = field(default_factory=dict)
    fail_at: dict[int, BaseException] = field(default_factory=dict)
    build_error: BaseException | None = None
    save_error: BaseException | None = None
    pause_error: BaseException | None = None
    on_pause: Callable[[Entry], object] | None = None
    on_add: Callable[[Entry], object] | None = None


class ScriptedScheduler(Scheduler):
    """The real scheduler, whose tasks a scripted worker carries out as soon as the driver adds or decides."""

    def __init__(self, scripts: dict[int, Script]) -> None:
        super().__init__(gather_seconds=0.0, schedule=LockstepSchedule())
        self.scripts = scripts
        self.added: list[int] = []
        self.decisions: list[tuple[int, Decision]] = []
        self.draining = False

    def add(self, entry: Entry) -> None:
        super().add(entry)
        self.added.append(entry.number)
        script = self.scripts[entry.number]
        if script.on_add is not None:
            script.on_add(entry)
        if self.draining:  # interrupted: nothing new is built
            return
        self._work(Task.BUILD, entry)
        if script.build_error is not None:
            self._fail(entry, script.build_error)
            return
        done, total = (script.branch.step if script.branch else 0), len(script.values)
        self.built(entry, runtime=script, chunks_done=done, finished=done >= total)
        entry.events.put(Built(total, script.branch))
        if done < total:
            self._train(entry)

    def decide(self, entry: Entry, decision: Decision) -> bool:
        self.decisions.append((entry.number, decision))
        at_once = super().decide(entry, decision)  # a queued trial's pause or stop is carried out at once
        if not at_once and not entry.gone:
            self._carry_out(entry, decision)
        return at_once

    def _carry_out(self, entry: Entry, decision: Decision) -> None:
        """What the worker does with the task the decision leaves."""
        if decision is Decision.CONTINUE:
            self._train(entry)
        elif decision is Decision.PAUSE:
            self._work(Task.PAUSE, entry)
            if self.scripts[entry.number].on_pause is not None:
                self.scripts[entry.number].on_pause(entry)
            error = self.scripts[entry.number].pause_error
            if error is not None:
                self._fail(entry, error)
                return
            entry.events.put(Paused())
        elif decision is Decision.FINISH:
            self._work(Task.FINISH, entry)
            error = self.scripts[entry.number].save_error
            if error is not None:
                self._fail(entry, error)
                return
            self.remove(entry)
            entry.events.put(Saved(entry.spec.adapter_dir))
        else:
            self._work(Task.RELEASE, entry)
            self.remove(entry)
            entry.events.put(Released())

    def drain(self, draining: bool = True, on_late: Callable[[Entry], None] | None = None) -> list[Entry]:
        self.draining = draining
        return super().drain(draining, on_late)

    def _work(self, expected: Task, entry: Entry) -> None:
        """Take the scheduler's next task, as the worker would: it must be ``expected``, for ``entry`` alone."""
        task = self.next_task()
        assert task is not None and task[0] is expected and task[1] == [entry], task

    def _train(self, entry: Entry) -> None:
        self._work(Task.TRAIN, entry)
        script = self.scripts[entry.number]
        step = entry.chunks_done
        if step in script.during:
            script.during[step](entry)
        if step in script.fail_at:
            self._fail(entry, script.fail_at[step])
            return
        value = script.values[step]
        metrics = {"eval_loss": value, "train_loss": value + 1.0, "train_learning_rate": LR}
        result = ChunkResult(step=step, metrics=metrics, last=step == len(script.values) - 1, train_seconds=0.5)
        # After a Ctrl-C during the chunk its driver reads Interrupted while the chunk is still training (the
        # worker finishes it after); the result follows.
        if not self.draining:
            self.chunk_done(entry)
        entry.events.put(result)

    def _fail(self, entry: Entry, error: BaseException) -> None:
        """What the worker does with a trial whose task raised: remove it, then tell its driver."""
        self.remove(entry)
        text = "".join(traceback.format_exception(error))
        entry.events.put(Failed(error, text, fatal=isinstance(error, SetupError)))


class WatchedPaused(PausedTrials):
    """The device's paused trials, calling ``on_add`` (in the driver's thread) once a trial is paused."""

    def __init__(self, slots: Slots) -> None:
        super().__init__(slots)
        self.on_add: Callable[[Entry], object] | None = None

    def add(self, entry: Any) -> None:
        super().add(entry)
        if self.on_add is not None:
            self.on_add(entry)


class FakeDevice:
    """What a trial driver uses of a :class:`DeviceRuntime`, with one slot and a scripted worker."""

    def __init__(self, scripts: dict[int, Script]) -> None:
        self.label = "fake:0"
        self.slots = Slots(1)
        self.scheduler = ScriptedScheduler(scripts)
        self.paused = WatchedPaused(self.slots)
        self.fatal: BaseException | None = None


@functools.cache
def _config() -> tuple[LoraConfig, SFTConfig]:
    return lora(), sft_args()


def _configure(trial: optuna.Trial) -> tuple[LoraConfig, SFTConfig]:
    return _config()


@pytest.fixture
def services(tmp_path: Path) -> StudyServices:
    data = Dataset.from_dict({"text": ["one two three", "four five six"]})
    config = ExecutorConfig(
        model="unused",  # nothing is loaded: the device is a fake
        train_dataset=data,
        eval_dataset=data,
        output_dir=tmp_path / "out",
        show_progress_bar=False,
        dashboard_controls=False,
        artifact_store=None,
        poll_seconds=0.01,
    )
    return StudyServices(config)


def _run(device: FakeDevice, services: StudyServices) -> Run:
    return Run(cast(DeviceRuntime, device), services, Progress(False))


def _objective(run: Run) -> Callable[[optuna.Trial], float]:
    return lambda trial: TrialDriver(run, trial, _configure).run()


def _study(pruner: optuna.pruners.BasePruner | None = None) -> optuna.Study:
    return optuna.create_study(pruner=pruner or optuna.pruners.NopPruner())


def _attrs_of(trial: FrozenTrial) -> dict[str, Any]:
    """The trial's user attrs, less those every trial has (the metric's name, where it ran, and what it did last:
    its activity, which the scripted device's instant tasks leave to timing; test_control.py checks it)."""
    return {k: v for k, v in trial.user_attrs.items() if k not in (_attrs.METRIC, _attrs.WORKER, _attrs.ACTIVITY)}


def _command_results(study: optuna.Study) -> list[str]:
    """What the executor did with each command, in the order they were issued."""
    attrs = _compat.storage(study).get_study_system_attrs(_compat.study_id(study))
    return [attrs[key]["result"] for key in sorted(attrs) if key.startswith(_attrs.DONE_PREFIX)]


def _trained(values: list[float], chunks: int) -> dict[str, Any]:
    """The attrs a trial has after training ``chunks`` chunks of ``values`` in a run of ``len(values)``."""
    return {
        _attrs.TOTAL_CHUNKS: len(values),
        _attrs.CHUNKS_DONE: chunks,
        _attrs.TRAIN_LOSS: values[chunks - 1] + 1.0,
        _attrs.LEARNING_RATE: LR,
    }


def test_a_trial_that_trains_every_chunk_completes_with_its_last_value_and_its_adapter(
    services: StudyServices, tmp_path: Path
) -> None:
    values = [0.9, 0.7, 0.5]
    device = FakeDevice({0: Script(values)})
    run = _run(device, services)
    study = _study()
    study.optimize(_objective(run), n_trials=1)

    [trial] = study.trials
    assert (trial.state, trial.value) == (TrialState.COMPLETE, 0.5)
    assert trial.intermediate_values == {0: 0.9, 1: 0.7, 2: 0.5}
    assert trial.user_attrs == {
        _attrs.METRIC: "eval_loss",
        _attrs.WORKER: f"{socket.gethostname()}:{os.getpid()}:fake:0",
        _attrs.STATUS: "complete",
        _attrs.ADAPTER_PATH: str(tmp_path / "out" / study.study_name / "trial-0"),
        **_trained(values, 3),
    }
    assert device.scheduler.decisions == [(0, Decision.CONTINUE), (0, Decision.CONTINUE), (0, Decision.FINISH)]
    assert device.scheduler.entries() == [] and device.slots.free() == 1
    assert run.externally_finished == set() and run.error is None and device.fatal is None


class StepPruner(optuna.pruners.BasePruner):
    """Prunes every trial once it reports ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def prune(self, study: optuna.Study, trial: FrozenTrial) -> bool:
        return trial.last_step == self.step


def test_a_pruned_trial_stops_after_its_chunk_and_says_who_pruned_it_against_whom(services: StudyServices) -> None:
    values = [0.9, 0.7, 0.5, 0.3]
    device = FakeDevice({0: Script(values), 1: Script(values)})
    study = _study(StepPruner(1))
    study.optimize(_objective(_run(device, services)), n_trials=2)

    for trial, peers in zip(study.trials, (0, 1), strict=True):
        assert trial.state == TrialState.PRUNED
        assert trial.intermediate_values == {0: 0.9, 1: 0.7}
        assert _attrs_of(trial) == {
            _attrs.STATUS: "pruned",
            _attrs.PRUNED_REASON: f"StepPruner stopped it after chunk 2/4 (step 1): eval_loss=0.7, compared with "
            f"{peers} other trial(s) at that step.",
            **_trained(values, 2),
        }
    # The device releases a pruned trial's state: it is told STOP, never FINISH (no adapter is saved).
    assert device.scheduler.decisions == [
        (0, Decision.CONTINUE),
        (0, Decision.STOP),
        (1, Decision.CONTINUE),
        (1, Decision.STOP),
    ]


def test_a_trial_that_fails_on_the_device_ends_failed_with_its_error_and_the_study_goes_on(
    services: StudyServices,
) -> None:
    error = DivergedError("train_loss=nan after chunk 2: the trial diverged and stops here.")
    device = FakeDevice({0: Script([0.9, 0.7, 0.5], fail_at={1: error}), 1: Script([0.8, 0.6])})
    run = _run(device, services)
    study = _study()
    study.optimize(_objective(run), n_trials=2)

    failed, completed = study.trials
    assert failed.state == TrialState.FAIL and failed.intermediate_values == {0: 0.9}
    assert _attrs_of(failed) == {
        _attrs.STATUS: "failed",
        _attrs.FAIL_REASON: "DivergedError: train_loss=nan after chunk 2: the trial diverged and stops here.",
        **_trained([0.9, 0.7, 0.5], 1),
    }
    assert (completed.state, completed.value) == (TrialState.COMPLETE, 0.6)
    # The device removed the failed trial itself: its driver does not tell it to leave.
    assert device.scheduler.decisions == [(0, Decision.CONTINUE), (1, Decision.CONTINUE), (1, Decision.FINISH)]
    assert device.fatal is None and run.error is None and device.slots.free() == 1


def test_a_trial_whose_adapter_cannot_be_saved_fails_with_the_save_error(services: StudyServices) -> None:
    device = FakeDevice({0: Script([0.9, 0.7], save_error=OSError("No space left on device"))})
    study = _study()
    study.optimize(_objective(_run(device, services)), n_trials=1)

    [trial] = study.trials
    assert trial.state == TrialState.FAIL and trial.intermediate_values == {0: 0.9, 1: 0.7}
    assert _attrs_of(trial) == {
        _attrs.STATUS: "failed",
        _attrs.FAIL_REASON: "OSError: No space left on device",
        **_trained([0.9, 0.7], 2),
    }
    assert device.scheduler.decisions == [(0, Decision.CONTINUE), (0, Decision.FINISH)]


def test_a_setup_error_on_the_device_stops_the_study_and_every_later_trial_raises_it(
    services: StudyServices,
) -> None:
    error = SetupError("metric='eval_bleu' is not among the evaluation's metrics ['eval_loss'].")
    device = FakeDevice({0: Script([0.9, 0.7], build_error=error), 1: Script([0.9, 0.7])})
    run = _run(device, services)
    study = _study()
    with pytest.raises(SetupError) as raised:
        study.optimize(_objective(run), n_trials=3)

    assert raised.value is error and device.fatal is error
    [trial] = study.trials
    assert trial.state == TrialState.FAIL and trial.intermediate_values == {}
    assert _attrs_of(trial) == {_attrs.STATUS: "failed", _attrs.FAIL_REASON: f"SetupError: {error}"}
    assert device.scheduler.decisions == []
    # The device is unusable: the next trial raises the same error before it registers or takes a slot.
    with pytest.raises(SetupError) as again:
        TrialDriver(run, study.ask(), _configure).run()
    assert again.value is error
    assert device.scheduler.added == [0] and device.slots.free() == 1
    assert _attrs_of(study.trials[1]) == {_attrs.STATUS: "failed", _attrs.FAIL_REASON: f"SetupError: {error}"}


def test_a_delete_command_ends_the_trial_failed_at_its_next_chunk_boundary(services: StudyServices) -> None:
    values = [0.9, 0.7, 0.5, 0.3]
    study = _study()
    during = {1: lambda entry: control.delete(study, entry.number, reason="worse than its clone")}
    device = FakeDevice({0: Script(values, during=during)})
    study.optimize(_objective(_run(device, services)), n_trials=1)

    [trial] = study.trials
    # The chunk in flight is reported; no chunk starts after it.
    assert trial.state == TrialState.FAIL and trial.intermediate_values == {0: 0.9, 1: 0.7}
    assert _attrs_of(trial) == {
        _attrs.STATUS: "deleted",
        _attrs.FAIL_REASON: "deleted: worse than its clone",
        **_trained(values, 2),
    }
    assert device.scheduler.decisions == [(0, Decision.CONTINUE), (0, Decision.STOP)]
    assert _command_results(study) == ["deleted after chunk 2"]


def test_a_stopped_trial_pauses_off_the_device_without_its_slot_and_resumes_where_it_stopped(
    services: StudyServices,
) -> None:
    values = [0.9, 0.7, 0.5]
    study = _study()
    during = {0: lambda entry: control.stop(study, entry.number)}
    device = FakeDevice({0: Script(values, during=during)})
    seen: list[tuple[Any, ...]] = []

    def on_pause(entry: Entry) -> None:
        stored = _compat.storage(study).get_trial(entry.trial_id)
        seen.append((stored.user_attrs[_attrs.STATUS], entry.status, device.slots.free(), device.paused.entries()))
        control.resume(study, entry.number)

    device.paused.on_add = on_pause
    study.optimize(_objective(_run(device, services)), n_trials=1)

    [entry] = [row[3][0] for row in seen]
    assert seen == [("paused", Status.PAUSED, 1, [entry])]
    [trial] = study.trials
    assert (trial.state, trial.value) == (TrialState.COMPLETE, 0.5)
    assert trial.intermediate_values == {0: 0.9, 1: 0.7, 2: 0.5}
    assert trial.user_attrs[_attrs.STATUS] == "complete"
    assert device.scheduler.decisions == [
        (0, Decision.PAUSE),
        (0, Decision.CONTINUE),  # resumed
        (0, Decision.CONTINUE),
        (0, Decision.FINISH),
    ]
    assert _command_results(study) == ["paused after chunk 1", "resumed"]
    assert len(device.paused) == 0 and device.slots.free() == 1


def test_a_trial_the_device_fails_while_pausing_it_ends_failed_instead_of_waiting_for_ever(
    services: StudyServices,
) -> None:
    values = [0.9, 0.7, 0.5]
    study = _study()
    during = {0: lambda entry: control.stop(study, entry.number)}
    device = FakeDevice({0: Script(values, during=during, pause_error=RuntimeError("pinned memory exhausted"))})
    study.optimize(_objective(_run(device, services)), n_trials=1)

    [trial] = study.trials
    assert trial.state == TrialState.FAIL and trial.intermediate_values == {0: 0.9}
    assert trial.user_attrs[_attrs.FAIL_REASON] == "RuntimeError: pinned memory exhausted"
    assert device.scheduler.decisions == [(0, Decision.PAUSE)]
    assert len(device.paused) == 0 and device.slots.free() == 1


@pytest.mark.parametrize("end", ["study end", "Ctrl-C"])
def test_a_trial_still_paused_when_the_study_ends_is_pruned_as_paused_at_end(services: StudyServices, end: str) -> None:
    values = [0.9, 0.7, 0.5]
    study = _study()
    during = {0: lambda entry: control.stop(study, entry.number)}
    device = FakeDevice({0: Script(values, during=during)})
    ending = end_paused if end == "study end" else interrupt
    device.paused.on_add = lambda entry: ending(cast(DeviceRuntime, device))
    study.optimize(_objective(_run(device, services)), n_trials=1)

    [trial] = study.trials
    assert trial.state == TrialState.PRUNED and trial.intermediate_values == {0: 0.9}
    assert _attrs_of(trial) == {
        _attrs.STATUS: "paused-at-end",
        _attrs.PRUNED_REASON: "Still paused after chunk 1 when the study ended; its state is kept: clone it to "
        "continue.",
        **_trained(values, 1),
    }
    assert device.scheduler.decisions == [(0, Decision.PAUSE), (0, Decision.STOP)]
    assert len(device.paused) == 0 and device.slots.free() == 1


def _interrupted_during_chunk_2(services: StudyServices, values: list[float]) -> tuple[FrozenTrial, FakeDevice]:
    """A one-trial study whose device is interrupted (Ctrl-C) while the trial trains its second chunk."""
    script = Script(values)
    device = FakeDevice({0: script})
    script.during = {1: lambda entry: interrupt(cast(DeviceRuntime, device))}
    study = _study()
    study.optimize(_objective(_run(device, services)), n_trials=1)
    [trial] = study.trials
    return trial, device


def test_an_interrupt_during_a_chunk_ends_the_trial_pruned_after_that_chunk(services: StudyServices) -> None:
    values = [0.9, 0.7, 0.5, 0.3]
    trial, device = _interrupted_during_chunk_2(services, values)
    # What the chunk in flight trained is reported, and kept.
    assert trial.state == TrialState.PRUNED and trial.intermediate_values == {0: 0.9, 1: 0.7}
    assert _attrs_of(trial) == {
        _attrs.STATUS: "interrupted",
        _attrs.PRUNED_REASON: "Interrupted (Ctrl-C) after chunk 2/4; its state is kept: clone it to continue.",
        **_trained(values, 2),
    }
    assert device.scheduler.decisions == [(0, Decision.CONTINUE), (0, Decision.STOP)]


def test_an_interrupt_during_the_last_chunk_lets_the_trial_complete_with_its_adapter(services: StudyServices) -> None:
    trial, device = _interrupted_during_chunk_2(services, [0.9, 0.7])
    # Every chunk trained: it ends as any complete trial does (its adapter saved), not as an interrupted one.
    assert (trial.state, trial.value) == (TrialState.COMPLETE, 0.7)
    assert trial.user_attrs[_attrs.STATUS] == "complete" and _attrs.ADAPTER_PATH in trial.user_attrs
    assert device.scheduler.decisions == [(0, Decision.CONTINUE), (0, Decision.FINISH)]


# "registered": Ctrl-C comes once the trial is registered, before it is built. "asking": its thread was between
# Optuna's ask and registering, so the interrupt did not see it, and nothing is built while draining: without
# being told it would wait for ever.
@pytest.mark.parametrize("when", ["registered", "asking"])
def test_an_interrupt_before_the_trial_is_built_ends_it_at_once(services: StudyServices, when: str) -> None:
    script = Script([0.9, 0.7])
    device = FakeDevice({0: script})
    if when == "registered":
        script.on_add = lambda entry: interrupt(cast(DeviceRuntime, device))
    else:
        interrupt(cast(DeviceRuntime, device))
    study = _study()
    study.optimize(_objective(_run(device, services)), n_trials=1)

    [trial] = study.trials
    assert trial.state == TrialState.PRUNED and trial.intermediate_values == {}
    assert _attrs_of(trial) == {
        _attrs.STATUS: "interrupted",
        _attrs.PRUNED_REASON: "Interrupted (Ctrl-C) before it started training.",
    }
    assert device.scheduler.decisions == [(0, Decision.STOP)]


@pytest.mark.parametrize(
    ("who", "said"),
    [
        # The driver waits 2 s for a retry that never comes before it says so.
        ("dashboard", "Trial 0 was finished outside the executor (optuna-dashboard's 'Fail Trial'?)"),
        ("heartbeat", "Trial 0 was failed by another worker's heartbeat check"),
    ],
    ids=["dashboard", "heartbeat"],
)
def test_a_trial_finished_outside_the_executor_reports_nothing_more_and_the_run_records_it(
    services: StudyServices, rapidfire_logs: pytest.LogCaptureFixture, who: str, said: str
) -> None:
    study = _study()

    def finish_elsewhere(entry: Entry) -> None:
        _compat.storage(study).set_trial_state_values(entry.trial_id, TrialState.FAIL)
        if who == "heartbeat":  # the other worker's heartbeat check also enqueues Optuna's retry
            optuna.storages.RetryFailedTrialCallback()(study, study.trials[entry.number])

    values = [0.9, 0.7, 0.5]
    device = FakeDevice({0: Script(values, during={1: finish_elsewhere})})
    run = _run(device, services)
    with pytest.raises(FinishedElsewhere, match=r"^Trial 0 was finished outside the executor\.$"):
        TrialDriver(run, study.ask(), _configure).run()

    trial = study.trials[0]
    assert trial.state == TrialState.FAIL and trial.intermediate_values == {0: 0.9}
    assert _attrs_of(trial) == {_attrs.STATUS: "running", **_trained(values, 1)}
    assert device.scheduler.decisions == [(0, Decision.CONTINUE), (0, Decision.STOP)]
    assert run.externally_finished == {0} and device.slots.free() == 1
    assert any(record.getMessage().startswith(said) for record in rapidfire_logs.records)


def test_a_warm_clone_of_a_trial_that_trained_every_chunk_fails_untrained(services: StudyServices) -> None:
    history = [{"eval_loss": 0.9}, {"eval_loss": 0.7}]
    branch = Branch(parent=3, step=2, warm=True, history=history)
    device = FakeDevice({0: Script([0.5, 0.4], branch=branch)})
    study = _study()
    study.optimize(_objective(_run(device, services)), n_trials=1)

    [trial] = study.trials
    assert trial.state == TrialState.FAIL and trial.intermediate_values == {}  # not even the parent's curve
    assert _attrs_of(trial) == {
        _attrs.STATUS: "failed",
        _attrs.FAIL_REASON: "Warm clone of trial 3, which had trained all 2 chunks: nothing is left to train under "
        "the new parameters. Clone it cold, or give the clone a longer run (more epochs).",
    }
    assert device.scheduler.decisions == [(0, Decision.STOP)]


def test_a_warm_clone_continues_its_parents_curve_from_its_branch_step(services: StudyServices) -> None:
    values = [0.0, 0.0, 0.6, 0.4]  # the first two are the parent's, not trained again
    branch = Branch(parent=3, step=2, warm=True, history=[{"eval_loss": 0.9}, {"eval_loss": 0.7}])
    device = FakeDevice({0: Script(values, branch=branch)})
    study = _study()
    study.optimize(_objective(_run(device, services)), n_trials=1)

    [trial] = study.trials
    assert (trial.state, trial.value) == (TrialState.COMPLETE, 0.4)
    assert trial.intermediate_values == {0: 0.9, 1: 0.7, 2: 0.6, 3: 0.4}
    assert _attrs_of(trial) == {
        _attrs.STATUS: "complete",
        _attrs.PARENT: 3,
        _attrs.BRANCH_STEP: 2,
        _attrs.CLONE: "warm",
        _attrs.ADAPTER_PATH: trial.user_attrs[_attrs.ADAPTER_PATH],
        **_trained(values, 4),
    }
    assert device.scheduler.decisions == [(0, Decision.CONTINUE), (0, Decision.FINISH)]


def test_a_retry_of_a_trial_that_died_after_its_last_chunk_completes_with_its_last_value(
    services: StudyServices,
) -> None:
    history = [{"eval_loss": 0.9}, {"eval_loss": 0.7}]
    branch = Branch(parent=3, step=2, warm=True, history=history, resume=True)
    device = FakeDevice({0: Script([0.0, 0.0], branch=branch)})
    study = _study()
    study.optimize(_objective(_run(device, services)), n_trials=1)

    [trial] = study.trials
    assert (trial.state, trial.value) == (TrialState.COMPLETE, 0.7)
    assert trial.intermediate_values == {0: 0.9, 1: 0.7}
    assert _attrs_of(trial) == {
        _attrs.STATUS: "complete",
        _attrs.TOTAL_CHUNKS: 2,
        _attrs.CHUNKS_DONE: 2,
        _attrs.RETRY_OF: 3,
        _attrs.RESUMED_FROM_STEP: 2,
        _attrs.ADAPTER_PATH: trial.user_attrs[_attrs.ADAPTER_PATH],
    }
    assert device.scheduler.decisions == [(0, Decision.FINISH)]


@pytest.mark.parametrize("failed_elsewhere", [False, True], ids=["still-running", "failed-elsewhere"])
def test_after_a_long_storage_outage_a_trial_another_worker_failed_stops_at_once(
    services: StudyServices, failed_elsewhere: bool
) -> None:
    study = _study()

    def outage(entry: Entry) -> None:  # while its first chunk trains, the storage is away past the grace period
        if failed_elsewhere:  # another worker's heartbeat check failed it and enqueued Optuna's retry
            _compat.storage(study).set_trial_state_values(entry.trial_id, TrialState.FAIL)
            optuna.storages.RetryFailedTrialCallback()(study, study.trials[entry.number])
        entry.events.put(StorageWasLost())

    values = [0.9, 0.7]
    device = FakeDevice({0: Script(values, during={0: outage})})
    run = _run(device, services)
    driver = TrialDriver(run, study.ask(), _configure)
    if not failed_elsewhere:  # nothing happened to it: it goes on
        assert driver.run() == 0.7
        assert device.scheduler.decisions == [(0, Decision.CONTINUE), (0, Decision.FINISH)]
        return
    with pytest.raises(FinishedElsewhere):
        driver.run()
    # It stopped on the news, before the result of the chunk it had in flight: nothing more is reported.
    assert study.trials[0].intermediate_values == {}
    assert device.scheduler.decisions == [(0, Decision.STOP)]
    assert run.externally_finished == {0} and device.slots.free() == 1


def test_ctrl_c_while_a_trial_is_being_paused_ends_it_as_interrupted(services: StudyServices) -> None:
    # Its status is already PAUSED, but it is not yet among the device's paused trials: it must still hear it.
    values = [0.9, 0.7, 0.5]
    study = _study()
    script = Script(values, during={0: lambda entry: control.stop(study, entry.number)})
    device = FakeDevice({0: script})
    script.on_pause = lambda entry: interrupt(cast(DeviceRuntime, device))
    study.optimize(_objective(_run(device, services)), n_trials=1)

    [trial] = study.trials
    assert trial.state == TrialState.PRUNED and trial.intermediate_values == {0: 0.9}
    assert trial.user_attrs[_attrs.STATUS] == "interrupted"
    assert device.scheduler.decisions == [(0, Decision.PAUSE), (0, Decision.STOP)]
    assert len(device.paused) == 0 and device.slots.free() == 1


@pytest.mark.parametrize(
    ("metric", "evaluated"), [(None, False), ("loss", False), ("eval_entropy", True), ("bleu", True)]
)
def test_only_a_metric_the_trainer_may_not_report_is_looked_for_in_a_first_evaluation(
    services: StudyServices, metric: str | None, evaluated: bool
) -> None:
    """``eval_loss`` and the trainer's default metric are reported by every evaluation: no one-batch evaluation
    before training for them; any other metric is looked for there, and its absence ends the study."""
    services = StudyServices(dataclasses.replace(services.config, metric=metric))
    services.check_config(_configure(_study().ask()), _study())
    calls: list[int] = []

    def evaluate() -> dict[str, float]:
        calls.append(1)
        return {"eval_loss": 0.5, "eval_entropy": 0.25}

    if metric == "bleu":
        with pytest.raises(SetupError, match=r"metric='eval_bleu' is not among the evaluation's metrics"):
            services.check_metrics(evaluate)
    else:
        services.check_metrics(evaluate)
    assert len(calls) == int(evaluated)
