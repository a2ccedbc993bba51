"""Behaviours 2 and 3: per-chunk reports, pruning during the first wave with any Optuna pruner."""

from __future__ import annotations

import optuna
import pytest
from _numerics import assert_apart, gradient_terms
from helpers import by_number, lora, sft_args
from optuna.trial import TrialState
from transformers import AutoConfig

from optuna_rapidfire._study._pruning import prune_decision

# Trial 0's learning rate is a thousand times too low: its loss stays at the base model's while the
# others' falls, so it is clearly the worst at every step (not a too high rate: its loss rises, but
# chaotically; with 0.3 its curve differed by 0.15 between CPU kernels). It is also the first to report
# in every round, so the test also shows that it is judged against its peers of the same step, not
# before they report. Trial 5 is the best at every step. The test asserts these margins.
LEARNING_RATES = [1e-5, 1e-2, 1.5e-2, 2e-2, 2.5e-2, 3e-2]
CONFIGS = [
    (lora(target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]), sft_args(learning_rate=lr)) for lr in LEARNING_RATES
]
THRESHOLD = 7.52  # between the base model's loss (trial 0) and the others' after one chunk

PRUNERS = {
    "median": lambda: optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=1),
    "percentile": lambda: optuna.pruners.PercentilePruner(25.0, n_startup_trials=3, n_warmup_steps=1),
    "threshold": lambda: optuna.pruners.ThresholdPruner(upper=THRESHOLD),
    "successive_halving": lambda: optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=2),
    # One bracket (log_8 of 5 steps < 1), so every trial competes with every other.
    "hyperband": lambda: optuna.pruners.HyperbandPruner(min_resource=1, reduction_factor=8),
    "wilcoxon": lambda: optuna.pruners.WilcoxonPruner(p_threshold=0.2, n_startup_steps=2),
}


# Lock-step rounds on one trial at a time, and a fused gang without barriers ("promote": the gang's
# members at the same step decide together, against every trial that reported it).
RUNS = [(name, "time_sliced", "lockstep") for name in sorted(PRUNERS)] + [
    ("median", "fused", "promote"),
    ("successive_halving", "fused", "promote"),
]


@pytest.mark.parametrize(("name", "engine", "schedule"), RUNS)
def test_pruner_stops_a_clearly_bad_trial_during_the_first_wave(
    make_executor, tiny_model, name: str, engine: str, schedule: str
) -> None:
    executor = make_executor(engine=engine, schedule=schedule, num_chunks=5, max_concurrent_trials=len(CONFIGS))
    study = optuna.create_study(study_name=f"pruning-{name}", pruner=PRUNERS[name]())
    executor.optimize(study, by_number(CONFIGS), n_trials=len(CONFIGS))
    _assert_decisions_are_far_from_ties(
        study, gradient_terms(AutoConfig.from_pretrained(tiny_model), rows=4, length=128)
    )

    bad = study.trials[0]
    assert bad.state == TrialState.PRUNED
    assert len(bad.intermediate_values) < 5
    if schedule == "lockstep":
        # Pruned during the first wave: every trial was live, none had completed.
        assert bad.datetime_complete < min(t.datetime_complete for t in study.trials if t.state == TrialState.COMPLETE)
    else:
        # ASHA's promotion: the worst trial waits at its first rung while better ones go on, so it trains no
        # chunk past its first before the others are done; then it is promoted last and pruned.
        assert len(bad.intermediate_values) <= 2
    # The best config is never pruned.
    assert study.trials[5].state == TrialState.COMPLETE


def _assert_decisions_are_far_from_ties(study: optuna.Study, terms: int) -> None:
    """Trial 0 is the worst and trial 5 the best at every step, above and below the threshold: each by a
    margin that the rounding of ``terms`` products (on any machine) cannot bridge."""
    values = [t.intermediate_values for t in study.trials]
    bad, best = values[0], values[5]
    for number, curve in enumerate(values[1:5], start=1):
        for step, value in curve.items():
            if step in bad:
                assert bad[step] > value
                assert_apart(bad[step], value, terms=terms, what=f"trials 0 and {number} at step {step}")
            if step in best:
                assert best[step] < value
                assert_apart(best[step], value, terms=terms, what=f"trials 5 and {number} at step {step}")
    assert min(bad.values()) > THRESHOLD > max(best.values())
    assert_apart(min(bad.values()), THRESHOLD, terms=terms, what="trial 0 and the threshold")
    assert_apart(max(best.values()), THRESHOLD, terms=terms, what="trial 5 and the threshold")


