"""The peer view (``_study/_pruning.py``): what the study's own pruner sees when asked about a trial at a step
while its peers still run, and the "auto" resources set from the run length. In-memory studies, no model;
every Optuna pruner in a real study: tests/e2e/test_pruning.py."""

from __future__ import annotations

from typing import Any

import optuna
import pytest
from optuna.pruners import BasePruner, HyperbandPruner, MedianPruner, PatientPruner, SuccessiveHalvingPruner
from optuna.study import Study
from optuna.trial import FrozenTrial, TrialState

from optuna_rapidfire import _compat
from optuna_rapidfire._study._pruning import prune_decision, resolve_auto_resources


class _Recorder(BasePruner):
    """A pruner that prunes nothing and records what it was shown."""

    def __init__(self) -> None:
        self.seen: dict[int, tuple[TrialState, float | None, dict[int, float]]] = {}
        self.best: int | None = None
        self.complete = -1

    def prune(self, study: Study, trial: FrozenTrial) -> bool:
        self.seen = {t.number: (t.state, t.value, dict(t.intermediate_values)) for t in study.get_trials()}
        self.best = study.best_trial.number
        self.complete = len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))
        return False


def _study(pruner: BasePruner, direction: str = "minimize") -> Study:
    return optuna.create_study(pruner=pruner, direction=direction)


def _trial(
    study: Study, curve: dict[int, float], state: TrialState = TrialState.RUNNING, value: float | None = None
) -> int:
    """A trial that reported ``curve``, left running or told ``state``; its number."""
    trial = study.ask()
    for step, reported in curve.items():
        trial.report(reported, step)
    if state == TrialState.COMPLETE:
        study.tell(trial, value)
    elif state != TrialState.RUNNING:
        study.tell(trial, state=state)
    return trial.number


def _frozen(study: Study, number: int) -> FrozenTrial:
    return next(t for t in study.get_trials() if t.number == number)


def test_peers_that_reached_the_step_appear_as_if_they_had_stopped_there_and_the_rest_as_they_are() -> None:
    recorder = _Recorder()
    study = _study(recorder)
    trial = study.ask()
    trial.report(5.0, 0)
    trial.report(4.0, 1)
    current = trial.number
    ahead = _trial(study, {0: 3.0, 1: 2.0, 2: 1.0})  # running, already past the step
    behind = _trial(study, {0: 6.0})  # running, not at the step yet
    pruned_there = _trial(study, {0: 9.0, 1: 8.0}, TrialState.PRUNED)
    pruned_before = _trial(study, {0: 9.5}, TrialState.PRUNED)
    complete = _trial(study, {0: 1.0, 1: 0.7, 2: 0.6}, TrialState.COMPLETE, value=0.5)
    snapshot = _frozen(study, current)
    trial.report(3.5, 2)  # the decision is about the snapshot, whatever the trial reported since

    assert prune_decision(study, snapshot, step=1) is False
    complete_state = (TrialState.COMPLETE, 0.5, {0: 1.0, 1: 0.7, 2: 0.6})
    assert recorder.seen == {
        current: (TrialState.RUNNING, None, {0: 5.0, 1: 4.0}),  # as it was when it reported the step
        ahead: (TrialState.COMPLETE, 2.0, {0: 3.0, 1: 2.0}),
        behind: (TrialState.RUNNING, None, {0: 6.0}),
        pruned_there: (TrialState.COMPLETE, 8.0, {0: 9.0, 1: 8.0}),  # ASHA's rungs hold pruned trials too
        pruned_before: (TrialState.PRUNED, 9.5, {0: 9.5}),  # Optuna keeps a pruned trial's last value
        complete: complete_state,  # a finished trial as it finished
    }
    assert recorder.complete == 3 and recorder.best == complete
    # The storage itself is untouched.
    assert [t.state for t in study.get_trials()] == [TrialState.RUNNING] * 3 + [TrialState.PRUNED] * 2 + [
        TrialState.COMPLETE
    ]


