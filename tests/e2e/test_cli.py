"""The ``optuna-rapidfire`` command as a new user meets it: wrong names, missing files, servers down, help."""

from __future__ import annotations

import sqlite3
from importlib.metadata import version
from pathlib import Path

import optuna
import pytest
import sqlalchemy
from _servers import postgres_server
from optuna.trial import TrialState

from optuna_rapidfire._study import _attrs
from optuna_rapidfire.cli import main

UNREACHABLE = "postgresql://user:secret@127.0.0.1:1/db"  # nothing listens on port 1
COMMANDS = {
    "ls": [],
    "stop": ["0"],
    "resume": ["0"],
    "delete": ["0"],
    "clone": ["0", "--set", "learning_rate=1e-4"],
    "worker": ["--app", "json:loads", "--n-trials", "1"],  # importable, and never called: the storage fails first
}


def _run(capsys: pytest.CaptureFixture[str], command: str, storage: str, study_name: str = "demo") -> tuple:
    rc = main([command, "--storage", storage, "--study-name", study_name, *COMMANDS[command]])
    out, err = capsys.readouterr()
    return rc, out, err


def _study(tmp_path: Path, name: str = "demo") -> tuple[str, optuna.Study]:
    url = f"sqlite:///{tmp_path / 'rf.db'}"
    return url, optuna.create_study(storage=url, study_name=name)


def _running_trial(study: optuna.Study, chunks_done: int) -> optuna.Trial:
    """A trial as the executor leaves it between chunks: params suggested, progress recorded."""
    trial = study.ask()
    trial.suggest_float("learning_rate", 1e-5, 1e-1, log=True)
    trial.suggest_int("r", 4, 16)
    trial.suggest_categorical("trainer", ["sft", "dpo"])
    trial.set_user_attr(_attrs.TOTAL_CHUNKS, 8)
    trial.set_user_attr(_attrs.CHUNKS_DONE, chunks_done)
    for step in range(chunks_done):
        trial.report(1.0 / (step + 1), step)
    return trial


def _row(table: str, number: int) -> str:
    return next(line for line in table.splitlines() if line.split()[0] == str(number))


def test_a_wrong_study_name_names_the_studies_that_exist(tmp_path: Path, capsys) -> None:
    url, _ = _study(tmp_path)
    optuna.create_study(storage=url, study_name="other")
    rc, out, err = _run(capsys, "ls", url, study_name="x")
    assert rc == 2 and out == ""
    assert err.strip() == f"optuna-rapidfire: error: no study 'x' in {url}; studies there: demo, other"


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_no_command_creates_a_missing_sqlite_database(tmp_path: Path, capsys, command: str) -> None:
    missing = tmp_path / "typo.db"
    rc, out, err = _run(capsys, command, f"sqlite:///{missing}")
    assert rc == 2 and out == ""
    assert f"no SQLite database at {missing}" in err
    assert len(err.strip().splitlines()) == 1
    assert not missing.exists()


@pytest.mark.parametrize("command", ["ls", "stop", "worker"])
def test_no_command_creates_optuna_tables_in_a_database_without_them(tmp_path: Path, capsys, command: str) -> None:
    empty = tmp_path / "empty.db"
    sqlite3.connect(empty).close()
    rc, _, err = _run(capsys, command, f"sqlite:///{empty}")
    assert rc == 2
    assert "holds no Optuna study (it has no Optuna tables)" in err
    with sqlite3.connect(empty) as connection:
        assert connection.execute("SELECT name FROM sqlite_master").fetchall() == []


@pytest.mark.parametrize("command", ["ls", "clone", "worker"])
def test_an_unreachable_postgresql_is_one_line_naming_host_and_port_without_the_password(capsys, command) -> None:
    rc, out, err = _run(capsys, command, UNREACHABLE)
    assert rc == 2 and out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith(
        "optuna-rapidfire: error: cannot connect to 127.0.0.1:1 (postgresql://user:***@127.0.0.1:1/db)"
    )
    assert "secret" not in err


def test_a_postgresql_database_gets_no_tables_from_the_cli_and_its_study_lists_by_the_readme_s_url(capsys) -> None:
    with postgres_server() as url:
        assert url.startswith("postgresql://")  # the form the README shows, no +driver
        rc, _, err = _run(capsys, "ls", url)
        assert rc == 2 and "holds no Optuna study (it has no Optuna tables)" in err
        engine = sqlalchemy.create_engine(url)
        assert sqlalchemy.inspect(engine).get_table_names() == []
        engine.dispose()
        optuna.create_study(storage=url, study_name="demo")
        assert _run(capsys, "ls", url)[:2] == (0, "trial  state  chunks  value  parent  params\n")


