"""CloneSampler: Population Based Training on top of any Optuna sampler, for optuna-rapidfire."""

from __future__ import annotations

import math
import threading
from typing import TYPE_CHECKING, Any

import numpy as np
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.samplers import BaseSampler, TPESampler
from optuna.study import StudyDirection
from optuna.trial import TrialState

if TYPE_CHECKING:
    from collections.abc import Sequence

    from optuna.study import Study
    from optuna.trial import FrozenTrial

# The system attr the executor reads to start a trial from another trial's state (see
# optuna_rapidfire._study._attrs.CLONE_OF).
CLONE_OF = "rapidfire:clone_of"
# User attrs the executor keeps on each trial (optuna_rapidfire._study._attrs).
CHUNKS_DONE = "rapidfire:chunks_done"
TOTAL_CHUNKS = "rapidfire:total_chunks"


class CloneSampler(BaseSampler):
    """Population Based Training (exploit and explore) for trials run by ``RapidFireExecutor``.

    When a trial is asked and the population (trials with intermediate values: running, complete, and
    pruned ones, which count for the ranking but are never parents) holds at least ``min_population``
    trials that reached a common step, then with probability
    ``clone_probability`` — and always right after a trial of the bottom quantile was pruned — the new
    trial *exploits*: it copies a parent drawn from the top ``quantile`` at that step (one with chunks
    left to train), and *explores*:
    float and int parameters are multiplied by a factor drawn from ``perturb_factors`` (kept inside
    their distribution), categorical ones are resampled with probability ``resample_probability``.
    The trial is marked as a clone of the parent, so the executor starts it from the parent's current
    weights, optimizer and schedule (warm start) with the perturbed hyperparameters. Every other
    trial, and every parameter the plan does not cover, is sampled by ``base_sampler``.

    Decisions use only what the storage holds, so several processes sharing a study can each run a
    CloneSampler. The sampler is thread-safe and, with ``seed``, reproducible.

    Example:

        .. code-block:: python

            import optuna
            from optuna_rapidfire.samplers import CloneSampler

            study = optuna.create_study(sampler=CloneSampler(seed=0), pruner=optuna.pruners.MedianPruner())
            executor.optimize(study, configure, n_trials=32)

    Args:
        base_sampler: Samples the trials that are not clones (TPE by default).
        clone_probability: Chance that an asked trial is a clone when the population allows one.
        quantile: Top (parents) and bottom (exploit triggers) fraction of the population.
        min_population: Trials that must have reached a common step before any cloning.
        perturb_factors: Factors a float or int parameter is multiplied by (one drawn per parameter).
        resample_probability: Chance that a categorical parameter is drawn anew.
        min_step: Earliest step at which trials are compared.
        warm_start: Whether clones continue from their parent's state (``False``: start from scratch
            with the perturbed params, a plain exploit/explore of configurations).
        seed: Seed of the sampler's own random choices (and of the default base sampler).
    """

    def __init__(
        self,
        base_sampler: BaseSampler | None = None,
        *,
        clone_probability: float = 0.25,
        quantile: float = 0.25,
        min_population: int = 4,
        perturb_factors: Sequence[float] = (0.8, 1.2),
        resample_probability: float = 0.25,
        min_step: int = 1,
        warm_start: bool = True,
        seed: int | None = None,
    ) -> None:
        for name, value in (
            ("clone_probability", clone_probability),
            ("resample_probability", resample_probability),
        ):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], but got {name}={value}.")
        if not 0.0 < quantile <= 0.5:
            raise ValueError(f"quantile must be in (0, 0.5], but got {quantile=}.")
        if min_population < 1:
            raise ValueError(f"min_population must be at least 1, but got {min_population=}.")
        if not perturb_factors or any(not f > 0 for f in perturb_factors):
            raise ValueError(f"perturb_factors must be positive numbers, but got {perturb_factors=}.")
        if min_step < 0:
            raise ValueError(f"min_step must not be negative, but got {min_step=}.")
        self._base = base_sampler or TPESampler(seed=seed)
        self._clone_probability = clone_probability
        self._quantile = quantile
        self._min_population = min_population
        self._factors = tuple(float(f) for f in perturb_factors)
        self._resample_probability = resample_probability
        self._min_step = min_step
        self._warm_start = warm_start
        self._rng = np.random.RandomState(seed)
        self._lock = threading.Lock()
        self._plans: dict[int, dict[str, Any]] = {}
        self._exploit_next = 0

    def reseed_rng(self) -> None:
        self._rng.seed()
        self._base.reseed_rng()

    # -- Optuna's sampler interface ------------------------------------------------------------------

    def before_trial(self, study: Study, trial: FrozenTrial) -> None:
        self._base.before_trial(study, trial)
        if "fixed_params" in trial.system_attrs or study._is_multi_objective():
            return  # an enqueued trial (a hand-made clone included) keeps its own params
        with self._lock:
            forced = self._exploit_next > 0
            if not forced and self._rng.rand() >= self._clone_probability:
                return
            parent = self._pick_parent(study)
            if parent is None:
                return
            if forced:
                self._exploit_next -= 1
            self._plans[trial._trial_id] = self._perturb(parent)
        study._storage.set_trial_system_attr(
            trial._trial_id, CLONE_OF, {"parent": parent.number, "warm": self._warm_start}
        )

    def infer_relative_search_space(self, study: Study, trial: FrozenTrial) -> dict[str, BaseDistribution]:
        return self._base.infer_relative_search_space(study, trial)

    def sample_relative(
        self, study: Study, trial: FrozenTrial, search_space: dict[str, BaseDistribution]
    ) -> dict[str, Any]:
        plan = self._plans.get(trial._trial_id)
        if plan is None:
            return self._base.sample_relative(study, trial, search_space)
        # A clone: its planned params, and nothing relative for the others (they go to the base
        # sampler one by one through sample_independent).
        return {
            name: plan[name]
            for name, distribution in search_space.items()
            if name in plan and distribution._contains(distribution.to_internal_repr(plan[name]))
        }

    def sample_independent(
        self, study: Study, trial: FrozenTrial, param_name: str, param_distribution: BaseDistribution
    ) -> Any:
        plan = self._plans.get(trial._trial_id)
        if plan is not None and param_name in plan:
            value = plan[param_name]
            if param_distribution._contains(param_distribution.to_internal_repr(value)):
                return value
        return self._base.sample_independent(study, trial, param_name, param_distribution)

    def after_trial(self, study: Study, trial: FrozenTrial, state: TrialState, values: Sequence[float] | None) -> None:
        with self._lock:
            self._plans.pop(trial._trial_id, None)
            if state == TrialState.PRUNED and self._in_bottom(study, trial):
                self._exploit_next += 1
        self._base.after_trial(study, trial, state, values)

    # -- exploit and explore -------------------------------------------------------------------------

    def _population(self, study: Study) -> list[FrozenTrial]:
        """Trials with progress: running and complete ones, and pruned ones (evidence, never parents)."""
        states = (TrialState.RUNNING, TrialState.COMPLETE, TrialState.PRUNED)
        return [t for t in study.get_trials(deepcopy=False, states=states) if t.intermediate_values and t.params]

    def _ranked_at_common_step(self, study: Study, population: list[FrozenTrial]) -> list[FrozenTrial]:
        """Trials at the latest step reached by ``min_population`` of them, best first."""
        reached: dict[int, int] = {}
        for trial in population:
            for step in trial.intermediate_values:
                reached[step] = reached.get(step, 0) + 1
        common = [s for s, n in reached.items() if n >= self._min_population and s >= self._min_step]
        if not common:
            return []
        step = max(common)
        at_step = [t for t in population if math.isfinite(t.intermediate_values.get(step, math.nan))]
        reverse = study.direction == StudyDirection.MAXIMIZE
        return sorted(at_step, key=lambda t: t.intermediate_values[step], reverse=reverse)

    def _pick_parent(self, study: Study) -> FrozenTrial | None:
        ranked = self._ranked_at_common_step(study, self._population(study))
        if len(ranked) < self._min_population:
            return None
        top = ranked[: max(1, int(len(ranked) * self._quantile))]
        parents = [t for t in top if t.state != TrialState.PRUNED and not _finished_training(t)]
        return parents[self._rng.randint(len(parents))] if parents else None

    def _in_bottom(self, study: Study, trial: FrozenTrial) -> bool:
        last = trial.last_step
        if last is None or study._is_multi_objective():
            return False
        peers = [t for t in self._population(study) if last in t.intermediate_values and t.number != trial.number]
        if len(peers) + 1 < self._min_population:
            return False
        values = sorted([t.intermediate_values[last] for t in peers] + [trial.intermediate_values[last]])
        if study.direction == StudyDirection.MAXIMIZE:
            values.reverse()
        cut = values[-max(1, int(len(values) * self._quantile))]
        value = trial.intermediate_values[last]
        return value >= cut if study.direction == StudyDirection.MINIMIZE else value <= cut

    def _perturb(self, parent: FrozenTrial) -> dict[str, Any]:
        params = {}
        for name, distribution in parent.distributions.items():
            value = parent.params[name]
            if isinstance(distribution, CategoricalDistribution):
                if self._rng.rand() < self._resample_probability:
                    value = distribution.choices[self._rng.randint(len(distribution.choices))]
            elif isinstance(distribution, (FloatDistribution, IntDistribution)):
                value = _scaled(value, self._factors[self._rng.randint(len(self._factors))], distribution)
            params[name] = value
        return params


def _finished_training(trial: FrozenTrial) -> bool:
    """Whether the executor says the trial has trained all its chunks (a clone would have none left)."""
    done, total = trial.user_attrs.get(CHUNKS_DONE), trial.user_attrs.get(TOTAL_CHUNKS)
    return isinstance(done, int) and isinstance(total, int) and done >= total


def _scaled(value: float, factor: float, distribution: FloatDistribution | IntDistribution) -> float | int:
    """``value * factor``, kept inside ``distribution`` (its bounds and step)."""
    low, high, step = distribution.low, distribution.high, distribution.step
    target = min(max(value * factor, low), high)
    if step is not None:
        target = low + round((target - low) / step) * step
        target = min(max(target, low), high)
    if isinstance(distribution, IntDistribution):
        scaled = round(target)
        if scaled == value and factor != 1.0:
            # An int that rounds back to itself moves one step the way the factor points.
            move = step or 1
            scaled = int(min(max(value + (move if factor > 1 else -move), low), high))
        return scaled
    return float(target)


__all__ = ["CLONE_OF", "CloneSampler"]
