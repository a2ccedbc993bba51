"""Pruning while every trial is still running.

Optuna's pruners compare a trial with *finished* trials: Median and Percentile look only at COMPLETE
trials, SuccessiveHalving infers its resources from them, Wilcoxon compares with the best COMPLETE trial.
When trials advance in lock-step, nothing has finished during the first wave, so nothing could be pruned.

The executor does not special-case any pruner. It calls the study's own pruner with a *peer view* of
the study, a storage proxy in which, for a decision about trial T at step s:

* every peer that has reported step s and was running at that step appears as a COMPLETE trial whose
  curve ends at step s (its value is its step-s value): "as if it had stopped there";
* T itself appears as it was when it reported step s;
* everything else (finished, pruned, failed trials, system attributes) is the real storage.

When decisions are taken depends on the schedule (:mod:`optuna_rapidfire._runtime._scheduler`). Under
``"lockstep"`` they wait for round barriers: T's pruner is asked only once every co-live trial of the
executor has reported step s, so the first trial to report is judged against the same peers as the
last; the pruner is asked twice per step, a first pass letting stateful pruners record the step (the
rung values of SuccessiveHalving and Hyperband), a second pass, after every peer's first pass,
deciding. Under ``"promote"`` T is judged as soon as it reports step s, against every trial that has
reported step s. Under both, running, paused and pruned peers that reached s are snapshots at s, as ASHA's
rungs hold every trial that reached them: the same reports give the same decision under either schedule.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, cast

import optuna
from optuna.study import Study, StudyDirection
from optuna.trial import FrozenTrial, TrialState

from optuna_rapidfire import _compat
from optuna_rapidfire._logging import get_logger

if TYPE_CHECKING:
    from collections.abc import Collection, Container

    from optuna.pruners import BasePruner

    from optuna_rapidfire._runtime._entry import Entry
    from optuna_rapidfire._runtime._scheduler import Scheduler

_logger = get_logger(__name__)


def _snapshot_at(trial: FrozenTrial, step: int) -> FrozenTrial:
    """``trial`` as a COMPLETE trial that stopped after reporting ``step``."""
    curve = {s: v for s, v in trial.intermediate_values.items() if s <= step}
    return FrozenTrial(
        number=trial.number,
        state=TrialState.COMPLETE,
        value=curve[step],
        values=None,
        datetime_start=trial.datetime_start,
        datetime_complete=trial.datetime_complete or trial.datetime_start,
        params=trial.params,
        distributions=trial.distributions,
        user_attrs=trial.user_attrs,
        system_attrs=trial.system_attrs,
        intermediate_values=curve,
        trial_id=_compat.trial_id(trial),
    )


class _PeerViewStorage:
    """Read-through proxy of a study's storage that shows running peers as finished at one step."""

    def __init__(self, storage: Any, current: FrozenTrial, step: int, round_peers: Collection[int]) -> None:
        self._storage = storage
        self._current = current
        self._step = step
        self._round_peers = round_peers

    def __getattr__(self, name: str) -> Any:
        return getattr(self._storage, name)

    def _view(self, trial: FrozenTrial) -> FrozenTrial | None:
        if _compat.trial_id(trial) == _compat.trial_id(self._current):
            return self._current
        if self._step not in trial.intermediate_values:
            return trial
        # Peers of this round are judged as they were at the barrier, whatever was decided for them since; pruned
        # trials that reached the step count too, as ASHA's rungs hold them (under every schedule alike: the
        # same reports give the same decision whichever schedule ordered the chunks).
        if (
            trial.state == TrialState.RUNNING
            or _compat.trial_id(trial) in self._round_peers
            or trial.state == TrialState.PRUNED
        ):
            return _snapshot_at(trial, self._step)
        return trial

    def get_all_trials(
        self, study_id: int, deepcopy: bool = True, states: Container[TrialState] | None = None
    ) -> list[FrozenTrial]:
        trials = []
        for trial in self._storage.get_all_trials(study_id, deepcopy=False):
            viewed = self._view(trial)
            if viewed is not None and (states is None or viewed.state in states):
                trials.append(viewed)
        return copy.deepcopy(trials) if deepcopy else trials

    def get_n_trials(self, study_id: int, state: tuple[TrialState, ...] | TrialState | None = None) -> int:
        if isinstance(state, TrialState):
            state = (state,)
        return len(self.get_all_trials(study_id, deepcopy=False, states=state))

    def get_best_trial(self, study_id: int) -> FrozenTrial:
        complete = self.get_all_trials(study_id, deepcopy=False, states=(TrialState.COMPLETE,))
        if not complete:
            raise ValueError("No trials are completed yet.")
        directions = self._storage.get_study_directions(study_id)
        if len(directions) > 1:
            raise RuntimeError("Best trial can be obtained only for single-objective optimization.")
        pick = max if directions[0] == StudyDirection.MAXIMIZE else min
        return pick(complete, key=lambda t: float(cast("float", t.value)))  # COMPLETE: a value


