"""The contract between the device's worker thread and a training engine, and what flows through it.

The worker hands an :class:`Engine` a :class:`TrialSpec` to build and gets back the engine's runtime object,
then asks it to :meth:`~Engine.run` groups of runtimes (one trial, or a gang when the engine fuses) and gets a
:class:`ChunkResult` per trial. :class:`EngineStats` are the engine's counters, read from any thread.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    import torch
    from peft import PeftConfig
    from transformers import TrainingArguments

    from optuna_rapidfire._engines._gang_stream import Refill
    from optuna_rapidfire._engines._trials import DeviceTrials, TrialRuntime
    from optuna_rapidfire._resident._snapshot import TrialSnapshot
    from optuna_rapidfire._trainers._base import TrainerKind


@dataclass(frozen=True)
class CloneOf:
    """A trial that starts from another trial's state.

    Attributes:
        parent: Number of the trial to copy.
        warm: Continue from the parent's state at chunk boundary ``step`` (else start cold, from
            scratch, with the new params).
        step: The parent's chunk boundary to branch from (the parent's chunks done when the clone was
            asked for, or the one named); ``None``: the latest.
        fetch: Loads the parent's kept state at ``step`` (the study's chunk states, or for a retry its
            predecessor's checkpoint); raises when there is none or it is unusable.
        resume: The trial is Optuna's retry of ``parent``, whose worker died: continue from its
            checkpoint (and only from that).
    """

    parent: int
    warm: bool = True
    step: int | None = None
    fetch: Callable[[], Any] | None = field(default=None, compare=False)
    resume: bool = False


@dataclass(frozen=True)
class Branch:
    """How a clone actually started.

    Attributes:
        parent: The parent's trial number.
        step: Chunks the parent had trained when the clone was made: the clone's first step.
        warm: Whether the clone continues from the parent's state.
        reason: Why a requested warm clone started cold.
        history: The parent's per-chunk metrics up to ``step`` (a warm clone inherits them).
        resume: The trial is a retry resuming its dead predecessor ``parent``.
    """

    parent: int
    step: int
    warm: bool
    reason: str | None = None
    history: list[dict[str, float]] = field(default_factory=list)
    resume: bool = False


@dataclass(frozen=True)
class TrialSpec:
    """Everything an engine needs to build a trial.

    Attributes:
        number: Optuna trial number.
        peft_config: The trial's adapter config (the user's own object, copied before use).
        args: The trial's training args as the user wrote them.
        kind: The TRL trainer type the args select.
        adapter_dir: Where the trial's final adapter is written if it completes.
        state_dir: Folder of the study's trial snapshots (``<state_dir>/trial-<number>``).
        clone_of: Set when the trial is a clone.
        checkpoint: Capture the trial's state after every chunk (:attr:`ChunkResult.snapshot`): what its
            checkpoints and the chunk states clones branch from are made of.
    """

    number: int
    peft_config: PeftConfig
    args: TrainingArguments
    kind: TrainerKind
    adapter_dir: str
    state_dir: str
    clone_of: CloneOf | None = None
    checkpoint: bool = False


@dataclass
class ChunkResult:
    """What one chunk produced.

    Attributes:
        step: The Optuna step to report (the trial's global chunk count before this chunk).
        metrics: Evaluation metrics (``eval_*``) and training metrics (``train_*``) of the chunk.
        last: Whether this was the trial's final chunk.
        train_seconds: Wall time of the training part.
        eval_seconds: Wall time of the evaluation part.
        snapshot: The trial's state after the chunk (CPU copies), when its spec asks for it.
    """

    step: int
    metrics: dict[str, float]
    last: bool
    train_seconds: float = 0.0
    eval_seconds: float = 0.0
    snapshot: Any = None


@dataclass(frozen=True)
class EngineStats:
    """Counters of a device's engine at one moment, for benchmarks and tests.

    Attributes:
        switches: How many times the device switched from training one trial to training another alone.
        switch_seconds: Host time of each of those switches.
        offloads: How many times an idle trial's state was moved to CPU memory.
        fused_steps: Steps of shared passes (the fused engine's gangs).
        pass_tokens: The most tokens one shared pass takes now (lowered after a pass ran out of memory);
            ``None`` for an engine without shared passes.
        live_trials: Trials built and not yet released.
        resident_trials: Live trials whose state is on the device.
        state_bytes: Each live trial's state (adapter weights and optimizer moments), in the order built.
        adapters: The adapters in the resident model (one per live trial, none once every trial left).
        base_bytes: The base model's weights and buffers.
        eval_rows: Rows of the evaluation set (after ``eval_samples``).
        decodes: Decode batches run for trials that sample completions (GRPO).
        decoded_requests: The trials' generation requests those batches served (more than ``decodes``
            when the members of a gang decoded together).
        launched_steps: Of ``fused_steps``, those that took the launched pass (compiled or not).
        compiles: Graphs the launched pass compiled (per layout and shape; a trial joining a seen layout
            adds none).
        compile_failures: Layouts whose compilation failed (they run uncompiled).
        gang_fill: How many passes of streamed gangs trained each number of members (index: members).
        graphs_recorded: Shapes of streamed passes and optimizer steps recorded as CUDA graphs.
        graph_replays: Passes and optimizer steps replayed from them.
        graph_failures: Shapes that could not be recorded (they run kernel by kernel).
    """

    switches: int = 0
    switch_seconds: tuple[float, ...] = ()
    offloads: int = 0
    fused_steps: int = 0
    pass_tokens: int | None = None
    live_trials: int = 0
    resident_trials: int = 0
    state_bytes: tuple[int, ...] = ()
    adapters: tuple[str, ...] = ()
    base_bytes: int = 0
    eval_rows: int = 0
    decodes: int = 0
    decoded_requests: int = 0
    launched_steps: int = 0
    compiles: int = 0
    compile_failures: int = 0
    gang_fill: tuple[int, ...] = ()
    graphs_recorded: int = 0
    graph_replays: int = 0
    graph_failures: int = 0


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

    def snapshot(self, runtime: TrialRuntime) -> TrialSnapshot:
        """The trial's state at its latest chunk boundary, as CPU copies (a per-chunk checkpoint)."""
        return self.trials.snapshot(runtime)

    def save_snapshot(self, runtime: TrialRuntime) -> None:
        """Write the trial's state to its snapshot folder (what clones of it start from)."""
        self.trials.save_snapshot(runtime)

    def evaluate(self, runtime: TrialRuntime, max_batches: int | None = None) -> dict[str, float]:
        """Evaluate the trial's adapter now (on the first ``max_batches`` eval batches only, if given)."""
        return self.trials.evaluate(runtime, max_batches)

    def save_adapter(self, runtime: TrialRuntime, directory: str) -> None:
        """Write the trial's adapter in PEFT's format."""
        self.trials.save_adapter(runtime, directory)

    def release(self, runtime: TrialRuntime) -> None:
        """Free the trial's state; safe to call on a half-built or already released trial."""
        self.trials.release(runtime)

    def close(self) -> None:  # noqa: B027 (a no-op for engines that hold nothing beyond the trials)
        """Drop what the engine holds of the device's model (the device is closing)."""