def test_median_pruner_alone_cannot_prune_in_lock_step(make_executor) -> None:
    # Why the peer view exists: Optuna's own should_prune() sees no COMPLETE trial in the first wave.
    study = optuna.create_study(pruner=optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=1))
    trials = [study.ask() for _ in range(4)]
    for step in range(3):
        for i, trial in enumerate(trials):
            trial.report(10.0 if i == 0 else 1.0 - 0.1 * step, step)
    assert not trials[0].should_prune()
    snapshot = study._storage.get_trial(trials[0]._trial_id)
    peers = {t._trial_id for t in trials[1:]}
    assert prune_decision(study, snapshot, 2, peers)
    good = study._storage.get_trial(trials[1]._trial_id)
    assert not prune_decision(study, good, 2, {t._trial_id for t in trials if t is not trials[1]})


def test_patient_pruner_prunes_only_a_trial_whose_value_rose() -> None:
    # PatientPruner acts only on a rising curve, which in training comes from a too high learning rate,
    # whose curve rounding decides (above): the values here are reported by hand.
    pruner = optuna.pruners.PatientPruner(optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=1), patience=1)
    study = optuna.create_study(pruner=pruner)
    rising, steady, *falling = (study.ask() for _ in range(5))
    for step in range(3):
        rising.report(5.0 + step, step)
        steady.report(5.0, step)
        for trial in falling:
            trial.report(1.0 - 0.1 * step, step)
    ids = {t._trial_id for t in (rising, steady, *falling)}
    for trial, pruned in ((rising, True), (steady, False), (falling[0], False)):
        snapshot = study._storage.get_trial(trial._trial_id)
        assert prune_decision(study, snapshot, 2, ids - {trial._trial_id}) == pruned


def test_peer_view_hides_peers_that_have_not_reached_the_step() -> None:
    study = optuna.create_study(pruner=optuna.pruners.MedianPruner(n_startup_trials=2))
    bad, slow_a, slow_b = (study.ask() for _ in range(3))
    bad.report(10.0, 0)
    bad.report(10.0, 1)
    for t in (slow_a, slow_b):
        t.report(1.0, 0)  # these peers have not reported step 1 yet
    snapshot = study._storage.get_trial(bad._trial_id)
    assert not prune_decision(study, snapshot, 1, set())
    for t in (slow_a, slow_b):
        t.report(1.0, 1)
    assert prune_decision(study, snapshot, 1, set())


def test_pruned_trial_stops_at_once_and_frees_its_slot_and_state(make_executor, chunk_log) -> None:
    class PruneTrialOneAtStepOne(optuna.pruners.BasePruner):
        def prune(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> bool:
            return trial.number == 1 and trial.last_step == 1

    executor = make_executor(num_chunks=4, max_concurrent_trials=2)
    study = optuna.create_study(pruner=PruneTrialOneAtStepOne())
    executor.optimize(study, by_number([(lora(), sft_args())] * 3), n_trials=3)

    pruned = study.trials[1]
    assert pruned.state == TrialState.PRUNED
    assert list(pruned.intermediate_values) == [0, 1]
    assert (1, 2) not in chunk_log  # no chunk after the pruning decision
    assert study.trials[2].state == TrialState.COMPLETE  # the freed slot went to the next trial
    assert executor.stats().adapters == ()  # every adapter was released
    assert executor.stats().live_trials == 0


def test_reports_every_chunk_on_an_eval_subsample(make_executor, eval_ds) -> None:
    full = make_executor(num_chunks=2, max_concurrent_trials=1)
    sub = make_executor(num_chunks=2, max_concurrent_trials=1, eval_samples=3)
    values = []
    for executor in (full, sub):
        study = optuna.create_study(pruner=optuna.pruners.NopPruner())
        executor.optimize(study, by_number([(lora(), sft_args())]), n_trials=1)
        values.append(study.trials[0].intermediate_values)
    assert list(values[0]) == list(values[1]) == [0, 1]
    assert values[0] != values[1]
    assert sub.stats().eval_rows == 3 and full.stats().eval_rows == len(eval_ds)
