"""The device's worker thread: takes tasks from the scheduler and has the engine carry them out.

Only this thread touches the model; only Optuna's threads touch the study. The two talk through the
scheduler (what to do next) and each trial's event queue (what happened).
"""

from __future__ import annotations

import functools
import math
import threading
import time
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from optuna_rapidfire import events
from optuna_rapidfire._logging import get_logger
from optuna_rapidfire._runtime._entry import Entry, Task

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from optuna_rapidfire._engines._base import Engine
    from optuna_rapidfire._engines._types import Branch, ChunkResult
    from optuna_rapidfire._runtime._scheduler import Scheduler

_logger = get_logger(__name__)


@dataclass(frozen=True)
class Built:
    """The trial's state exists; ``total_chunks`` is its planned length; ``branch`` is set for clones."""

    total_chunks: int
    branch: Branch | None = None


@dataclass(frozen=True)
class Paused:
    """The trial's state has left the device; it waits for a resume."""


@dataclass(frozen=True)
class Saved:
    """The trial's final adapter is copied off the device (its state is freed next): ``write`` puts its files in
    ``path`` (the trial's driver calls it, once, before it records the path; by default they are there already)."""

    path: str
    write: Callable[[], None] = lambda: None


@dataclass(frozen=True)
class Released:
    """The trial's state is released."""


@dataclass(frozen=True)
class Failed:
    """The trial failed on the device; its state is released.

    ``fatal`` marks a mistake in the executor's own arguments (found by ``check_metrics``): it ends the
    study instead of failing one trial.
    """

    error: BaseException
    traceback: str
    fatal: bool = False


class SetupError(ValueError):
    """An executor argument is unusable for every trial (raised by ``check_metrics``)."""


class DivergedError(ArithmeticError):
    """A trial's training or evaluation loss is not finite: it stops at that chunk instead of training on."""


_LOSSES = ("train_loss", "eval_loss")


def diverged(result: ChunkResult) -> DivergedError | None:
    """Why a trained chunk ends its trial (a loss that is NaN or infinite), or ``None``."""
    bad = {name: result.metrics[name] for name in _LOSSES if not math.isfinite(result.metrics.get(name, 0.0))}
    if not bad:
        return None
    found = ", ".join(f"{name}={value}" for name, value in bad.items())
    return DivergedError(
        f"{found} after chunk {result.step + 1}: the trial diverged and stops here (a learning rate too large, "
        "or no gradient clipping?)."
    )


