"""Training engines: how live trials share a device.

``_base`` is the contract the device's worker calls; ``_trials`` the services every engine composes
(building, snapshots, evaluation, export, finishing a chunk), with ``_placement`` (memory budget and the
model's routing) and ``_clones`` (starting a clone from its parent). ``_time_sliced`` trains one trial at a
time; ``_fused_engine`` trains gangs in shared passes: ``_fusion`` decides whether a gang can share them,
``_gang_passes`` lays them out, ``_gang_training`` and ``_gang_evaluation`` run them (the kernels are in
:mod:`optuna_rapidfire._fused`), through ``_launched``'s compiled layouts where it can. :data:`ENGINES`
names them, as the schedules' registry does.
"""

from __future__ import annotations

from optuna_rapidfire._engines._base import Engine
from optuna_rapidfire._engines._fused_engine import FusedEngine
from optuna_rapidfire._engines._time_sliced import TimeSlicedEngine

ENGINES: dict[str, type[Engine]] = {engine.name: engine for engine in (TimeSlicedEngine, FusedEngine)}
"""The engines ``RapidFireExecutor(engine=...)`` knows by name."""

__all__ = ["ENGINES", "Engine"]
