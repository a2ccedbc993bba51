"""Worker processes started together: the plain-TRL baselines (several processes sharing one GPU).

The parent writes one spec per worker, starts ``python -m MODULE --worker SPEC`` for each, waits until every
worker is warm and ready, then gives all of them one go time; each worker writes its result last.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def worker_main(main: Callable[[str], None], usage: str) -> None:
    """A worker module's ``__main__``: ``python -m MODULE --worker SPEC`` runs ``main(SPEC)`` with Optuna's and
    datasets' chatter off; anything else exits with ``usage``."""
    if len(sys.argv) != 3 or sys.argv[1] != "--worker":
        raise SystemExit(usage)
    import datasets
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    datasets.disable_progress_bars()
    main(sys.argv[2])


def write_result(sync: Path, index: int, result: dict[str, Any]) -> None:
    """A worker's last act: its result, where :func:`spawn_workers` collects it."""
    (sync / f"result-{index}.json").write_text(json.dumps(result))


def wait_for_go(sync: Path, index: int) -> float:
    """A worker's side of :func:`spawn_workers`: say it is ready, wait until every worker is; the go time."""
    (sync / f"ready-{index}").touch()
    while not (sync / "go").exists():
        time.sleep(0.01)
    return float((sync / "go").read_text())


def spawn_workers(specs: list[dict[str, Any]], module: str, timeout: float | None = None) -> list[dict[str, Any]]:
    """Start one worker process per spec, let them go together once all are warm, collect their results.

    ``module``: the workers' code, run as ``python -m
    module --worker SPEC``; a worker reads its spec (with ``index`` and the folder ``dir``), calls
    :func:`wait_for_go` once it is ready and writes ``result-<index>.json`` in ``dir`` last. ``timeout``: seconds
    from their start within which every worker must have written its result; else all are killed (RuntimeError).
    """
    sync = Path(tempfile.mkdtemp(prefix="search-workers-"))
    procs = []
    for index, spec in enumerate(specs):
        spec = {**spec, "index": index, "dir": str(sync), "spawned": time.time()}
        path = sync / f"spec-{index}.json"
        path.write_text(json.dumps(spec))
        command = [sys.executable, "-m", module, "--worker", str(path)]
        with (sync / f"log-{index}.txt").open("w") as log:
            procs.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=os.getcwd()))

    deadline = None if timeout is None else time.time() + timeout

    def fail(index: int, why: str) -> None:
        tail = (sync / f"log-{index}.txt").read_text()[-3000:]
        for other in procs:
            if other.poll() is None:
                other.kill()
        raise RuntimeError(f"worker {index} {why}:\n{tail}")

    def wait_for(name: str, what: str) -> None:
        while sum((sync / name.format(i)).exists() for i in range(len(specs))) < len(specs):
            for index, proc in enumerate(procs):
                if proc.poll() is not None and not (sync / f"result-{index}.json").exists():
                    fail(index, f"exited with {proc.returncode} before {what}")
            if deadline is not None and time.time() > deadline:
                late = next(i for i in range(len(specs)) if not (sync / name.format(i)).exists())
                fail(late, f"had not finished {timeout:.0f} s after its start (before {what})")
            time.sleep(0.05)

    wait_for("ready-{}", "it was ready")
    (sync / "go.tmp").write_text(repr(time.time()))
    (sync / "go.tmp").replace(sync / "go")  # whole, never half-written, when a worker sees it
    wait_for("result-{}.json", "it wrote its result")
    for proc in procs:
        proc.wait()
    return [json.loads((sync / f"result-{i}.json").read_text()) for i in range(len(specs))]
