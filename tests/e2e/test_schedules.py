"""Schedules (issue 13): per-chunk values do not depend on the schedule or the engine; under "promote"
pruning decisions see exactly the trials that reported the same step, leaders complete first, and a
trial is judged as soon as it reports."""

from __future__ import annotations

import optuna
import pytest
from _numerics import assert_within_rounding, gradient_terms
from helpers import lora, sft_args
from optuna.trial import TrialState
from transformers import AutoConfig

from optuna_rapidfire._engines import ENGINES
from optuna_rapidfire._study import _attrs
from optuna_rapidfire.schedules import LockstepSchedule, PromoteSchedule

# Mixed ranks, targets, batch sizes, accumulation and dropout (each trial draws its own masks).
CONFIGS = [
    {"r": 4, "modules": ["q_proj", "v_proj"], "lr": 1e-2, "batch": 2, "accumulation": 1, "dropout": 0.0},
    {"r": 8, "modules": ["q_proj", "k_proj", "v_proj", "o_proj"], "lr": 3e-3, "batch": 4, "accumulation": 2,
     "dropout": 0.1},
    {"r": 2, "modules": ["q_proj", "v_proj"], "lr": 3e-2, "batch": 3, "accumulation": 1, "dropout": 0.2},
    {"r": 4, "modules": ["o_proj", "up_proj"], "lr": 5e-3, "batch": 2, "accumulation": 2, "dropout": 0.0},
]  # fmt: skip


def configure(trial: optuna.Trial):
    c = CONFIGS[trial.suggest_int("config", 0, len(CONFIGS) - 1)]
    args = sft_args(
        learning_rate=c["lr"],
        per_device_train_batch_size=c["batch"],
        gradient_accumulation_steps=c["accumulation"],
        lr_scheduler_type="cosine",
        seed=3,
    )
    return lora(r=c["r"], lora_dropout=c["dropout"], target_modules=c["modules"]), args


def _study_values(make_executor, engine: str, schedule: str) -> list[dict[int, float]]:
    # Fewer slots than trials: trials 2 and 3 start beside 0 and 1 or after them, so progress is mixed. Under
    # promote every trial trains to the end here (when_exhausted="promote"), so that all values can be compared.
    chosen = PromoteSchedule(when_exhausted="promote") if schedule == "promote" else schedule
    executor = make_executor(engine=engine, schedule=chosen, num_chunks=3, max_concurrent_trials=2)
    study = optuna.create_study(pruner=optuna.pruners.NopPruner())
    for i in range(len(CONFIGS)):
        study.enqueue_trial({"config": i})
    executor.optimize(study, configure, n_trials=len(CONFIGS))
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * len(CONFIGS)
    return [dict(t.intermediate_values) for t in study.trials]


def test_the_same_trials_report_the_same_values_under_both_schedules_and_engines(make_executor, tiny_model) -> None:
    values = {
        (engine, schedule): _study_values(make_executor, engine, schedule)
        for engine in ENGINES
        for schedule in ("lockstep", "promote")
    }
    terms = gradient_terms(AutoConfig.from_pretrained(tiny_model), rows=8, length=128)
    # One engine, two schedules: the time-sliced engine runs the same operations in another order of
    # trials (bit for bit); a fused trial shares its passes with other gangs (within rounding).
    assert values["time_sliced", "promote"] == values["time_sliced", "lockstep"]
    for number, (got, expected) in enumerate(zip(values["fused", "promote"], values["fused", "lockstep"], strict=True)):
        assert_within_rounding(got, expected, terms=terms, what=f"fused, promote vs lockstep, trial {number}")
    # Across engines, trials without adapter dropout (the time-sliced engine draws PEFT's masks from the
    # global RNG, the fused one from each trial's own generator).
    for number, config in enumerate(CONFIGS):
        if config["dropout"] == 0.0:
            for schedule in ("lockstep", "promote"):
                got, expected = values["fused", schedule][number], values["time_sliced", schedule][number]
                assert_within_rounding(got, expected, terms=terms, what=f"{schedule}, fused vs time-sliced, {number}")


