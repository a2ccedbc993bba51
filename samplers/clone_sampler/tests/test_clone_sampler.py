"""Tests of CloneSampler: Optuna's generic sampler cases, and its exploit/explore decisions."""

from __future__ import annotations

import threading
from pathlib import Path

import optuna
import optunahub
import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.testing.pytest_samplers import (
    BasicSamplerTestCase,
    MultiObjectiveSamplerTestCase,
    RelativeSamplerTestCase,
)
from optuna.trial import TrialState
from optuna_rapidfire.samplers.clone_sampler._impl import CLONE_OF, _scaled

from optuna_rapidfire.samplers import CloneSampler

ROOT = Path(__file__).resolve().parents[2]


class TestGenericCases(BasicSamplerTestCase, RelativeSamplerTestCase, MultiObjectiveSamplerTestCase):
    # Optuna's own trials here report no intermediate values, so these check the sampler's contract
    # where it hands sampling to its base (a relative sampler from the first trial on).
    @pytest.fixture
    def sampler(self):
        return lambda: CloneSampler(optuna.samplers.TPESampler(n_startup_trials=0, seed=0), seed=0)


def _population(study: optuna.Study, values: list[list[float]]) -> None:
    """Running trials with params lr/r/dropout/optim and the given intermediate curves."""
    for number, curve in enumerate(values):
        trial = study.ask()
        trial.suggest_float("lr", 1e-4, 1e-1, log=True)
        trial.suggest_int("r", 2, 64, log=True)
        trial.suggest_float("dropout", 0.0, 0.3, step=0.05)
        trial.suggest_categorical("optim", ["adamw", "sgd", "lion"])
        for step, value in enumerate(curve):
            trial.report(value, step)
        assert trial.number == number


def _ask_clone(study: optuna.Study) -> optuna.trial.FrozenTrial:
    trial = study.ask()
    trial.suggest_float("lr", 1e-4, 1e-1, log=True)
    trial.suggest_int("r", 2, 64, log=True)
    trial.suggest_float("dropout", 0.0, 0.3, step=0.05)
    trial.suggest_categorical("optim", ["adamw", "sgd", "lion"])
    return study._storage.get_trial(trial._trial_id)


CURVES = [[5.0 - 0.1 * i, 4.0 - 0.2 * i, 3.0 - 0.3 * i] for i in range(8)]  # trial 7 is the best


def test_clones_a_top_quantile_trial_with_perturbed_params() -> None:
    study = optuna.create_study(sampler=CloneSampler(clone_probability=1.0, seed=1))
    _population(study, CURVES)
    for _ in range(10):
        trial = _ask_clone(study)
        request = trial.system_attrs[CLONE_OF]
        assert request["warm"] is True
        assert request["parent"] in (6, 7)  # top 25% of 8 at the latest common step
        parent = study.trials[request["parent"]]
        assert trial.params["lr"] == pytest.approx(parent.params["lr"] * 0.8) or trial.params["lr"] == pytest.approx(
            min(parent.params["lr"] * 1.2, 1e-1)
        )
        assert trial.params["r"] != parent.params["r"] or parent.params["r"] in (2, 64)
        for name, distribution in parent.distributions.items():
            assert distribution._contains(distribution.to_internal_repr(trial.params[name]))


def test_no_clone_below_min_population_or_without_progress() -> None:
    study = optuna.create_study(sampler=CloneSampler(clone_probability=1.0, min_population=4, seed=0))
    _population(study, CURVES[:3])
    assert CLONE_OF not in _ask_clone(study).system_attrs
    study = optuna.create_study(sampler=CloneSampler(clone_probability=1.0, min_step=5, seed=0))
    _population(study, CURVES)
    assert CLONE_OF not in _ask_clone(study).system_attrs


def test_a_pruned_bottom_trial_always_triggers_a_clone() -> None:
    study = optuna.create_study(sampler=CloneSampler(clone_probability=0.0, seed=0))
    _population(study, CURVES)
    assert CLONE_OF not in _ask_clone(study).system_attrs
    study.tell(0, state=TrialState.PRUNED)  # trial 0 is the worst at every step
    assert study.trials[-1].system_attrs.get(CLONE_OF) is None
    assert CLONE_OF in _ask_clone(study).system_attrs
    assert CLONE_OF not in _ask_clone(study).system_attrs  # only the next one
    study.tell(6, state=TrialState.PRUNED)  # a good trial pruned (by hand) is no reason to exploit
    assert CLONE_OF not in _ask_clone(study).system_attrs


def test_maximize_picks_the_highest() -> None:
    study = optuna.create_study(direction="maximize", sampler=CloneSampler(clone_probability=1.0, seed=0))
    _population(study, CURVES)
    for _ in range(5):
        assert _ask_clone(study).system_attrs[CLONE_OF]["parent"] in (0, 1)


