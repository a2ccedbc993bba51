"""The device's memory budget for trial states (optuna_rapidfire/_engines/_placement.py): idle trials go first, least
recently used first; a trial being set up, and a gang's members, never go."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from optuna_rapidfire._engines._placement import Placement


@dataclass
class _State:
    size: int
    resident: bool = True
    asked: list[int] = field(default_factory=list)  # one entry per nbytes() call

    def nbytes(self) -> int:
        self.asked.append(1)
        return self.size

    def offload(self, device: torch.device) -> None:
        self.resident = False

    def onload(self, device: torch.device) -> None:
        self.resident = True


def _trials(count: int, size: int = 10) -> list[Any]:
    return [
        SimpleNamespace(state=_State(size), last_used=float(i), spec=SimpleNamespace(number=i)) for i in range(count)
    ]


def test_idle_trials_leave_least_recently_used_first_until_the_states_fit() -> None:
    live = _trials(4)
    placement = Placement(SimpleNamespace(device=torch.device("cpu")), live, state_budget=25)  # type: ignore[arg-type]
    placement.on_device([live[0]])  # live[0] is now the most recently used, and kept
    assert [t.state.resident for t in live] == [True, False, False, True]
    assert placement.offloads == 2


def test_a_gangs_members_resuming_neither_leave_nor_have_their_states_counted() -> None:
    """Each member of a GRPO gang is set up again at every resumption (several a step): with every live trial in the
    gang nothing may go, so the states' sizes are not even counted."""
    live = _trials(3)
    placement = Placement(SimpleNamespace(device=torch.device("cpu")), live, state_budget=5)  # type: ignore[arg-type]
    placement.gang = list(live)
    for member in live:
        placement.on_device([member])
    assert all(t.state.resident for t in live) and placement.offloads == 0
    assert not any(t.state.asked for t in live)
    placement.gang = live[:2]  # one trial is idle now: it goes, the gang stays
    placement.on_device([live[0]])
    assert [t.state.resident for t in live] == [True, True, False]
