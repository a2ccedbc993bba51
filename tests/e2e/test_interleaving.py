"""Behaviour 1: chunks, lock-step rounds (schedule="lockstep"), least progress first, epochs and steps."""

from __future__ import annotations

import numpy as np
import optuna
import pytest
from helpers import by_number, lora, sft_args

from optuna_rapidfire._resident._data import ChunkPlan


def test_chunk_plan_partitions_the_shuffled_rows() -> None:
    plan = ChunkPlan(num_rows=50, num_chunks=4, seed=3)
    chunks = [plan.rows(c) for c in range(4)]
    assert sorted(np.concatenate(chunks).tolist()) == list(range(50))
    assert [len(c) for c in chunks] in ([12, 13, 12, 13], [13, 12, 13, 12], [12, 13, 13, 12], [13, 12, 12, 13])
    assert chunks[0].tolist() != list(range(len(chunks[0])))  # shuffled
    again = ChunkPlan(num_rows=50, num_chunks=4, seed=3)
    assert all(np.array_equal(a, again.rows(c)) for c, a in enumerate(chunks))
    other = ChunkPlan(num_rows=50, num_chunks=4, seed=4)
    assert not np.array_equal(chunks[0], other.rows(0))


def test_visit_order_keeps_first_epoch_and_reshuffles_later_ones() -> None:
    plan = ChunkPlan(num_rows=40, num_chunks=2, seed=0)
    assert plan.visit_order(20, 0, 1).tolist() == list(range(20))
    second = plan.visit_order(20, 1, 1)
    assert sorted(second.tolist()) == list(range(20)) and second.tolist() != list(range(20))
    assert np.array_equal(second, plan.visit_order(20, 1, 1))


@pytest.mark.parametrize("num_chunks", [0, -2])
def test_chunk_plan_rejects_bad_num_chunks(num_chunks: int) -> None:
    with pytest.raises(ValueError, match="num_chunks"):
        ChunkPlan(num_rows=10, num_chunks=num_chunks, seed=0)


def _rounds(log: list[tuple[int, int]]) -> list[int]:
    return [step for _, step in log]


def test_first_wave_advances_in_lock_step(make_executor, chunk_log) -> None:
    executor = make_executor(schedule="lockstep", num_chunks=3, max_concurrent_trials=4)
    study = optuna.create_study(pruner=optuna.pruners.NopPruner())
    configs = [(lora(r=4 + i), sft_args(learning_rate=1e-3 * (i + 1))) for i in range(4)]
    executor.optimize(study, by_number(configs), n_trials=4)

    assert _rounds(chunk_log) == [0] * 4 + [1] * 4 + [2] * 4
    for start in (0, 4, 8):
        assert sorted(n for n, _ in chunk_log[start : start + 4]) == [0, 1, 2, 3]
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials)
    for trial in study.trials:
        assert list(trial.intermediate_values) == [0, 1, 2]
        assert trial.value == trial.intermediate_values[2]


