"""How this benchmark watches the package, and every private name of it that the parts read, in one place.

When the package's internals move (engine classes split, modules renamed), this module is the one to fix: the
parts import only its public names. (The standalone probes, ``benchmarks/fused_*.py`` and
``benchmarks/compile_probe.py``, call the fused pass's functions themselves: that is what they measure;
``benchmarks/stream_profile.py`` listens to the events.) Every log is a context manager that stops listening on exit.

Listened to (the package's events, :mod:`optuna_rapidfire.events`, no patch):

- :class:`Recorder`: ``ChunkTrained`` (each chunk's tokens, training and evaluation seconds, whatever engine
  trained it) and ``Switched`` (the switch to another trial's state, synchronized on a GPU while listened to);
- :class:`PassLog`: ``PassTrained`` (every chunk an engine trains for the scheduler, and every shared pass of a
  stream: its members, steps and seconds);
- :class:`DecodeLog`: ``Decoded`` (every GRPO decode: its requests, rows, widest prompt, generated tokens,
  synchronized seconds, what it served, the sampling settings);
- :class:`GangTrainingWindows`: ``GangTrained`` (the synchronized wall-clock window of each gang's shared
  training, a fused chunk's or a stream pass's);
- :class:`StudyTimes`: ``ChunkTrained``, ``TrialBuilt`` and ``Checkpointed`` (evaluation, build and state-copy
  seconds summed: where an executor's time goes outside its passes).

Nothing of the package is patched. :class:`PackageLog` keeps the package's log lines and reads the seconds of each
compiled layout's first pass from the launched pass's "Compiled the launched pass" line.

Read as they are:

- :data:`PASS_TOKENS`: the fused engine's default cap of tokens per pass, recorded with the fused part's results;
- :data:`attrs`: the keys of the trial attributes the package writes (worker, fail reason, clone, parent);
- :class:`ChunkPlan`: which train rows each chunk holds (plain TRL visits them in the executor's order);
- :class:`DecodeRequest`, :func:`decode`: the fused decode, called directly for the GRPO decode ceiling.
"""

from __future__ import annotations

import abc
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from optuna_rapidfire import events
from optuna_rapidfire._engines._gang_passes import PASS_TOKENS
from optuna_rapidfire._fused._fused_decode import DecodeRequest, decode
from optuna_rapidfire._resident._data import ChunkPlan
from optuna_rapidfire._study import _attrs as attrs

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = [
    "PASS_TOKENS",
    "ChunkPlan",
    "DecodeLog",
    "DecodeRequest",
    "GangTrainingWindows",
    "PackageLog",
    "PassLog",
    "Recorder",
    "StudyTimes",
    "attrs",
    "decode",
]


class _Listener(abc.ABC):
    """A log of the package's events of :attr:`KINDS` (only those: some make the device wait while listened to),
    listening while in a ``with`` block."""

    KINDS: tuple[type, ...] = ()
    _registration: Callable[[], None]

    @abc.abstractmethod
    def _hear(self, event: events.Event) -> None:
        """Take one event of :attr:`KINDS`."""

    def __enter__(self) -> Self:
        self._registration = events.listen(self._hear, *self.KINDS)
        return self

    def __exit__(self, *exc: object) -> None:
        self._registration()


class Recorder(_Listener):
    """Listens to the engine's events: chunk timings, tokens, evaluation time, switch latency (synchronized)."""

    KINDS = (events.ChunkTrained, events.Switched)

    def __init__(self) -> None:
        self.first_report: dict[int, float] = {}
        self.eval_seconds = 0.0
        self.train_seconds = 0.0
        self.tokens = 0
        self.switches: list[float] = []
        self.chunks: list[dict[str, float]] = []  # per chunk: step, tokens, train seconds

    def _hear(self, event: events.Event) -> None:
        if isinstance(event, events.ChunkTrained):
            self.tokens += event.tokens
            self.eval_seconds += event.eval_seconds
            self.train_seconds += event.train_seconds
            self.chunks.append({"step": event.step, "tokens": event.tokens, "train_seconds": event.train_seconds})
            if event.step == 0:
                self.first_report.setdefault(event.trial, time.perf_counter())
        elif isinstance(event, events.Switched):
            self.switches.append(event.seconds)

    def steady_tokens_per_second(self) -> float:
        """Training tokens/s over every trial's chunks after its first (warm kernels, allocator, caches)."""
        later = [c for c in self.chunks if c["step"] > 0] or self.chunks
        return sum(c["tokens"] for c in later) / max(sum(c["train_seconds"] for c in later), 1e-9)


