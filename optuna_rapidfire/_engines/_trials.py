"""The live trials of one device: what every engine does with a trial besides training its chunks.

:class:`DeviceTrials` builds a trial (its adapter in the shared ``PeftModel``, its TRL trainer, optimizer,
LR schedule and RNG: a :class:`TrialRuntime`), starts clones from their parent's state, takes snapshots,
keeps the trials' states within the device's memory budget (offloading idle ones to pinned CPU memory),
routes the model's forward passes through one trial or a gang, evaluates, exports adapters and releases
trials. It also finishes every chunk, whichever engine trained it (:meth:`DeviceTrials.finish`,
:func:`train_metrics`, :func:`clips`), so both engines report the same result and metrics.

Engines compose one ``DeviceTrials``; a fused engine and the time-sliced engine it falls back to share it.
Everything here runs on the device's worker thread, except :meth:`DeviceTrials.stats`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import math
import os
import threading
import time
from typing import TYPE_CHECKING, Any, TypeVar, cast

import numpy as np
import torch

from optuna_rapidfire import _compat, events
from optuna_rapidfire._engines._clones import branch_from
from optuna_rapidfire._engines._placement import Placement
from optuna_rapidfire._engines._types import ChunkResult, EngineStats, TrialRuntime, TrialSpec, runtime_of
from optuna_rapidfire._logging import get_logger
from optuna_rapidfire._resident._data import rows_of
from optuna_rapidfire._resident._snapshot import TrialSnapshot
from optuna_rapidfire._resident._state import RngState, SwapState
from optuna_rapidfire._trainers._base import ACCELERATE_STATE

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from datasets import Dataset
    from transformers import TrainingArguments

    from optuna_rapidfire._fused._dropout import DropoutStream
    from optuna_rapidfire._resident._data import ChunkPlan, PreparedData
    from optuna_rapidfire._resident._model import ResidentModel
    from optuna_rapidfire._trainers._base import TrainerExtras, TrainerKind
    from optuna_rapidfire._trainers._host import DevicePart, Member


P = TypeVar("P", bound="DevicePart")

_logger = get_logger(__name__)


class DeviceTrials:
    """The live trials on ``resident``'s device, and the services every engine uses on them.

    Args:
        resident: The base model with the live trials' adapters.
        data: Chunks and eval set, prepared per data key.
        extras: Executor-wide arguments for the TRL trainers.
        output_dir: Folder under which each trial's trainer gets its ``output_dir``.
        state_budget: Bytes of trial state (adapters + optimizer moments) kept on the device; idle
            trials beyond it are moved to pinned CPU memory. ``None``: no limit.
    """

    def __init__(
        self,
        *,
        resident: ResidentModel,
        data: PreparedData,
        extras: TrainerExtras,
        output_dir: str,
        state_budget: int | None = None,
    ) -> None:
        self.resident = resident
        self.data = data
        self.extras = extras
        self.output_dir = output_dir
        self._runtimes: list[TrialRuntime] = []
        self.placement = Placement(resident, self._runtimes, state_budget)
        self._base_bytes = resident.base_nbytes()  # before any adapter is injected into the base
        self._parts: dict[str, DevicePart] = {}  # the kinds' per-device state (GRPO's decode), made when needed
        self._evaluating: dict[str, str] = {}  # adapter -> "eval" or "check", while its trial evaluates
        self._writes = _Writes()  # snapshot files being written, off the device thread

    @property
    def device(self) -> torch.device:
        return self.resident.device

    # -- what a kind's gang code uses (:class:`~optuna_rapidfire._trainers._host.GangHost`) ----------------------

    def part(self, key: str, make: Callable[[], P]) -> P:
        if key not in self._parts:
            self._parts[key] = make()
        return cast("P", self._parts[key])

    def on_device(self, members: Sequence[Member]) -> None:
        self.placement.on_device([runtime_of(m) for m in members])

    def evaluating(self, adapter: str) -> str | None:
        return self._evaluating.get(adapter)

    def keep_on_device(self, gang: Sequence[Member]) -> None:
        self.placement.gang = [runtime_of(m) for m in gang]

    def resume_member(self, member: Member, gang: Sequence[Member], rng: RngState, training: bool) -> None:
        self.placement.resume(runtime_of(member), [runtime_of(m) for m in gang], rng, training)

    def dropout_stream(self, member: Member) -> DropoutStream:
        return self.placement.dropout_stream(runtime_of(member))

    def stats(self) -> EngineStats:
        """The counters kept here (an engine adds its own).

        Called from another thread, this counts the trials as they are at that moment; counting a state
        whose optimizer moments are being created at the same time raises ``RuntimeError`` (ask again).
        """
        runtimes = list(self._runtimes)
        peft = self.resident.peft
        stats = EngineStats(
            switches=self.placement.switches,
            switch_seconds=tuple(self.placement.switch_seconds),
            offloads=self.placement.offloads,
            live_trials=len(runtimes),
            resident_trials=sum(r.state.resident for r in runtimes),
            state_bytes=tuple(r.state.nbytes() for r in runtimes),
            adapters=() if peft is None else tuple(peft.peft_config),
            base_bytes=self._base_bytes,
            eval_rows=len(self.data.eval),
        )
        return dataclasses.replace(stats, **_summed([part.counters() for part in list(self._parts.values())]))

    # -- building and releasing ------------------------------------------------------------------

    def build(self, spec: TrialSpec) -> TrialRuntime:
        """Create the trial's state (adapter, trainer, optimizer, schedule, RNG; a clone's from its parent)."""
        parent = "" if spec.clone_of is None else self._parent_snapshot(spec)
        kind = spec.kind
        name = f"trial_{spec.number}"
        with ACCELERATE_STATE:
            args = kind.effective_args(spec.args, os.path.join(self.output_dir, name), self.device)
        params = self.resident.add_adapter(name, spec.peft_config, seed=args.seed)
        try:
            if not params:
                raise ValueError(f"The adapter config of trial {spec.number} creates no trainable parameters.")
            sample = self.data.train.select(self.data.plan.rows(0)[:1].tolist())
            # The trainer and its optimizer see the trial's own adapter only: their walks over the model's
            # modules and parameters then cost the same whatever the number of resident trials.
            with self.resident.alone(name):
                # No other thread may make TrainingArguments (clearing accelerate's shared state) until the
                # trainer has its own copy of that state.
                with ACCELERATE_STATE, self.resident.building(name) as trainer_forward:
                    _compat.reset_accelerate_state()  # set up whole by this trainer's accelerator
                    trainer = kind.build_trainer(self.resident, args, sample, self.extras)
                    kind.isolate(trainer)
                key = kind.data_key(args)
                sizes = self.data.chunk_sizes(key, lambda ds, split: kind.prepare(trainer, ds, split))
                steps_per_chunk = chunk_steps(self.data.plan, spec.number, args, kind, sizes)
                total_chunks = kind.total_chunks(args, self.data.plan.num_chunks)
                total_steps = sum(steps_per_chunk[c % len(sizes)] for c in range(total_chunks))
                optimizer = trainer.create_optimizer()
                scheduler = trainer.create_scheduler(num_training_steps=total_steps, optimizer=optimizer)
            state = SwapState(
                adapter_name=name,
                params=params,
                optimizer=optimizer,
                lr_scheduler=scheduler,
                scaler=getattr(trainer.accelerator, "scaler", None),
                rng=RngState.seeded(args.seed, self.device),
            )
        except BaseException:
            self.resident.delete_adapter(name)
            with contextlib.suppress(OSError):
                os.rmdir(os.path.join(self.output_dir, name))
            raise
        runtime = TrialRuntime(
            spec=spec,
            args=args,
            forward=trainer_forward(),
            trainer=trainer,
            state=state,
            data_key=key,
            steps_per_chunk=steps_per_chunk,
            total_chunks=total_chunks,
        )
        if spec.clone_of is not None:
            runtime.branch = branch_from(self.resident, runtime, spec.clone_of, parent)
        kind.gang.install(self, runtime)
        self._runtimes.append(runtime)
        self.placement.fit_budget(keep=[runtime])
        return runtime

    def release(self, runtime: TrialRuntime) -> None:
        """Free the trial's state; safe to call on a half-built or already released trial."""
        if runtime.released:
            return
        runtime.released = True
        runtime.kept_snapshot = None
        self.resident.delete_adapter(runtime.state.adapter_name)
        runtime.state.optimizer.state.clear()
        runtime.state.params.clear()
        if runtime in self._runtimes:
            self._runtimes.remove(runtime)
        self.placement.forget(runtime)
        # TRL's trainer makes its output_dir and writes nothing there (the executor saves adapters itself).
        for folder in (os.path.join(self.output_dir, runtime.state.adapter_name), self.output_dir):
            with contextlib.suppress(OSError):  # not empty: another trial's, or something of the user's
                os.rmdir(folder)

    def save_adapters(self, trials: Sequence[tuple[TrialRuntime, str]]) -> list[Callable[[], None]]:
        """Start saving each ``(runtime, directory)``'s adapter (weights copied off the device together); each function
        returned writes the files from any thread, then emits :class:`~optuna_rapidfire.events.AdapterSaved`."""
        savers = self.resident.adapter_savers([(r.state.adapter_name, d) for r, d in trials])
        ends = zip(savers, trials, strict=True)
        return [functools.partial(_adapter_written, f, r.spec.number, d) for f, (r, d) in ends]

    # -- parents and snapshots -------------------------------------------------------------------

    def _live(self, number: int) -> TrialRuntime | None:
        return next((r for r in self._runtimes if r.spec.number == number), None)

    def _parent_snapshot(self, spec: TrialSpec) -> TrialSnapshot | str:
        """The parent's state at the clone's chunk boundary: as kept (the study's chunk states, or a retry's
        checkpoint); for a clone of the latest state with none kept, the live parent's or the one saved when it
        ended; else why there is none."""
        clone_of = spec.clone_of
        assert clone_of is not None
        number, step = clone_of.parent, clone_of.step
        reason = f"no state of trial {number} is available here"
        if clone_of.fetch is not None:
            try:
                fetched = clone_of.fetch()
            except Exception as error:  # missing, dropped, corrupted or foreign: start from scratch, say why
                reason = str(error)
            else:
                assert isinstance(fetched, TrialSnapshot)
                return fetched
        if clone_of.resume:
            return reason
        # A live parent may be inside a stream's chunk now (builds run between passes): only its kept
        # states are chunk boundaries, so it is used only for a clone of the latest state kept nowhere.
        live = self._live(number)
        if live is not None and step is None:
            return self.snapshots([(live, False)])[0]
        directory = os.path.join(spec.state_dir, f"trial-{number}")
        self._writes.wait(directory)
        if TrialSnapshot.exists(directory):
            saved = TrialSnapshot.load(directory)
            if step is None or saved.position.chunks_done == step:
                return saved
        return reason

    def snapshots(self, trials: Sequence[tuple[TrialRuntime, bool]]) -> list[TrialSnapshot]:
        """Each ``(runtime, keep)``'s state at its latest chunk boundary, copied to the CPU, read from the device
        together (:meth:`TrialSnapshot.capture_together`); ``keep``: its last chunk's checkpoint (only read from now
        on), kept for :meth:`save_snapshot` at its end (no second copy or serialisation)."""
        if self.device.type == "cuda" and not all(runtime.state.resident for runtime, _ in trials):
            torch.cuda.synchronize(self.device)  # offload copies to host memory may still be in flight
        snapshots = TrialSnapshot.capture_together([_parts(self, runtime) for runtime, _ in trials])
        for (runtime, keep), snapshot in zip(trials, snapshots, strict=True):
            if keep:
                runtime.kept_snapshot = (_boundary(runtime), snapshot)
        return snapshots

    def save_snapshot(self, runtime: TrialRuntime) -> None:
        """Write the trial's state to its snapshot folder (what clones of it start from), once it trained: copied to
        the host here (unless its chunk's checkpoint holds it), written by a background thread (a reader of the folder
        waits for it: :meth:`flush`) while the device trains on; not again while the trial has not moved."""
        boundary = _boundary(runtime)
        if runtime.state.position.chunks_done > 0 and runtime.saved_at != boundary:
            snapshot, study = _kept(runtime) or self.snapshots([(runtime, False)])[0], runtime.spec.study_name
            directory = os.path.join(runtime.spec.state_dir, f"trial-{runtime.spec.number}")
            self._writes.submit(directory, lambda: snapshot.save(directory, study))
            runtime.saved_at = boundary

    def flush(self) -> None:
        """Wait until every snapshot file handed to the background writer is written."""
        self._writes.wait()

    # -- training --------------------------------------------------------------------------------

    def next_chunk(self, runtime: TrialRuntime) -> tuple[Dataset, list[list[int]]]:
        """The trial's next chunk (prepared) and the row indices of its micro-batches, in visit order."""
        plan = self.data.plan
        runtime.kept_snapshot = None  # the chunk changes the state (a stream moves the position at its end only)
        epoch, chunk = runtime.state.position.chunk(plan.num_chunks)
        dataset = self.data.chunk(runtime.data_key, chunk, runtime.prepare)
        return dataset, runtime.spec.kind.micro_batches(runtime.args, plan.visit_order(len(dataset), epoch, chunk))

    @staticmethod
    def after_optimizer_step(runtime: TrialRuntime, stepped: bool = True) -> None:
        """Advance the LR schedule (unless the fp16 scaler skipped the step), clear gradients, count the step."""
        state = runtime.state
        if stepped:
            state.lr_scheduler.step()
        state.optimizer.zero_grad(set_to_none=True)
        state.position.optimizer_steps += 1
        runtime.trainer.state.global_step = state.position.optimizer_steps

    def finish(
        self,
        runtime: TrialRuntime,
        metrics: dict[str, float],
        train_seconds: float,
        evaluated: tuple[dict[str, float], float] | None = None,
    ) -> ChunkResult:
        """A trained chunk's result: evaluate the trial, add the chunk's ``metrics`` (:func:`train_metrics`)
        to the eval metrics, and keep them in the trial's history (what a warm clone inherits).

        ``evaluated``: the trial's eval metrics and seconds when it was evaluated already (in a gang).
        """
        start = time.perf_counter()
        if evaluated is None:
            full = self.evaluate(runtime)
            eval_seconds = time.perf_counter() - start
        else:
            full, eval_seconds = dict(evaluated[0]), evaluated[1]
        full.update(metrics)
        runtime.history.append(dict(full))
        result = ChunkResult(
            step=runtime.state.position.chunks_done - 1,
            metrics=full,
            last=runtime.state.position.chunks_done >= runtime.total_chunks,
            train_seconds=train_seconds,
            eval_seconds=eval_seconds,
        )
        tokens = _compat.train_tokens(runtime.trainer)
        chunk_tokens, runtime.tokens_at_last_chunk = tokens - runtime.tokens_at_last_chunk, tokens
        if events.listening(events.ChunkTrained):
            number, step, last = runtime.spec.number, result.step, result.last
            chunk = events.ChunkTrained(number, step, dict(full), train_seconds, eval_seconds, last, chunk_tokens)
            events.emit(chunk)
        return result

    # -- evaluation ------------------------------------------------------------------------------

    def evaluate(self, runtime: TrialRuntime, max_batches: int | None = None) -> dict[str, float]:
        """Evaluate the trial's adapter on the (prepared) eval set, as TRL's ``evaluate`` would.

        ``max_batches``: evaluate on the first batches only (a check of the metrics' names), which leaves
        the trial's sampling generator where it was: the check changes none of the trial's values.
        """
        adapter = runtime.state.adapter_name
        phase = "eval" if max_batches is None else "check"
        self._evaluating[adapter] = phase
        start = time.perf_counter()
        try:
            metrics = _evaluate(self, runtime, max_batches)
        finally:
            self._evaluating.pop(adapter, None)
        if events.listening(events.Evaluated):
            events.emit(events.Evaluated((runtime.spec.number,), False, phase, time.perf_counter() - start))
        return metrics


