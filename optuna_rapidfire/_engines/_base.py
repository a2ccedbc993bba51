"""The contract between the device's worker thread and a training engine."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

    from peft import PeftConfig
    from transformers import TrainingArguments

    from optuna_rapidfire._trainers._base import TrainerKind


@dataclass(frozen=True)
class CloneOf:
    """A trial that starts from another trial's state.

    Attributes:
        parent: Number of the trial to copy.
        warm: Continue from the parent's state at its latest chunk boundary (else start cold, from
            scratch, with the new params).
        fetch: Loads the parent's latest checkpoint from the artifact store (when it is neither live on
            this device nor saved on this machine); raises when there is none or it is unusable.
        resume: The trial is Optuna's retry of ``parent``, whose worker died: continue from its
            checkpoint (and only from that).
    """

    parent: int
    warm: bool = True
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
        snapshot: The trial's state after the chunk (CPU copies), when the trial is checkpointed.
    """

    step: int
    metrics: dict[str, float]
    last: bool
    train_seconds: float = 0.0
    eval_seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    snapshot: Any = None


class Engine(ABC):
    """Trains trials on one device, one call per chunk.

    All methods run on the device's worker thread. An engine owns the per-trial runtime objects it
    returns from :meth:`build`; the scheduler only passes them back.
    """

    @abstractmethod
    def build(self, spec: TrialSpec) -> Any:
        """Create the trial's state (adapter, optimizer, schedule, RNG); raise if the config is unusable."""

    @abstractmethod
    def total_chunks(self, runtime: Any) -> int:
        """How many chunks the trial trains if nothing stops it."""

    @abstractmethod
    def branch(self, runtime: Any) -> Branch | None:
        """How a clone started (``None`` for a trial that is not a clone)."""

    @abstractmethod
    def pause(self, runtime: Any) -> None:
        """Move an idle trial's state off the device until it trains again."""

    @abstractmethod
    def snapshot(self, runtime: Any) -> Any:
        """The trial's state at its latest chunk boundary, as CPU copies (a per-chunk checkpoint)."""

    @abstractmethod
    def save_snapshot(self, runtime: Any) -> None:
        """Write the trial's state to its snapshot folder (what clones of it start from)."""

    @abstractmethod
    def run_chunk(self, runtime: Any) -> ChunkResult:
        """Train the trial's next chunk, then evaluate it."""

    @abstractmethod
    def evaluate(self, runtime: Any, max_batches: int | None = None) -> dict[str, float]:
        """Evaluate the trial's adapter now (on the first ``max_batches`` eval batches only, if given)."""

    @abstractmethod
    def save_adapter(self, runtime: Any, directory: str) -> None:
        """Write the trial's adapter in PEFT's format."""

    @abstractmethod
    def release(self, runtime: Any) -> None:
        """Free the trial's state; safe to call on a half-built or already released trial."""
