"""The seams of the package this benchmark times: every patch of optuna_rapidfire's internals, and every private
name of it that the parts read, in one place.

When the package's internals move (engine classes split, modules renamed), this module is the one to fix: the
parts import only its public names. (The standalone probes, ``benchmarks/fused_*.py`` and
``benchmarks/compile_probe.py``, call the fused pass's functions themselves: that is what they measure.)
Every patch is a context manager that puts the original back on exit.

Patched:

- ``TimeSlicedEngine.run_chunk`` (:class:`Recorder`): a time-sliced trial's chunk (switch, training,
  evaluation): its tokens, training and evaluation seconds;
- ``FusedEngine.run`` (:class:`Recorder`, :class:`ChunkLog`): a fused gang's chunk, each member's result;
- ``Placement.switch_to`` (:class:`Recorder`): a switch to another trial's state, the device synchronized
  before and after;
- ``GangTraining.train`` (:class:`GangTrainingWindows`): the training phase of a fused gang's chunk, its
  wall-clock window;
- ``Generation.decode`` (:class:`DecodeLog`): every GRPO decode (a trial's alone or a gang's), timed and
  its generated tokens counted;
- ``DeviceTrials.evaluate`` (:class:`DecodeLog`): whether a decode serves an evaluation or the metric-name
  check of the first trial built;
- ``FusedEngine.run`` and ``TimeSlicedEngine.run`` (:class:`PassLog`): every chunk an engine trains for the
  scheduler (a gang's on the fused engine, a trial's on the time-sliced one): its members and seconds.

Listened to (the package's own log, no patch): :class:`PackageLog` keeps the package's log lines and reads the
seconds of each compiled layout's first pass from the launched pass's "Compiled the launched pass" line.

The patches read these attributes of the package's objects: a runtime's ``trainer._total_train_tokens`` (TRL's
count), ``spec.number`` and ``state.adapter_name``; ``Placement.current``; a chunk result's ``step``,
``train_seconds`` and ``eval_seconds``; a decode request's ``adapter``, ``prompts`` and sampling settings.

Read as they are:

- :data:`PASS_TOKENS`: the fused engine's default cap of tokens per pass, recorded with the fused part's results;
- :data:`attrs`: the keys of the trial attributes the package writes (worker, fail reason, clone, parent);
- :class:`ChunkPlan`: which train rows each chunk holds (plain TRL visits them in the executor's order);
- :class:`DecodeRequest`, :func:`decode`: the fused decode, called directly for the GRPO decode ceiling.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from benchmarks.harness.measure import sync
from optuna_rapidfire._engines._fused_engine import FusedEngine
from optuna_rapidfire._engines._gang_passes import PASS_TOKENS
from optuna_rapidfire._engines._gang_stream import GangStream
from optuna_rapidfire._engines._gang_training import GangTraining
from optuna_rapidfire._engines._placement import Placement
from optuna_rapidfire._engines._time_sliced import TimeSlicedEngine
from optuna_rapidfire._engines._trials import DeviceTrials
from optuna_rapidfire._engines._types import ChunkResult
from optuna_rapidfire._fused._fused_decode import DecodeRequest, decode
from optuna_rapidfire._resident._data import ChunkPlan
from optuna_rapidfire._study import _attrs as attrs
from optuna_rapidfire._trainers.grpo._generation import Generation

__all__ = [
    "PASS_TOKENS",
    "ChunkLog",
    "ChunkPlan",
    "DecodeLog",
    "DecodeRequest",
    "GangTrainingWindows",
    "PackageLog",
    "PassLog",
    "Recorder",
    "attrs",
    "decode",
]


class Recorder:
    """Hooks into the engine: chunk timings, tokens, evaluation time, switch latency (synchronized)."""

    def __init__(self) -> None:
        self.first_report: dict[int, float] = {}
        self.eval_seconds = 0.0
        self.train_seconds = 0.0
        self.tokens = 0
        self.switches: list[float] = []
        self.chunks: list[dict[str, float]] = []  # per chunk: step, tokens, train seconds
        self._originals: dict[str, Any] = {}
        self._in_gang = False  # a fused engine's run: it records its members' chunks itself

    def __enter__(self) -> Recorder:
        recorder = self
        run_chunk, switch_to = TimeSlicedEngine.run_chunk, Placement.switch_to
        run_gang = FusedEngine.run
        self._originals = {"run_chunk": run_chunk, "switch_to": switch_to, "run_gang": run_gang}

        def tokens(runtime: Any) -> int:
            return int(getattr(runtime.trainer, "_total_train_tokens", 0))

        def record(runtime: Any, before: int, result: Any) -> None:
            if not isinstance(result, ChunkResult):  # that trial failed alone (its own out of memory...)
                return
            recorder.tokens += tokens(runtime) - before
            recorder.eval_seconds += result.eval_seconds
            recorder.train_seconds += result.train_seconds
            recorder.chunks.append(
                {"step": result.step, "tokens": tokens(runtime) - before, "train_seconds": result.train_seconds}
            )
            if result.step == 0:
                recorder.first_report.setdefault(runtime.spec.number, time.perf_counter())

        def timed_run_chunk(engine: TimeSlicedEngine, runtime: Any) -> Any:
            before = tokens(runtime)
            result = run_chunk(engine, runtime)
            if not recorder._in_gang:
                record(runtime, before, result)
            return result

        def timed_run_gang(engine: FusedEngine, runtimes: Any) -> Any:
            before = [tokens(runtime) for runtime in runtimes]
            recorder._in_gang = True
            try:
                results = run_gang(engine, runtimes)
            finally:
                recorder._in_gang = False
            for runtime, count, result in zip(runtimes, before, results, strict=True):
                record(runtime, count, result)
            return results

        def timed_switch(placement: Placement, runtime: Any) -> None:
            changes = placement.current is not runtime
            sync()
            start = time.perf_counter()
            switch_to(placement, runtime)
            sync()
            if changes:
                recorder.switches.append(time.perf_counter() - start)

        TimeSlicedEngine.run_chunk = timed_run_chunk  # type: ignore[method-assign, assignment]
        Placement.switch_to = timed_switch  # type: ignore[method-assign, assignment]
        FusedEngine.run = timed_run_gang  # type: ignore[method-assign, assignment]
        return self

    def steady_tokens_per_second(self) -> float:
        """Training tokens/s over every trial's chunks after its first (warm kernels, allocator, caches)."""
        later = [c for c in self.chunks if c["step"] > 0] or self.chunks
        return sum(c["tokens"] for c in later) / max(sum(c["train_seconds"] for c in later), 1e-9)

    def __exit__(self, *exc: object) -> None:
        TimeSlicedEngine.run_chunk = self._originals["run_chunk"]  # type: ignore[method-assign]
        Placement.switch_to = self._originals["switch_to"]  # type: ignore[method-assign]
        FusedEngine.run = self._originals["run_gang"]  # type: ignore[method-assign]


