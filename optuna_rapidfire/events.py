"""What happens inside a study, as events delivered to listeners: the package's observation seam.

A listener is any callable that takes an event; :func:`listen` registers one for this process (as a
``logging`` handler is) and returns the function that removes it, which is also a context manager::

    from optuna_rapidfire import events

    def show(event: events.Event) -> None:
        if isinstance(event, events.ChunkTrained):
            print(f"trial {event.trial} chunk {event.step}: {event.train_seconds:.1f} s")

    with events.listen(show, events.ChunkTrained):
        executor.optimize(study, configure, n_trials=16)

Listeners are called synchronously, in the thread where the event happens (mostly the device's worker
thread, between and inside passes), in the order they were registered: keep them quick. Like a TRL
``TrainerCallback``, a listener that raises fails what it was listening to (the trial, or the gang whose
pass it watched): that is how tests inject a failure at a given point. Nothing is built or timed for an
event while nobody listens to its kind: name the kinds a listener wants (``listen(show, ChunkTrained)``), since
a listener of every event makes the device synchronize around each pass, switch and decode to time them.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union, get_args

if TYPE_CHECKING:
    import optuna

__all__ = [
    "AdapterSaved",
    "Checkpointed",
    "ChunkReported",
    "ChunkStarting",
    "ChunkTrained",
    "Compiled",
    "Decoded",
    "Evaluated",
    "Event",
    "GangTrained",
    "Listener",
    "ModelLoaded",
    "Offloaded",
    "PassStarting",
    "PassTrained",
    "Switched",
    "TrialActivity",
    "TrialBuilt",
    "TrialEnded",
    "TrialReady",
    "TrialStarted",
    "listen",
]


@dataclass(frozen=True)
class ModelLoaded:
    """The base model was loaded for a device (once per device and executor): ``model`` is the very module every
    trial's adapter is injected into, never copied."""

    device: str
    seconds: float
    model: Any


@dataclass(frozen=True)
class TrialBuilt:
    """A trial's state exists on a device: its adapter, trainer, optimizer (a warm clone's from its parent)."""

    trial: int
    device: str
    seconds: float
    branch_step: int | None  # the parent's chunk a warm clone or a retry continued from (``None``: fresh)
    # The optimizer's settings per parameter group (lr, weight_decay, betas...), as the trial starts training: a
    # warm clone's own, over its parent's moments.
    param_groups: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True)
class ChunkStarting:
    """The device is about to train these trials' next chunks, together (a fused gang) or one trial alone.

    ``steps[i]`` is the chunk (Optuna step) ``trials[i]`` trains, ``rows[i]`` the train set's rows (indices) in
    that chunk, in its order. A listener that waits here delays the chunks.
    """

    trials: tuple[int, ...]
    steps: tuple[int, ...]
    rows: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class Switched:
    """The device's model was set up for another trial trained alone (its adapter, forward, RNG, mode); on a GPU
    ``seconds`` is the device's time too (synchronized before and after while anyone listens)."""

    trial: int
    previous: int | None
    seconds: float


@dataclass(frozen=True)
class ChunkTrained:
    """A trial trained and evaluated a chunk: the result its driver reports to Optuna."""

    trial: int
    step: int
    metrics: dict[str, float]
    train_seconds: float
    eval_seconds: float
    last: bool
    tokens: int  # the training tokens of the chunk (TRL's count, which it reports as ``num_tokens``)


@dataclass(frozen=True)
class PassStarting:
    """The device is about to run one shared forward/backward pass of these trials (a fused gang's or a stream's;
    the optimizer steps of those whose accumulation ends follow it). A listener that raises fails the pass as an
    error of the pass would: before any member stepped, the members are trained one by one, alone."""

    trials: tuple[int, ...]


@dataclass(frozen=True)
class PassTrained:
    """The device trained, in ``seconds``: what the scheduler handed an engine (``engine`` ``"time_sliced"``: one
    trial's chunk; ``"fused"``: a gang's chunks, each member its own, in shared passes or in turns), or one
    shared pass of a stream (``"stream"``: one step of each seated member, members joining and leaving between
    passes). ``steps[i]`` is the chunk ``trials[i]`` was in. ``seconds`` is the host's: a stream's pass is
    queued on a GPU and may still run when it is emitted, unless someone listens to :class:`GangTrained` (which
    synchronizes the device around each pass). A stream's pass says too which micro-batch of its chunk each member
    trained (``batches[i]``, from 0) and how many compilations its forward and backward passes waited for
    (``compiles``: a compiled launched pass meeting a new layout or shape); both are empty and 0 elsewhere."""

    trials: tuple[int, ...]
    steps: tuple[int, ...]
    seconds: float
    engine: str
    batches: tuple[int, ...] = ()
    compiles: int = 0