def test_a_peer_of_the_round_that_finished_since_the_barrier_is_seen_as_it_was_at_the_step() -> None:
    recorder = _Recorder()
    study = _study(recorder)
    current = _trial(study, {0: 5.0, 1: 4.0})
    finished = _trial(study, {0: 1.0, 1: 0.7, 2: 0.6}, TrialState.COMPLETE, value=0.5)
    other = _trial(study, {0: 1.0, 1: 0.9}, TrialState.COMPLETE, value=0.9)
    round_peers = {_compat.trial_id(_frozen(study, finished))}
    prune_decision(study, _frozen(study, current), step=1, round_peers=round_peers)
    assert recorder.seen[finished] == (TrialState.COMPLETE, 0.7, {0: 1.0, 1: 0.7})
    assert recorder.seen[other] == (TrialState.COMPLETE, 0.9, {0: 1.0, 1: 0.9})
    assert recorder.best == finished  # 0.7 against 0.9


@pytest.mark.parametrize(("direction", "best"), [("minimize", 1), ("maximize", 2)])
def test_the_best_trial_is_the_best_peer_at_the_step_in_the_studys_direction(direction: str, best: int) -> None:
    recorder = _Recorder()
    study = _study(recorder, direction)
    current = _trial(study, {0: 5.0})
    _trial(study, {0: 1.0, 1: 9.0})  # best at step 0 when minimizing, whatever it reported later
    _trial(study, {0: 7.0, 1: 0.0})  # best at step 0 when maximizing
    prune_decision(study, _frozen(study, current), step=0)
    assert recorder.best == best and recorder.complete == 2


def test_the_best_trial_is_asked_for_in_vain_when_no_peer_reached_the_step() -> None:
    class AsksBest(BasePruner):
        def prune(self, study: Study, trial: FrozenTrial) -> bool:
            with pytest.raises(ValueError, match="No trials are completed yet"):
                _ = study.best_trial
            return False

    study = _study(AsksBest())
    current = _trial(study, {0: 5.0, 1: 4.0})
    _trial(study, {0: 1.0})
    assert prune_decision(study, _frozen(study, current), step=1) is False


def test_a_median_pruner_stops_a_bad_trial_among_running_peers_which_alone_it_could_not() -> None:
    study = _study(MedianPruner(n_startup_trials=2, n_warmup_steps=0))
    numbers = [_trial(study, {0: value}) for value in (1.0, 2.0, 3.0)]
    worst, best = _frozen(study, numbers[2]), _frozen(study, numbers[0])
    assert study.pruner.prune(study, worst) is False  # no COMPLETE trial: Optuna alone never prunes here
    assert prune_decision(study, worst, step=0) is True  # 3.0 against the peers' median 1.5
    assert prune_decision(study, best, step=0) is False


@pytest.mark.parametrize(
    ("pruner", "max_steps", "resources"),
    [
        (HyperbandPruner(), 12, (12, 1)),  # "auto" max_resource: the run length
        (HyperbandPruner(max_resource=30), 12, (30, 1)),  # a user's value stays
        (SuccessiveHalvingPruner(), 250, (None, 2)),  # "auto" min_resource: 1% of the run, at least 1
        (SuccessiveHalvingPruner(), 50, (None, 1)),
        (SuccessiveHalvingPruner(min_resource=5), 250, (None, 5)),
    ],
)
def test_auto_resources_are_set_from_the_run_length(pruner: Any, max_steps: int, resources: tuple[Any, Any]) -> None:
    resolve_auto_resources(pruner, max_steps)
    assert _compat.auto_resources(pruner) == resources


def test_auto_resources_of_a_wrapped_pruner_are_set_too() -> None:
    inner = SuccessiveHalvingPruner()
    resolve_auto_resources(PatientPruner(inner, patience=1), 400)
    assert _compat.auto_resources(inner) == (None, 4)
