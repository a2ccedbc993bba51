"""What flows between the device's worker, its engine and the engine's parts: plain data, no behaviour.

A leaf of the engines: every engine module, the device's worker and the study's side import these types from
here, and this module imports nothing of theirs (so no engine module needs another for a type).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from collections.abc import Callable, Hashable

    from datasets import Dataset
    from peft import PeftConfig
    from transformers import Trainer, TrainingArguments

    from optuna_rapidfire._resident._snapshot import TrialSnapshot
    from optuna_rapidfire._resident._state import SwapState
    from optuna_rapidfire._trainers._base import TrainerKind
    from optuna_rapidfire._trainers._host import Member


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
        study_name: The study's name, written into the trial's snapshots.
    """

    number: int
    peft_config: PeftConfig
    args: TrainingArguments
    kind: TrainerKind
    adapter_dir: str
    state_dir: str
    clone_of: CloneOf | None = None
    checkpoint: bool = False
    study_name: str = ""


@dataclass
class ChunkResult:
    """What one chunk produced.

    Attributes:
        step: The Optuna step to report (the trial's global chunk count before this chunk).
        metrics: Evaluation metrics (``eval_*``) and training metrics (``train_*``) of the chunk.
        last: Whether this was the trial's final chunk.
        train_seconds: Wall time of the training part; in a gang's shared passes the trial's share of them (each
            pass's time over its members), so a gang's members add up to the gang's training time.
        eval_seconds: Wall time of the evaluation part.
        snapshot: The trial's state after the chunk (CPU copies), when its spec asks for it.
        snapshot_seconds: How long the device's worker took to copy that state to the host.
    """

    step: int
    metrics: dict[str, float]
    last: bool
    train_seconds: float = 0.0
    eval_seconds: float = 0.0
    snapshot: Any = None
    snapshot_seconds: float = 0.0


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
        scoring_passes: Shared passes without gradients of GRPO gangs: the members' references (adapters
            off), their old policies (a rollout reused, ``num_iterations`` > 1) or their evaluations' policies,
            each one pass for every member waiting.
        prefix_passes: Of the GRPO gangs' shared passes (``fused_steps`` and ``scoring_passes``), those whose
            rows of one prompt shared its tokens (:mod:`optuna_rapidfire._trainers.grpo._prefix`).
        stacked_passes: Of the GRPO gangs' shared passes with adapters, those whose layers read the members'
            adapters from stacks kept for the gang (:mod:`optuna_rapidfire._fused._stacks`): layers where every
            member has one rank, on equal rows.
        launched_steps: Of ``fused_steps``, those that took the launched pass (compiled or not).
        compiles: Graphs the launched pass compiled (per layout and shape; a trial joining a seen layout
            adds none).
        compile_failures: Layouts whose compilation failed (they run uncompiled).
        gang_fill: How many passes of streamed gangs trained each number of members (index: members).
        graphs_recorded: Shapes of streamed passes and optimizer steps recorded as CUDA graphs.
        graph_replays: Passes and optimizer steps replayed from them.
        graph_failures: Shapes that could not be recorded (they run kernel by kernel).
        graph_calls: Calls of the recorded passes by kind (``pass``: a training pass, ``step``: the gang's
            optimizer step, ``eval``: an evaluation pass), whether recorded, replayed or run as they are.
        gang_seconds: Where the host time of GRPO gangs went: ``members`` (each member's own TRL code between
            the shared steps, one member at a time), ``decode``, ``rewards``, ``logps`` (shared scoring and
            policy forward passes) and ``backward`` (shared steps; a step's time includes its waits for the
            device). Empty without GRPO gangs.
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
    scoring_passes: int = 0
    prefix_passes: int = 0
    stacked_passes: int = 0
    launched_steps: int = 0
    compiles: int = 0
    compile_failures: int = 0
    gang_fill: tuple[int, ...] = ()
    graphs_recorded: int = 0
    graph_replays: int = 0
    graph_failures: int = 0
    graph_calls: dict[str, int] = field(default_factory=dict)
    gang_seconds: dict[str, float] = field(default_factory=dict)


@dataclass(eq=False)
class TrialRuntime:
    """A built trial: its spec, TRL trainer, swappable state and chunk plan."""

    spec: TrialSpec
    args: TrainingArguments
    forward: Any
    trainer: Trainer
    state: SwapState
    data_key: Hashable
    steps_per_chunk: list[int]
    total_chunks: int
    history: list[dict[str, float]] = field(default_factory=list)
    branch: Branch | None = None
    last_used: float = field(default_factory=time.monotonic)
    tokens_at_last_chunk: int = 0  # the trainer's count of training tokens when its last chunk ended
    released: bool = False
    # The last chunk's checkpoint (see DeviceTrials.snapshot) and where the trial stood when it was taken.
    kept_snapshot: tuple[tuple[int, int, int], TrialSnapshot] | None = field(default=None, repr=False)
    # Where the trial stood when its snapshot file was last handed to the writers (DeviceTrials.save_snapshot).
    saved_at: tuple[int, int, int] | None = None

    def prepare(self, dataset: Dataset, split: str) -> Dataset:
        return self.spec.kind.prepare(self.trainer, dataset, split)


def clips(args: TrainingArguments) -> bool:
    """Whether the trial clips its gradients (to ``max_grad_norm``) before each optimizer step."""
    return args.max_grad_norm is not None and args.max_grad_norm > 0


def train_metrics(
    runtime: TrialRuntime, step_losses: list[torch.Tensor], grad_norm: torch.Tensor | None
) -> dict[str, float]:
    """A trained chunk's ``train_*`` metrics: what the trial's trainer collected since the last chunk (TRL's
    token accuracy, entropy... when its own loss ran), the mean loss of its optimizer steps, the learning
    rate now, and the last step's gradient norm before clipping (when the trial clips)."""
    state = runtime.state
    metrics = {f"train_{k}": v for k, v in runtime.spec.kind.drain_metrics(runtime.trainer, "train").items()}
    metrics["train_loss"] = torch.stack(step_losses).mean().item()
    metrics["train_learning_rate"] = float(state.lr_scheduler.get_last_lr()[0])
    if grad_norm is not None:
        metrics["train_grad_norm"] = float(grad_norm)
    return metrics


def runtime_of(member: Member) -> TrialRuntime:
    """A kind's member (:class:`~optuna_rapidfire._trainers._host.Member`) as what it is on the device: every
    member a kind is handed is one of the device's trials."""
    assert isinstance(member, TrialRuntime), type(member)
    return member