@torch.no_grad()
def _evaluate(trials: DeviceTrials, runtime: TrialRuntime, max_batches: int | None) -> dict[str, float]:
    """:meth:`DeviceTrials.evaluate`."""
    from transformers import EvalPrediction
    from transformers.trainer_pt_utils import nested_concat, nested_numpify

    kind, trainer, args = runtime.spec.kind, runtime.trainer, runtime.args
    trials.placement.use(runtime)
    dataset = trials.data.eval_set(runtime.data_key, runtime.prepare)
    model = trials.resident.module
    was_training = model.training
    model.eval()
    compute_metrics = trials.extras.compute_metrics
    preprocess = trials.extras.preprocess_logits_for_metrics
    total = torch.zeros((), device=trials.device, dtype=torch.float64)
    count = 0
    predictions: Any = None
    labels: Any = None
    batches = kind.eval_batches(args, len(dataset))
    sample_rng = runtime.state.sample_rng
    if max_batches is not None:
        batches = batches[:max_batches]
    try:
        for indices in batches:
            loss, size, logits, batch_labels = kind.eval_batch(
                trainer, model, rows_of(dataset, indices), trials.device, compute_metrics is not None
            )
            total += loss.detach().double() * size
            count += size
            if compute_metrics is not None and logits is not None:
                if preprocess is not None:
                    logits = preprocess(logits, batch_labels)
                logits, batch_labels = _cpu(logits), _cpu(batch_labels)
                predictions = logits if predictions is None else nested_concat(predictions, logits, -100)
                labels = batch_labels if labels is None else nested_concat(labels, batch_labels, -100)
    finally:
        if was_training:
            model.train()
        if max_batches is not None:
            runtime.state.sample_rng = sample_rng
    metrics = {"eval_loss": (total / max(count, 1)).item()}
    metrics.update({f"eval_{k}": v for k, v in kind.drain_metrics(trainer, "eval").items()})
    if compute_metrics is not None:
        user = compute_metrics(
            EvalPrediction(predictions=nested_numpify(predictions), label_ids=nested_numpify(labels))
        )
        for key, value in user.items():
            metrics[key if key.startswith("eval_") else f"eval_{key}"] = float(value)
    return metrics