def prune_decision(study: Study, snapshot: FrozenTrial, step: int, round_peers: Collection[int] = ()) -> bool:
    """Ask the study's pruner about ``snapshot`` at ``step``, with running peers visible.

    Args:
        study: The study (its pruner decides).
        snapshot: The trial as read from the storage right after it reported ``step``.
        step: The step just reported.
        round_peers: Trial ids of the peers shown as snapshots at ``step`` even though they have
            finished since (the trials of the round, under "lockstep").
    """
    storage = _PeerViewStorage(_compat.storage(study), snapshot, step, round_peers)
    view = _compat.with_storage(study, storage)
    return bool(study.pruner.prune(view, snapshot))


def should_prune(
    scheduler: Scheduler, entry: Entry, study: Study, trial: optuna.Trial, step: int, value: float
) -> tuple[bool, FrozenTrial]:
    """Ask the study's pruner about ``trial``'s ``step`` in two passes: the first lets stateful pruners record
    the step (SuccessiveHalving's rung values), the second decides. Returns the decision and the trial as
    judged.

    Each pass waits for the peers the schedule names (:meth:`BaseSchedule.pruning_peers`: every live trial under
    "lockstep", a round barrier; the trial's fused mates under "promote", so that they are judged alike
    whichever reports first). The trial is judged against every trial that has reported ``step``: running,
    paused and pruned ones appear as if complete at ``step``, complete ones as they are (a failed trial's
    values are not evidence).
    """
    among = scheduler.pruning_peers(entry)
    scheduler.mark(entry, reported=step, value=value)
    peers = scheduler.wait_for_round(entry, step, stage="reported", among=among)
    frozen = _compat.storage(study).get_trial(_compat.trial_id(trial))
    prune_decision(study, frozen, step, peers)
    scheduler.mark(entry, screened=step)
    scheduler.wait_for_round(entry, step, stage="screened", among=among)
    return prune_decision(study, frozen, step, peers), frozen


def resolve_auto_resources(pruner: BasePruner, max_steps: int) -> None:
    """Give "auto" resources of SuccessiveHalving/Hyperband their value from the known run length.

    Those pruners infer their resources from the first COMPLETE trial; with lock-step trials that
    would be a peer snapshot, which is shorter than a real run. The executor knows the run length.
    """
    for current in _compat.pruner_chain(pruner):
        max_resource, min_resource = _compat.auto_resources(current)
        if isinstance(current, optuna.pruners.HyperbandPruner) and max_resource == "auto":
            _compat.set_auto_resources(current, max_resource=max_steps)
            _logger.info("HyperbandPruner(max_resource='auto') set to the run length, %d steps.", max_steps)
        if isinstance(current, optuna.pruners.SuccessiveHalvingPruner) and min_resource is None:
            _compat.set_auto_resources(current, min_resource=max(max_steps // 100, 1))