def test_the_readme_s_plain_postgresql_url_has_its_driver_installed() -> None:
    # SQLAlchemy picks the driver of a plain postgresql:// URL (psycopg 3 since 2.1) when the engine is made.
    engine = sqlalchemy.create_engine("postgresql://user@127.0.0.1:1/db")
    assert engine.dialect.driver == "psycopg"
    engine.dispose()


def test_a_storage_that_is_not_a_database_url_is_refused_by_name(tmp_path: Path, capsys) -> None:
    rc, _, err = _run(capsys, "ls", str(tmp_path / "rf.db"))
    assert rc == 2
    assert "--storage must be an RDB URL (postgresql://..., sqlite:///...)" in err


def test_version_is_the_installed_package_version(capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"optuna-rapidfire {version('optuna-rapidfire')}"


@pytest.mark.parametrize("argv", [["--help"], ["ls", "--help"], ["worker", "--help"], ["clone", "--help"]])
def test_help_reads_as_plain_text(capsys, argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert "``" not in out and ":func:" not in out
    if argv == ["--help"]:
        assert "optuna-rapidfire ls     --storage sqlite:///rf.db --study-name demo\n" in out  # examples kept as lines


def test_a_warm_clone_enqueued_from_the_cli_shows_its_parent_and_params_while_waiting(tmp_path: Path, capsys) -> None:
    url, study = _study(tmp_path)
    parent = _running_trial(study, chunks_done=3)
    clone = ["clone", "--storage", url, "--study-name", "demo", "0", "--wait", "0"]
    assert main([*clone, "--set", "learning_rate=1e-4"]) == 0
    assert capsys.readouterr().out.strip() == (
        "trial 0: warm clone enqueued as trial 1, to branch after chunk 3; not started yet (it takes the next slot)"
    )
    # A chunk whose state is not kept (nothing ran here) is refused at once, with what is kept.
    assert main([*clone, "--from-chunk", "2"]) == 2
    assert "Trial 0's state after chunk 2 is no longer kept (kept: after chunks none)" in capsys.readouterr().err
    assert main([*clone, "--set", "r=16", "--cold"]) == 0
    capsys.readouterr()

    assert main(["ls", "--storage", url, "--study-name", "demo"]) == 0
    table = capsys.readouterr().out
    header = table.splitlines()[0].split()
    assert header == ["trial", "state", "chunks", "value", "parent", "params"]
    assert _row(table, 0).split()[1:4] == ["RUNNING", "3/8", "0.333333"]
    lr, r, trainer = (parent.params[k] for k in ("learning_rate", "r", "trainer"))
    warm = _row(table, 1).split(None, 5)
    assert warm == ["1", "WAITING", "-", "0@3", "warm", f"learning_rate=0.0001, r={r}, trainer={trainer}"]
    cold = _row(table, 2).split(None, 5)
    assert cold == ["2", "WAITING", "-", "0@0", "cold", f"learning_rate={lr:.4g}, r=16, trainer={trainer}"]
    assert [t.state for t in study.get_trials()] == [TrialState.RUNNING, TrialState.WAITING, TrialState.WAITING]


def test_a_clone_that_has_started_shows_where_it_branched(tmp_path: Path, capsys) -> None:
    url, study = _study(tmp_path)
    _running_trial(study, chunks_done=5)
    child = study.ask()  # what the executor records once the clone is built from its parent's step 2
    child.set_user_attr(_attrs.PARENT, 0)
    child.set_user_attr(_attrs.BRANCH_STEP, 2)
    child.set_user_attr(_attrs.CLONE, "warm")
    assert main(["ls", "--storage", url, "--study-name", "demo"]) == 0
    assert _row(capsys.readouterr().out, 1).split()[1:5] == ["RUNNING", "0/?", "0@2", "warm"]


def test_ls_says_what_each_running_trial_does(tmp_path: Path, capsys) -> None:
    url, study = _study(tmp_path)
    for chunks, status, activity in (
        (2, "running", "training"),
        (1, "running", "waiting at its rung after chunk 1"),
        (3, "paused", "waiting for the device"),  # paused wins over what it did before it paused
        (0, "running", "queued"),
    ):
        trial = _running_trial(study, chunks_done=chunks)
        trial.set_user_attr(_attrs.STATUS, status)
        trial.set_user_attr(_attrs.ACTIVITY, activity)
    assert main(["ls", "--storage", url, "--study-name", "demo"]) == 0
    table = capsys.readouterr().out
    states = [_row(table, n).split("RUNNING (", 1)[1].split(")", 1)[0] for n in range(4)]
    assert states == ["training", "waiting at its rung after chunk 1", "paused", "queued"], table