class _Witness(optuna.pruners.BasePruner):
    """Records, for every decision, the step and which trials the pruner saw as finished at that step
    (peers are shown as COMPLETE trials whose curve ends at the step)."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int, dict[int, int]]] = []

    def prune(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> bool:
        step = trial.last_step
        assert step is not None
        complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        self.seen.append((trial.number, step, {t.number: max(t.intermediate_values) for t in complete}))
        return False


@pytest.mark.parametrize("engine", list(ENGINES))
def test_under_promote_a_decision_sees_every_trial_that_reported_its_step_and_only_at_that_step(
    make_executor, engine: str
) -> None:
    witness = _Witness()
    executor = make_executor(engine=engine, schedule="promote", num_chunks=3, max_concurrent_trials=2)
    study = optuna.create_study(pruner=witness)
    for i in range(len(CONFIGS)):
        study.enqueue_trial({"config": i})
    executor.optimize(study, configure, n_trials=len(CONFIGS))
    final = {t.number: t for t in study.trials}
    for number, step, peers in witness.seen:
        for peer, last in peers.items():
            if final[peer].datetime_complete is not None and last == max(final[peer].intermediate_values):
                continue  # a really finished trial is shown as it is
            assert last == step, (number, step, peers)  # a running peer ends at the step being judged
    # Trial 2 starts once trial 0 has completed (two slots), after 0 and 1 reported their first chunk: at
    # step 0 it is judged against both, the waiting trial 1 included.
    for number, step, peers in witness.seen:
        if number == 2 and step == 0:
            assert {0, 1} <= set(peers), (step, peers)


def test_under_promote_the_leaders_complete_before_the_laggards_last_chunk(make_executor, chunk_log) -> None:
    schedule = PromoteSchedule(when_exhausted="promote")  # every trial trains to the end
    executor = make_executor(engine="time_sliced", schedule=schedule, num_chunks=4, max_concurrent_trials=3)
    study = optuna.create_study(pruner=optuna.pruners.NopPruner())
    for i in range(3):
        study.enqueue_trial({"config": i})
    executor.optimize(study, configure, n_trials=3)
    first_done = min(t.datetime_complete for t in study.trials)
    assert first_done is not None
    # One device, time-sliced: trial 0 has the most progress whenever it is ready, so its four chunks come
    # before trial 2's last; lock-step would run every trial's chunk k before anyone's chunk k+1.
    last_of = {number: max(i for i, (n, _) in enumerate(chunk_log) if n == number) for number in range(3)}
    assert last_of[0] < last_of[2]
    assert sorted(study.trials, key=lambda t: t.datetime_complete)[0].number == 0


def test_a_schedule_is_chosen_by_name_or_instance_and_a_bad_one_is_refused(make_executor) -> None:
    default = make_executor(schedule="default").schedule
    assert isinstance(default, PromoteSchedule) and default.when_exhausted == "stop"
    assert make_executor(schedule="promote_all").schedule.when_exhausted == "promote"
    assert isinstance(make_executor(schedule="lockstep").schedule, LockstepSchedule)
    mine = PromoteSchedule(gang_wait_seconds=0.1)
    assert make_executor(schedule=mine).schedule is mine
    with pytest.raises(ValueError, match="schedule='round-robin'"):
        make_executor(schedule="round-robin")


def _by_rate(trial: optuna.Trial):
    rate = trial.suggest_float("learning_rate", 1e-10, 1e-1, log=True)
    return lora(r=4, lora_dropout=0.0), sft_args(learning_rate=rate, per_device_train_batch_size=4, seed=3)


def test_by_default_a_useless_trial_trains_nothing_past_its_first_chunk_while_a_better_one_waits(
    make_executor, chunk_log
) -> None:
    """Eight trials, four with a learning rate that learns and four with one that cannot, all live at once,
    the default pruner, ASHA's stops (``when_exhausted="stop"``): the promotion sends the useful ones on from
    their first rung (ties at the cut go on together) and keeps the useless ones waiting there; once no config
    is left they are stopped there, so none of them trains a second chunk, and every useful trial completes."""
    good, useless = 5e-3, 1e-9
    rates = [good, useless] * 4
    executor = make_executor(num_chunks=4, max_concurrent_trials=8, schedule=PromoteSchedule(when_exhausted="stop"))
    study = optuna.create_study()  # MedianPruner
    for rate in rates:
        study.enqueue_trial({"learning_rate": rate})
    executor.optimize(study, _by_rate, n_trials=8)
    good_trials = [n for n, rate in enumerate(rates) if rate == good]
    assert all(study.trials[n].state == TrialState.COMPLETE for n in good_trials)
    last_good = max(i for i, (number, _) in enumerate(chunk_log) if number in good_trials)
    for i, (number, done) in enumerate(chunk_log):
        if number not in good_trials and done >= 1:
            assert i > last_good, (number, done, chunk_log)
    for number in set(range(8)) - set(good_trials):
        trial = study.trials[number]
        assert trial.state == TrialState.PRUNED and max(trial.intermediate_values) == 0, trial
        reason = trial.user_attrs[_attrs.PRUNED_REASON]
        assert reason.startswith(("Stopped by the promote schedule", "MedianPruner stopped it")), reason


def test_trials_waiting_at_a_rung_hold_no_slot_so_new_configs_start_beside_them(make_executor, chunk_log) -> None:
    """Two slots, rungs needing three reports: after the first two trials' first chunks neither may go on, so
    both wait holding no slot and the next two configs start beside them: one before anyone's second chunk
    (ASHA starts a new trial when nothing can be promoted), both before any trial is done (before, one slot
    was lent at a time, and the fourth config waited for a trial to end)."""
    rates = [5e-3, 1e-9, 5e-3, 5e-3]
    executor = make_executor(num_chunks=3, max_concurrent_trials=2)
    study = optuna.create_study(pruner=optuna.pruners.NopPruner())
    for rate in rates:
        study.enqueue_trial({"learning_rate": rate})
    executor.optimize(study, _by_rate, n_trials=len(rates))
    assert all(t.state == TrialState.COMPLETE for t in study.trials)  # the default trains the waiting ones on
    second_chunks = [i for i, (_, done) in enumerate(chunk_log) if done == 1]
    assert chunk_log.index((2, 0)) < min(second_chunks), chunk_log
    first_done = min(chunk_log.index((number, 2)) for number in range(4))
    assert chunk_log.index((3, 0)) < first_done, chunk_log


def test_once_no_config_is_left_asha_s_stop_ends_the_waiting_trials_no_promotion_can_reach(
    make_executor, chunk_log
) -> None:
    """The same study with ``when_exhausted="stop"``: the three equal good trials go on together (ties at the
    cut), and the useless one, below them at its only rung, ends PRUNED there with its rank, never trained on."""
    rates = [5e-3, 1e-9, 5e-3, 5e-3]
    schedule = PromoteSchedule(when_exhausted="stop")
    executor = make_executor(num_chunks=3, max_concurrent_trials=2, schedule=schedule)
    study = optuna.create_study(pruner=optuna.pruners.NopPruner())
    for rate in rates:
        study.enqueue_trial({"learning_rate": rate})
    executor.optimize(study, _by_rate, n_trials=len(rates))
    assert [t.state for t in study.trials] == [TrialState.COMPLETE, TrialState.PRUNED, *[TrialState.COMPLETE] * 2]
    reason = study.trials[1].user_attrs[_attrs.PRUNED_REASON]
    assert reason.startswith("Stopped by the promote schedule at its rung after chunk 1: rank 4 of the 4 trials")
    assert [done for number, done in chunk_log if number == 1] == [0]