def chunk_steps(
    plan: ChunkPlan, number: int, args: TrainingArguments, kind: TrainerKind, sizes: list[int]
) -> list[int]:
    """Optimizer steps the trial takes in each chunk (of ``sizes`` examples after preparation); a chunk too
    small for one batch is an error that says why it is small."""
    steps = []
    for chunk, size in enumerate(sizes):
        micro = len(kind.micro_batches(args, np.arange(size)))
        if micro < 1:
            rows = len(plan.rows(chunk))
            if getattr(args, "packing", False):
                why = f"packing joined its {rows} rows into {size} examples"
            elif size < rows:
                why = (
                    f"preparation dropped {rows - size} of its {rows} rows (TRL drops rows whose tokens are "
                    "all masked, e.g. a prompt that fills max_length, and rows it cannot use)"
                )
            else:
                why = f"it has only {rows} rows"
            raise ValueError(
                f"Chunk {chunk + 1} of {len(sizes)} holds {size} examples after preparation, fewer than one "
                f"batch of per_device_train_batch_size={args.per_device_train_batch_size} (trial {number}): "
                f"{why}. Lower num_chunks or the batch size, or check the rows and max_length."
            )
        steps.append(math.ceil(micro / args.gradient_accumulation_steps))
    return steps


def _cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, (tuple, list)):
        return type(value)(_cpu(v) for v in value)
    return value


