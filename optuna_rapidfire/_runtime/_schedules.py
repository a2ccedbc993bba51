"""The schedules by name: the registry ``RapidFireExecutor(schedule=...)``, ``tune`` and the errors read."""

from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING

from optuna_rapidfire._runtime._lockstep import LockstepSchedule
from optuna_rapidfire._runtime._promote import PromoteSchedule
from optuna_rapidfire._runtime._schedule import BaseSchedule

if TYPE_CHECKING:
    from collections.abc import Callable


SCHEDULES: dict[str, Callable[[], BaseSchedule]] = {
    "lockstep": LockstepSchedule,
    "promote": PromoteSchedule,
    "promote_all": functools.partial(PromoteSchedule, when_exhausted="promote"),
}
"""The schedules ``RapidFireExecutor(schedule=...)`` knows by name (``"promote_all"``: promote, training the
waiting trials on once the budget is spent, instead of ASHA's stop); ``"default"`` names :data:`DEFAULT_SCHEDULE`."""

DEFAULT_SCHEDULE = "promote"
"""The schedule ``"default"`` means: ASHA's promotion rule, chosen by a CPU simulation over learning curves
(tests/unit/test_scheduler.py) and measured against "lockstep" by the search part of benchmarks/README.md."""


def takes_reports(schedule: BaseSchedule) -> bool:
    """Whether the schedule's ``choose`` takes ``reports`` (one written before it existed does not)."""
    parameters = inspect.signature(schedule.choose).parameters
    return "reports" in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def schedule_from(setting: str | BaseSchedule) -> BaseSchedule:
    """A schedule from its name or itself; the error names the bad value and the choices."""
    if isinstance(setting, BaseSchedule):
        return setting
    if isinstance(setting, str) and (setting in SCHEDULES or setting == "default"):
        return SCHEDULES[DEFAULT_SCHEDULE if setting == "default" else setting]()
    raise ValueError(
        f"schedule must be one of 'default' ({DEFAULT_SCHEDULE!r}), {', '.join(repr(n) for n in SCHEDULES)} or a "
        f"BaseSchedule instance (e.g. PromoteSchedule()), but got schedule={setting!r}."
    )