def test_late_trial_catches_up_least_progress_first(make_executor, chunk_log) -> None:
    # Two slots, three trials: trial 2 starts when trial 0 is pruned after its first chunk. From the
    # moment it is on the device, trial 1 never trains a chunk while trial 2 has less progress.
    class PruneTrialZero(optuna.pruners.BasePruner):
        def prune(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> bool:
            return trial.number == 0

    executor = make_executor(schedule="lockstep", num_chunks=4, max_concurrent_trials=2)
    study = optuna.create_study(pruner=PruneTrialZero())
    configs = [(lora(), sft_args()) for _ in range(3)]
    executor.optimize(study, by_number(configs), n_trials=3)

    assert sorted(chunk_log[:2]) == [(0, 0), (1, 0)]
    assert (0, 1) not in chunk_log
    joined = chunk_log.index((2, 0))
    for position in range(joined, len(chunk_log)):
        number, step = chunk_log[position]
        if number == 1:
            done_by_two = sum(1 for n, _ in chunk_log[:position] if n == 2)
            assert done_by_two >= step, chunk_log
    assert [t.state for t in study.trials] == [
        optuna.trial.TrialState.PRUNED,
        optuna.trial.TrialState.COMPLETE,
        optuna.trial.TrialState.COMPLETE,
    ]


def test_epochs_cycle_chunks_with_contiguous_steps(make_executor, chunk_log) -> None:
    executor = make_executor(schedule="lockstep", num_chunks=3, max_concurrent_trials=2)
    study = optuna.create_study(pruner=optuna.pruners.NopPruner())
    configs = [(lora(), sft_args(num_train_epochs=2)), (lora(), sft_args(num_train_epochs=1.5))]
    executor.optimize(study, by_number(configs), n_trials=2)

    first, second = study.trials
    assert list(first.intermediate_values) == [0, 1, 2, 3, 4, 5]
    assert list(second.intermediate_values) == [0, 1, 2, 3, 4]
    assert first.user_attrs["rapidfire:total_chunks"] == 6
    assert second.user_attrs["rapidfire:chunks_done"] == 5


def test_every_trial_sees_the_same_chunks_in_the_same_order(make_executor, listen) -> None:
    from optuna_rapidfire import events

    seen: dict[int, list[list[str]]] = {}

    def starting(event: events.ChunkStarting) -> None:  # the rows of each chunk, as the device is about to train it
        for trial, rows in zip(event.trials, event.rows, strict=True):
            seen.setdefault(trial, []).append(executor.config.train_dataset.select(list(rows))["prompt"])

    listen(starting, events.ChunkStarting)
    executor = make_executor(num_chunks=3, max_concurrent_trials=3)
    study = optuna.create_study(pruner=optuna.pruners.NopPruner())
    configs = [(lora(r=4), sft_args()), (lora(r=8), sft_args(per_device_train_batch_size=2)), (lora(), sft_args())]
    executor.optimize(study, by_number(configs), n_trials=3)

    assert seen[0] == seen[1] == seen[2]
    assert len(seen[0]) == 3
    assert sorted(p for prompts in seen[0] for p in prompts) == sorted(executor.config.train_dataset["prompt"])


def test_study_optimize_with_objective_interleaves_the_same_way(make_executor, chunk_log) -> None:
    executor = make_executor(schedule="lockstep", num_chunks=2, max_concurrent_trials=3)
    study = optuna.create_study(pruner=optuna.pruners.NopPruner())
    configs = [(lora(), sft_args(learning_rate=1e-3 * (i + 1))) for i in range(3)]
    study.optimize(executor.objective(by_number(configs)), n_trials=3, n_jobs=executor.max_concurrent_trials)

    assert _rounds(chunk_log) == [0, 0, 0, 1, 1, 1]
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.COMPLETE] * 3


def test_training_arguments_made_in_another_thread_wait_until_a_trainer_being_built_is_isolated(
    make_executor, monkeypatch
) -> None:
    """Every new TrainingArguments clears accelerate's shared state; a trial thread's configure(trial) in
    the middle of another trial's trainer construction made SFTTrainer fail on its accelerator state."""
    import threading

    import accelerate

    from optuna_rapidfire._trainers._base import ACCELERATE_STATE

    original = accelerate.Accelerator.__init__
    waited: list[bool] = []

    def init_then_configure_elsewhere(self, *args, **kwargs) -> None:
        original(self, *args, **kwargs)

        def configure_elsewhere() -> None:  # what a trial thread does when it runs configure(trial)
            with ACCELERATE_STATE:
                sft_args()

        other = threading.Thread(target=configure_elsewhere)
        other.start()
        other.join(timeout=0.5)
        waited.append(other.is_alive())  # still waiting: the build holds the state

    monkeypatch.setattr(accelerate.Accelerator, "__init__", init_then_configure_elsewhere)
    study = optuna.create_study()
    make_executor(num_chunks=2, max_concurrent_trials=1).optimize(study, by_number([(lora(), sft_args())]), n_trials=1)
    assert study.trials[0].state == optuna.trial.TrialState.COMPLETE
    assert waited and all(waited)