def _adapter_written(finish: Callable[[], None], number: int, directory: str) -> None:
    finish()
    if events.listening(events.AdapterSaved):
        events.emit(events.AdapterSaved(number, directory))


WRITERS = 8
"""Background threads writing snapshot files at once: a gang whose members end together hands over one file each
(8 x 41 MB for 1B trials, ~25 ms each with its ``fsync`` on an H100 host), which one thread wrote after the study's
last chunk for ~0.2 s, and four threads in two waves for ~0.24 s, the study's end waiting for them."""


class _Writes:
    """Files written by up to :data:`WRITERS` background threads; the writes of one path in the order given; a write
    that fails is logged (what it held is lost: a clone of that trial then starts from scratch and says why)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[str, concurrent.futures.Future[None]] = {}  # each path's latest write
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def submit(self, path: str, write: Callable[[], None]) -> None:
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(WRITERS, thread_name_prefix="rapidfire-writes")
            # The pool starts writes in the order given, so the one before (started, or done) never waits for this.
            future = self._pool.submit(self._write, path, write, self._pending.get(path))
            self._pending[path] = future
        future.add_done_callback(lambda done: self._done(path, done))

    @staticmethod
    def _write(path: str, write: Callable[[], None], before: concurrent.futures.Future[None] | None) -> None:
        if before is not None:
            concurrent.futures.wait([before])  # the same path's earlier write lands first
        try:
            write()
        except Exception as error:
            _logger.warning("Could not write %s: %s", path, error)

    def _done(self, path: str, future: concurrent.futures.Future[None]) -> None:
        with self._lock:
            if self._pending.get(path) is future:
                del self._pending[path]

    def wait(self, path: str | None = None) -> None:
        """Wait for the write of ``path`` (every write, and then the writer thread ends: ``None``)."""
        with self._lock:
            futures = list(self._pending.values()) if path is None else [self._pending.get(path)]
        concurrent.futures.wait([f for f in futures if f is not None])
        if path is None:
            with self._lock:
                if self._pool is not None and all(f.done() for f in self._pending.values()):
                    self._pool.shutdown()  # a later write starts another
                    self._pool = None


def chunks_starting(trials: DeviceTrials, runtimes: list[TrialRuntime]) -> None:
    """Tell the listeners of :class:`~optuna_rapidfire.events.ChunkStarting` which chunks of which trials train
    next, with their rows (nothing is gathered while nobody listens)."""
    if not events.listening(events.ChunkStarting):
        return
    plan = trials.data.plan
    rows = tuple(tuple(int(i) for i in plan.rows(r.state.position.chunk(plan.num_chunks)[1])) for r in runtimes)
    steps = tuple(r.state.position.chunks_done for r in runtimes)
    events.emit(events.ChunkStarting(tuple(r.spec.number for r in runtimes), steps, rows))


def _summed(counters: list[dict[str, Any]]) -> dict[str, Any]:
    """The kinds' counters added up by name (a dict's values key by key: ``gang_seconds``)."""
    total: dict[str, Any] = {}
    for found in counters:
        for name, count in found.items():
            if isinstance(count, dict):
                merged = total.setdefault(name, {})
                for key, value in count.items():
                    merged[key] = merged.get(key, 0) + value
            else:
                total[name] = total.get(name, 0) + count
    return total


def _parts(
    trials: DeviceTrials, runtime: TrialRuntime
) -> tuple[int, str, SwapState, dict[str, torch.Tensor], list[dict[str, float]]]:
    """What :meth:`TrialSnapshot.capture_together` copies of a trial."""
    weights = trials.resident.adapter_weights(runtime.state.adapter_name)
    return runtime.spec.number, runtime.spec.kind.name, runtime.state, weights, runtime.history


def _kept(runtime: TrialRuntime) -> TrialSnapshot | None:
    """The trial's kept checkpoint (:meth:`DeviceTrials.snapshot`), if the trial has not moved since."""
    kept = runtime.kept_snapshot
    return kept[1] if kept is not None and kept[0] == _boundary(runtime) else None


def _boundary(runtime: TrialRuntime) -> tuple[int, int, int]:
    """Where the trial stands: chunks done, optimizer steps, chunks evaluated (a kept snapshot's key)."""
    position = runtime.state.position
    return position.chunks_done, position.optimizer_steps, len(runtime.history)
