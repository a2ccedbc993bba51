"""Real servers for tests, started on loopback in a temporary folder and stopped afterwards."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path


def free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _postgres_bin(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return candidates[-1] if candidates else None


def _as_postgres_user(command: list[str]) -> list[str]:
    # PostgreSQL refuses to run as root; Debian's package creates the "postgres" user.
    if os.geteuid() == 0:
        return ["runuser", "-u", "postgres", "--", *command]
    return command


class PostgresServer:
    """A throw-away PostgreSQL server on a loopback port, which a test may stop and start again."""

    def __init__(self) -> None:
        initdb, pg_ctl = _postgres_bin("initdb"), _postgres_bin("pg_ctl")
        if initdb is None or pg_ctl is None:
            raise RuntimeError("PostgreSQL server binaries not found: install Debian's postgresql package.")
        self._pg_ctl = pg_ctl
        # Its own folder outside pytest's (which only root may enter), owned by the server's user.
        self.workdir = Path(tempfile.mkdtemp(prefix="rapidfire-pg-"))
        self._data = self.workdir / "pgdata"
        if os.geteuid() == 0:
            shutil.chown(self.workdir, "postgres", "postgres")
        self.port = free_port()
        subprocess.run(
            _as_postgres_user([initdb, "-D", str(self._data), "-U", "rapidfire", "--auth=trust", "-E", "UTF8"]),
            check=True,
            capture_output=True,
        )
        self.url = f"postgresql://rapidfire@127.0.0.1:{self.port}/postgres"

    def start(self) -> None:
        options = f"-p {self.port} -k {self.workdir} -c listen_addresses=127.0.0.1 -c fsync=off"
        log = str(self.workdir / "log")
        subprocess.run(
            _as_postgres_user([self._pg_ctl, "-D", str(self._data), "-o", options, "-l", log, "-w", "start"]),
            check=True,
            capture_output=True,
        )

    def stop(self) -> None:
        subprocess.run(
            _as_postgres_user([self._pg_ctl, "-D", str(self._data), "-m", "immediate", "stop"]),
            check=False,
            capture_output=True,
        )


@contextlib.contextmanager
def postgres(started: bool = True) -> Iterator[PostgresServer]:
    """A :class:`PostgresServer`, started; stopped and removed afterwards."""
    server = PostgresServer()
    try:
        if started:
            server.start()
        yield server
    finally:
        server.stop()
        shutil.rmtree(server.workdir, ignore_errors=True)


@contextlib.contextmanager
def postgres_server() -> Iterator[str]:
    """Start a throw-away PostgreSQL server on a free loopback port; yield its SQLAlchemy URL."""
    with postgres() as server:
        yield server.url


class TcpProxy:
    """A loopback TCP relay to ``port``: one client's network path to a server, which a test can cut (every
    connection dropped, new ones closed at once, as a lost route does) and restore, while the server stays up
    for everyone else."""

    def __init__(self, port: int) -> None:
        self.port = free_port()
        self._target = port
        self._cut = threading.Event()
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            if self._cut.is_set():
                client.close()
                continue
            try:
                server = socket.create_connection(("127.0.0.1", self._target))
            except OSError:
                client.close()
                continue
            with self._lock:
                self._open += [client, server]
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                with contextlib.suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        self._cut.set()
        with self._lock:
            dropped, self._open = self._open, []
        for connection in dropped:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
            connection.close()

    def restore(self) -> None:
        self._cut.clear()

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.cut()
        with contextlib.suppress(OSError):  # wakes the thread blocked in accept (close alone does not)
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()


@contextlib.contextmanager
def dashboard_server(storage_url: str) -> Iterator[str]:
    """Run ``optuna-dashboard`` on a free loopback port; yield its base URL."""
    port = free_port()
    command = [sys.executable, "-c", "from optuna_dashboard._cli import main; main()"]
    process = subprocess.Popen(
        [*command, storage_url, "--host", "127.0.0.1", "--port", str(port), "--quiet"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/studies", timeout=2).read()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("optuna-dashboard did not start") from None
                time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=20)


@contextlib.contextmanager
def mlflow_server(workdir: Path) -> Iterator[str]:
    """Run a real ``mlflow server`` (SQLite backend, proxied artifacts) on a free loopback port."""
    port = free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--backend-store-uri",
            f"sqlite:///{workdir / 'mlflow.db'}",
            "--artifacts-destination",
            str(workdir / "artifacts"),
            "--workers",
            "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(workdir / "server.log", "w"),  # noqa: SIM115 - closed with the process
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2).read()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    log = (workdir / "server.log").read_text()[-2000:]
                    raise RuntimeError(f"mlflow server did not start: {log}") from None
                time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
