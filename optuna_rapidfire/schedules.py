"""Schedules: which live trials of a device train next (``RapidFireExecutor(schedule=...)``).

Like Optuna's pruners, one small class per policy; the executor also takes their names:

* :class:`PromoteSchedule` (``"promote"``, the default): ASHA's promotions, pruning decided at once; waiting
  trials hold no slot, and once the budget is spent those no promotion can reach are stopped
  (``"promote_all"``: trained on instead);
* :class:`LockstepSchedule` (``"lockstep"``): chunk k of every live trial before anyone's chunk k+1,
  pruning at round barriers.

A schedule of one's own subclasses :class:`BaseSchedule`: it gets a read-only :class:`TrialView` of each
live trial (its :class:`Status`, progress, last report) and the device's :class:`Reports`, returns whom to
train now (or a :class:`Stop` of trials to end) from :meth:`~BaseSchedule.choose`, and may say which trials
wait without a slot (:meth:`~BaseSchedule.waiting`) and whose reports a pruning decision waits for
(:meth:`~BaseSchedule.pruning_peers`).

Per-chunk values do not depend on the schedule: a trial trains the same chunks with the same state
whichever trials it shares the device with, and in whatever order.
"""

from __future__ import annotations

from optuna_rapidfire._runtime._lockstep import LockstepSchedule
from optuna_rapidfire._runtime._promote import PromoteSchedule
from optuna_rapidfire._runtime._schedule import BaseSchedule, Reports, Status, Stop, TrialView

__all__ = ["BaseSchedule", "LockstepSchedule", "PromoteSchedule", "Reports", "Status", "Stop", "TrialView"]
