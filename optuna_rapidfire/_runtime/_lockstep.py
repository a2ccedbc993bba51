"""The lock-step schedule: chunk k of every live trial before anyone's chunk k+1, pruning at round barriers."""

from __future__ import annotations

from typing import TYPE_CHECKING

from optuna_rapidfire._runtime._schedule import BaseSchedule, Status

if TYPE_CHECKING:
    from collections.abc import Sequence

    from optuna_rapidfire._runtime._schedule import Reports, TrialView


class LockstepSchedule(BaseSchedule):
    """Least progress first, and nobody ahead of a live trial with less: chunk k of all before chunk k+1.

    Every config is compared with every other on the same data at the same time; pruning decisions
    wait for round barriers. Trials all complete at the end of their wave.
    """

    name = "lockstep"

    def choose(
        self, live: Sequence[TrialView], *, fuse: bool, now: float, reports: Reports | None = None
    ) -> list[TrialView] | float | None:
        if not live:
            return None
        least = min(e.chunks_done for e in live)
        behind = [e for e in live if e.chunks_done == least]
        if fuse:
            if any(e.status in (Status.AWAITING, Status.BUILDING) for e in behind):
                return None  # a member of the group is still being decided on or built
            group = [e for e in behind if e.status is Status.READY]
            return group or None
        ready = next((e for e in behind if e.status is Status.READY), None)
        return None if ready is None else [ready]

    def pruning_peers(self, trial: TrialView) -> frozenset[int] | None:
        """Every live trial: a decision at step s waits until all have reported s (a round barrier)."""
        return None
