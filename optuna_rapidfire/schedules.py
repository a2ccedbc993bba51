"""Schedules: which live trials of a device train next (``RapidFireExecutor(schedule=...)``).

Like Optuna's pruners, one small class per policy; the executor also takes their names:

* :class:`PromoteSchedule` (``"promote"``, the default): asynchronous, leaders first, no barriers;
* :class:`LockstepSchedule` (``"lockstep"``): chunk k of every live trial before anyone's chunk k+1.

Per-chunk values do not depend on the schedule: a trial trains the same chunks with the same state
whichever trials it shares the device with, and in whatever order.
"""

from __future__ import annotations

from optuna_rapidfire._runtime._scheduler import BaseSchedule, LockstepSchedule, PromoteSchedule

__all__ = ["BaseSchedule", "LockstepSchedule", "PromoteSchedule"]
