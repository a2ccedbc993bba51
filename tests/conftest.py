"""Shared fixtures: a tiny local model, small data slices, and executors that are always closed.

Plain helpers (configs, a configure by trial number, waiting) are in helpers.py."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
# No network here: MLflow's telemetry client, started by the first MLflow call of each trial thread, unsets its
# session variable from several threads at once (os.environ KeyError), which failed a trial's trainer build and
# left accelerate's shared state half-made for another (tests/e2e/test_mlflow.py, now and then).
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

from datasets import Dataset

from optuna_rapidfire import RapidFireExecutor
from optuna_rapidfire.demo import build_tiny_model, load_gsm8k

optuna.logging.set_verbosity(optuna.logging.WARNING)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Path of a 2-layer Llama-shape model with random weights and a BPE tokenizer."""
    return str(build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", vocab_size=1024, hidden_size=32))


@pytest.fixture(scope="session")
def train_ds() -> Dataset:
    return load_gsm8k("train", num_rows=48)


@pytest.fixture(scope="session")
def eval_ds() -> Dataset:
    return load_gsm8k("test", num_rows=8)


@pytest.fixture
def make_executor(
    tiny_model: str, train_ds: Dataset, eval_ds: Dataset, tmp_path: Path
) -> Iterator[Callable[..., RapidFireExecutor]]:
    """Build executors over the tiny model (closed at the end of the test). Their studies train every trial to
    the end (``schedule="promote_all"``) unless a test chooses a schedule: most tests compare complete trials,
    and the default's ASHA stops are tested where they matter (test_schedules.py)."""
    made: list[RapidFireExecutor] = []

    def make(**kwargs: Any) -> RapidFireExecutor:
        settings: dict[str, Any] = {
            "model": tiny_model,
            "train_dataset": train_ds,
            "eval_dataset": eval_ds,
            "num_chunks": 4,
            "max_concurrent_trials": 4,
            "output_dir": tmp_path / "out",
            "show_progress_bar": False,
            "schedule": "promote_all",
            # The suite runs on the CPU (CI has no GPU); RAPIDFIRE_TEST_DEVICE=cuda runs it on a GPU.
            "devices": os.environ.get("RAPIDFIRE_TEST_DEVICE", "cpu"),
        }
        settings.update(kwargs)
        executor = RapidFireExecutor(**settings)
        made.append(executor)
        return executor

    yield make
    for executor in made:
        executor.close()


@pytest.fixture
def rapidfire_logs(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """Capture the package's log records (its root logger does not propagate by default)."""
    root = logging.getLogger("optuna_rapidfire")
    root.propagate = True
    try:
        yield caplog
    finally:
        root.propagate = False


@pytest.fixture
def listen() -> Iterator[Callable[..., None]]:
    """Register a listener of the package's events (:mod:`optuna_rapidfire.events`), of every kind or of the kinds
    named after it, for the rest of the test."""
    from optuna_rapidfire import events

    registrations: list[Callable[[], None]] = []
    yield lambda listener, *kinds: registrations.append(events.listen(listener, *kinds))
    for remove in registrations:
        remove()


@pytest.fixture
def chunk_log() -> Iterator[list[tuple[int, int]]]:
    """Record ``(trial number, step)`` of every chunk the device starts to train, in order (a gang's members in
    the gang's order), from the package's events."""
    from optuna_rapidfire import events

    log: list[tuple[int, int]] = []

    def record(event: events.Event) -> None:
        if isinstance(event, events.ChunkStarting):
            log.extend(zip(event.trials, event.steps, strict=True))

    with events.listen(record, events.ChunkStarting):
        yield log


@pytest.fixture
def sigint_handled() -> Iterator[None]:
    """During the test, SIGINT raises KeyboardInterrupt here and is handled in the processes the test starts. A
    shell that runs the suite in the background starts it with SIGINT ignored (POSIX), which a child inherits and
    Python then keeps: Ctrl-C tests would see nothing."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture
def slow_chunks() -> Iterator[Callable[..., None]]:
    """Make every chunk (or fused gang, or member joining a stream) wait ``seconds`` before it starts (so a test
    can act while trials run); with ``hold``, it also waits (up to 120 s) while ``hold()`` is true, so that a
    test acting from outside (a browser) is never overtaken by the trials, however slow the machine."""
    import time

    from optuna_rapidfire import events

    registrations: list[Callable[[], None]] = []

    def apply(seconds: float, hold: Callable[[], bool] | None = None) -> None:
        def wait(event: events.Event) -> None:
            if not isinstance(event, events.ChunkStarting):
                return
            time.sleep(seconds)
            deadline = time.monotonic() + 120
            while hold is not None and hold() and time.monotonic() < deadline:
                time.sleep(0.05)

        registrations.append(events.listen(wait, events.ChunkStarting))

    yield apply
    for remove in registrations:
        remove()
