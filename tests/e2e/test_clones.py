"""Warm and cold clones: exact continuation, changed hyperparameters take effect, incompatible changes go cold."""

from __future__ import annotations

import math
import subprocess
import sys
from typing import Any

import optuna
import pytest
from helpers import by_number, lora, sft_args, until_the_clone_is_taken, wait_until
from optuna.trial import TrialState

from optuna_rapidfire import control
from optuna_rapidfire._engines import ENGINES
from optuna_rapidfire._resident._snapshot import TrialSnapshot
from optuna_rapidfire._study import _attrs
from optuna_rapidfire._study._checkpoints import MEMORY

NUM_CHUNKS = 6


def configure(trial: optuna.Trial):
    rank = trial.suggest_categorical("r", [4, 8])
    lr = trial.suggest_float("learning_rate", 1e-4, 1e-1, log=True)
    decay = trial.suggest_float("weight_decay", 0.0, 0.5)
    return lora(r=rank, lora_dropout=0.2), sft_args(learning_rate=lr, weight_decay=decay, seed=3)


def _study_with_parent(make_executor, slow_chunks, clone_after_step: int, engine: str = "time_sliced", **clone_kwargs):
    """Run a parent trial; once it has reported ``clone_after_step``, clone it and run the clone."""
    executor = make_executor(num_chunks=NUM_CHUNKS, max_concurrent_trials=2, engine=engine)
    study = optuna.create_study(pruner=optuna.pruners.NopPruner())
    study.enqueue_trial({"r": 8, "learning_rate": 2e-2, "weight_decay": 0.1})
    objective = executor.objective(configure)
    import threading

    asked: list[int] = []
    slow_chunks(0.0, hold=until_the_clone_is_taken(study, clone_after_step, asked))
    parent = threading.Thread(target=study.optimize, args=(objective,), kwargs={"n_trials": 1})
    parent.start()
    wait_until(lambda: clone_after_step in study.trials[0].intermediate_values, what="the parent's report")
    child = control.clone(study, 0, **clone_kwargs)
    asked.append(child)
    study.optimize(objective, n_trials=1)
    parent.join()
    return study, study.trials[0], study.trials[child]


@pytest.mark.parametrize("engine", list(ENGINES))
def test_warm_clone_without_change_continues_exactly(make_executor, slow_chunks, engine: str) -> None:
    _study, parent, clone = _study_with_parent(make_executor, slow_chunks, clone_after_step=1, engine=engine)
    assert parent.state == clone.state == TrialState.COMPLETE
    branch = clone.user_attrs[_attrs.BRANCH_STEP]
    assert 2 <= branch < NUM_CHUNKS
    assert clone.user_attrs[_attrs.PARENT] == 0 and clone.user_attrs[_attrs.CLONE] == "warm"
    assert clone.params == parent.params
    # The clone inherits the parent's values up to the branch, then reports exactly the parent's.
    assert list(clone.intermediate_values) == list(range(NUM_CHUNKS))
    for step in range(NUM_CHUNKS):
        assert clone.intermediate_values[step] == parent.intermediate_values[step], step
    assert clone.value == parent.value


def test_warm_clone_takes_its_new_learning_rate_and_weight_decay(make_executor, slow_chunks, listen) -> None:
    from optuna_rapidfire import events

    groups: dict[int, list[dict]] = {}  # each trial's optimizer settings as it starts training (TrialBuilt)
    listen(lambda event: groups.setdefault(event.trial, list(event.param_groups)), events.TrialBuilt)
    _study, parent, clone = _study_with_parent(
        make_executor, slow_chunks, clone_after_step=1, params={"learning_rate": 5e-3, "weight_decay": 0.3}
    )
    assert clone.user_attrs[_attrs.CLONE] == "warm"
    assert clone.user_attrs[_attrs.LEARNING_RATE] == pytest.approx(5e-3)
    assert parent.user_attrs[_attrs.LEARNING_RATE] == pytest.approx(2e-2)
    first = groups[clone.number]
    assert [g["lr"] for g in first] == [pytest.approx(5e-3)] * len(first)
    assert sorted(g["weight_decay"] for g in first) == [0.0, pytest.approx(0.3)]  # biases and norms: no decay
    assert [g["lr"] for g in groups[parent.number]] == [pytest.approx(2e-2)] * len(first)
    branch = clone.user_attrs[_attrs.BRANCH_STEP]
    assert clone.intermediate_values[branch] != parent.intermediate_values[branch]
    for step in range(branch):
        assert clone.intermediate_values[step] == parent.intermediate_values[step]