class GangTrainingWindows:
    """The wall-clock windows (``time.time_ns()``, the device synchronized at both ends) of the training phase of
    every fused gang chunk (the worker thread's), in :attr:`windows`."""

    def __init__(self) -> None:
        self.windows: list[tuple[int, int]] = []
        self._original: Any = None

    def __enter__(self) -> GangTrainingWindows:
        original = self._original = GangTraining.train
        windows = self.windows

        def timed(training: GangTraining, runtimes: Any) -> Any:
            sync()
            begin = time.time_ns()
            try:
                return original(training, runtimes)
            finally:
                sync()
                windows.append((begin, time.time_ns()))

        GangTraining.train = timed  # type: ignore[method-assign, assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        GangTraining.train = self._original  # type: ignore[method-assign]


class ChunkLog:
    """Per trial and chunk, the fused engine's training and evaluation seconds (hooks its ``run``);
    ``on_gang(members, steps, seconds)`` hears of every gang's chunk as it ends."""

    def __init__(self, on_gang: Callable[[int, list[int], float], None] | None = None) -> None:
        self.chunks: dict[int, dict[int, tuple[float, float]]] = {}
        self._on_gang = on_gang
        self._original: Any = None

    def __enter__(self) -> ChunkLog:
        original = self._original = FusedEngine.run
        log = self

        def run(engine: FusedEngine, runtimes: Any) -> Any:
            start = time.perf_counter()
            results = original(engine, runtimes)
            steps = sorted({r.step for r in results if isinstance(r, ChunkResult)})
            if log._on_gang is not None:
                log._on_gang(len(runtimes), steps, time.perf_counter() - start)
            for runtime, result in zip(runtimes, results, strict=True):
                if isinstance(result, ChunkResult):
                    times = (result.train_seconds, result.eval_seconds)
                    log.chunks.setdefault(runtime.spec.number, {})[result.step] = times
            return results

        FusedEngine.run = run  # type: ignore[method-assign, assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        FusedEngine.run = self._original  # type: ignore[method-assign]

    def count(self) -> int:
        return sum(len(chunks) for chunks in self.chunks.values())