@dataclass(frozen=True)
class GangTrained:
    """Trials trained together in shared passes: a fused gang's chunks, or one pass of a stream (their evaluation
    not included). ``start_ns``/``end_ns``: the wall clock (``time.time_ns()``), the device synchronized at both
    ends while anyone listens to this kind (to line the window up with a profiler's trace)."""

    trials: tuple[int, ...]
    start_ns: int
    end_ns: int


@dataclass(frozen=True)
class Decoded:
    """A decode batch of GRPO trials' generation requests ran (one trial's alone, or a gang's together): one request per
    trial, ``rows`` prompts in all (the widest ``prompt_width`` tokens), ``new_tokens`` generated, in ``seconds``
    (the device's time: synchronized while anyone listens). ``phase``: what the decode served, ``"train"`` (a
    training step), ``"eval"`` (an evaluation), ``"check"`` (the one-batch check of the first trial's metrics, for a
    metric other than ``eval_loss`` or the trainer's default) or ``"mixed"``; ``sampling``: the first request's
    sampling settings, as the decode applied them; ``completions``: each trial's completions (token ids, one tuple
    per prompt), in the order of ``trials``."""

    trials: tuple[int, ...]
    rows: int
    new_tokens: int
    seconds: float
    prompt_width: int
    phase: str
    sampling: dict[str, Any]
    completions: tuple[tuple[tuple[int, ...], ...], ...] = ()


@dataclass(frozen=True)
class Offloaded:
    """A trial's state (adapter and optimizer) was moved off the device to fit its state budget, or because the
    trial paused; ``gang``: the members of the gang running in turns on that device then (none is offloaded)."""

    trial: int
    gang: tuple[int, ...]


@dataclass(frozen=True)
class Compiled:
    """The fused engine compiled its launched pass for a gang layout (``seconds``: the first pass's)."""

    layout: str
    seconds: float


@dataclass(frozen=True)
class Evaluated:
    """Trials were evaluated: a gang together in shared forward passes (``shared``), or one trial alone by its own
    trainer's loop. ``phase``: ``"eval"`` (after a chunk) or ``"check"`` (the first batches, to learn the metrics'
    names, when the first trial is built and the metric is not ``eval_loss`` or the trainer's default).
    ``batch_tokens[i]``: the loss tokens of each of ``trials[i]``'s eval micro-batches in a shared evaluation (empty
    alone)."""

    trials: tuple[int, ...]
    shared: bool
    phase: str
    seconds: float
    batch_tokens: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class AdapterSaved:
    """A trial's final adapter was written to ``path`` (PEFT's format), before its driver records it; emitted by the
    trial's own thread, which writes the files while the device trains the others."""

    trial: int
    path: str


@dataclass(frozen=True)
class Checkpointed:
    """A trial's state after a chunk was kept (for retries and clones), ``bytes`` long, in ``where``;
    ``capture_seconds``: the device worker's time to copy it to the host (which the device's passes wait for)."""

    trial: int
    step: int
    bytes: int
    where: str
    capture_seconds: float


# -- the study's side: what a trial's driver records and reports (one ``optimize`` call's progress bars and MLflow
# runs are listeners of these, kept by that call; these reach the listeners of this module too) ---------------


@dataclass(frozen=True)
class TrialStarted:
    """A trial's config was checked and the trial registered on a device, to be built (``kind``: its trainer
    kind's name; ``metric``: the value it reports)."""

    study: optuna.Study
    trial: int
    params: dict[str, Any]
    kind: str
    metric: str


@dataclass(frozen=True)
class TrialReady:
    """A trial was built: its run has ``total_chunks`` chunks and starts after chunk ``start`` (a clone's branch, a
    retry's checkpoint; 0: from the start). A clone says its ``parent`` (``None``: not a clone), whether it is
    ``warm``, and the parent's values it inherits, one per chunk up to ``start`` (empty for a cold clone)."""

    study: optuna.Study
    trial: int
    total_chunks: int
    start: int
    parent: int | None
    warm: bool
    inherited: tuple[float, ...]