def test_warm_clone_moves_its_own_schedule_to_the_parents_position(make_executor, listen) -> None:
    from optuna_rapidfire import events

    rates: dict[int, dict[int, float]] = {}  # trial -> chunks done -> learning rate after that chunk

    def record(event: events.Event) -> None:
        if isinstance(event, events.ChunkTrained):
            rates.setdefault(event.trial, {})[event.step + 1] = event.metrics["train_learning_rate"]

    listen(record)

    def scheduled(trial: optuna.Trial):
        lr = trial.suggest_float("learning_rate", 1e-4, 1e-1, log=True)
        warmup = trial.suggest_int("warmup_steps", 0, 20)
        return lora(), sft_args(learning_rate=lr, lr_scheduler_type="linear", warmup_steps=warmup)

    executor = make_executor(num_chunks=NUM_CHUNKS, max_concurrent_trials=2)
    study = optuna.create_study(pruner=optuna.pruners.NopPruner())
    study.enqueue_trial({"learning_rate": 2e-2, "warmup_steps": 0})
    objective = executor.objective(scheduled)
    import threading

    parent = threading.Thread(target=study.optimize, args=(objective,), kwargs={"n_trials": 1})
    parent.start()
    wait_until(lambda: 1 in study.trials[0].intermediate_values, what="the parent's report")
    changed = {"learning_rate": 1e-2, "warmup_steps": 10}
    child = control.clone(study, 0, params=changed)
    study.optimize(objective, n_trials=1)
    parent.join()
    # A trial with the clone's settings from scratch: its schedule at each chunk is what the clone's
    # must be once moved to the parent's position.
    study.enqueue_trial(changed)
    study.optimize(objective, n_trials=1)
    clone, fresh = study.trials[child].number, study.trials[-1].number
    branch = study.trials[child].user_attrs[_attrs.BRANCH_STEP]
    assert rates[clone] and min(rates[clone]) == branch + 1
    for chunks_done, rate in rates[clone].items():
        assert rate == pytest.approx(rates[fresh][chunks_done])
    assert rates[clone][branch + 1] != pytest.approx(rates[0][branch + 1])


def test_rank_change_makes_a_cold_clone(make_executor, slow_chunks) -> None:
    _study, parent, clone = _study_with_parent(make_executor, slow_chunks, clone_after_step=1, params={"r": 4})
    assert clone.user_attrs[_attrs.CLONE] == "cold"
    assert "rank or target modules" in clone.user_attrs[_attrs.COLD_REASON]
    assert clone.user_attrs[_attrs.BRANCH_STEP] == 0
    assert list(clone.intermediate_values) == list(range(NUM_CHUNKS))  # trained from scratch
    assert not math.isclose(clone.intermediate_values[0], parent.intermediate_values[0])


def test_cold_clone_on_request(make_executor, slow_chunks) -> None:
    _study, parent, clone = _study_with_parent(make_executor, slow_chunks, clone_after_step=0, warm_start=False)
    assert clone.user_attrs[_attrs.CLONE] == "cold"
    assert clone.user_attrs[_attrs.COLD_REASON] == "a cold clone was asked for"
    assert clone.intermediate_values[0] == parent.intermediate_values[0]  # same params, same seed, from scratch