class DecodeLog:
    """Every decode an engine runs: its requests, rows, widest prompt, generated tokens, seconds (device
    synchronized before and after) and phase ("train", "eval", "check": the metric-name check of the first
    trial built, or "mixed"). Hooks ``Generation.decode`` and ``DeviceTrials.evaluate``."""

    def __init__(self) -> None:
        self.decodes: list[dict[str, Any]] = []
        self.settings: dict[str, Any] | None = None  # the first request's sampling settings
        self._phase: dict[str, str] = {}  # adapter -> "eval" or "check" while its trial evaluates
        self._originals: tuple[Any, Any] | None = None

    def __enter__(self) -> DecodeLog:
        log = self
        run_decode, evaluate = self._originals = (Generation.decode, DeviceTrials.evaluate)

        def timed(generation: Generation, requests: Any, first: Any) -> Any:
            phases = {log._phase.get(r.adapter, "train") for r in requests}
            sync()
            start = time.perf_counter()
            out = run_decode(generation, requests, first)
            sync()
            seconds = time.perf_counter() - start
            if log.settings is None:
                log.settings = _decode_settings(requests[0])
            log.decodes.append(
                {
                    "requests": len(requests),
                    "rows": sum(len(r.prompts) for r in requests),
                    "prompt_width": max(len(p) for r in requests for p in r.prompts),
                    "tokens": sum(len(c) for completions in out for c in completions),
                    "seconds": seconds,
                    "phase": phases.pop() if len(phases) == 1 else "mixed",
                }
            )
            return out

        def flagged(trials: DeviceTrials, runtime: Any, max_batches: int | None = None) -> Any:
            name = runtime.state.adapter_name
            log._phase[name] = "eval" if max_batches is None else "check"
            try:
                return evaluate(trials, runtime, max_batches)
            finally:
                log._phase.pop(name, None)

        Generation.decode = timed  # type: ignore[method-assign,assignment]
        DeviceTrials.evaluate = flagged  # type: ignore[method-assign,assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._originals is not None
        Generation.decode, DeviceTrials.evaluate = self._originals  # type: ignore[method-assign]


def _decode_settings(request: DecodeRequest) -> dict[str, Any]:
    keep = ("max_new_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "do_sample")
    return {name: getattr(request, name) for name in keep} | {"eos_token_ids": list(request.eos_token_ids)}


class PassLog:
    """Every chunk an engine trains for the scheduler, in :attr:`passes`: ``[start, seconds, engine, members,
    steps]`` (``time.time()`` at its start; ``steps``: the members' chunk indices). A fused gang's chunk is one
    entry (its members train in shared passes); a fused engine's gang that trains time-sliced is one entry too.
    A streamed gang (members at any step, joining and leaving between passes) has one entry per shared pass,
    engine ``"stream"``, its ``steps`` the chunk each member is in."""

    def __init__(self) -> None:
        self.passes: list[list[Any]] = []
        self._originals: tuple[Any, Any, Any] | None = None
        self._depth = threading.local()  # the fused engine's gangs it cannot fuse go through the time-sliced one

    def __enter__(self) -> PassLog:
        log = self
        fused, sliced, streamed = self._originals = (FusedEngine.run, TimeSlicedEngine.run, GangStream._pass)

        def stream_pass(stream: Any, seated: Any, *args: Any) -> Any:
            start = time.time()
            try:
                return streamed(stream, seated, *args)
            finally:
                steps = [seat.runtime.state.position.chunks_done for seat in seated]
                log.passes.append([start, time.time() - start, "stream", len(seated), steps])

        GangStream._pass = stream_pass  # type: ignore[method-assign]

        def logged(original: Any) -> Any:
            def run(engine: Any, runtimes: Any) -> Any:
                depth = getattr(log._depth, "value", 0)
                log._depth.value = depth + 1
                start = time.time()
                try:
                    results = original(engine, runtimes)
                finally:
                    log._depth.value = depth
                if depth == 0:
                    steps = [r.step for r in results if isinstance(r, ChunkResult)]
                    log.passes.append([start, time.time() - start, engine.name, len(runtimes), steps])
                return results

            return run

        FusedEngine.run = logged(fused)  # type: ignore[method-assign]
        TimeSlicedEngine.run = logged(sliced)  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._originals is not None
        FusedEngine.run, TimeSlicedEngine.run, GangStream._pass = self._originals  # type: ignore[method-assign]


class PackageLog(logging.Handler):
    """The package's log lines while in use (``[seconds since it began, level, message]`` in :attr:`lines`), and
    in :attr:`compile_seconds` the first-pass seconds (compilation included) of every layout the launched pass
    compiled in a pass, and in :attr:`background_seconds` those of its compilations in the background."""

    _COMPILED = "Compiled the launched pass"
    _BACKGROUND = "Background compilation"

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[list[Any]] = []
        self.compile_seconds: list[float] = []
        self.background_seconds: list[float] = []  # compilations in the background (no pass waited for them)
        self._began = time.time()

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        self.lines.append([round(record.created - self._began, 2), record.levelname, message])
        if message.startswith(self._COMPILED) and isinstance(record.args, tuple) and len(record.args) > 1:
            self.compile_seconds.append(float(record.args[1]))
        if message.startswith(self._BACKGROUND) and isinstance(record.args, tuple) and len(record.args) > 1:
            self.background_seconds.append(float(record.args[1]))

    def __enter__(self) -> PackageLog:
        self._began = time.time()
        logging.getLogger("optuna_rapidfire").addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger("optuna_rapidfire").removeHandler(self)
