"""Several workers on one PostgreSQL study: checkpoints, a worker killed mid-chunk, corrupted checkpoints.

Workers are real ``optuna-rapidfire worker`` processes (as on separate machines, sharing the storage and
an artifact folder); the PostgreSQL server is started on loopback by the test.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import optuna
import psutil
import pytest
from _servers import TcpProxy, postgres, postgres_server
from helpers import Background, wait_until
from optuna.artifacts import FileSystemArtifactStore
from optuna.trial import TrialState

from optuna_rapidfire import StorageUnavailableError
from optuna_rapidfire._study import _attrs

TESTS = Path(__file__).resolve().parents[1]  # where _worker_app.py is
PASSWORD = "s3cret-pw-7731"  # in the storage URL: must never show in logs or attributes


def _env(tiny_model: str, tmp_path: Path) -> dict[str, str]:
    artifacts = tmp_path / "artifacts"
    artifacts.mkdir(exist_ok=True)
    return {
        **os.environ,
        "RF_TEST_MODEL": tiny_model,
        "RF_TEST_ARTIFACTS": str(artifacts),
        "RF_TEST_OUTPUT": str(tmp_path / "out"),
        "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
    }


def _worker(url: str, env: dict[str, str], log: Path, *extra: str, grace: int = 10) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "optuna_rapidfire", "worker", "--storage", url, "--study-name", "multi"]
    # A grace period well above the interval: a busy 2-core machine can delay a live worker's heartbeat.
    command += ["--app", "_worker_app:app", "--devices", "cpu", "--heartbeat-interval", "1"]
    command += ["--grace-period", str(grace)]
    with open(log, "wb") as out:
        return subprocess.Popen([*command, *extra], env=env, cwd=TESTS, stdout=out, stderr=subprocess.STDOUT)


def _exit_code(worker: subprocess.Popen[bytes], log: Path, study: optuna.Study, timeout: float) -> int:
    """The worker's exit code; if it does not exit in time, fail with its log and the trials' states."""
    try:
        return worker.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        worker.send_signal(signal.SIGKILL)
        worker.wait()
        states = [(t.number, t.state.name, sorted(t.intermediate_values), t.user_attrs) for t in study.get_trials()]
        raise AssertionError(f"the worker did not exit in {timeout} s\n{states}\n{log.read_text()[-8000:]}") from None


def _reference_values(tiny_model: str, tmp_path: Path, learning_rate: float) -> dict[int, float]:
    """What the config reports when it trains alone, start to end, in this process."""
    os.environ.update({k: v for k, v in _env(tiny_model, tmp_path).items() if k.startswith("RF_TEST_")})
    import _worker_app

    study = optuna.create_study(pruner=optuna.pruners.NopPruner())
    study.enqueue_trial({"learning_rate": learning_rate})
    with _worker_app.executor("cpu", artifact_store=None, output_dir=tmp_path / "ref") as executor:
        executor.optimize(study, _worker_app.configure, n_trials=1)
    return dict(study.trials[0].intermediate_values)


@pytest.mark.timeout(600)
def test_a_killed_worker_s_trials_resume_on_another_worker_from_their_checkpoints(
    tiny_model: str, tmp_path: Path
) -> None:
    with postgres_server() as plain_url:
        url = plain_url.replace("rapidfire@", f"rapidfire:{PASSWORD}@")  # the server trusts loopback
        study = optuna.create_study(storage=url, study_name="multi", pruner=optuna.pruners.NopPruner())
        for lr in (1e-3, 3e-3, 1e-2, 3e-2):
            study.enqueue_trial({"learning_rate": lr})
        env = _env(tiny_model, tmp_path)
        doomed = _worker(url, env, tmp_path / "a.log", "--study-trials", "4")
        # Kill worker A in the middle of a chunk: once one of its trials has a checkpoint and a report.
        deadline = time.monotonic() + 240
        victims: list[optuna.trial.FrozenTrial] = []
        while not victims:
            assert time.monotonic() < deadline, (tmp_path / "a.log").read_text()
            assert doomed.poll() is None, (tmp_path / "a.log").read_text()
            running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
            if len(running) == 2 and all(_attrs.CHECKPOINT in t.system_attrs for t in running):
                victims = running
            time.sleep(0.05)
        doomed.send_signal(signal.SIGKILL)
        doomed.wait()
        killed = {t.number: len(t.intermediate_values) for t in study.get_trials(deepcopy=False)}
        assert all(killed[v.number] < 4 for v in victims), killed  # they died before their last chunk
        # Every trial running at the kill dies with the worker: the promote schedule may have started a third
        # config in a lent slot beside two waiting ones.
        dead = sorted(t.number for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)))
        assert {v.number for v in victims} <= set(dead)

        # One dead trial's checkpoint gets corrupted on the shared store: its retry must start over.
        store = tmp_path / "artifacts"
        corrupted = study.trials[victims[1].number].system_attrs[_attrs.CHECKPOINT]
        blob = store / corrupted["artifact_id"]
        data = bytearray(blob.read_bytes())
        middle = len(data) // 2
        data[middle : middle + 64] = bytes(b ^ 0xFF for b in data[middle : middle + 64])
        blob.write_bytes(bytes(data))

        survivor = _worker(url, env, tmp_path / "b.log", "--study-trials", "4")
        # A worker talks to the storage and the artifact store only: it listens on no port.
        wait_until(
            lambda: any(str(survivor.pid) in t.user_attrs.get(_attrs.WORKER, "") for t in study.get_trials()),
            timeout=240,
            what="the second worker's first trial",
        )
        sockets = psutil.Process(survivor.pid).net_connections(kind="inet")
        assert [c for c in sockets if c.status == psutil.CONN_LISTEN] == []
        assert _exit_code(survivor, tmp_path / "b.log", study, timeout=400) == 0, (tmp_path / "b.log").read_text()
        log = (tmp_path / "b.log").read_text() + (tmp_path / "a.log").read_text()

        trials = study.get_trials()
        by_number = {t.number: t for t in trials}
        # The dead worker's trials were failed by heartbeat and retried, each once.
        assert all(by_number[number].state == TrialState.FAIL for number in dead)
        for number in dead:  # each says why it failed, and is no longer "running"
            attrs = by_number[number].user_attrs
            assert attrs[_attrs.STATUS] == "failed" and attrs[_attrs.FAIL_REASON].startswith("HeartbeatStale: ")
        retries = {t.system_attrs["failed_trial"]: t for t in trials if "failed_trial" in t.system_attrs}
        assert sorted(retries) == dead
        # On failure: each trial's state, why it failed or how it resumed, and the workers' logs.
        told = (_attrs.FAIL_REASON, _attrs.RETRY_OF, _attrs.RESUMED_FROM_STEP, _attrs.RESUME_FAILED)
        summary = [(t.number, t.state.name, {k: t.user_attrs[k] for k in told if k in t.user_attrs}) for t in trials]
        assert all(r.state == TrialState.COMPLETE for r in retries.values()), f"{summary}\n{log[-6000:]}"
        assert all(r.user_attrs.get(_attrs.FAIL_REASON) is None for r in retries.values())  # not the dead one's

        # Every config completed exactly once: nothing lost, nothing trained twice.
        complete = [t for t in trials if t.state == TrialState.COMPLETE]
        assert sorted(t.params["learning_rate"] for t in complete) == [1e-3, 3e-3, 1e-2, 3e-2]

        good = retries[victims[0].number]
        resumed_from = good.user_attrs[_attrs.RESUMED_FROM_STEP]
        assert resumed_from >= 1 and good.user_attrs[_attrs.RETRY_OF] == victims[0].number
        # The retry kept its predecessor's curve and continued it exactly as an uninterrupted run.
        lr = good.params["learning_rate"]
        assert good.intermediate_values == _reference_values(tiny_model, tmp_path, lr)

        bad = retries[victims[1].number]
        assert "corrupted" in bad.user_attrs.get(_attrs.RESUME_FAILED, ""), (bad.user_attrs, log[-3000:])
        assert _attrs.RESUMED_FROM_STEP not in bad.user_attrs
        assert sorted(bad.intermediate_values) == [0, 1, 2, 3]
        assert bad.intermediate_values == _reference_values(tiny_model, tmp_path, bad.params["learning_rate"])

        # Only the latest checkpoint of each trial is kept in the shared store.
        links = {t.system_attrs[_attrs.CHECKPOINT]["artifact_id"] for t in complete}
        kept = {p.name for p in store.iterdir()} - {blob.name}
        assert links <= kept
        assert len(kept - links) <= len(dead)  # at most a dead trial's orphan, never a pile-up

        # Credentials stay out of logs and attributes.
        assert PASSWORD not in log
        for trial in trials:
            assert PASSWORD not in repr(trial.user_attrs) + repr(trial.system_attrs)


def test_checkpoints_load_only_into_their_own_study_and_trial(tiny_model: str, tmp_path: Path) -> None:
    os.environ.update({k: v for k, v in _env(tiny_model, tmp_path).items() if k.startswith("RF_TEST_")})
    import _worker_app

    from optuna_rapidfire._study._checkpoints import CheckpointError, Checkpoints

    storage = f"sqlite:///{tmp_path / 'c.db'}"
    study = optuna.create_study(storage=storage, study_name="multi", pruner=optuna.pruners.NopPruner())
    study.enqueue_trial({"learning_rate": 1e-2})
    with _worker_app.executor("cpu") as executor:
        executor.optimize(study, _worker_app.configure, n_trials=1)
    trial = study.trials[0]
    link = trial.system_attrs[_attrs.CHECKPOINT]
    assert link["step"] == 4 and link["bytes"] > 0
    checkpoints = Checkpoints(FileSystemArtifactStore(str(tmp_path / "artifacts")))
    assert checkpoints.load(study, link, {0}).position.chunks_done == 4
    with pytest.raises(CheckpointError, match="belongs to trial 0"):
        checkpoints.load(study, link, {3})
    other = optuna.create_study(storage=storage, study_name="other")
    with pytest.raises(CheckpointError, match="belongs to study 'multi'"):
        checkpoints.load(other, link, {0})
    with pytest.raises(CheckpointError, match="cannot be read"):
        checkpoints.load(study, {**link, "artifact_id": "missing"}, {0})
    # A blob that is not a snapshot (or is truncated) is refused before anything is unpickled.
    fake = tmp_path / "artifacts" / "fake"
    fake.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    import hashlib

    forged = {**link, "artifact_id": "fake", "sha256": hashlib.sha256(fake.read_bytes()).hexdigest()}
    with pytest.raises(CheckpointError, match="not a readable trial snapshot"):
        checkpoints.load(study, forged, {0})


def test_worker_command_refuses_bad_input(tmp_path: Path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "optuna_rapidfire", "worker", "--study-name", "s", *args]
        return subprocess.run(command, capture_output=True, text=True, cwd=TESTS, timeout=120)

    bad_app = run("--storage", f"sqlite:///{tmp_path / 'x.db'}", "--app", "no_such_module:app")
    assert bad_app.returncode == 2 and "cannot import 'no_such_module'" in bad_app.stderr
    bad_storage = run("--storage", f"redis://user:{PASSWORD}@host/0", "--app", "_worker_app:app")
    assert bad_storage.returncode == 2 and "must be an RDB URL" in bad_storage.stderr
    assert PASSWORD not in bad_storage.stderr
    bad_count = run("--storage", "sqlite:///x.db", "--app", "_worker_app:app", "--study-trials", "0")
    assert bad_count.returncode == 2 and "--study-trials must be positive" in bad_count.stderr


def _reports(storage: optuna.storages.RDBStorage) -> dict[int, dict[int, float]]:
    study = optuna.load_study(study_name="outage", storage=storage)
    return {t.number: dict(t.intermediate_values) for t in study.get_trials(deepcopy=False)}


@pytest.mark.timeout(600)
def test_a_worker_cut_off_longer_than_the_grace_period_stops_its_trials_cleanly_and_says_why(
    tiny_model: str, tmp_path: Path
) -> None:
    """Worker A loses its route to the storage for longer than the heartbeat grace period while worker B runs:
    B fails A's trials and resumes them from their checkpoints; A, once back, stops them at once, one line says
    what happened, nothing is half-written, and every config completes once, exactly as an uninterrupted run."""
    with postgres() as server, TcpProxy(server.port) as proxy:
        url = server.url.replace("rapidfire@", f"rapidfire:{PASSWORD}@")
        cut_off_url = url.replace(f":{server.port}/", f":{proxy.port}/")
        study = optuna.create_study(storage=url, study_name="multi", pruner=optuna.pruners.NopPruner())
        for lr in (1e-3, 1e-2):
            study.enqueue_trial({"learning_rate": lr})
        env = _env(tiny_model, tmp_path)
        # A retries for as long as a slow machine may take to start B and let B fail A's trials.
        a = _worker(
            cut_off_url, {**env, "RF_TEST_STORAGE_RETRY": "300"}, tmp_path / "a.log", "--study-trials", "2", grace=5
        )

        def running() -> list[optuna.trial.FrozenTrial]:
            return study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))

        wait_until(
            lambda: len(lost := running()) == 2 and all(_attrs.CHECKPOINT in t.system_attrs for t in lost),
            timeout=240,
            what="worker A's two trials, each with a checkpoint",
        )
        proxy.cut()  # A's trials now wait on the storage (their chunk in flight trains on)
        lost = sorted(t.number for t in running())
        assert len(lost) == 2, (tmp_path / "a.log").read_text()
        # B joins while A is away: to B, A's trials are a dead worker's once their heartbeats are 5 s old.
        b = _worker(url, env, tmp_path / "b.log", "--study-trials", "2", grace=5)
        try:
            wait_until(
                lambda: all(study.trials[n].state == TrialState.FAIL for n in lost),
                timeout=240,
                what="B's heartbeat check",
            )
        finally:
            proxy.restore()
        assert _exit_code(a, tmp_path / "a.log", study, timeout=400) == 0, (tmp_path / "a.log").read_text()
        assert _exit_code(b, tmp_path / "b.log", study, timeout=400) == 0, (tmp_path / "b.log").read_text()
        a_log = (tmp_path / "a.log").read_text()

        trials = study.get_trials()
        for number in lost:
            attrs = trials[number].user_attrs
            assert attrs[_attrs.STATUS] == "failed" and attrs[_attrs.FAIL_REASON].startswith("HeartbeatStale: ")
        retries = {t.system_attrs["failed_trial"]: t for t in trials if "failed_trial" in t.system_attrs}
        assert sorted(retries) == lost
        complete = [t for t in trials if t.state == TrialState.COMPLETE]
        # Both enqueued configs completed in their retries. B may also have sampled a config of its own, when it
        # asked before A's heartbeats were stale (seen once in a full local run: three trials completed).
        assert all(t.state == TrialState.COMPLETE for t in retries.values())
        assert sorted(t.params["learning_rate"] for t in retries.values()) == [1e-3, 1e-2]
        assert all(t.user_attrs[_attrs.RESUMED_FROM_STEP] >= 1 for t in retries.values())
        # Continued from its checkpoint, a retry's curve is an uninterrupted run's.
        one = retries[lost[0]]
        assert one.intermediate_values == _reference_values(tiny_model, tmp_path, one.params["learning_rate"])
        # A says once what happened, then for each trial that its retry continues it; no traceback, no blame.
        assert a_log.count("reachable again after") == 1 and "with a heartbeat grace period of 5 s" in a_log
        for number in lost:
            assert f"Trial {number} was failed by another worker's heartbeat check" in a_log, a_log[-4000:]
        assert "Traceback" not in a_log and "optuna-dashboard" not in a_log, a_log[-4000:]
        # Nothing half-written: the artifact store holds exactly the complete trials' checkpoints.
        links = {t.system_attrs[_attrs.CHECKPOINT]["artifact_id"] for t in complete}
        assert {p.name for p in (tmp_path / "artifacts").iterdir()} == links


def test_the_study_rides_out_a_storage_outage_and_stops_clearly_after_a_long_one(
    tiny_model: str, tmp_path: Path, slow_chunks: Callable[..., None]
) -> None:
    os.environ.update({k: v for k, v in _env(tiny_model, tmp_path).items() if k.startswith("RF_TEST_")})
    import _worker_app

    with postgres() as server:
        url = server.url.replace("rapidfire@", f"rapidfire:{PASSWORD}@")
        study = optuna.create_study(storage=url, study_name="outage", pruner=optuna.pruners.NopPruner())
        for lr in (1e-3, 1e-2):
            study.enqueue_trial({"learning_rate": lr})
        # Once trial `waiting[0]` has reported, no chunk starts until the server is down: the outage always
        # comes while trials train, however fast they are.
        down, waiting = threading.Event(), [0]

        def before_the_outage() -> bool:
            if down.is_set():
                return False
            try:
                trials = study.get_trials(deepcopy=False)
            except Exception:  # the server is going down
                return False
            return len(trials) > waiting[0] and bool(trials[waiting[0]].intermediate_values)

        slow_chunks(0.0, hold=before_the_outage)

        # A 4 s outage while trials train: calls retry, nothing is lost, values are exact.
        with _worker_app.executor("cpu", storage_retry_seconds=60) as executor:
            run = Background(lambda: executor.optimize(study, _worker_app.configure, n_trials=2))
            wait_until(lambda: study.trials[0].intermediate_values, what="a first report")
            server.stop()
            down.set()
            time.sleep(4)
            server.start()
            run.join()
        trials = study.get_trials()
        assert [t.state for t in trials] == [TrialState.COMPLETE] * 2
        for trial in trials:
            assert trial.intermediate_values == _reference_values(tiny_model, tmp_path, trial.params["learning_rate"])

        # An outage longer than storage_retry_seconds: a clear error, and what was reported stays.
        study.enqueue_trial({"learning_rate": 3e-2})
        down.clear()
        waiting[0] = 2
        with _worker_app.executor("cpu", storage_retry_seconds=2) as executor:
            run = Background(lambda: executor.optimize(study, _worker_app.configure, n_trials=1))
            wait_until(lambda: len(study.trials) == 3 and study.trials[2].intermediate_values, what="a report")
            before = dict(study.trials[2].intermediate_values)
            server.stop()
            down.set()
            with pytest.raises(StorageUnavailableError, match="stayed unreachable") as raised:
                run.join()
            assert PASSWORD not in str(raised.value)
        server.start()
        after = _reports(optuna.storages.RDBStorage(url))
        assert after[0] == dict(trials[0].intermediate_values) and after[1] == dict(trials[1].intermediate_values)
        assert before.items() <= after[2].items()


def test_a_warm_clone_of_a_trial_that_ran_elsewhere_starts_from_its_checkpoint(tiny_model: str, tmp_path: Path) -> None:
    os.environ.update({k: v for k, v in _env(tiny_model, tmp_path).items() if k.startswith("RF_TEST_")})
    import _worker_app

    from optuna_rapidfire import control

    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 'w.db'}", study_name="multi")
    study.enqueue_trial({"learning_rate": 1e-2})
    # "Machine A": its own output folder (where local snapshots live); only the artifact store is shared.
    with _worker_app.executor("cpu", output_dir=tmp_path / "machine-a") as executor:
        executor.optimize(study, _worker_app.configure, n_trials=1)
    child = control.clone(study, 0, from_chunk=4)  # its last chunk, named: the clone's run is longer

    def longer(trial: optuna.Trial):  # the clone runs a second epoch: it continues after the parent's last chunk
        peft_config, args = _worker_app.configure(trial)
        args.num_train_epochs = 2
        return peft_config, args

    with _worker_app.executor("cpu", output_dir=tmp_path / "machine-b") as executor:
        executor.optimize(study, longer, n_trials=1)
    clone = study.trials[child]
    assert clone.user_attrs[_attrs.CLONE] == "warm" and clone.user_attrs[_attrs.BRANCH_STEP] == 4
    parent = study.trials[0].intermediate_values
    assert {step: clone.intermediate_values[step] for step in parent} == parent
    assert sorted(clone.intermediate_values) == list(range(8))
    assert not (tmp_path / "machine-b" / "multi" / "state" / "trial-0").exists()


def test_checkpoints_are_on_by_default_only_when_the_storage_records_heartbeats(
    tiny_model: str, tmp_path: Path
) -> None:
    os.environ.update({k: v for k, v in _env(tiny_model, tmp_path).items() if k.startswith("RF_TEST_")})
    import _worker_app

    plain = optuna.create_study(storage=f"sqlite:///{tmp_path / 'plain.db'}", study_name="multi")
    url = f"sqlite:///{tmp_path / 'beat.db'}"
    beating = optuna.create_study(storage=optuna.storages.RDBStorage(url, heartbeat_interval=60), study_name="multi")
    for study in (plain, beating):
        study.enqueue_trial({"learning_rate": 1e-2})
        with _worker_app.executor("cpu", artifact_store="auto", num_chunks=2) as executor:
            executor.optimize(study, _worker_app.configure, n_trials=1)
    assert _attrs.CHECKPOINT not in plain.trials[0].system_attrs
    link = beating.trials[0].system_attrs[_attrs.CHECKPOINT]
    assert (tmp_path / "beat.db.artifacts" / link["artifact_id"]).is_file()
    assert not (tmp_path / "plain.db.artifacts").exists()


@pytest.mark.timeout(400)
@pytest.mark.parametrize(("storage", "signal_name"), [("sqlite", "SIGINT"), ("postgresql", "SIGTERM")])
def test_ctrl_c_ends_the_live_trials_cleanly_and_the_worker_exits_130_with_one_line(
    tiny_model: str, tmp_path: Path, storage: str, signal_name: str, sigint_handled
) -> None:
    """Ctrl-C, and SIGTERM (a scheduler's cancel) alike, said as what it was."""
    with contextlib.ExitStack() as servers:
        sqlite = f"sqlite:///{tmp_path / 'ctrl-c.db'}"
        url = sqlite if storage == "sqlite" else servers.enter_context(postgres_server())
        _ctrl_c_ends_the_live_trials_cleanly(url, tiny_model, tmp_path, getattr(signal, signal_name))


def _ctrl_c_ends_the_live_trials_cleanly(url: str, tiny_model: str, tmp_path: Path, sent: signal.Signals) -> None:
    cause = "SIGTERM" if sent == signal.SIGTERM else "Ctrl-C"
    study = optuna.create_study(storage=url, study_name="multi", pruner=optuna.pruners.NopPruner())
    for lr in (1e-3, 3e-3, 1e-2, 3e-2):
        study.enqueue_trial({"learning_rate": lr})
    hold = tmp_path / "hold"  # after its first chunk, the worker's chunks wait for the signal while this exists
    hold.touch()
    env = {**_env(tiny_model, tmp_path), "RF_TEST_HOLD": str(hold)}
    worker = _worker(url, env, tmp_path / "w.log", "--study-trials", "4")
    wait_until(
        lambda: any(t.intermediate_values for t in study.get_trials(deepcopy=False)), timeout=240, what="a report"
    )
    worker.send_signal(sent)
    hold.unlink()
    assert worker.wait(timeout=240) == 130, (tmp_path / "w.log").read_text()
    log = (tmp_path / "w.log").read_text()
    assert "Traceback" not in log and "terminate called" not in log, log[-4000:]
    assert (
        log.rstrip().splitlines()[-1]
        == f"optuna-rapidfire: worker {worker.pid} interrupted ({cause}); its live trials ended (PRUNED)."
    )
    trials = study.get_trials()
    assert TrialState.RUNNING not in [t.state for t in trials]  # no zombie, also without heartbeats' help
    interrupted = [t for t in trials if t.user_attrs.get(_attrs.STATUS) == "interrupted"]
    assert interrupted and all(t.state == TrialState.PRUNED for t in interrupted)
    for trial in interrupted:  # what it reported stays, and the reason says where it stopped
        reason = trial.user_attrs[_attrs.PRUNED_REASON]
        if _attrs.TOTAL_CHUNKS not in trial.user_attrs:  # a config the schedule had just started, not built yet
            assert reason == f"Interrupted ({cause}) before it started training." and not trial.intermediate_values
            continue
        assert reason.startswith(f"Interrupted ({cause}) after chunk {len(trial.intermediate_values)}/4"), reason
