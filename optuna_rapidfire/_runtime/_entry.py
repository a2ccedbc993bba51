"""A trial as the device's scheduler sees it (:class:`Entry`), and what its driver and the worker tell each other
about it: a :class:`Decision` after a chunk, the :class:`Request` it leaves, the :class:`Task` the worker gets."""

from __future__ import annotations

import enum
import queue
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from optuna_rapidfire._runtime._schedule import Status, TrialView

if TYPE_CHECKING:
    from optuna_rapidfire._engines._types import TrialRuntime, TrialSpec


class Decision(enum.Enum):
    """What a trial's driver decided after a chunk (as Ray Tune's schedulers answer a result)."""

    CONTINUE = "continue"  # train the next chunk
    PAUSE = "pause"  # a person stopped it: move its state off the device, keep it
    FINISH = "finish"  # complete: save its adapter, then release it
    STOP = "stop"  # pruned, failed or deleted: release its state


class Request(enum.Enum):
    """Housekeeping a decision leaves for the device's worker."""

    PAUSE = "pause"
    FINISH = "finish"
    RELEASE = "release"


class Task(enum.Enum):
    """What the worker is asked to do, for the list of entries the task carries (one, except a fused TRAIN)."""

    BUILD = "build"
    TRAIN = "train"  # one trial, or a group for an engine that fuses (which trials: the schedule's choice)
    PAUSE = "pause"
    FINISH = "finish"
    RELEASE = "release"


@dataclass(frozen=True)
class Stopped:
    """Event for a READY trial its schedule stopped (a :class:`Stop`): end it as PRUNED, for ``reason``."""

    reason: str


_LIVE = (Status.BUILDING, Status.READY, Status.TRAINING, Status.AWAITING)


@dataclass(eq=False)
class Entry:
    """One trial as the scheduler sees it.

    Attributes:
        number: Optuna trial number (unique within the study).
        trial_id: Optuna trial id (unique within the storage).
        spec: What the engine needs to build the trial.
        status: What the trial is doing.
        request: Housekeeping asked for and not done yet.
        chunks_done: Chunks trained so far.
        reported: Highest step the trial has reported to Optuna (-1: none).
        screened: Highest step for which the trial's first pruning pass ran (-1: none).
        awaiting_since: When the trial last became AWAITING (``time.monotonic()``).
        mates: Numbers of the trials that trained the same step in the same pass (a fused gang's
            members at equal progress): under a schedule without barriers they decide together.
        held: A queued trial its driver acts on (a person's command, :meth:`Scheduler.hold`): not built
            meanwhile, and not READY once built, until its driver decides.
        taken: The device's worker took the trial's build.
        events: What the worker tells the trial's Optuna thread, in order.
        runtime: The engine's per-trial object, owned by the worker thread.
    """

    number: int
    trial_id: int
    spec: TrialSpec
    status: Status = Status.BUILDING
    request: Request | None = None
    chunks_done: int = 0
    reported: int = -1
    screened: int = -1
    awaiting_since: float = 0.0
    mates: frozenset[int] = frozenset()
    held: bool = False
    taken: bool = False
    events: queue.Queue[Any] = field(default_factory=queue.Queue)
    runtime: TrialRuntime | None = None

    @property
    def live(self) -> bool:
        """Counts in the lock-step rounds: registered, not paused, not leaving."""
        return self.status in _LIVE and self.request is None

    @property
    def gone(self) -> bool:
        return self.status is Status.GONE

    @property
    def leaving(self) -> bool:
        """Gone, or its driver asked the device to save or free it (the device may be freeing it still, after the
        driver got its answer): nothing more for its driver to ask."""
        return self.status is Status.GONE or self.request in (Request.FINISH, Request.RELEASE)

    @property
    def built(self) -> TrialRuntime:
        """The engine's runtime of a trial the device has built (an error to ask of one not built)."""
        if self.runtime is None:
            raise RuntimeError(f"Trial {self.number} has not been built on the device.")
        return self.runtime

    @property
    def buildable(self) -> bool:
        """Registered, not built nor being built, not held."""
        return self.status is Status.BUILDING and not self.taken and not self.held

    def view(self) -> TrialView:
        """What a schedule sees of the trial now."""
        return TrialView(self.number, self.status, self.chunks_done, self.reported, self.awaiting_since, self.mates)