def test_enqueued_trials_keep_their_params() -> None:
    study = optuna.create_study(sampler=CloneSampler(clone_probability=1.0, seed=0))
    _population(study, CURVES)
    study.enqueue_trial({"lr": 0.05, "r": 16, "dropout": 0.1, "optim": "sgd"})
    trial = _ask_clone(study)
    assert CLONE_OF not in trial.system_attrs
    assert trial.params == {"lr": 0.05, "r": 16, "dropout": 0.1, "optim": "sgd"}


def test_seeded_decisions_are_reproducible() -> None:
    picks = []
    for _ in range(2):
        study = optuna.create_study(sampler=CloneSampler(clone_probability=0.5, seed=7))
        _population(study, CURVES)
        picks.append([(t.system_attrs.get(CLONE_OF), t.params) for t in (_ask_clone(study) for _ in range(8))])
    assert picks[0] == picks[1]


def test_thread_safe_under_concurrent_asks() -> None:
    study = optuna.create_study(sampler=CloneSampler(clone_probability=1.0, seed=0))
    _population(study, CURVES)
    asked: list[optuna.trial.FrozenTrial] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            for _ in range(5):
                asked.append(_ask_clone(study))
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and len(asked) == 30
    for trial in asked:
        parent = study.trials[trial.system_attrs[CLONE_OF]["parent"]]
        assert trial.params["lr"] in (
            pytest.approx(parent.params["lr"] * 0.8),
            pytest.approx(min(parent.params["lr"] * 1.2, 0.1)),
        )


def test_a_second_process_decides_from_the_shared_storage(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'pbt.db'}"
    first = optuna.create_study(storage=url, study_name="pbt", sampler=CloneSampler(seed=0))
    _population(first, CURVES)
    # Another process: a fresh sampler that never saw those trials being sampled.
    second = optuna.load_study(study_name="pbt", storage=url, sampler=CloneSampler(clone_probability=1.0, seed=3))
    assert _ask_clone(second).system_attrs[CLONE_OF]["parent"] in (6, 7)


@pytest.mark.parametrize(
    ("value", "factor", "distribution", "expected"),
    [
        (0.05, 1.2, FloatDistribution(1e-4, 0.1, log=True), 0.06),
        (0.09, 1.2, FloatDistribution(1e-4, 0.1, log=True), 0.1),
        (0.2, 0.8, FloatDistribution(0.0, 0.3, step=0.05), 0.15),
        (8, 1.2, IntDistribution(2, 64, log=True), 10),
        (2, 1.2, IntDistribution(2, 64), 3),  # rounds back to 2: moves one step up instead
        (3, 0.8, IntDistribution(3, 9, step=2), 3),  # already at the bottom
        (5, 1.2, IntDistribution(3, 9, step=2), 7),
    ],
)
def test_perturbation_stays_inside_the_distribution(value, factor, distribution, expected) -> None:
    assert _scaled(value, factor, distribution) == pytest.approx(expected)


def test_categoricals_are_resampled_with_their_probability() -> None:
    sampler = CloneSampler(resample_probability=1.0, seed=0)
    parent = optuna.trial.create_trial(
        params={"optim": "adamw"},
        distributions={"optim": CategoricalDistribution(["adamw", "sgd", "lion"])},
        value=1.0,
    )
    drawn = {sampler._perturb(parent)["optim"] for _ in range(50)}
    assert drawn == {"adamw", "sgd", "lion"}
    keep = CloneSampler(resample_probability=0.0, seed=0)
    assert {keep._perturb(parent)["optim"] for _ in range(20)} == {"adamw"}


@pytest.mark.parametrize(
    "kwargs",
    [
        {"clone_probability": 1.5},
        {"quantile": 0.0},
        {"quantile": 0.7},
        {"min_population": 0},
        {"perturb_factors": ()},
        {"perturb_factors": (0.8, -1.0)},
        {"resample_probability": -0.1},
        {"min_step": -1},
    ],
)
def test_bad_arguments_name_the_value(kwargs) -> None:
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=name):
        CloneSampler(**kwargs)


def test_loads_as_an_optunahub_package() -> None:
    module = optunahub.load_local_module("clone_sampler", registry_root=str(ROOT))
    assert module.CloneSampler.__name__ == "CloneSampler"
    readme = (ROOT / "clone_sampler" / "README.md").read_text()
    header = readme.split("---")[1]
    for field in ("author:", "title:", "description:", "tags:", "optuna_versions:", "license:"):
        assert field in header
    assert (ROOT / "clone_sampler" / "LICENSE").is_file() and (ROOT / "clone_sampler" / "example.py").is_file()


def test_a_trial_with_nothing_left_to_train_is_not_a_parent() -> None:
    study = optuna.create_study(sampler=CloneSampler(clone_probability=1.0, seed=0))
    _population(study, CURVES)
    for number in (6, 7):  # the two leaders have trained all their chunks
        study._storage.set_trial_user_attr(study.trials[number]._trial_id, "rapidfire:chunks_done", 3)
        study._storage.set_trial_user_attr(study.trials[number]._trial_id, "rapidfire:total_chunks", 3)
    assert CLONE_OF not in _ask_clone(study).system_attrs
