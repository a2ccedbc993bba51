"""The study's storage as the executor sees it (``_study/_storages.py``): retries through an outage, one pair
of lines per outage, stale trials marked before they are failed, and trials alive here never failed here."""

from __future__ import annotations

import logging
import threading
import time
import warnings
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState
from sqlalchemy.exc import OperationalError

from optuna_rapidfire import _compat
from optuna_rapidfire._study import _attrs
from optuna_rapidfire._study._pool import fail_stale_trials
from optuna_rapidfire._study._storages import on_long_outage, retrying

_STALE = 2.5  # seconds after which a heartbeat is stale under a 1 s grace period: SQLite keeps whole seconds


class _Outage(optuna.storages.RDBStorage):
    """An SQLite RDB storage whose every call fails as a lost connection does while ``down`` is set."""

    down = False

    def __getattribute__(self, name: str):  # type: ignore[no-untyped-def]
        attribute = super().__getattribute__(name)
        settings = name == "get_heartbeat_interval"  # read from the object, not the database: it gets through
        if callable(attribute) and not name.startswith("_") and not settings and super().__getattribute__("down"):

            def unreachable(*args, **kwargs):  # type: ignore[no-untyped-def]
                raise OperationalError("SELECT 1", {}, ConnectionRefusedError("connection refused"))

            return unreachable
        return attribute


def _fail_stale_as_optuna_does(study: optuna.Study) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)  # what Optuna's study.optimize does before asking


def test_a_stale_trial_is_marked_failed_whoever_fails_it(tmp_path: Path) -> None:
    # Optuna's own check when a trial starts (not only the pool's) finds trials through the pool's storage:
    # a trial that went stale between the pool's look and Optuna's must still say why it failed.
    rdb = optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'hb.db'}", heartbeat_interval=1, grace_period=1)
    study = optuna.create_study(storage=rdb)
    dead = [study.ask() for _ in range(2)]
    for trial in dead:
        rdb.record_heartbeat(_compat.trial_id(trial))
    time.sleep(_STALE)  # both heartbeats are now older than the grace period
    _fail_stale_as_optuna_does(_compat.with_storage(study, retrying(rdb, 0.0)))
    for trial in study.get_trials():
        assert trial.state == TrialState.FAIL
        assert trial.user_attrs[_attrs.STATUS] == "failed"
        assert trial.user_attrs[_attrs.FAIL_REASON].startswith("HeartbeatStale: ")


def test_a_long_outage_is_said_once_and_this_worker_judges_nobody_stale_just_after_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rdb = _Outage(f"sqlite:///{tmp_path / 'hb.db'}", heartbeat_interval=1, grace_period=1)
    study = optuna.create_study(storage=rdb)
    alive = study.ask()
    rdb.record_heartbeat(_compat.trial_id(alive))
    here = retrying(rdb, 60.0)
    outages: list[float] = []
    on_long_outage(here, outages.append)

    rdb.down = True
    # This worker's heartbeat thread and a trial's report, both retrying while the storage is away.
    callers = [
        threading.Thread(target=here.record_heartbeat, args=(_compat.trial_id(alive),)),
        threading.Thread(target=here.get_trial, args=(_compat.trial_id(alive),)),
    ]
    with caplog.at_level(logging.WARNING, logger="optuna_rapidfire"):
        for caller in callers:
            caller.start()
        time.sleep(1.0)
        here.get_heartbeat_interval()  # a call that needs no database gets through: the outage goes on
        time.sleep(_STALE - 1.0)
        rdb.down = False
        # Stale in the storage (another worker would fail it), but this worker is just back: its own checks
        # (the pool's, and Optuna's through the pool's storage) judge nobody stale yet.
        assert _compat.stale_trial_ids(rdb, _compat.study_id(study)) == [_compat.trial_id(alive)]
        fail_stale_trials(_compat.with_storage(study, here))
        _fail_stale_as_optuna_does(_compat.with_storage(study, here))
        assert study.trials[0].state == TrialState.RUNNING
        for caller in callers:
            caller.join()
    assert len(outages) == 1 and outages[0] > _STALE
    lines = [r.getMessage() for r in caplog.records]
    assert sum("is unreachable" in line for line in lines) == 1, lines
    assert sum("reachable again" in line for line in lines) == 1, lines
    assert any("with a heartbeat grace period of 1 s" in line for line in lines), lines


class _SlowHeartbeats(optuna.storages.RDBStorage):
    """An SQLite RDB storage whose heartbeats hang (a slow database) until ``released`` is set."""

    def __init__(self, url: str, **settings: int) -> None:
        super().__init__(url, **settings)
        self.released = threading.Event()

    def record_heartbeat(self, trial_id: int) -> None:
        self.released.wait()
        super().record_heartbeat(trial_id)


def test_this_worker_never_fails_a_trial_whose_heartbeat_it_is_still_sending(tmp_path: Path) -> None:
    rdb = _SlowHeartbeats(f"sqlite:///{tmp_path / 'hb.db'}", heartbeat_interval=1, grace_period=1)
    study = optuna.create_study(storage=rdb)
    alive = study.ask()
    optuna.storages.RDBStorage.record_heartbeat(rdb, _compat.trial_id(alive))
    here = retrying(rdb, 60.0)
    beating = threading.Thread(target=here.record_heartbeat, args=(_compat.trial_id(alive),))
    beating.start()
    try:
        time.sleep(_STALE)  # no outage: only this heartbeat is slow, and the stored one goes stale
        assert _compat.stale_trial_ids(rdb, _compat.study_id(study)) == [_compat.trial_id(alive)]
        fail_stale_trials(_compat.with_storage(study, here))
        _fail_stale_as_optuna_does(_compat.with_storage(study, here))
        assert study.trials[0].state == TrialState.RUNNING
        fail_stale_trials(study)  # another worker knows nothing of it: it fails it
        assert study.trials[0].state == TrialState.FAIL
    finally:
        rdb.released.set()
        beating.join()


@pytest.mark.parametrize("enqueued", [False, True], ids=["new", "enqueued"])
def test_a_trial_is_never_running_without_a_heartbeat_when_its_worker_dies_right_after_asking(
    tmp_path: Path, enqueued: bool
) -> None:
    # A worker killed after Optuna's ask made the trial RUNNING, before the heartbeat thread started: another
    # worker must still find the trial stale (Optuna's check skips a trial that never had a heartbeat).
    url = f"sqlite:///{tmp_path / 'hb.db'}"
    rdb = optuna.storages.RDBStorage(url, heartbeat_interval=1, grace_period=1)
    study = optuna.create_study(storage=rdb, study_name="s")
    if enqueued:
        study.enqueue_trial({"x": 1.0})
    dying = optuna.load_study(study_name="s", storage=retrying(rdb, 0.0))
    asked = dying.ask()  # and the worker dies here: no heartbeat thread ever runs
    assert dying.trials[0].state == TrialState.RUNNING
    time.sleep(_STALE)
    other = optuna.storages.RDBStorage(url, heartbeat_interval=1, grace_period=1)
    _fail_stale_as_optuna_does(optuna.load_study(study_name="s", storage=other))
    trial = other.get_trial(_compat.trial_id(asked))
    assert trial.state == TrialState.FAIL
    assert trial.system_attrs.get("fixed_params") == ({"x": 1.0} if enqueued else None)
