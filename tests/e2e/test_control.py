"""Stop (pause), resume, delete and clone by hand, from Python or the CLI in another process."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from pathlib import Path

import optuna
import pytest
from helpers import Background, by_number, lora, sft_args, wait_until
from optuna.trial import TrialState

from optuna_rapidfire import control, events
from optuna_rapidfire._engines import ENGINES
from optuna_rapidfire._study import _attrs

CONFIGS = [(lora(r=4, lora_dropout=0.1), sft_args(learning_rate=1e-2 * (i + 1), seed=i)) for i in range(4)]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "optuna_rapidfire", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )


def _status(study: optuna.Study, number: int) -> str | None:
    return study.trials[number].user_attrs.get(_attrs.STATUS)


def _values(trial: optuna.trial.FrozenTrial) -> list[float]:
    return [trial.intermediate_values[s] for s in sorted(trial.intermediate_values)]


def test_stop_and_resume_from_another_process(make_executor, chunk_log, slow_chunks, tmp_path: Path) -> None:
    slow_chunks(0.1)
    url = f"sqlite:///{tmp_path / 'rf.db'}"
    executor = make_executor(num_chunks=8, max_concurrent_trials=2)
    study = optuna.create_study(storage=url, study_name="ctl", pruner=optuna.pruners.NopPruner())
    run = Background(lambda: executor.optimize(study, by_number(CONFIGS), n_trials=3))
    wait_until(lambda: 0 in study.trials[0].intermediate_values, what="trial 0's first report")

    stopped = _cli("stop", "--storage", url, "--study-name", "ctl", "0")
    assert stopped.returncode == 0, stopped.stderr
    wait_until(lambda: _status(study, 0) == "paused", what="trial 0 to pause")
    paused_at = study.trials[0].user_attrs[_attrs.CHUNKS_DONE]
    log_at_pause = len(chunk_log)
    assert "RUNNING (paused)" in _cli("ls", "--storage", url, "--study-name", "ctl").stdout
    # Its slot went to another trial: trial 2 starts and trains while trial 0 waits.
    wait_until(lambda: len(study.trials[2].intermediate_values) >= 2, what="trial 2 to start")
    assert study.trials[0].user_attrs[_attrs.CHUNKS_DONE] == paused_at
    assert all(number != 0 for number, _ in chunk_log[log_at_pause:])

    resumed = _cli("resume", "--storage", url, "--study-name", "ctl", "0")
    assert resumed.returncode == 0, resumed.stderr
    run.join()
    trial = study.trials[0]
    assert trial.state == TrialState.COMPLETE and trial.user_attrs[_attrs.STATUS] == "complete"
    assert list(trial.intermediate_values) == list(range(8))

    # Pausing (and moving its state off the device) changed nothing in what it computed.
    alone = optuna.create_study(pruner=optuna.pruners.NopPruner())
    make_executor(num_chunks=8, max_concurrent_trials=1).optimize(alone, by_number(CONFIGS[:1]), n_trials=1)
    assert _values(trial) == _values(alone.trials[0])


def test_a_command_waits_for_the_chunk_in_progress(make_executor, listen) -> None:
    in_chunk = threading.Event()
    proceed = threading.Event()

    def gated(event: events.Event) -> None:
        if isinstance(event, events.ChunkStarting) and (event.trials, event.steps) == ((0,), (1,)):
            in_chunk.set()
            proceed.wait(60)

    listen(gated)
    executor = make_executor(num_chunks=4, max_concurrent_trials=1)
    study = optuna.create_study(pruner=optuna.pruners.NopPruner())
    run = Background(lambda: executor.optimize(study, by_number(CONFIGS[:1]), n_trials=1))
    in_chunk.wait(60)
    control.stop(study, 0)  # while chunk 1 trains
    proceed.set()
    wait_until(lambda: _status(study, 0) == "paused", what="the pause")
    assert list(study.trials[0].intermediate_values) == [0, 1]  # chunk 1 finished and was reported
    control.resume(study, 0)
    run.join()
    assert study.trials[0].state == TrialState.COMPLETE


@pytest.mark.parametrize("engine", list(ENGINES))
def test_delete_ends_the_trial_as_fail_and_frees_its_state(make_executor, engine) -> None:
    executor = make_executor(num_chunks=4, max_concurrent_trials=2, engine=engine)
    study = optuna.create_study(pruner=optuna.pruners.NopPruner())
    run = Background(lambda: executor.optimize(study, by_number(CONFIGS), n_trials=3))
    wait_until(lambda: 0 in study.trials[1].intermediate_values, what="trial 1's first report")
    control.delete(study, 1, reason="diverged")
    run.join()
    deleted = study.trials[1]
    assert deleted.state == TrialState.FAIL
    assert deleted.user_attrs[_attrs.FAIL_REASON] == "deleted: diverged"
    assert deleted.user_attrs[_attrs.STATUS] == "deleted"
    assert len(deleted.intermediate_values) < 4
    assert [study.trials[i].state for i in (0, 2)] == [TrialState.COMPLETE] * 2
    assert executor.stats().adapters == ()


@pytest.mark.parametrize("engine", list(ENGINES))
def test_a_trial_still_paused_at_the_end_is_pruned_and_can_be_continued(make_executor, tmp_path, engine) -> None:
    executor = make_executor(num_chunks=4, max_concurrent_trials=2, pause_grace_seconds=0.5, engine=engine)
    study = optuna.create_study(study_name="end", pruner=optuna.pruners.NopPruner())
    run = Background(lambda: executor.optimize(study, by_number(CONFIGS[:2]), n_trials=2))
    wait_until(lambda: 0 in study.trials[0].intermediate_values, what="trial 0's first report")
    control.stop(study, 0)
    run.join()
    paused = study.trials[0]
    assert paused.state == TrialState.PRUNED
    assert paused.user_attrs[_attrs.STATUS] == "paused-at-end"
    assert (tmp_path / "out" / "end" / "state" / "trial-0" / "snapshot.safetensors").is_file()
    assert study.trials[1].state == TrialState.COMPLETE

    child = control.clone(study, 0)
    executor.optimize(study, by_number([CONFIGS[0]] * 3), n_trials=1)
    continued = study.trials[child]
    assert continued.state == TrialState.COMPLETE and continued.user_attrs[_attrs.CLONE] == "warm"
    assert list(continued.intermediate_values) == [0, 1, 2, 3]
    alone = optuna.create_study(pruner=optuna.pruners.NopPruner())
    single = make_executor(num_chunks=4, max_concurrent_trials=1, engine=engine)
    single.optimize(alone, by_number(CONFIGS[:1]), n_trials=1)
    assert _values(continued) == _values(alone.trials[0])


def test_commands_on_unknown_or_finished_trials_change_nothing(make_executor) -> None:
    study = optuna.create_study()
    make_executor(num_chunks=2, max_concurrent_trials=1).optimize(study, by_number(CONFIGS[:1]), n_trials=1)
    before = study._storage.get_study_system_attrs(study._study_id)
    with pytest.raises(ValueError, match="does not exist"):
        control.stop(study, 5)
    with pytest.raises(ValueError, match="is COMPLETE: only a running trial can be stopped"):
        control.stop(study, 0)
    with pytest.raises(ValueError, match="only a running trial can be resumed"):
        control.resume(study, 0)
    with pytest.raises(ValueError, match="only a running trial can be deleted"):
        control.delete(study, 0)
    with pytest.raises(TypeError):
        control.stop(study, "0")
    assert study._storage.get_study_system_attrs(study._study_id) == before
    assert _cli("stop", "--storage", "sqlite:///nowhere.db", "--study-name", "x", "0").returncode == 2


def test_resume_of_a_running_trial_is_an_error(make_executor, slow_chunks) -> None:
    slow_chunks(0.05)
    executor = make_executor(num_chunks=4, max_concurrent_trials=1)
    study = optuna.create_study(pruner=optuna.pruners.NopPruner())
    run = Background(lambda: executor.optimize(study, by_number(CONFIGS[:1]), n_trials=1))
    wait_until(lambda: study.trials and study.trials[0].user_attrs.get(_attrs.STATUS) == "running", what="start")
    with pytest.raises(ValueError, match="is not paused"):
        control.resume(study, 0)
    run.join()


def test_concurrent_commands_are_applied_exactly_once(make_executor, slow_chunks) -> None:
    slow_chunks(0.05)
    executor = make_executor(num_chunks=6, max_concurrent_trials=2)
    study = optuna.create_study(pruner=optuna.pruners.NopPruner())
    run = Background(lambda: executor.optimize(study, by_number(CONFIGS[:2]), n_trials=2))
    wait_until(lambda: 0 in study.trials[0].intermediate_values, what="trial 0's first report")

    def issue(command) -> None:
        with contextlib.suppress(ValueError):  # validated against a state another client already changed
            command(study, 0)

    for command in (control.stop, control.resume):
        clients = [threading.Thread(target=issue, args=(command,)) for _ in range(6)]
        for client in clients:
            client.start()
        for client in clients:
            client.join()
        wanted = "paused" if command is control.stop else "running"
        wait_until(lambda wanted=wanted: _status(study, 0) == wanted, what=f"status {wanted}")
    run.join()

    results = [
        v["result"]
        for k, v in study._storage.get_study_system_attrs(study._study_id).items()
        if k.startswith(_attrs.DONE_PREFIX)
    ]
    issued = [k for k in study._storage.get_study_system_attrs(study._study_id) if k.startswith(_attrs.COMMAND_PREFIX)]
    assert len(results) == len(issued)  # none lost: every command was answered
    # After its chunk, or at once while it waited for the device: paused once either way.
    assert sum(r.startswith(("paused after chunk", "paused while waiting after chunk")) for r in results) == 1
    assert sum(r == "resumed" for r in results) == 1
    assert all(r.startswith(("paused ", "resumed", "ignored")) for r in results)
    assert study.trials[0].state == TrialState.COMPLETE


@pytest.mark.parametrize("engine", list(ENGINES))
def test_fail_trial_from_outside_ends_it_cleanly_and_the_study_goes_on(
    make_executor, slow_chunks, tmp_path, engine
) -> None:
    slow_chunks(0.05)
    url = f"sqlite:///{tmp_path / 'rf.db'}"
    executor = make_executor(num_chunks=5, max_concurrent_trials=3, engine=engine)
    study = optuna.create_study(storage=url, study_name="fail", pruner=optuna.pruners.NopPruner())
    run = Background(lambda: executor.optimize(study, by_number(CONFIGS), n_trials=4))
    wait_until(lambda: 0 in study.trials[1].intermediate_values, what="trial 1's first report")
    # What optuna-dashboard's "Fail Trial" button does.
    study._storage.set_trial_state_values(study.trials[1]._trial_id, TrialState.FAIL)
    run.join()
    assert study.trials[1].state == TrialState.FAIL
    assert [study.trials[i].state for i in (0, 2, 3)] == [TrialState.COMPLETE] * 3
    assert executor.stats().live_trials == 0


def test_fail_trial_while_its_adapter_is_saved_ends_it_cleanly_and_the_study_goes_on(
    make_executor, tmp_path, listen
) -> None:
    # optuna-dashboard's "Fail Trial" clicked while the device saves trial 1's final adapter: the trial is
    # FAIL in the storage before its driver records the adapter's path.
    from optuna_rapidfire import events

    url = f"sqlite:///{tmp_path / 'rf.db'}"
    study = optuna.create_study(storage=url, study_name="fail-at-save", pruner=optuna.pruners.NopPruner())

    def saved(event: events.AdapterSaved) -> None:
        if event.trial == 1:
            study._storage.set_trial_state_values(study.trials[1]._trial_id, TrialState.FAIL)

    listen(saved, events.AdapterSaved)
    executor = make_executor(num_chunks=2, max_concurrent_trials=2)
    executor.optimize(study, by_number(CONFIGS[:3]), n_trials=3)
    assert [t.state for t in study.trials] == [TrialState.COMPLETE, TrialState.FAIL, TrialState.COMPLETE]
    assert executor.stats().live_trials == 0


def test_a_trial_failed_by_another_worker_s_heartbeat_check_says_so_and_its_retry_runs(
    make_executor, slow_chunks, tmp_path, rapidfire_logs
) -> None:
    """What a worker sees after its heartbeats missed the grace period: another worker failed its trial and
    enqueued the retry. The message names that, not optuna-dashboard, and the retry runs."""
    slow_chunks(0.05)
    url = f"sqlite:///{tmp_path / 'rf.db'}"
    executor = make_executor(num_chunks=4, max_concurrent_trials=2)
    study = optuna.create_study(storage=url, study_name="stale", pruner=optuna.pruners.NopPruner())
    optuna.logging.enable_propagation()  # Optuna's lines too
    run = Background(lambda: executor.optimize(study, by_number(CONFIGS), n_trials=3))
    wait_until(lambda: 0 in study.trials[1].intermediate_values, what="trial 1's first report")
    # What fail_stale_trials does, its callback first here: on a busy machine the driver could otherwise look
    # for the retry (it waits 2 s) before the test's callback has written it.
    optuna.storages.RetryFailedTrialCallback()(study, study.trials[1])
    study._storage.set_trial_state_values(study.trials[1]._trial_id, TrialState.FAIL)
    try:
        run.join()
    finally:
        optuna.logging.disable_propagation()
    retry = next(t for t in study.trials if t.system_attrs.get("failed_trial") == 1)
    assert "Trial 1 was failed by another worker's heartbeat check" in rapidfire_logs.text
    assert f"was retried there as trial {retry.number}" in rapidfire_logs.text
    assert "FinishedElsewhere" not in rapidfire_logs.text  # no traceback of Optuna's about it
    if retry.state == TrialState.WAITING:  # the budget went to trials started before it was enqueued
        executor.optimize(study, by_number(CONFIGS), n_trials=1)
        retry = study.trials[retry.number]
    assert retry.state == TrialState.COMPLETE  # (from scratch: this study keeps no checkpoints)


def test_commands_to_trials_waiting_between_chunks_apply_at_once(make_executor, tmp_path, capsys) -> None:
    """Trials 1 and 2 wait after their first chunk (a schedule that does not choose them; trial 0 trains on):
    a stop (from the CLI, which says what was done), a delete and a clone to them apply within poll_seconds,
    with no chunk trained in between."""
    from optuna_rapidfire.cli import main
    from optuna_rapidfire.schedules import PromoteSchedule

    released = threading.Event()

    class Holding(PromoteSchedule):
        """Promote-all, except that trials 1 and 2 wait after chunk 1 until the test releases them."""

        def choose(self, live, *, fuse, now, reports=None):
            if not released.is_set():
                live = [v for v in live if not (v.number in (1, 2) and v.chunks_done >= 1)]
            return super().choose(live, fuse=fuse, now=now, reports=reports)

    executor = make_executor(
        num_chunks=4, max_concurrent_trials=3, poll_seconds=0.2, schedule=Holding(when_exhausted="promote")
    )
    url = f"sqlite:///{tmp_path / 'waiting.db'}"
    study = optuna.create_study(storage=url, study_name="waiting", pruner=optuna.pruners.NopPruner())

    def waiting() -> bool:
        trials = study.get_trials(deepcopy=False)
        return len(trials) == 3 and all(0 in t.intermediate_values for t in trials[1:])

    run = Background(lambda: executor.optimize(study, by_number(CONFIGS), n_trials=3))
    try:
        wait_until(waiting, what="trials 1 and 2 waiting after their first chunk")
        # What they do now is recorded for ls, the dashboard and the bars (within poll_seconds).
        wait_until(
            lambda: all(study.trials[n].user_attrs.get(_attrs.ACTIVITY, "").startswith("waiting ") for n in (1, 2)),
            what="their activity",
        )
        assert main(["stop", "--storage", url, "--study-name", "waiting", "1", "--wait", "30"]) == 0
        assert capsys.readouterr().out == "trial 1: stop applied: paused while waiting after chunk 1\n"
        control.delete(study, 2, reason="not promising")
        wait_until(lambda: _status(study, 1) == "paused", timeout=30, what="the stop of the waiting trial")
        wait_until(lambda: study.trials[2].state == TrialState.FAIL, timeout=30, what="the delete")
        # Applied while they waited: neither trained a chunk meanwhile.
        assert [sorted(study.trials[n].intermediate_values) for n in (1, 2)] == [[0], [0]]
        results = _command_results(study)
        assert results[:2] == ["paused while waiting after chunk 1", "deleted while waiting after chunk 1"], results
        control.resume(study, 1)
    finally:
        released.set()
    # Beyond the budget (3 trials asked for), in the slot the deleted trial freed; the CLI says how it started.
    clone = ["clone", "--storage", url, "--study-name", "waiting", "1", "--from-chunk", "1", "--wait", "60"]
    assert main(clone) == 0
    child = len(study.trials) - 1
    assert capsys.readouterr().out == f"trial 1: trial {child} started warm from trial 1 after chunk 1\n"
    run.join()
    assert study.trials[1].state == TrialState.COMPLETE and sorted(study.trials[1].intermediate_values) == [0, 1, 2, 3]
    assert study.trials[2].user_attrs[_attrs.FAIL_REASON] == "deleted: not promising"
    clone = study.trials[child]
    assert clone.state == TrialState.COMPLETE and clone.user_attrs[_attrs.BRANCH_STEP] == 1


def test_commands_to_queued_trials_apply_before_they_are_built(make_executor, slow_chunks) -> None:
    """Two hand clones queue while trial 0's chunk trains (held by the test): a stop and a delete reach them
    within poll_seconds, before the device could build either; the stopped one resumes, is built and trains."""
    holding = threading.Event()
    holding.set()
    slow_chunks(0.0, hold=holding.is_set)
    executor = make_executor(num_chunks=4, max_concurrent_trials=3, poll_seconds=0.2)
    study = optuna.create_study(pruner=optuna.pruners.NopPruner())
    run = Background(lambda: executor.optimize(study, by_number(CONFIGS), n_trials=1))
    try:
        wait_until(lambda: _activity(study, 0) == "training", what="trial 0's first chunk")
        first, second = (control.clone(study, 0, warm_start=False) for _ in range(2))
        wait_until(lambda: all(_activity(study, n) == "queued" for n in (first, second)), what="the clones queued")
        control.stop(study, first)
        control.delete(study, second, reason="not needed")
        wait_until(lambda: _status(study, first) == "paused", timeout=30, what="the stop of the queued trial")
        wait_until(lambda: study.trials[second].state == TrialState.FAIL, timeout=30, what="the delete")
        assert holding.is_set() and _activity(study, 0) == "training"  # the device never left trial 0's chunk
        results = _command_results(study)
        assert results == [f"{op} while queued, before its first chunk" for op in ("paused", "deleted")], results
        control.resume(study, first)
        wait_until(lambda: _status(study, first) == "running", timeout=30, what="the resume")
    finally:
        holding.clear()
    run.join()
    assert study.trials[0].state == TrialState.COMPLETE
    resumed = study.trials[first]
    assert resumed.state == TrialState.COMPLETE and sorted(resumed.intermediate_values) == [0, 1, 2, 3]
    assert study.trials[second].user_attrs[_attrs.FAIL_REASON] == "deleted: not needed"
    assert not study.trials[second].intermediate_values


def _activity(study: optuna.Study, number: int) -> str | None:
    trials = study.get_trials(deepcopy=False)
    return trials[number].user_attrs.get(_attrs.ACTIVITY) if number < len(trials) else None


def _command_results(study: optuna.Study) -> list[str]:
    from optuna_rapidfire import _compat

    attrs = _compat.storage(study).get_study_system_attrs(_compat.study_id(study))
    return [attrs[key]["result"] for key in sorted(attrs) if key.startswith(_attrs.DONE_PREFIX)]