def test_a_warm_clone_of_a_trial_that_trained_everything_is_refused_at_once_and_one_of_a_failed_trial_too(
    make_executor, tmp_path
) -> None:
    executor = make_executor(num_chunks=3, max_concurrent_trials=1)
    url = f"sqlite:///{tmp_path / 'clones.db'}"
    study = optuna.create_study(storage=url, study_name="clones", pruner=optuna.pruners.NopPruner())
    study.enqueue_trial({"r": 8, "learning_rate": 2e-2, "weight_decay": 0.1})
    executor.optimize(study, configure, n_trials=1)
    before = len(study.trials)
    # Unchanged, from its last chunk: nothing would be left to train, so nothing is enqueued.
    with pytest.raises(ValueError, match=r"had trained all 3 chunks at chunk 3: .* nothing left to train"):
        control.clone(study, 0)
    # An earlier chunk of a finished trial: only its last state is kept.
    with pytest.raises(ValueError, match=r"state after chunk 1 is no longer kept \(kept: after chunks \[3\]\)"):
        control.clone(study, 0, from_chunk=1)
    with pytest.raises(ValueError, match="from_chunk must be between 1 and 3"):
        control.clone(study, 0, from_chunk=4)
    # Changed: this process ran the study, so the clone's run length is known from configure (3 chunks, as the
    # learning rate does not change it): nothing would be left to train either.
    with pytest.raises(ValueError, match=r"a run with these params is 3 chunks: .* nothing left to train"):
        control.clone(study, 0, params={"learning_rate": 1e-3})
    assert len(study.trials) == before
    # From a process that never ran the study (the CLI on another machine) the run length is unknown: the clone
    # is enqueued, and once built it fails, recording nothing of the new learning rate.
    cli = [sys.executable, "-m", "optuna_rapidfire", "clone", "--storage", url, "--study-name", "clones", "0"]
    done = subprocess.run([*cli, "--set", "learning_rate=1e-3"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    child = len(study.trials) - 1
    executor.optimize(study, configure, n_trials=1)
    clone = study.trials[child]
    assert clone.state == TrialState.FAIL and clone.intermediate_values == {}
    assert clone.user_attrs[_attrs.FAIL_REASON].startswith("Warm clone of trial 0, which had trained all 3 chunks")
    with pytest.raises(ValueError, match=f"Trial {child} failed .*Clone it cold"):
        control.clone(study, child)
    cold = control.clone(study, child, warm_start=False)  # a cold clone of it trains from scratch
    executor.optimize(study, configure, n_trials=1)
    assert study.trials[cold].state == TrialState.COMPLETE and sorted(study.trials[cold].intermediate_values) == [
        0,
        1,
        2,
    ]


def test_a_warm_clone_from_a_named_chunk_of_a_live_trial_continues_from_there_with_its_new_learning_rate(
    make_executor, slow_chunks
) -> None:
    executor = make_executor(num_chunks=NUM_CHUNKS, max_concurrent_trials=2)
    study = optuna.create_study(pruner=optuna.pruners.NopPruner())
    study.enqueue_trial({"r": 8, "learning_rate": 2e-2, "weight_decay": 0.1})
    asked: list[int] = []

    def clone_after_chunk_4() -> bool:
        if not asked and 3 in study.trials[0].intermediate_values:
            asked.append(control.clone(study, 0, from_chunk=2))
            asked.append(control.clone(study, 0, params={"learning_rate": 5e-3}, from_chunk=2))
        return False

    slow_chunks(0.0, hold=clone_after_chunk_4)
    executor.optimize(study, configure, n_trials=1)
    parent, same, changed = study.trials[0], study.trials[asked[0]], study.trials[asked[1]]
    assert parent.state == same.state == changed.state == TrialState.COMPLETE
    assert same.user_attrs[_attrs.BRANCH_STEP] == changed.user_attrs[_attrs.BRANCH_STEP] == 2
    assert same.intermediate_values == parent.intermediate_values
    # The changed clone inherits chunks 1-2, then trains from the parent's state after chunk 2 at its own rate.
    assert [changed.intermediate_values[s] for s in (0, 1)] == [parent.intermediate_values[s] for s in (0, 1)]
    assert changed.intermediate_values[2] != parent.intermediate_values[2]
    assert changed.user_attrs[_attrs.LEARNING_RATE] == pytest.approx(5e-3)


def test_clone_rejects_unknown_or_out_of_range_params(make_executor) -> None:
    study = optuna.create_study()
    study.enqueue_trial({"r": 8, "learning_rate": 2e-2, "weight_decay": 0.1})
    make_executor(num_chunks=2, max_concurrent_trials=1).optimize(study, configure, n_trials=1)
    before = len(study.trials)
    with pytest.raises(ValueError, match="no parameter 'rank'"):
        control.clone(study, 0, params={"rank": 4})
    with pytest.raises(ValueError, match="outside"):
        control.clone(study, 0, params={"learning_rate": 10.0})
    with pytest.raises(ValueError, match="not one of its choices"):
        control.clone(study, 0, params={"r": 5})
    with pytest.raises(ValueError, match="does not exist"):
        control.clone(study, 42)
    assert len(study.trials) == before


@pytest.mark.parametrize("schedule", ["default", "lockstep"])
def test_a_clone_asked_for_while_the_study_runs_branches_where_asked_and_trains_in_the_same_call(
    make_executor, slow_chunks, schedule: str
) -> None:
    """One slot, n_trials=2, one enqueued trial; after its chunk 2 a warm clone of it is asked for, unchanged.
    The clone trains in the same optimize call (beyond the budget: the sampler's config still runs), branches
    from chunk 2 whatever its parent did since, and continues the parent's values exactly."""
    executor = make_executor(num_chunks=NUM_CHUNKS, max_concurrent_trials=1, schedule=schedule)
    study = optuna.create_study(pruner=optuna.pruners.NopPruner(), sampler=optuna.samplers.RandomSampler(seed=0))
    study.enqueue_trial({"r": 8, "learning_rate": 2e-2, "weight_decay": 0.1})
    asked: list[int] = []

    def clone_after_chunk_2() -> bool:  # the parent's next chunk starts only once the clone was asked for
        if not asked and 1 in study.trials[0].intermediate_values:
            asked.append(control.clone(study, 0))
        return False

    slow_chunks(0.0, hold=clone_after_chunk_2)
    executor.optimize(study, configure, n_trials=2)
    [child] = asked
    parent, clone = study.trials[0], study.trials[child]
    assert parent.state == clone.state == TrialState.COMPLETE
    assert clone.user_attrs[_attrs.BRANCH_STEP] == 2 and clone.user_attrs[_attrs.CLONE] == "warm"
    assert clone.intermediate_values == parent.intermediate_values
    # The budget counts the trials the study asked for: the clone came on top.
    assert sum(_attrs.CLONE_OF not in t.user_attrs for t in study.trials) == 2
    assert all(t.state.is_finished() for t in study.trials)  # nothing left waiting


@pytest.mark.parametrize("engine", list(ENGINES))
def test_a_finished_trials_snapshot_file_is_its_last_checkpoint_taken_from_the_device_once(
    make_executor, monkeypatch, tmp_path, engine: str
) -> None:
    """The state a finished trial leaves for clones is the one its last chunk's checkpoint copied to the host:
    copied from the device once a chunk, not again at the trial's end, and written with the study's name. A gang's
    members that end a chunk together are copied together (one wait for the device), before either driver runs."""
    captured: list[list[int]] = []
    capture = TrialSnapshot.capture_together.__func__  # type: ignore[attr-defined]

    def counted(cls: type[TrialSnapshot], trials: list[tuple[Any, ...]]) -> list[TrialSnapshot]:
        captured.append([number for number, *_ in trials])
        return capture(cls, trials)

    monkeypatch.setattr(TrialSnapshot, "capture_together", classmethod(counted))
    executor = make_executor(num_chunks=2, max_concurrent_trials=2, engine=engine, schedule="lockstep")
    study = optuna.create_study(study_name="kept", pruner=optuna.pruners.NopPruner())
    configs = [(lora(r=4), sft_args(learning_rate=1e-2 * (i + 1), seed=i)) for i in range(2)]
    executor.optimize(study, by_number(configs), n_trials=2)
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2
    assert sorted(n for numbers in captured for n in numbers) == [0, 0, 1, 1]  # one per chunk
    if engine == "fused":  # the gang's two members, together at each of the two chunks' ends
        assert [sorted(numbers) for numbers in captured] == [[0, 1], [0, 1]]
    kept = study._storage.get_study_system_attrs(study._study_id)
    for number in (0, 1):
        blob = (tmp_path / "out" / "kept" / "state" / f"trial-{number}" / "snapshot.safetensors").read_bytes()
        snapshot, study_name = TrialSnapshot.from_bytes(blob)
        assert study_name == "kept" and snapshot.trial_number == number and snapshot.position.chunks_done == 2
        last_checkpoint = kept[f"{_attrs.CHUNK_STATES_PREFIX}{number}"]["2"]
        with MEMORY.open_reader(last_checkpoint["artifact_id"]) as kept_bytes:
            assert kept_bytes.read() == blob  # the very bytes of the checkpoint


def test_a_member_whose_state_cannot_be_copied_fails_alone(make_executor, monkeypatch) -> None:
    """When copying a gang's states together raises, each member's is copied alone: the one that cannot be copied
    fails its trial, the other member's chunk is reported and its trial completes."""
    capture = TrialSnapshot.capture_together.__func__  # type: ignore[attr-defined]

    def failing(cls: type[TrialSnapshot], trials: list[tuple[Any, ...]]) -> list[TrialSnapshot]:
        if len(trials) > 1 or trials[0][0] == 1:
            raise RuntimeError(f"no host memory for trial {[number for number, *_ in trials]}")
        return capture(cls, trials)

    monkeypatch.setattr(TrialSnapshot, "capture_together", classmethod(failing))
    executor = make_executor(num_chunks=2, max_concurrent_trials=2, engine="fused", schedule="lockstep")
    study = optuna.create_study(pruner=optuna.pruners.NopPruner())
    configs = [(lora(r=4), sft_args(learning_rate=1e-2 * (i + 1), seed=i)) for i in range(2)]
    executor.optimize(study, by_number(configs), n_trials=2)
    assert [t.state for t in study.trials] == [TrialState.COMPLETE, TrialState.FAIL]
    assert sorted(study.trials[0].intermediate_values) == [0, 1] and not study.trials[1].intermediate_values
    assert "no host memory for trial [1]" in study.trials[1].user_attrs[_attrs.FAIL_REASON]
