"""Behaviour 7: in-memory, SQLite, other RDB URLs (PostgreSQL) and JournalStorage; live curves in the dashboard."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from pathlib import Path

import optuna
import pytest
from _servers import dashboard_server, postgres_server
from helpers import by_number, lora, sft_args
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState

CONFIGS = [(lora(r=2), sft_args()), (lora(r=4), sft_args(learning_rate=3e-2)), (lora(r=8), sft_args())]


def _run(make_executor, storage) -> optuna.Study:
    executor = make_executor(num_chunks=2, max_concurrent_trials=3)
    study = optuna.create_study(storage=storage, study_name="rf", pruner=optuna.pruners.NopPruner())
    executor.optimize(study, by_number(CONFIGS), n_trials=3)
    return study


def _check(storage) -> None:
    study = optuna.load_study(study_name="rf", storage=storage)
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 3
    for trial in study.trials:
        assert list(trial.intermediate_values) == [0, 1]
        assert trial.user_attrs["rapidfire:chunks_done"] == 2
        assert trial.user_attrs["rapidfire:adapter_path"]


def test_in_memory_storage(make_executor) -> None:
    study = _run(make_executor, None)
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 3


def test_sqlite_storage(make_executor, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'rf.db'}"
    _run(make_executor, url)
    _check(url)


def test_journal_storage(make_executor, tmp_path: Path) -> None:
    storage = JournalStorage(JournalFileBackend(str(tmp_path / "journal.log")))
    _run(make_executor, storage)
    _check(JournalStorage(JournalFileBackend(str(tmp_path / "journal.log"))))


def test_postgresql_storage(make_executor) -> None:
    with postgres_server() as url:
        _run(make_executor, url)
        _check(url)


def test_dashboard_shows_per_chunk_curves_while_trials_run(make_executor, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'rf.db'}"
    executor = make_executor(num_chunks=6, max_concurrent_trials=2)
    study = optuna.create_study(storage=url, study_name="live", pruner=optuna.pruners.NopPruner())
    configure = by_number([(lora(), sft_args())] * 2)
    objective = executor.objective(configure)

    with dashboard_server(url) as dashboard:
        runner = threading.Thread(target=study.optimize, args=(objective,), kwargs={"n_trials": 2, "n_jobs": 2})
        runner.start()
        seen_running_curve = False
        deadline = time.monotonic() + 120
        while runner.is_alive() and time.monotonic() < deadline:
            summaries = json.load(urllib.request.urlopen(f"{dashboard}/api/studies", timeout=5))
            study_id = summaries["study_summaries"][0]["study_id"]
            detail = json.load(urllib.request.urlopen(f"{dashboard}/api/studies/{study_id}", timeout=5))
            for trial in detail["trials"]:
                if trial["state"] == "Running" and len(trial["intermediate_values"]) >= 2:
                    seen_running_curve = True
            if seen_running_curve:
                break
            time.sleep(0.05)
        runner.join()
    assert seen_running_curve, "the dashboard never showed a running trial's per-chunk curve"
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2


@pytest.fixture(autouse=True)
def _slow_chunks(request) -> None:
    # The dashboard test polls while trials run: make each chunk take long enough to be seen.
    if request.node.name.startswith("test_dashboard"):
        from optuna_rapidfire import events

        def slow(event: events.Event) -> None:
            if isinstance(event, events.ChunkStarting):
                time.sleep(0.3)

        request.addfinalizer(events.listen(slow, events.ChunkStarting))