class GangTrainingWindows(_Listener):
    """The wall-clock windows (``time.time_ns()``, the device synchronized at both ends) of the training of every
    fused gang's chunk and of every stream pass (the worker thread's), in :attr:`windows`. From ``GangTrained``
    events."""

    KINDS = (events.GangTrained,)

    def __init__(self) -> None:
        self.windows: list[tuple[int, int]] = []

    def _hear(self, event: events.Event) -> None:
        if isinstance(event, events.GangTrained):
            self.windows.append((event.start_ns, event.end_ns))


class DecodeLog(_Listener):
    """Every decode an engine runs: its requests, rows, widest prompt, generated tokens, seconds (device
    synchronized before and after) and phase ("train", "eval", "check": the metric-name check of the first
    trial built, or "mixed"); :attr:`settings`: the first one's sampling settings. From ``Decoded`` events."""

    KINDS = (events.Decoded,)

    def __init__(self) -> None:
        self.decodes: list[dict[str, Any]] = []
        self.settings: dict[str, Any] | None = None  # the first request's sampling settings

    def _hear(self, event: events.Event) -> None:
        if not isinstance(event, events.Decoded):
            return
        if self.settings is None:
            self.settings = dict(event.sampling)
        self.decodes.append(
            {
                "requests": len(event.trials),
                "rows": event.rows,
                "prompt_width": event.prompt_width,
                "tokens": event.new_tokens,
                "seconds": event.seconds,
                "phase": event.phase,
            }
        )


class PassLog(_Listener):
    """Every chunk an engine trains for the scheduler, in :attr:`passes`: ``[start, seconds, engine, members,
    steps]`` (``time.time()`` at its start; ``steps``: the members' chunk indices). A fused gang's chunk is one
    entry (its members train in shared passes); a fused engine's gang that trains time-sliced is one entry too.
    A streamed gang (members at any step, joining and leaving between passes) has one entry per shared pass,
    engine ``"stream"``, its ``steps`` the chunk each member is in. From the package's ``PassTrained`` events."""

    KINDS = (events.PassTrained,)

    def __init__(self) -> None:
        self.passes: list[list[Any]] = []

    def _hear(self, event: events.Event) -> None:
        if isinstance(event, events.PassTrained):
            end = time.time()
            self.passes.append([end - event.seconds, event.seconds, event.engine, len(event.trials), list(event.steps)])


class StudyTimes(_Listener):
    """Where an executor's time goes outside its passes, summed from the package's events (none of which makes the
    device wait): ``evaluation`` (ChunkTrained's eval seconds), ``builds`` (TrialBuilt), ``state_copies`` (each
    chunk's state copied to the host for checkpoints, Checkpointed) with ``state_bytes``, and ``chunks``."""

    KINDS = (events.ChunkTrained, events.TrialBuilt, events.Checkpointed)

    def __init__(self) -> None:
        self.times: dict[str, float] = dict.fromkeys(("evaluation", "builds", "state_copies", "state_bytes"), 0.0)
        self.times["chunks"] = 0

    def _hear(self, event: events.Event) -> None:
        if isinstance(event, events.ChunkTrained):
            self.times["evaluation"] += event.eval_seconds
            self.times["chunks"] += 1
        elif isinstance(event, events.TrialBuilt):
            self.times["builds"] += event.seconds
        elif isinstance(event, events.Checkpointed):
            self.times["state_copies"] += event.capture_seconds
            self.times["state_bytes"] += event.bytes


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
