"""The device's worker with a scripted engine: no model, no study."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from optuna_rapidfire._engines._types import ChunkResult
from optuna_rapidfire._runtime._entry import Decision, Entry
from optuna_rapidfire._runtime._scheduler import Scheduler
from optuna_rapidfire._runtime._schedules import schedule_from
from optuna_rapidfire._runtime._worker import DeviceWorker, Failed, Saved


class _Engine:
    """Records what the worker asks of it; ``save_adapter`` of ``broken_save`` and ``release`` of ``broken_release``
    raise."""

    device = torch.device("cpu")
    fuses = True

    def __init__(self, broken_save: int, broken_release: int) -> None:
        self.log: list[str] = []
        self.broken_save, self.broken_release = broken_save, broken_release

    def save_adapter(self, runtime: Any, path: str) -> Any:
        self.log.append(f"save {runtime}")
        if runtime == self.broken_save:
            raise OSError("disk full")
        return lambda: None

    def save_adapters(self, trials: list[tuple[Any, str]]) -> list[Any]:
        self.log.append(f"save together {[runtime for runtime, _ in trials]}")
        if any(runtime == self.broken_save for runtime, _ in trials):
            raise OSError("disk full")
        return [lambda: None for _ in trials]

    def save_snapshot(self, runtime: Any) -> None:
        self.log.append(f"snapshot {runtime}")

    def release(self, runtime: Any) -> None:
        self.log.append(f"release {runtime}")
        if runtime == self.broken_release:
            raise RuntimeError("cannot free")


def _adapter_dir(entry: Entry) -> str:
    return f"adapter-{entry.number}"


def test_trials_finishing_together_are_all_saved_before_any_is_freed_and_each_failure_stays_its_own() -> None:
    """A gang's members finish at once: each driver gets its adapter to write before the device frees the states
    (the drivers complete meanwhile); a save that fails fails that trial alone; a state that cannot be freed once
    its adapter is saved leaves the trial saved."""
    scheduler = Scheduler(gather_seconds=0.0, schedule=schedule_from("lockstep"))
    entries = [Entry(number=n, trial_id=100 + n, spec=None) for n in range(4)]
    for entry in entries:
        scheduler.add(entry)
        scheduler.built(entry, runtime=entry.number)
    engine = _Engine(broken_save=1, broken_release=2)
    worker = DeviceWorker(engine, scheduler, adapter_dir=_adapter_dir, check_metrics=lambda evaluate: None)  # type: ignore[arg-type]
    for entry in entries:
        scheduler.decide(entry, Decision.FINISH)
    worker.start()
    got = {entry.number: entry.events.get(timeout=10) for entry in entries}
    scheduler.settle(worker.is_alive)
    scheduler.close()
    worker.join(10)
    assert [type(got[n]) for n in range(4)] == [Saved, Failed, Saved, Saved]
    assert isinstance(got[1], Failed) and "disk full" in str(got[1].error)
    assert [g.path for g in got.values() if isinstance(g, Saved)] == ["adapter-0", "adapter-2", "adapter-3"]
    log = engine.log
    assert log[0] == "save together [0, 1, 2, 3]"  # tried together first; one failed, so each alone
    last_save = max(log.index(f"save {n}") for n in (0, 2, 3))
    assert all(log.index(f"release {n}") > last_save for n in (0, 2, 3))  # every save first, then the frees
    assert log.count("release 1") == 1 and scheduler.entries() == []  # the failed one freed once; all left
    assert all(entry.events.empty() for entry in entries)  # one event each: the freeing failure is only logged


def test_trials_finishing_together_have_their_adapters_copied_off_the_device_together() -> None:
    scheduler = Scheduler(gather_seconds=0.0, schedule=schedule_from("lockstep"))
    entries = [Entry(number=n, trial_id=100 + n, spec=None) for n in range(3)]
    for entry in entries:
        scheduler.add(entry)
        scheduler.built(entry, runtime=entry.number)
    engine = _Engine(broken_save=-1, broken_release=-1)
    worker = DeviceWorker(engine, scheduler, adapter_dir=_adapter_dir, check_metrics=lambda evaluate: None)  # type: ignore[arg-type]
    for entry in entries:
        scheduler.decide(entry, Decision.FINISH)
    worker.start()
    assert all(isinstance(entry.events.get(timeout=10), Saved) for entry in entries)
    scheduler.settle(worker.is_alive)
    scheduler.close()
    worker.join(10)
    assert engine.log[0] == "save together [0, 1, 2]" and not any(
        line.startswith("save ") and "together" not in line for line in engine.log
    )


def test_a_trials_last_chunk_hands_its_snapshot_file_over_as_its_chunk_is_delivered() -> None:
    """The state after a trial's last chunk is what clones of it start from, whether it then finishes or stops: its
    file goes to the writers as the chunk reaches the driver, not only at the trial's end (a gang's members ending
    together had eight files to write while the study's end waited); other chunks' states are not written."""
    scheduler = Scheduler(gather_seconds=0.0, schedule=schedule_from("lockstep"))
    entries = [Entry(number=n, trial_id=100 + n, spec=SimpleNamespace(checkpoint=True)) for n in range(3)]  # type: ignore[arg-type]
    for entry in entries:
        scheduler.add(entry)
        scheduler.built(entry, runtime=entry.number)
    engine = _Engine(broken_save=-1, broken_release=-1)
    engine.snapshots = lambda trials: [f"state of {runtime}" for runtime, _ in trials]  # type: ignore[attr-defined]
    worker = DeviceWorker(engine, scheduler, adapter_dir=_adapter_dir, check_metrics=lambda evaluate: None)  # type: ignore[arg-type]
    results = [ChunkResult(step=1, metrics={"eval_loss": 1.0}, last=n != 1) for n in range(3)]
    worker.deliver_all([(entry, result, frozenset()) for entry, result in zip(entries, results, strict=True)])
    assert [entry.events.get_nowait() for entry in entries] == results
    assert engine.log == ["snapshot 0", "snapshot 2"]  # the last chunks' only
