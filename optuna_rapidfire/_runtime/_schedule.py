"""What a schedule is: the contract between the device's scheduler and a policy of who trains next.

A schedule (Ray Tune's ``TrialScheduler`` is the model) gets a read-only :class:`TrialView` of each live
trial and the :class:`Reports` of the device, and decides: which ready trials train now, or which to stop
(:meth:`BaseSchedule.choose`, which may return a :class:`Stop`), which trials wait for a promotion and so
hold no slot (:meth:`BaseSchedule.waiting`), and whose reports a trial's pruning decision waits for
(:meth:`BaseSchedule.pruning_peers`). It changes nothing; the scheduler keeps the trials' states.
The schedules themselves are one module each (:mod:`._lockstep`, :mod:`._promote`); users import them
from :mod:`optuna_rapidfire.schedules`.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence


class Status(enum.Enum):
    """What a trial is doing on the device."""

    BUILDING = "building"  # registered, its state not created yet
    READY = "ready"  # may train its next chunk
    TRAINING = "training"  # on the device now
    AWAITING = "awaiting"  # reported a chunk; its driver has not decided yet
    PAUSED = "paused"  # keeps its state off the device, holds no slot, is not waited for
    GONE = "gone"  # left the device


@dataclass(frozen=True)
class TrialView:
    """A live trial as a schedule sees it: read-only, taken when the schedule is asked.

    Attributes:
        number: Optuna trial number.
        status: What the trial is doing.
        chunks_done: Chunks trained so far.
        reported: Highest step the trial has reported to Optuna (-1: none).
        awaiting_since: When the trial last became :attr:`Status.AWAITING` (``time.monotonic()``).
        mates: Numbers of the trials that trained the same step in the same pass (a fused gang's
            members at equal progress).
    """

    number: int
    status: Status
    chunks_done: int = 0
    reported: int = -1
    awaiting_since: float = 0.0
    mates: frozenset[int] = frozenset()


@dataclass(frozen=True)
class Reports:
    """What a schedule may read besides the live trials.

    Attributes:
        values: Every value reported on this device, by step (``values[step][trial number]``; finished and
            pruned trials' too).
        maximize: The study's direction.
        capacity: How many trials the device trains at once (``max_concurrent_trials``).
        last_change: When a trial last arrived or left (``time.monotonic()``).
        more_trials: Whether a new trial may still come: ``True`` (one is on its way), ``False`` (the study's
            budget is spent: none will), ``None`` (nobody can tell, as under a plain ``study.optimize``).
        arriving_since: Since when the oldest new trial on its way has been coming (``time.monotonic()``;
            ``None``: none is): it is being asked for and configured, and is built before the next pass.
        streaming: The device is asking between two passes of a running gang, whose free slots the trials
            chosen take at once (a trial that comes later takes a slot at a later pass): waiting for a member
            gains nothing.
        member_cost: How much longer a fused pass gets per extra member, as a share of a pass of the fewest
            members measured on this device (``None``: not measured yet; see ``_pass_costs.PassCosts``): a few
            hundredths where passes are bound by kernel launches, near ``1 / members`` and more where by arithmetic.
    """

    values: Mapping[int, Mapping[int, float]]
    maximize: bool = False
    capacity: int = 1
    last_change: float = 0.0
    more_trials: bool | None = None
    arriving_since: float | None = None
    streaming: bool = False
    member_cost: float | None = None


@dataclass(frozen=True)
class Stop:
    """A schedule's answer that stops trials now: each trial of ``reasons`` ends as PRUNED with its reason (as
    ASHA stops a trial no promotion can reach any more). Only READY trials are stopped."""

    reasons: Mapping[int, str]


class BaseSchedule(ABC):
    """Which ready trials train next. Pure: it looks at the live trials and changes nothing.

    Attributes:
        name: The name ``RapidFireExecutor(schedule=...)`` accepts for it.
    """

    name: str = ""

    @abstractmethod
    def choose(
        self, live: Sequence[TrialView], *, fuse: bool, now: float, reports: Reports | None = None
    ) -> list[TrialView] | Stop | float | None:
        """What the device does now.

        Args:
            live: The live trials, in number order.
            fuse: The engine trains a group of trials together (else one trial).
            now: ``time.monotonic()``.
            reports: The values reported so far (``None``: none known).

        Returns:
            The trials to train now (one unless ``fuse``); a :class:`Stop` of trials to end now; a number of
            seconds after which to ask again if nothing changes; or ``None``: wait for a change.
        """

    def waiting(self, live: Sequence[TrialView], reports: Reports) -> frozenset[int]:
        """The live trials that wait for a promotion: they hold no slot, so as many new trials may start
        beside them (their states stay off the device as the memory budget needs). By default none."""
        return frozenset()

    def pruning_peers(self, trial: TrialView) -> frozenset[int] | None:
        """Whose reports a trial's pruning decision at its latest step waits for.

        The study's pruner is asked twice (a first pass lets stateful pruners record the step); each pass
        waits until the trials returned here have reached it at the same step, so that they are judged
        alike whichever reports first.

        Returns:
            Trial numbers to wait for: by default the trial's :attr:`~TrialView.mates` (the members of
            its fused pass at equal progress), so a decision is taken at once, against every trial that
            has reported the step; ``None``: every live trial (a round barrier).
        """
        return trial.mates

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