class DeviceWorker(threading.Thread):
    """Runs every task of one device, in the order the scheduler gives them.

    Args:
        engine: Carries out builds and chunks.
        scheduler: Gives the tasks.
        adapter_dir: Gives the folder of an entry's final adapter.
        check_metrics: Called, before any training, with a one-batch evaluation of the first trial built (a
            function returning its metrics, which it calls unless the metric is known to be reported); a
            :class:`SetupError` raised there ends the study (for instance when the executor's ``metric`` is not
            among the evaluation's metrics).
    """

    def __init__(
        self,
        engine: Engine,
        scheduler: Scheduler,
        adapter_dir: Callable[[Entry], str],
        check_metrics: Callable[[Callable[[], dict[str, float]]], None],
    ) -> None:
        super().__init__(name="rapidfire-device-worker", daemon=True)
        self.engine = engine
        self.scheduler = scheduler
        self._adapter_dir = adapter_dir
        self._check_metrics = check_metrics
        self._checked = False

    def run(self) -> None:
        if self.engine.device.type == "cuda":
            torch.cuda.set_device(self.engine.device)
        while (task := self.scheduler.next_task(fuse=self.engine.fuses)) is not None:
            kind, entries = task
            try:
                self._run(kind, entries)
            except BaseException as error:  # one trial's failure must not stop the device
                # A shared pass that failed after its members stepped fails every trial of the gang: their
                # states were updated together (the engine retries them one by one when none stepped).
                for victim in entries:
                    self._fail(victim, error)

    def _run(self, task: Task, entries: list[Entry]) -> None:
        if task is Task.TRAIN and self.engine.stream_refusal([e.built for e in entries]) is None:
            self._stream(entries)
            return
        if task is Task.TRAIN:  # one trial, or a gang
            start = time.perf_counter()
            steps = tuple(e.chunks_done for e in entries)
            results = self.engine.run([e.built for e in entries])
            if events.listening(events.PassTrained):
                numbers, seconds = tuple(e.number for e in entries), time.perf_counter() - start
                events.emit(events.PassTrained(numbers, steps, seconds, self.engine.name))
            self.deliver_all([(member, result, None) for member, result in zip(entries, results, strict=True)])
            return
        if task is Task.FINISH:
            self._finish(entries)
            return
        [entry] = entries
        if task is Task.BUILD:
            start = time.perf_counter()
            runtime = self.engine.build(entry.spec)
            entry.runtime = runtime
            if not self._checked:
                self._check_metrics(functools.partial(self.engine.evaluate, runtime, max_batches=1))
                self._checked = True
            branch = self.engine.branch(runtime)
            done, total = (branch.step if branch is not None else 0), self.engine.total_chunks(runtime)
            self.scheduler.built(entry, runtime, chunks_done=done, finished=done >= total)
            if events.listening(events.TrialBuilt):
                warm = branch is not None and (branch.warm or branch.resume)
                seconds = time.perf_counter() - start
                groups = tuple(
                    {k: v for k, v in group.items() if k != "params"} for group in runtime.state.optimizer.param_groups
                )
                step = done if warm else None
                events.emit(events.TrialBuilt(entry.number, str(self.engine.device), seconds, step, groups))
            entry.events.put(Built(total, branch))
        elif task is Task.PAUSE:
            self.engine.pause(entry.built)
            entry.events.put(Paused())
        elif task is Task.RELEASE:
            if entry.runtime is not None:
                # What a clone of this trial would start from, now that its state goes away.
                self.engine.save_snapshot(entry.runtime)
                self.engine.release(entry.runtime)
            self.scheduler.remove(entry)
            entry.events.put(Released())

    def _finish(self, entries: list[Entry]) -> None:
        """Save the adapters of trials that finished (a gang's members finish together) and hand each driver its
        files to write, then free the trials' states: the drivers write and complete their trials while the device
        frees the others' (one after another, saving and freeing took a 1B gang's end 0.17-0.45 s on H100 hosts).
        A trial whose adapter cannot be saved fails alone; one whose state cannot be freed once saved completes."""
        paths = [self._adapter_dir(entry) for entry in entries]
        writes: list[Callable[[], None] | None] = [None] * len(entries)
        if len(entries) > 1:
            try:  # the files: in the drivers' threads
                writes = list(self.engine.save_adapters([(e.built, p) for e, p in zip(entries, paths, strict=True)]))
            except Exception:  # saved one by one below: a failure fails its trial alone
                _logger.debug("Saving %d adapters together raised.", len(entries), exc_info=True)
        saved: list[Entry] = []
        for entry, path, write in zip(entries, paths, writes, strict=True):
            try:
                if write is None:
                    write = self.engine.save_adapter(entry.built, path)
                self.engine.save_snapshot(entry.built)
            except Exception as error:  # this trial's failure only
                self._fail(entry, error)
                continue
            entry.events.put(Saved(path, write))
            saved.append(entry)
        for entry in saved:
            try:
                self.engine.release(entry.built)
            except Exception:  # its adapter is saved: the trial completes, and its state goes with the model
                _logger.warning("Trial %d's state could not be freed after it finished.", entry.number, exc_info=True)
            self.scheduler.remove(entry)

    def _stream(self, entries: list[Entry]) -> None:
        """Train a gang as a stream (:meth:`Engine.stream`): members join between passes and leave as their
        chunks end. An error that fails the stream fails the members seated then."""
        refill = _Refill(self, entries)
        try:
            self.engine.stream([e.built for e in entries], refill)
        except BaseException as error:
            for victim in refill.seated():
                self._fail(victim, error)

    def side_tasks(self) -> None:
        """Carry out the housekeeping and builds waiting now (between two passes of a stream)."""
        while (task := self.scheduler.side_task()) is not None:
            kind, entries = task
            try:
                self._run(kind, entries)
            except Exception as error:  # that trial's failure only
                for victim in entries:
                    self._fail(victim, error)

    def deliver_all(
        self, delivered: Sequence[tuple[Entry, ChunkResult | BaseException, frozenset[int] | None]]
    ) -> None:
        """Hand each member's chunk (or its error: it fails that member alone) to its driver, with the mates that
        ended the same step beside it. The states of those that keep checkpoints are copied to the host first, all
        together and before any driver runs (:meth:`Engine.snapshots`): a driver checkpoints, holding Python's
        global lock, while this thread would copy the next member's state."""
        checked = [(entry, _checked(result), mates) for entry, result, mates in delivered]
        saving = [(e, r) for e, r, _ in checked if not isinstance(r, BaseException) and e.spec.checkpoint]
        if len(saving) > 1:
            start = time.perf_counter()
            try:
                snapshots = self.engine.snapshots([(e.built, r.last) for e, r in saving])
            except Exception:  # copied one by one below: a failure fails its member alone
                _logger.debug("Copying %d members' states together raised.", len(saving), exc_info=True)
            else:
                seconds = (time.perf_counter() - start) / len(saving)
                for (_, chunk), snapshot in zip(saving, snapshots, strict=True):
                    chunk.snapshot, chunk.snapshot_seconds = snapshot, seconds
        for entry, result, mates in checked:
            if isinstance(result, BaseException):
                self._fail(entry, result)
                continue
            if entry.spec.checkpoint and result.snapshot is None:
                start = time.perf_counter()
                try:
                    result.snapshot = self.engine.snapshot(entry.built, keep=result.last)  # kept for FINISH
                except Exception as error:  # this member's failure only
                    self._fail(entry, error)
                    continue
                result.snapshot_seconds = time.perf_counter() - start
            self.scheduler.chunk_done(entry, mates)
            entry.events.put(result)
        # A trial's state after its last chunk is what clones of it start from, whether it then finishes or stops:
        # its file is started now, while the drivers report (a gang's members ending together wrote eight files of
        # 41 MB after their ends, the study's end waiting for them); the end's own save finds it handed over.
        for entry, result, _ in checked:
            if not isinstance(result, BaseException) and result.last and result.snapshot is not None:
                try:
                    self.engine.save_snapshot(entry.built)
                except Exception:  # saved again when the trial ends
                    _logger.debug("Trial %d's last snapshot could not be handed over.", entry.number, exc_info=True)

    def _fail(self, entry: Entry, error: BaseException) -> None:
        text = "".join(traceback.format_exception(error))
        fatal = isinstance(error, SetupError)
        # A setup error concerns every trial: none of them can run.
        for victim in self.scheduler.entries() if fatal else [entry]:
            if victim.runtime is not None:
                try:
                    self.engine.release(victim.runtime)
                except Exception:  # the trial already failed; report the first error
                    _logger.debug("Releasing failed trial %d raised.", victim.number, exc_info=True)
            self.scheduler.remove(victim)
            victim.events.put(Failed(error, text, fatal=fatal))
        if isinstance(error, torch.cuda.OutOfMemoryError):
            torch.cuda.empty_cache()