@dataclass(frozen=True)
class TrialActivity:
    """What a live trial does now: ``training``, ``waiting at its rung after chunk k``, ``paused``..."""

    study: optuna.Study
    trial: int
    activity: str


@dataclass(frozen=True)
class ChunkReported:
    """A trial reported ``value`` (its ``metric``) to Optuna after chunk ``step`` (0-based), with the chunk's
    other metrics and its seconds (training and evaluation)."""

    study: optuna.Study
    trial: int
    step: int
    metric: str
    value: float
    metrics: dict[str, float]
    seconds: float


@dataclass(frozen=True)
class TrialEnded:
    """A trial ended in ``state`` (``COMPLETE``, ``PRUNED``, ``FAIL``) with its last ``value``; ``adapter``: the
    folder its final adapter was saved in (``None``: none was)."""

    study: optuna.Study
    trial: int
    state: str
    value: float | None
    adapter: str | None


Event = Union[  # noqa: UP007
    ModelLoaded,
    TrialBuilt,
    ChunkStarting,
    Switched,
    ChunkTrained,
    PassStarting,
    PassTrained,
    GangTrained,
    Decoded,
    Offloaded,
    Compiled,
    Checkpointed,
    Evaluated,
    AdapterSaved,
    TrialStarted,
    TrialReady,
    TrialActivity,
    ChunkReported,
    TrialEnded,
]
"""Any event of this module."""

_KINDS: tuple[type, ...] = get_args(Event)

Listener = Callable[[Event], object]
"""A function called with every event (or with the kinds of event it was registered for)."""

_listeners: tuple[tuple[Listener, tuple[type, ...]], ...] = ()  # each with the kinds it wants (empty: all)
_lock = threading.Lock()


class _Registration:
    """Removes its listener when called, or on leaving a ``with`` block."""

    def __init__(self, listener: Listener) -> None:
        self._listener = listener

    def __call__(self) -> None:
        global _listeners
        with _lock:
            _listeners = tuple(entry for entry in _listeners if entry[0] is not self._listener)

    def __enter__(self) -> _Registration:
        return self

    def __exit__(self, *exc: object) -> None:
        self()


def listen(listener: Listener, *kinds: type) -> _Registration:
    """Call ``listener`` with every event in this process from now on, or only with the ``kinds`` of event named
    (``listen(log, ChunkTrained)``); the result removes it (call it, or use it as a context manager).

    Name the kinds a listener wants where it can: some events cost time to gather only while someone wants them
    (:class:`GangTrained`, :class:`Switched` and :class:`Decoded` synchronize the device to time it)."""
    if not callable(listener):
        raise TypeError(f"listener must be a callable taking an event, but got {listener!r}.")
    unknown = [kind for kind in kinds if kind not in _KINDS]
    if unknown:
        names = ", ".join(kind.__name__ for kind in _KINDS)
        raise TypeError(f"listen() takes kinds of event of this module ({names}), but got {unknown[0]!r}.")
    global _listeners
    with _lock:
        _listeners = (*_listeners, (listener, kinds))
    return _Registration(listener)


def listening(kind: type | None = None) -> bool:
    """Whether anyone listens (to events of ``kind``, if given), so that an event's data is gathered only then."""
    return any(not kinds or kind is None or kind in kinds for _, kinds in _listeners)


@contextlib.contextmanager
def window(trials: tuple[int, ...], device: Any) -> Iterator[None]:
    """Emit a :class:`GangTrained` for ``trials`` once the ``with`` block ends without an error, the ``device``
    synchronized at both ends (a CUDA device); nothing is timed or synchronized while nobody listens to it."""
    timed = listening(GangTrained)
    cuda = timed and getattr(device, "type", None) == "cuda"
    if cuda:
        import torch

        torch.cuda.synchronize(device)
    start = time.time_ns()
    yield
    if timed:
        if cuda:
            torch.cuda.synchronize(device)
        emit(GangTrained(trials, start, time.time_ns()))


def emit(event: Event) -> None:
    """Deliver ``event`` to every listener that wants its kind, in order; a listener's exception propagates."""
    for listener, kinds in _listeners:
        if not kinds or type(event) in kinds:
            listener(event)
