"""Opening a study's storage for the ``optuna-rapidfire`` commands: an RDB URL checked and connected with a
timeout, errors said in one line (the password hidden), and never a database, table or study created."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from optuna_rapidfire._study._storages import RDB_BACKENDS, hide_password

if TYPE_CHECKING:
    import optuna
    from sqlalchemy.engine import URL

# A server that drops packets would otherwise keep the command waiting for the operating system's timeout.
_CONNECT_TIMEOUT_S = 10


def unreachable(url: str, error: Exception) -> str:
    """One line saying which server (or file) could not be reached and why, without the password."""
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    lines = str(getattr(error, "orig", None) or error).strip().splitlines()  # the driver's words, no SQL
    reason = lines[0] if lines else type(error).__name__
    if parsed.password:
        reason = reason.replace(str(parsed.password), "***")
    if parsed.get_backend_name() == "sqlite":
        return f"cannot open {hide_password(url)}: {reason}"
    port = parsed.port or RDB_BACKENDS.get(parsed.get_backend_name()) or "default port"
    return f"cannot connect to {parsed.host or 'localhost'}:{port} ({hide_password(url)}): {reason}"


def _sqlite_path(parsed: URL) -> str | None:
    database = parsed.database or ""
    if parsed.query.get("uri") == "true":
        database = database.removeprefix("file:")
    return None if database in ("", ":memory:") else database


def open_storage(url: str, **rdb_kwargs: Any) -> optuna.storages.RDBStorage:
    """The RDB storage at ``url``, which must already hold Optuna's tables.

    Opening an SQLite path creates the file and Optuna's ``RDBStorage`` creates its tables, so a typo in a
    read-only command would leave an empty database behind: the file and the tables are checked first.
    """
    import optuna
    import sqlalchemy
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, SQLAlchemyError

    shown = hide_password(url)
    try:
        parsed = make_url(url)
    except ArgumentError:
        parsed = None
    if parsed is None or parsed.get_backend_name() not in RDB_BACKENDS:
        raise ValueError(f"--storage must be an RDB URL (postgresql://..., sqlite:///...), but got {shown!r}.")
    backend = parsed.get_backend_name()
    connect_args: dict[str, Any] = {}
    if backend == "sqlite":
        path = _sqlite_path(parsed)
        if path is None:
            raise ValueError(f"{shown} is an in-memory database, which holds no study: give the study's file.")
        if not os.path.isfile(path):
            raise ValueError(
                f"no SQLite database at {os.path.abspath(path)} ({shown}): check the path, or create the study "
                f"first (optuna create-study --storage {shown} --study-name NAME)."
            )
    elif backend in ("postgresql", "mysql"):
        connect_args["connect_timeout"] = _CONNECT_TIMEOUT_S
    try:
        engine = sqlalchemy.create_engine(parsed, connect_args=connect_args)
    except ImportError as error:
        hint = " (pip install 'psycopg[binary]', or the project's postgresql extra)" if backend == "postgresql" else ""
        raise ValueError(f"no database driver for {shown}: {error}{hint}.") from None
    try:
        with engine.connect() as connection:
            tables = set(sqlalchemy.inspect(connection).get_table_names())
    except SQLAlchemyError as error:
        raise ValueError(unreachable(url, error)) from None
    finally:
        engine.dispose()
    if "studies" not in tables:
        raise ValueError(
            f"{shown} holds no Optuna study (it has no Optuna tables): create the study first "
            f"(optuna create-study --storage {shown} --study-name NAME)."
        )
    try:
        return optuna.storages.RDBStorage(url, skip_table_creation=True, **rdb_kwargs)
    except RuntimeError as error:  # Optuna's "the table schema is too old: run optuna storage upgrade"
        raise ValueError(str(error)) from None


def check_study(storage: optuna.storages.BaseStorage, study_name: str, url: str) -> None:
    try:
        storage.get_study_id_from_name(study_name)
    except KeyError:
        names = sorted(study.study_name for study in storage.get_all_studies())
        there = f"studies there: {', '.join(names)}" if names else "it holds no study yet"
        raise ValueError(f"no study {study_name!r} in {hide_password(url)}; {there}") from None


def load_study(url: str, study_name: str) -> optuna.Study:
    import optuna

    storage = open_storage(url)
    check_study(storage, study_name, url)
    return optuna.load_study(study_name=study_name, storage=storage)


# -- ls ----------------------------------------------------------------------------------------------
