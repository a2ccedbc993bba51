"""The contract between the device's worker thread and a training engine, and what flows through it.

The worker hands an :class:`Engine` a :class:`~optuna_rapidfire._engines._types.TrialSpec` to build and gets back
the engine's runtime object, then asks it to :meth:`~Engine.run` groups of runtimes (one trial, or a gang when
the engine fuses) and gets a ``ChunkResult`` per trial. ``EngineStats`` are the engine's counters, read from any
thread. Those types live in :mod:`optuna_rapidfire._engines._types`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    import torch

    from optuna_rapidfire._engines._gang_stream import Refill
    from optuna_rapidfire._engines._trials import DeviceTrials
    from optuna_rapidfire._engines._types import Branch, ChunkResult, EngineStats, TrialRuntime, TrialSpec
    from optuna_rapidfire._resident._snapshot import TrialSnapshot


class Engine(ABC):
    """Trains trials on one device: the contract the device's worker calls.

    An engine decides only how chunks train (:meth:`run`); everything else about a trial (building,
    clones, snapshots, the memory budget, evaluation, export, release) is the device's
    :class:`~optuna_rapidfire._engines._trials.DeviceTrials`, which every engine composes. All methods run
    on the device's worker thread, except :meth:`stats`. The runtimes :meth:`build` returns are the
    engine's; the scheduler only passes them back.

    Args:
        trials: The device's trials.
    """

    #: Whether the engine trains the ready trials at the least progress together (the scheduler then hands
    #: :meth:`run` those gangs); else it gets one trial at a time.
    fuses: ClassVar[bool]
    #: The name ``RapidFireExecutor(engine=...)`` takes for it (the registry: ``optuna_rapidfire._engines.ENGINES``).
    name: ClassVar[str]

    def __init__(self, trials: DeviceTrials) -> None:
        self.trials = trials

    @classmethod
    def create(cls, trials: DeviceTrials, *, compile: str | bool, capacity: int, graphs: bool = False) -> Engine:
        """The engine for a device's ``trials``; ``compile``: the launched pass's backend (``False``: none),
        ``capacity``: the most trials trained at once, ``graphs``: replay passes from CUDA graphs. Each engine
        takes what it uses."""
        return cls(trials)

    @property
    def device(self) -> torch.device:
        """The device the engine trains on."""
        return self.trials.device

    @abstractmethod
    def run(self, runtimes: Sequence[TrialRuntime]) -> list[ChunkResult | BaseException]:
        """Train each trial's next chunk, then evaluate it.

        Returns:
            Each trial's chunk result, in order, or the error that failed that trial alone. An error that
            fails them all is raised.
        """

    def stream_refusal(self, runtimes: Sequence[TrialRuntime]) -> str | None:
        """Why this gang cannot train as a stream (:meth:`stream`; ``None``: it can). By default no gang can."""
        return "the engine trains each gang's chunks together"

    def stream(self, runtimes: Sequence[TrialRuntime], refill: Refill) -> None:
        """Train ``runtimes`` and whoever ``refill`` seats beside them, members at any step sharing every pass,
        each delivered through ``refill`` at the pass where its chunk ends, until none is left (an engine whose
        :meth:`stream_refusal` lets the gang through). An error that fails every seated member is raised."""
        raise RuntimeError(f"{type(self).__name__} cannot train this gang as a stream: {self.stream_refusal(runtimes)}")

    @abstractmethod
    def stats(self) -> EngineStats:
        """The engine's counters now; read from any thread, while the worker may be changing them."""

    def build(self, spec: TrialSpec) -> TrialRuntime:
        """Create the trial's state (adapter, optimizer, schedule, RNG); raise if the config is unusable."""
        return self.trials.build(spec)

    def total_chunks(self, runtime: TrialRuntime) -> int:
        """How many chunks the trial trains if nothing stops it."""
        return runtime.total_chunks

    def branch(self, runtime: TrialRuntime) -> Branch | None:
        """How a clone started (``None`` for a trial that is not a clone)."""
        return runtime.branch

    def pause(self, runtime: TrialRuntime) -> None:
        """Move an idle trial's state off the device until it trains again."""
        self.trials.placement.pause(runtime)

    def snapshot(self, runtime: TrialRuntime, keep: bool = False) -> TrialSnapshot:
        """The trial's state at its latest chunk boundary, as CPU copies (a per-chunk checkpoint, kept for the
        trial's snapshot file when ``keep``: see :meth:`DeviceTrials.snapshot`)."""
        return self.trials.snapshots([(runtime, keep)])[0]

    def snapshots(self, trials: Sequence[tuple[TrialRuntime, bool]]) -> list[TrialSnapshot]:
        """:meth:`snapshot` of each ``(runtime, keep)``, read from the device with one wait for it (a gang's members
        at the end of their chunk: :meth:`DeviceTrials.snapshots`)."""
        return self.trials.snapshots(trials)

    def save_snapshot(self, runtime: TrialRuntime) -> None:
        """Write the trial's state to its snapshot folder (what clones of it start from)."""
        self.trials.save_snapshot(runtime)

    def flush(self) -> None:
        """Wait until the snapshot files being written in the background are written."""
        self.trials.flush()

    def evaluate(self, runtime: TrialRuntime, max_batches: int | None = None) -> dict[str, float]:
        """Evaluate the trial's adapter now (on the first ``max_batches`` eval batches only, if given)."""
        return self.trials.evaluate(runtime, max_batches)

    def save_adapter(self, runtime: TrialRuntime, directory: str) -> Callable[[], None]:
        """Start saving the trial's adapter in PEFT's format into ``directory``: the function returned writes its
        files and needs nothing of the device (the trial's driver calls it: the device trains on meanwhile)."""
        return self.trials.save_adapters([(runtime, directory)])[0]

    def save_adapters(self, trials: Sequence[tuple[TrialRuntime, str]]) -> list[Callable[[], None]]:
        """:meth:`save_adapter` of each ``(runtime, directory)``, their weights copied off the device together (a
        gang's members finishing at once)."""
        return self.trials.save_adapters(trials)

    def release(self, runtime: TrialRuntime) -> None:
        """Free the trial's state; safe to call on a half-built or already released trial."""
        self.trials.release(runtime)

    def close(self) -> None:  # noqa: B027 (a no-op for engines that hold nothing beyond the trials)
        """Drop what the engine holds of the device's model (the device is closing)."""
