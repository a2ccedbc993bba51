"""The scheduler's rules with fake trials: no model, no engine, no study."""

from __future__ import annotations

import threading

import pytest

from optuna_rapidfire._scheduler import Decision, Entry, Lockstep, Scheduler, Status, Task


def _scheduler(*numbers: int) -> tuple[Scheduler, list[Entry]]:
    scheduler = Scheduler(gather_seconds=0.0)
    entries = [Entry(number=n, trial_id=100 + n, spec=None) for n in numbers]
    for entry in entries:
        scheduler.add(entry)
    return scheduler, entries


def _build_all(scheduler: Scheduler, count: int) -> None:
    for _ in range(count):
        task, (entry,) = scheduler.next_task()
        assert task is Task.BUILD
        scheduler.built(entry, runtime=object())


def _train(scheduler: Scheduler, fuse: bool = False) -> list[int]:
    """Take the next training task (for an engine that fuses or not), 'train' it, and return the trial
    numbers it held."""
    task, group = scheduler.next_task(fuse=fuse)
    assert task is Task.TRAIN
    assert fuse or len(group) == 1
    for entry in group:
        scheduler.chunk_done(entry)
    return [e.number for e in group]


def test_trials_advance_in_lockstep_rounds_least_progress_first() -> None:
    scheduler, entries = _scheduler(0, 1, 2)
    _build_all(scheduler, 3)
    order = []
    for _ in range(2):  # two rounds
        for _ in range(3):
            order += _train(scheduler)
        for entry in entries:
            scheduler.decide(entry, Decision.CONTINUE)
    assert order == [0, 1, 2, 0, 1, 2]
    assert [e.chunks_done for e in entries] == [2, 2, 2]


def test_nobody_runs_ahead_of_a_live_trial_still_being_decided() -> None:
    scheduler, (first, second) = _scheduler(0, 1)
    _build_all(scheduler, 2)
    assert _train(scheduler) == [0]
    scheduler.decide(first, Decision.CONTINUE)  # trial 0 may go on, but trial 1 has less progress
    assert _train(scheduler) == [1]
    # Trial 1 awaits its decision: trial 0 (at equal progress) may train, trial 1 may not.
    scheduler.decide(first, Decision.CONTINUE)
    assert Lockstep().choose([first, second], fuse=False) == [first]
    assert _train(scheduler) == [0]
    assert Lockstep().choose([first, second], fuse=False) is None  # 0 is ahead, 1 undecided: wait


def test_a_fusing_device_takes_every_ready_trial_at_the_least_progress_as_one_group() -> None:
    scheduler, entries = _scheduler(0, 1, 2)
    _build_all(scheduler, 3)
    assert _train(scheduler, fuse=True) == [0, 1, 2]
    scheduler.decide(entries[0], Decision.CONTINUE)
    scheduler.decide(entries[1], Decision.CONTINUE)
    assert Lockstep().choose(entries, fuse=True) is None  # trial 2 is still being decided on
    scheduler.decide(entries[2], Decision.STOP)
    task, (entry,) = scheduler.next_task()  # housekeeping goes first
    assert (task, entry) == (Task.RELEASE, entries[2])
    scheduler.remove(entry)
    assert _train(scheduler, fuse=True) == [0, 1]


def test_housekeeping_goes_before_builds_and_builds_before_training() -> None:
    scheduler, (first, _) = _scheduler(0, 1)
    _build_all(scheduler, 2)
    assert _train(scheduler) == [0]
    late = Entry(number=2, trial_id=102, spec=None)
    scheduler.add(late)
    scheduler.decide(first, Decision.FINISH)
    assert scheduler.next_task() == (Task.FINISH, [first])
    scheduler.remove(first)
    assert scheduler.next_task() == (Task.BUILD, [late])
    scheduler.built(late, runtime=object())
    assert _train(scheduler) == [1]
    assert _train(scheduler) == [2]  # the late trial at the least progress is not left behind


def test_a_paused_trial_is_not_waited_for_and_is_not_live() -> None:
    scheduler, (first, second) = _scheduler(0, 1)
    _build_all(scheduler, 2)
    assert _train(scheduler) == [0]
    scheduler.mark(first, reported=0)
    scheduler.decide(first, Decision.PAUSE)
    assert scheduler.next_task() == (Task.PAUSE, [first])
    assert first.status is Status.PAUSED and not first.live
    # Trial 1 reports step 0: its round holds no one else, so it does not wait for the paused trial.
    assert _train(scheduler) == [1]
    scheduler.mark(second, reported=0)
    assert scheduler.wait_for_round(second, 0, stage="reported") == set()


def test_a_round_barrier_waits_for_every_live_peer() -> None:
    scheduler, (first, second) = _scheduler(0, 1)
    _build_all(scheduler, 2)
    scheduler.mark(first, reported=0)
    result: list[set[int]] = []
    waiter = threading.Thread(target=lambda: result.append(scheduler.wait_for_round(first, 0, stage="reported")))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()  # trial 1 has not reported step 0
    scheduler.mark(second, reported=0)
    waiter.join(5)
    assert result == [{second.trial_id}]


def test_the_first_wave_is_gathered_before_training_starts() -> None:
    scheduler = Scheduler(gather_seconds=30.0)
    scheduler.expect(2)
    first = Entry(number=0, trial_id=100, spec=None)
    scheduler.add(first)
    scheduler.next_task()
    scheduler.built(first, runtime=object())
    task_of: list[object] = []
    taker = threading.Thread(target=lambda: task_of.append(scheduler.next_task()))
    taker.start()
    taker.join(0.2)
    assert taker.is_alive()  # one of two expected trials: the device waits for the second
    second = Entry(number=1, trial_id=101, spec=None)
    scheduler.add(second)
    taker.join(5)
    assert task_of == [(Task.BUILD, [second])]


def test_a_trial_handed_out_twice_is_refused_and_close_ends_the_worker() -> None:
    scheduler, _ = _scheduler(0)
    with pytest.raises(RuntimeError, match="handed it out twice"):
        scheduler.add(Entry(number=0, trial_id=100, spec=None))
    scheduler.close()
    assert scheduler.next_task() is None