class _Refill:
    """A stream's side of the device (:class:`~optuna_rapidfire._engines._gang_stream.Refill`): between passes it
    does the waiting housekeeping and builds, then seats whom the scheduler hands over; it delivers each ended
    member's chunk, the members that ended the same step beside it as its mates."""

    def __init__(self, worker: DeviceWorker, entries: list[Entry]) -> None:
        self.worker = worker
        self._active = {id(e.runtime): e for e in entries}

    def joiners(self, room: int, fits: Callable[[Any], bool]) -> list[Any]:
        self.worker.side_tasks()
        joined = self.worker.scheduler.join(room, lambda entry: fits(entry.runtime))
        for entry in joined:
            self._active[id(entry.runtime)] = entry
        return [entry.runtime for entry in joined]

    def delivered(self, done: Sequence[tuple[Any, ChunkResult | BaseException]]) -> None:
        entries = [(self._active.pop(id(runtime)), result) for runtime, result in done]
        # Each member's step before any delivery moves one on: a member delivered first would otherwise count as
        # the mate of a member one chunk ahead, whose decision then waits for a report that never comes.
        steps = [entry.chunks_done for entry, _ in entries]
        numbers = [entry.number for entry, _ in entries]
        mates = [
            frozenset(n for n, at in zip(numbers, steps, strict=True) if n != me and at == step)
            for me, step in zip(numbers, steps, strict=True)
        ]
        self.worker.deliver_all([(entry, result, m) for (entry, result), m in zip(entries, mates, strict=True)])

    def timed(self, members: int, seconds: float) -> None:
        self.worker.scheduler.pass_costs.add(members, seconds)

    def seated(self) -> list[Entry]:
        """The members in the stream now (joined, not delivered)."""
        return list(self._active.values())


def _checked(result: ChunkResult | BaseException) -> ChunkResult | BaseException:
    """``result``, or the error of a chunk whose values diverged."""
    return result if isinstance(result, BaseException) else diverged(result) or result
