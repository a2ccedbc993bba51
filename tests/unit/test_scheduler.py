"""The scheduler's rules with fake trials: no model, no engine, no study."""

from __future__ import annotations

import threading
import time

import pytest

from optuna_rapidfire._runtime import _scheduler as _scheduler_module
from optuna_rapidfire._runtime._entry import Decision, Entry, Stopped, Task
from optuna_rapidfire._runtime._scheduler import Scheduler
from optuna_rapidfire._runtime._schedules import schedule_from
from optuna_rapidfire._runtime._slots import Slots
from optuna_rapidfire.schedules import (
    BaseSchedule,
    LockstepSchedule,
    PromoteSchedule,
    Reports,
    Status,
    Stop,
    TrialView,
)


def _scheduler(*numbers: int, schedule: str = "lockstep") -> tuple[Scheduler, list[Entry]]:
    scheduler = Scheduler(gather_seconds=0.0, schedule=schedule_from(schedule))
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
    assert LockstepSchedule().choose([first, second], fuse=False, now=0.0) == [first]
    assert _train(scheduler) == [0]
    assert LockstepSchedule().choose([first, second], fuse=False, now=0.0) is None  # 0 is ahead, 1 undecided: wait


def test_a_fusing_device_takes_every_ready_trial_at_the_least_progress_as_one_group() -> None:
    scheduler, entries = _scheduler(0, 1, 2)
    _build_all(scheduler, 3)
    assert _train(scheduler, fuse=True) == [0, 1, 2]
    scheduler.decide(entries[0], Decision.CONTINUE)
    scheduler.decide(entries[1], Decision.CONTINUE)
    assert LockstepSchedule().choose(entries, fuse=True, now=0.0) is None  # trial 2 is still being decided on
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


def test_trials_finishing_together_are_one_finish_task_and_settle_waits_until_they_left() -> None:
    """A gang's members finish at once: the device saves them all, then frees them (their drivers go on meanwhile);
    settle() returns once every finished trial has left, or at once when the device no longer works."""
    scheduler, entries = _scheduler(0, 1, 2)
    _build_all(scheduler, 3)
    assert _train(scheduler, fuse=True) == [0, 1, 2]
    scheduler.decide(entries[0], Decision.FINISH)
    scheduler.decide(entries[2], Decision.FINISH)
    scheduler.decide(entries[1], Decision.STOP)  # a pruned one: released on its own
    assert scheduler.next_task() == (Task.FINISH, [entries[0], entries[2]])
    settled = threading.Event()
    waiter = threading.Thread(target=lambda: (scheduler.settle(lambda: True), settled.set()))
    waiter.start()
    for entry in (entries[0], entries[2]):
        assert not settled.wait(0.2)  # a finished trial still holds its state
        scheduler.remove(entry)
    assert scheduler.next_task() == (Task.RELEASE, [entries[1]])
    assert not settled.wait(0.2)
    scheduler.remove(entries[1])
    assert settled.wait(5)
    waiter.join(5)
    late = Entry(number=3, trial_id=103, spec=None)
    scheduler.add(late)
    _build_all(scheduler, 1)
    scheduler.decide(late, Decision.STOP)
    scheduler.settle(lambda: False)  # a worker that died frees nothing more: no wait


def test_a_finish_waits_a_moment_for_the_mates_that_have_not_decided_then_goes_alone() -> None:
    """Drivers of a gang's members decide a few ms apart: the first FINISH waits for its undecided mates (up to
    FINISH_GATHER_SECONDS after its chunk), so that they are saved together; a mate that decides later than that does
    not hold it back."""
    scheduler, entries = _scheduler(0, 1, 2)
    _build_all(scheduler, 3)
    assert _train(scheduler, fuse=True) == [0, 1, 2]
    scheduler.decide(entries[0], Decision.FINISH)

    def others() -> None:
        time.sleep(_scheduler_module.FINISH_GATHER_SECONDS / 5)
        scheduler.decide(entries[1], Decision.FINISH)
        scheduler.decide(entries[2], Decision.FINISH)

    deciding = threading.Thread(target=others)
    deciding.start()
    assert scheduler.next_task() == (Task.FINISH, entries)
    deciding.join(5)

    scheduler, entries = _scheduler(0, 1)
    _build_all(scheduler, 2)
    assert _train(scheduler, fuse=True) == [0, 1]
    scheduler.decide(entries[0], Decision.FINISH)
    assert scheduler.side_task() is None  # a stream's side task does not wait: later
    start = time.monotonic()
    assert scheduler.next_task() == (Task.FINISH, [entries[0]])  # the mate is still deciding: alone, after a moment
    assert time.monotonic() - start < 5


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


@pytest.mark.parametrize("build_seconds", [0.0, 2.4], ids=["quick build", "build longer than the window"])
def test_the_first_wave_is_gathered_before_training_starts(build_seconds: float) -> None:
    # A build slows the threads still configuring their trials: the window (2 s here) starts again when a build
    # ends, not at the last arrival (it used to end while the device was building: the first wave started short).
    scheduler = Scheduler(gather_seconds=2.0)
    scheduler.expect(2)
    first = Entry(number=0, trial_id=100, spec=None)
    scheduler.add(first)
    scheduler.next_task()
    time.sleep(build_seconds)
    scheduler.built(first, runtime=object())
    task_of: list[object] = []
    taker = threading.Thread(target=lambda: task_of.append(scheduler.next_task()))
    taker.start()
    taker.join(0.3)
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


# -- promote -----------------------------------------------------------------------------------------


def test_promote_gives_the_device_to_the_ready_trial_with_the_most_progress() -> None:
    scheduler, entries = _scheduler(0, 1, 2, schedule="promote")
    _build_all(scheduler, 3)
    assert _train(scheduler) == [0]
    # Trial 0 is being decided on: the device does not wait for it (no round barrier), trial 1 trains.
    assert _train(scheduler) == [1]
    scheduler.decide(entries[0], Decision.CONTINUE)
    scheduler.decide(entries[1], Decision.CONTINUE)
    # 0 and 1 have one chunk, 2 has none: the older leader goes first, then the other, then the laggard.
    assert _train(scheduler) == [0]
    assert _train(scheduler) == [1]
    assert _train(scheduler) == [2]
    scheduler.decide(entries[0], Decision.CONTINUE)
    scheduler.decide(entries[2], Decision.CONTINUE)
    assert _train(scheduler) == [0]  # two chunks beat one
    assert [e.chunks_done for e in entries] == [3, 2, 1]


def test_promote_fuses_every_ready_trial_whatever_its_progress() -> None:
    scheduler, entries = _scheduler(0, 1, schedule="promote")
    _build_all(scheduler, 2)
    assert _train(scheduler, fuse=True) == [0, 1]
    for entry in entries:
        scheduler.decide(entry, Decision.CONTINUE)
    entries.append(Entry(number=2, trial_id=102, spec=None))
    scheduler.add(entries[2])
    _build_all(scheduler, 1)  # trial 2 joins with no progress: it shares the next pass
    assert _train(scheduler, fuse=True) == [0, 1, 2]
    assert [e.chunks_done for e in entries] == [2, 2, 1]


def test_a_promote_gang_waits_briefly_for_decisions_in_flight_then_goes_without_them() -> None:
    first, second = Entry(number=0, trial_id=100, spec=None), Entry(number=1, trial_id=101, spec=None)
    first.status, second.status = Status.READY, Status.AWAITING
    second.awaiting_since = 10.0
    schedule = PromoteSchedule(gang_wait_seconds=2.0)
    assert schedule.choose([first, second], fuse=True, now=10.5) == pytest.approx(1.5)  # ask again in 1.5 s
    assert schedule.choose([first, second], fuse=True, now=12.5) == [first]
    assert schedule.choose([first, second], fuse=False, now=10.5) == [first]  # one at a time: no wait
    second.status = Status.PAUSED
    assert schedule.choose([first, second], fuse=True, now=10.5) == [first]  # a paused trial is not waited for


def test_schedules_by_name_and_bad_names_are_refused_naming_the_value() -> None:
    assert isinstance(schedule_from("promote"), PromoteSchedule)
    assert isinstance(schedule_from("lockstep"), LockstepSchedule)
    mine = PromoteSchedule(gang_wait_seconds=0.5)
    assert schedule_from(mine) is mine
    assert isinstance(schedule_from("default"), PromoteSchedule)
    listed = r"one of 'default' \('promote'\), 'lockstep', 'promote', 'promote_all' .*'asha'"
    with pytest.raises(ValueError, match=listed):
        schedule_from("asha")
    with pytest.raises(ValueError, match="gang_wait_seconds=-1"):
        PromoteSchedule(gang_wait_seconds=-1)


@pytest.mark.parametrize("fuse", [False, True])
def test_under_promote_the_device_is_never_idle_while_a_trial_is_ready_and_leaders_complete_first(
    fuse: bool,
) -> None:
    """A device worker whose engine only records what it is asked, and drivers that decide at once
    (trial 3 in half a second). A watcher samples the table: the device never waits longer than a
    gang's wait for decisions in flight while a trial is READY; and the first trial completes before
    the laggard trains its last chunk. (LockstepSchedule fails both: it waits for trial 3.)"""
    chunks = 4
    scheduler = Scheduler(gather_seconds=0.0, schedule=PromoteSchedule(gang_wait_seconds=0.05))
    entries = [Entry(number=n, trial_id=100 + n, spec=None) for n in range(4)]
    log: list[tuple[str, list[int]]] = []
    waiting_since: list[float | None] = [None]
    idle_while_ready: list[list[int]] = []
    finished = threading.Event()

    def device() -> None:
        while True:
            waiting_since[0] = time.monotonic()
            task = scheduler.next_task(fuse=fuse)
            waiting_since[0] = None
            if task is None:
                return
            kind, group = task
            log.append((kind.value, [e.number for e in group]))
            if kind is Task.BUILD:
                scheduler.built(group[0], runtime=object())
            elif kind is Task.TRAIN:
                time.sleep(0.01)
                for entry in group:
                    scheduler.chunk_done(entry)
                    entry.events.put("chunk")
            else:  # trials finishing together come as one group
                for entry in group:
                    scheduler.remove(entry)
                    entry.events.put("gone")

    def watcher() -> None:
        idle_since = None  # since when the device has waited with a trial READY, without a break
        while not finished.is_set():
            ready = [e.number for e in entries if e.status is Status.READY]
            if waiting_since[0] is not None and ready:
                idle_since = idle_since or time.monotonic()
                if time.monotonic() - idle_since > 0.15:
                    idle_while_ready.append(ready)
            else:
                idle_since = None
            time.sleep(0.005)

    def driver(entry: Entry) -> None:
        scheduler.add(entry)
        for chunk in range(chunks):
            assert entry.events.get(timeout=10) == "chunk"
            time.sleep(0.5 if entry.number == 3 else 0.001)  # trial 3 decides slowly
            scheduler.decide(entry, Decision.FINISH if chunk == chunks - 1 else Decision.CONTINUE)
        assert entry.events.get(timeout=10) == "gone"

    threads = [threading.Thread(target=device), threading.Thread(target=watcher)]
    drivers = [threading.Thread(target=driver, args=(e,)) for e in entries]
    for thread in threads + drivers:
        thread.start()
    for thread in drivers:
        thread.join(30)
    finished.set()
    scheduler.close()
    for thread in threads:
        thread.join(10)
    assert idle_while_ready == []
    assert sum(len(trials) for what, trials in log if what == "train") == 4 * chunks
    first_done = next(i for i, (what, trials) in enumerate(log) if what == "finish" and 0 in trials)
    laggard_last = max(i for i, (what, trials) in enumerate(log) if what == "train" and 3 in trials)
    assert first_done < laggard_last


def test_a_custom_schedule_that_hands_back_nothing_ready_makes_the_device_wait() -> None:
    class Careless(LockstepSchedule):
        def choose(self, live, *, fuse, now):  # type: ignore[no-untyped-def]
            return [e for e in live if e.status is not Status.READY]  # nothing it may train

    scheduler = Scheduler(gather_seconds=0.0, schedule=Careless())
    entry = Entry(number=0, trial_id=100, spec=None)
    scheduler.add(entry)
    _build_all(scheduler, 1)
    entry.status = Status.AWAITING
    taker = threading.Thread(target=scheduler.next_task)
    taker.start()
    taker.join(0.2)
    assert taker.is_alive()  # no TRAIN task without a READY trial: it waits, it does not spin
    assert entry.status is Status.AWAITING
    scheduler.close()
    taker.join(5)


def test_a_decision_about_a_trial_the_device_removed_leaves_it_gone() -> None:
    # A gang that fails after delivering one member's chunk removes every member; that member's driver
    # may still decide on the delivered chunk, and must then see the trial as gone (not wait on it).
    scheduler, (entry,) = _scheduler(0, schedule="promote")
    _build_all(scheduler, 1)
    assert _train(scheduler) == [0]
    scheduler.remove(entry)
    scheduler.decide(entry, Decision.CONTINUE)
    assert entry.gone and entry.request is None


# -- ASHA's promotion rule (PromoteSchedule) ------------------------------------------------------------


def _waiting(number: int, chunks: int) -> Entry:
    entry = Entry(number=number, trial_id=100 + number, spec=None, status=Status.READY)
    entry.chunks_done = chunks
    return entry


def test_promotions_follow_ashas_rule_with_eta_2_on_every_chunk() -> None:
    """The worked example of PromoteSchedule's docstring, step by step (a minimizing study)."""
    schedule = PromoteSchedule(eta=2, rungs="every", new_trial_seconds=0.0)
    values: dict[int, dict[int, float]] = {0: {0: 0.9, 1: 0.5, 2: 0.7, 3: 0.6}}
    reports = Reports(values, maximize=False, capacity=8)
    trials = [_waiting(n, 1) for n in range(4)]
    # Rung 1 holds 4: the top floor(4/2) = 2 (trials 1 and 3) go on, the better first; 0 and 2 wait.
    assert schedule.choose(trials, fuse=True, now=0.0, reports=reports) == [trials[1], trials[3]]
    assert schedule.choose(trials, fuse=False, now=0.0, reports=reports) == [trials[1]]
    trials[1].chunks_done = trials[3].chunks_done = 2
    values[1] = {1: 0.4, 3: 0.55}
    # Rung 2 holds 2: the top 1 (trial 1) goes on; 3 waits, and so do 0 and 2 at rung 1.
    assert schedule.choose(trials, fuse=True, now=0.0, reports=reports) == [trials[1]]
    new = _waiting(4, 0)
    # A trial that has not reported trains before anyone waiting, after the promotable ones.
    assert schedule.choose([*trials, new], fuse=True, now=0.0, reports=reports) == [trials[1], new]
    new.chunks_done = 1
    values[0][4] = 0.45
    trials[1].status = Status.AWAITING  # being decided on: the rest waits for it
    # Rung 1 now holds 5: the top 2 are trials 1 (past it) and 4.
    assert schedule.choose([*trials, new], fuse=False, now=0.0, reports=reports) == [new]


def test_promotions_follow_ashas_rule_with_eta_3_on_a_geometric_ladder() -> None:
    schedule = PromoteSchedule(eta=3, new_trial_seconds=0.0)
    assert [c for c in range(1, 30) if schedule.is_rung(c)] == [1, 3, 9, 27]
    values: dict[int, dict[int, float]] = {0: {n: v for n, v in enumerate([3.0, 1.0, 2.0, 5.0, 4.0, 0.5])}}
    reports = Reports(values, maximize=True, capacity=6)  # maximizing: larger is better
    trials = [_waiting(n, 1) for n in range(6)]
    # 6 at rung 1: the top 2 when maximizing are trials 3 (5.0) and 4 (4.0).
    assert schedule.choose(trials, fuse=True, now=0.0, reports=reports) == [trials[3], trials[4]]
    trials[3].chunks_done = 2  # between rungs 1 and 3: it goes on without a judgement
    values[1] = {3: 9.0}
    assert schedule.choose(trials, fuse=True, now=0.0, reports=reports) == [trials[4], trials[3]]
    trials[3].chunks_done, trials[4].chunks_done = 3, 3
    values[2] = {3: 9.5, 4: 8.0}
    # Rung 3 holds 2 (< eta): nobody goes on from it. Nothing else may train and every slot holds a waiting
    # trial: the best waiting trial is promoted, the highest rung first.
    assert schedule.choose(trials, fuse=True, now=0.0, reports=reports) == [trials[3]]
    # With a free slot and a trial just arrived or left, the device waits for the sampler's next config.
    patient = PromoteSchedule(eta=3, new_trial_seconds=2.0)
    early = Reports(values, maximize=True, capacity=8, last_change=9.5)
    assert patient.choose(trials, fuse=True, now=10.0, reports=early) == pytest.approx(1.5)
    assert patient.choose(trials, fuse=True, now=12.0, reports=early) == [trials[3]]


def test_promote_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="eta must be an integer of at least 2"):
        PromoteSchedule(eta=1)
    with pytest.raises(ValueError, match="rungs must be 'geometric' or 'every'"):
        PromoteSchedule(rungs="linear")


def _chunks_until_the_best_completes(schedule, order: list[int], curves: list[list[float]], capacity: int) -> int:
    """A device that trains one chunk at a time, fed the configs in ``order`` as slots free (no pruner):
    how many chunks it trains until the config with the best final value has trained all its chunks."""
    total = len(curves[0])
    best = min(range(len(curves)), key=lambda c: curves[c][-1])
    values: dict[int, dict[int, float]] = {}
    pending, live, trained = list(order), [], 0
    config_of: dict[int, int] = {}
    while True:
        while pending and len(live) < capacity:
            number = len(config_of)
            config_of[number] = pending.pop(0)
            live.append(_waiting(number, 0))
        choice = schedule.choose(live, fuse=False, now=float(trained), reports=Reports(values, capacity=capacity))
        assert isinstance(choice, list) and len(choice) == 1, choice
        (entry,) = choice
        values.setdefault(entry.chunks_done, {})[entry.number] = curves[config_of[entry.number]][entry.chunks_done]
        entry.chunks_done += 1
        trained += 1
        if entry.chunks_done == total:
            if config_of[entry.number] == best:
                return trained
            live.remove(entry)


def test_promote_reaches_the_best_config_no_later_than_lockstep_on_most_orderings() -> None:
    """A simulation over learning curves (no training): 16 configs, 4 slots, 8 chunks, 200 random orderings;
    the chunks trained until the best config has completed, under ASHA's promotion and under lock-step."""
    import random

    rng = random.Random(0)
    curves = []
    for _ in range(16):
        final, start, speed = rng.uniform(1.0, 3.0), rng.uniform(3.5, 4.5), rng.uniform(0.2, 0.8)
        curves.append([final + (start - final) * (1 - speed) ** k + rng.gauss(0, 0.02) for k in range(1, 9)])
    wins = 0
    for _ in range(200):
        order = list(range(16))
        rng.shuffle(order)
        promote = _chunks_until_the_best_completes(PromoteSchedule(new_trial_seconds=0.0), order, curves, 4)
        lockstep = _chunks_until_the_best_completes(LockstepSchedule(), order, curves, 4)
        wins += promote <= lockstep
    assert wins >= 180, wins


def test_when_nobody_can_tell_whether_a_trial_comes_the_best_waiting_trial_goes_on_after_a_wait() -> None:
    schedule = PromoteSchedule(eta=3, new_trial_seconds=1.0)
    trials = [_waiting(0, 1), _waiting(1, 1)]
    values: dict[int, dict[int, float]] = {0: {0: 0.5, 1: 0.9}}
    unknown = Reports(values, capacity=2, last_change=5.0, more_trials=None)  # a plain study.optimize
    assert schedule.choose(trials, fuse=True, now=5.5, reports=unknown) == pytest.approx(0.5)
    assert schedule.choose(trials, fuse=True, now=6.5, reports=unknown) == [trials[0]]
    coming = Reports(values, capacity=2, last_change=0.0, more_trials=True)
    waited = schedule.choose(trials, fuse=True, now=99.0, reports=coming)  # a new config is on its way
    assert isinstance(waited, float) and 0 < waited < 1


def test_once_the_budget_is_spent_a_rung_is_final_and_the_rest_of_the_waiting_trials_are_stopped() -> None:
    schedule = PromoteSchedule(eta=3, when_exhausted="stop")
    trials = [_waiting(n, 1) for n in range(6)] + [_waiting(6, 3), _waiting(7, 3)]
    # Rung 1 holds 8: trials 6 and 7 (the top 2) went on; rung 3 holds those 2 (< eta), so while new trials may
    # still come nobody goes on from it.
    values: dict[int, dict[int, float]] = {0: {n: 1.0 + n / 10 for n in range(6)} | {6: 0.6, 7: 0.7}}
    values[2] = {6: 0.4, 7: 0.3}
    open_ = Reports(values, capacity=8, more_trials=True)
    assert schedule.waiting(trials, open_) == frozenset(range(8))
    spent = Reports(values, capacity=8, more_trials=False)
    # Rung 3 is final: its best (trial 7) goes on; nobody of rung 1 does.
    assert schedule.choose(trials, fuse=True, now=0.0, reports=spent) == [trials[7]]
    trials.pop()  # trial 7 completes
    stop = schedule.choose(trials, fuse=True, now=0.0, reports=spent)
    assert isinstance(stop, Stop) and set(stop.reasons) == set(range(7))
    assert "after chunk 3: rank 2 of the 2 trials that reported there, below the top 1" in stop.reasons[6]
    assert "after chunk 1: rank 3 of the 8 trials that reported there, below the top 2" in stop.reasons[0]
    # The behaviour before, by name ("promote_all"): the best waiting trial goes on, the highest rung first.
    before = schedule_from("promote_all")
    assert isinstance(before, PromoteSchedule) and before.when_exhausted == "promote"
    assert PromoteSchedule().when_exhausted == "stop"  # the default
    assert before.choose(trials, fuse=True, now=0.0, reports=spent) == [trials[6]]
    with pytest.raises(ValueError, match="when_exhausted must be 'stop' or 'promote'"):
        PromoteSchedule(when_exhausted="never")


def test_ties_at_the_cut_go_on_together() -> None:
    schedule = PromoteSchedule(eta=3)
    trials = [_waiting(n, 1) for n in range(6)]
    values = {0: {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0, 4: 9.0, 5: 9.0}}  # four equal good ones, two bad
    chosen = schedule.choose(trials, fuse=True, now=0.0, reports=Reports(values, capacity=8))
    assert chosen == trials[:4]  # the top floor(6/3) = 2, and every trial tied with the second


def test_a_gang_holds_at_most_the_device_s_capacity_the_promoted_first() -> None:
    schedule = PromoteSchedule(eta=2, rungs="every")
    trials = [_waiting(n, 1) for n in range(4)] + [_waiting(n, 0) for n in range(4, 8)]
    values = {0: {0: 0.1, 1: 0.2, 2: 0.8, 3: 0.9}}
    chosen = schedule.choose(trials, fuse=True, now=0.0, reports=Reports(values, capacity=4))
    assert chosen == [trials[0], trials[1], trials[4], trials[5]]


def test_a_gang_with_room_waits_a_moment_for_new_trials_on_their_way() -> None:
    schedule = PromoteSchedule(eta=2, rungs="every", gang_wait_seconds=2.0)
    trials = [_waiting(0, 1), _waiting(1, 1)]
    values = {0: {0: 0.1, 1: 0.2, 2: 0.8, 3: 0.9}}  # trials 0 and 1 are the top 2 of 4 at rung 1
    coming = Reports(values, capacity=4, more_trials=True, arriving_since=10.0)
    assert schedule.choose(trials, fuse=True, now=10.5, reports=coming) == pytest.approx(1.5)
    assert schedule.choose(trials, fuse=True, now=12.5, reports=coming) == trials  # waited long enough
    assert schedule.choose(trials, fuse=False, now=10.5, reports=coming) == trials[:1]  # one at a time: no gang
    full = Reports(values, capacity=2, more_trials=True, arriving_since=10.0)
    assert schedule.choose(trials, fuse=True, now=10.5, reports=full) == trials  # no room: no wait


def _next_task_in_a_thread(scheduler: Scheduler) -> tuple[threading.Thread, list]:
    got: list = []
    thread = threading.Thread(target=lambda: got.append(scheduler.next_task(fuse=True)), daemon=True)
    thread.start()
    return thread, got


def _until(condition, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_waiting_trials_are_parked_so_new_trials_start_beside_them_and_are_stopped_once_none_can_come() -> None:
    slots = Slots(2)
    scheduler, entries = _scheduler(0, 1, schedule="promote")
    scheduler.schedule = PromoteSchedule(when_exhausted="stop")
    scheduler.lender = slots
    for _ in entries:
        slots.acquire(starting=True).registered()
    slots.set_starting(True)
    _build_all(scheduler, 2)
    assert _train(scheduler, fuse=True) == [0, 1]
    assert slots.free() == 0
    for entry, value in zip(entries, (0.5, 0.9), strict=True):
        scheduler.mark(entry, reported=0, value=value)
        scheduler.decide(entry, Decision.CONTINUE)
    # Both wait at rung 1 (2 < eta): they hold no slot, so two new trials may start beside them.
    thread, got = _next_task_in_a_thread(scheduler)
    _until(lambda: slots.free() == 2, "the waiting trials were not parked")
    lease = slots.acquire(starting=True)
    assert slots.more_trials() is True
    newcomer = Entry(number=2, trial_id=102, spec=None)
    scheduler.add(newcomer)
    lease.registered()
    thread.join(10)
    assert got and got[0][0] is Task.BUILD and got[0][1] == [newcomer]
    scheduler.built(newcomer, runtime=object())
    assert _train(scheduler, fuse=True) == [2]
    scheduler.mark(newcomer, reported=0, value=0.7)
    scheduler.decide(newcomer, Decision.CONTINUE)
    # Rung 1 holds 3 now: trial 0 (the best) goes on.
    assert _train(scheduler, fuse=True) == [0]
    scheduler.mark(entries[0], reported=1, value=0.4)
    scheduler.decide(entries[0], Decision.FINISH)
    task, (done,) = scheduler.next_task(fuse=True)
    assert (task, done) == (Task.FINISH, entries[0])
    scheduler.remove(done)
    # The pool starts no more trials: rung 1 is final, and trials 1 and 2 (below its top 1) are stopped.
    slots.set_starting(False)
    thread, got = _next_task_in_a_thread(scheduler)
    for entry in (entries[1], newcomer):
        event = entry.events.get(timeout=10)
        assert isinstance(event, Stopped) and "below the top 1" in event.reason
        assert entry.status is Status.AWAITING
        scheduler.decide(entry, Decision.STOP)
    thread.join(10)
    assert got and got[0][0] is Task.RELEASE


def _gang_sizes(schedule: PromoteSchedule, curves: list[list[float]], capacity: int) -> list[tuple[int, bool]]:
    """A fusing device fed the configs in order by a pool that starts a trial whenever one of its ``capacity``
    slots is free (trials the schedule keeps waiting hold none): per pass, the gang's size and whether configs
    were left to start."""
    total = len(curves[0])
    values: dict[int, dict[int, float]] = {}
    pending, live, sizes = list(range(len(curves))), [], []
    while True:
        waiting = schedule.waiting(live, Reports(values, capacity=capacity))
        while pending and len(live) - len(waiting) < capacity:
            live.append(_waiting(pending.pop(0), 0))
        reports = Reports(values, capacity=capacity, more_trials=bool(pending) or False)
        choice = schedule.choose(live, fuse=True, now=0.0, reports=reports)
        if isinstance(choice, Stop):
            live = [e for e in live if e.number not in choice.reasons]
            continue
        if not isinstance(choice, list):
            assert not live, (choice, live)
            return sizes
        sizes.append((len(choice), bool(pending)))
        for entry in choice:
            values.setdefault(entry.chunks_done, {})[entry.number] = curves[entry.number][entry.chunks_done]
            entry.chunks_done += 1
            if entry.chunks_done == total:
                live.remove(entry)


def test_the_gang_stays_full_while_configs_are_left() -> None:
    """A simulation over learning curves (no training): 48 configs, 8 slots, 8 chunks. While configs are left
    to start, every pass trains 8 trials (promoted, fresh and between rungs together); the gang only shrinks
    once the budget is spent."""
    import random

    rng = random.Random(1)
    curves = []
    for _ in range(48):
        final, start, speed = rng.uniform(1.0, 3.0), rng.uniform(3.5, 4.5), rng.uniform(0.2, 0.8)
        curves.append([final + (start - final) * (1 - speed) ** k + rng.gauss(0, 0.02) for k in range(1, 9)])
    for when_exhausted in ("promote", "stop"):
        sizes = _gang_sizes(PromoteSchedule(when_exhausted=when_exhausted), curves, 8)
        while_left = [size for size, left in sizes if left]
        assert while_left and all(size == 8 for size in while_left), sizes
        assert max(size for size, _ in sizes) == 8
    # ASHA's stop: after the budget is spent, the passes train only trials a promotion can reach (here 105
    # chunks, against all 384 when every waiting trial is trained on, most of them in passes of one trial).
    stopped = _gang_sizes(PromoteSchedule(when_exhausted="stop"), curves, 8)
    trained_on = _gang_sizes(PromoteSchedule(when_exhausted="promote"), curves, 8)
    assert len(stopped) < len(trained_on)


def test_a_schedule_sees_read_only_views_and_names_the_peers_of_a_pruning_decision() -> None:
    seen: list = []

    class Newest(BaseSchedule):
        def choose(self, live, *, fuse, now, reports=None):
            seen.extend(live)
            ready = [v for v in live if v.status is Status.READY]
            return ready[-1:] or None

    scheduler, entries = _scheduler(0, 1, schedule="lockstep")
    scheduler.schedule = Newest()
    _build_all(scheduler, 2)
    task = scheduler.next_task()
    assert task is not None and task[1] == [entries[1]]  # the view handed back names its entry
    assert seen and all(isinstance(v, TrialView) for v in seen)
    with pytest.raises(AttributeError):
        seen[0].status = Status.GONE  # type: ignore[misc]
    entries[0].mates = frozenset({1})
    assert Newest().pruning_peers(entries[0].view()) == frozenset({1})  # by default: the fused mates
    assert PromoteSchedule().pruning_peers(entries[0].view()) == frozenset({1})
    assert LockstepSchedule().pruning_peers(entries[0].view()) is None  # a round barrier: every live trial
    assert scheduler.pruning_peers(entries[0]) == frozenset({1})


def test_a_stream_seats_the_schedule_s_choice_in_its_free_slots_without_waiting() -> None:
    """Between two passes a stream asks for trials: those the schedule lets train take its free slots at once
    (TRAINING), at most ``room`` of them, the first that does not fit the stream ending the list; a decision in
    flight or a new trial on its way makes nobody wait (a later pass seats them); housekeeping and builds come
    out as side tasks, never a TRAIN."""
    scheduler, entries = _scheduler(0, 1, 2, 3, schedule="promote")
    _build_all(scheduler, 4)
    assert scheduler.side_task() is None
    [first] = scheduler.join(1, fits=lambda entry: True)
    assert first.status is Status.TRAINING and first.number == 0
    assert [e.number for e in scheduler.join(3, fits=lambda entry: entry.number != 2)] == [1]
    assert entries[2].status is Status.READY and entries[3].status is Status.READY
    scheduler.chunk_done(first, mates=frozenset({1}))
    assert first.mates == frozenset({1}) and first.status is Status.AWAITING
    # Trial 0's decision is in flight: a fixed gang would wait for it (gang_wait_seconds); a stream goes on.
    assert [e.number for e in scheduler.join(2, fits=lambda entry: True)] == [2, 3]
    scheduler.decide(first, Decision.FINISH)
    assert scheduler.side_task() == (Task.FINISH, [first])
    late = Entry(number=4, trial_id=104, spec=None)
    scheduler.add(late)
    assert scheduler.side_task() == (Task.FINISH, [first])  # housekeeping first
    scheduler.remove(first)
    assert scheduler.side_task() == (Task.BUILD, [late])
    scheduler.drain()
    assert scheduler.join(4, fits=lambda entry: True) == [] and scheduler.side_task() is None


def test_waiting_trials_are_not_stopped_while_a_member_still_trains() -> None:
    """Once the budget is spent the promote schedule stops the waiting trials no promotion can reach, but not
    while a trial of a stream is still training: its report may change what is promotable."""
    schedule = PromoteSchedule(eta=3)
    waiting = [_waiting(n, 1) for n in range(3)]
    training = Entry(number=3, trial_id=103, spec=None, status=Status.TRAINING)
    values = {0: {0: 0.1, 1: 0.5, 2: 0.9}}
    done = Reports(values, capacity=8, more_trials=False, streaming=True)
    views = [e.view() for e in [*waiting, training]]
    assert schedule.choose(views, fuse=True, now=0.0, reports=done) == [views[0]]  # the top 1 of 3 goes on
    views = [e.view() for e in [*waiting[1:], training]]
    assert schedule.choose(views, fuse=True, now=0.0, reports=done) is None
    assert isinstance(schedule.choose(views[:2], fuse=True, now=0.0, reports=done), Stop)


def test_members_ending_at_one_pass_boundary_are_mates_only_of_those_that_ended_the_same_step() -> None:
    """A stream delivers the members that ended at one pass boundary one after another, each delivery moving that
    member on a chunk: the mates are worked out before any of them, so a member one chunk behind (delivered first)
    is never the mate of one a chunk ahead, whose pruning decision would then wait for ever for a report of a step
    that member never trains."""
    from optuna_rapidfire._runtime._worker import _Refill

    scheduler, entries = _scheduler(0, 1, 2, schedule="promote")
    runtimes = [object() for _ in entries]
    for _ in entries:
        task, (entry,) = scheduler.next_task()
        assert task is Task.BUILD
        scheduler.built(entry, runtime=runtimes[entry.number], chunks_done=2 if entry.number == 0 else 3)
    delivered: dict[int, frozenset[int]] = {}

    class Worker:
        def __init__(self) -> None:
            self.scheduler = scheduler

        def deliver_all(self, ended: list[tuple[Entry, object, frozenset[int]]]) -> None:
            for entry, _, mates in ended:
                delivered[entry.number] = mates
                scheduler.chunk_done(entry, mates)

    for entry in entries:
        entry.status = Status.TRAINING
    refill = _Refill(Worker(), entries)  # type: ignore[arg-type]
    refill.delivered([(runtime, object()) for runtime in runtimes])  # type: ignore[misc]
    assert delivered == {0: frozenset(), 1: frozenset({2}), 2: frozenset({1})}
    assert [e.chunks_done for e in entries] == [3, 4, 4] and refill.seated() == []


def test_a_queued_trial_held_for_a_command_is_not_built_and_pauses_or_leaves_at_once() -> None:
    scheduler, (kept, paused, dropped) = _scheduler(0, 1, 2)
    assert all(scheduler.hold(e) for e in (paused, dropped))  # queued: held, not built meanwhile
    task, (entry,) = scheduler.next_task()
    assert (task, entry) == (Task.BUILD, kept)
    scheduler.built(kept, runtime=object())
    assert scheduler.side_task() is None  # nothing else to build while the two are held
    # Nothing of theirs is on the device: the pause and the stop are done here, no task for the worker.
    assert scheduler.decide(paused, Decision.PAUSE) and paused.status is Status.PAUSED
    assert scheduler.decide(dropped, Decision.STOP) and dropped.gone
    assert [e.number for e in scheduler.entries()] == [0, 1]
    # Resumed, the paused one goes back to be built, then trains.
    assert not scheduler.decide(paused, Decision.CONTINUE)
    task, (entry,) = scheduler.next_task()
    assert (task, entry, paused.status) == (Task.BUILD, paused, Status.BUILDING)


def test_a_trial_held_while_being_built_waits_built_for_its_driver_s_decision() -> None:
    scheduler, (entry,) = _scheduler(0)
    task, _ = scheduler.next_task()
    assert task is Task.BUILD
    assert scheduler.hold(entry)
    assert not scheduler.decide(entry, Decision.PAUSE)  # its build is under way: the device pauses it once built
    assert entry.request is not None and entry.status is Status.BUILDING
    scheduler.built(entry, runtime=object())
    assert entry.status is Status.AWAITING  # not READY: nothing trains it before the pause
    task, _ = scheduler.next_task()
    assert (task, entry.status) == (Task.PAUSE, Status.PAUSED)
    scheduler.decide(entry, Decision.CONTINUE)  # resumed: built already, it trains
    assert entry.status is Status.READY and _train(scheduler) == [0]


def test_once_the_budget_is_spent_the_better_half_of_a_rung_fills_a_gang_where_a_member_costs_little() -> None:
    """ASHA leaves a fusing gang's slots empty once no config is left; the promote schedule fills them with the
    best waiting trials of the better half of their rung, as many as keep the pass within ``fill_max_cost`` of a
    pass of one member (the device's measured ``member_cost``), and only beside a trial that trains anyway."""
    schedule = PromoteSchedule(eta=3)
    waiting = [_waiting(n, 1) for n in range(6)]
    training = Entry(number=8, trial_id=108, spec=None, status=Status.TRAINING)
    training.chunks_done = 3
    # Rung 1 holds 8: trials 6 and 7 went on (and completed); trial 5 diverged.
    values: dict[int, dict[int, float]] = {0: {n: 1.0 + n / 10 for n in range(5)} | {5: float("nan"), 6: 0.6, 7: 0.7}}
    views = [e.view() for e in [*waiting, training]]

    def choose(**fields: object) -> object:
        reports = Reports(values, capacity=8, more_trials=False, streaming=True, **fields)  # type: ignore[arg-type]
        return schedule.choose(views, fuse=True, now=0.0, reports=reports)

    # Launch-bound passes: the better half (ranks 0-3 of 8: trials 6, 7, 0, 1) of which 0 and 1 wait.
    assert choose(member_cost=0.02) == [views[0], views[1]]
    assert choose(member_cost=0.6) == [views[0]]  # a pass of 2 members stays within twice one member's
    assert choose(member_cost=1.5) is None  # a member costs more than a pass: nobody fills (a report may promote)
    assert choose(member_cost=None) is None  # nothing measured yet
    assert (
        schedule.choose(
            views, fuse=False, now=0.0, reports=Reports(values, capacity=8, more_trials=False, member_cost=0.02)
        )
        is None
    )
    open_ = Reports(values, capacity=8, more_trials=True, streaming=True, member_cost=0.02)
    assert schedule.choose(views, fuse=True, now=0.0, reports=open_) is None  # configs may still come
    assert (
        PromoteSchedule(eta=3, fill_free_slots=False).choose(
            views, fuse=True, now=0.0, reports=Reports(values, capacity=8, more_trials=False, member_cost=0.02)
        )
        is None
    )
    # Nobody trains any more: a filler never starts a gang of its own; ASHA's stop, as before.
    alone = schedule.choose(
        views[:6], fuse=True, now=0.0, reports=Reports(values, capacity=8, more_trials=False, member_cost=0.02)
    )
    assert isinstance(alone, Stop) and set(alone.reasons) == set(range(6))
    with pytest.raises(ValueError, match=r"fill_max_cost=-0\.1"):
        PromoteSchedule(fill_max_cost=-0.1)
    with pytest.raises(ValueError, match="fill_free_slots must be True or False"):
        PromoteSchedule(fill_free_slots="yes")  # type: ignore[arg-type]


def test_pass_costs_tell_launch_bound_passes_from_compute_bound_ones() -> None:
    from optuna_rapidfire._runtime._pass_costs import PassCosts

    costs = PassCosts()
    for _ in range(8):
        costs.add(1, 0.040)
        costs.add(0, 1.0)  # ignored: no member
        costs.add(8, float("nan"))  # ignored
    assert costs.member_cost() is None  # one member count measured
    for _ in range(7):
        costs.add(8, 0.054)
    assert costs.member_cost() is None  # too few passes of 8 to trust
    costs.add(8, 0.054)
    assert costs.member_cost() == pytest.approx((0.054 - 0.040) / 7 / 0.040)
    bound = PassCosts()
    for _ in range(8):
        bound.add(2, 0.2)
        bound.add(4, 0.4)
    assert bound.member_cost() == pytest.approx(0.5)
    for _ in range(8):
        bound.add(1, 0.15)  # the smallest gangs decide: a launch-bound floor below the arithmetic
    assert bound.member_cost() == pytest.approx((0.2 - 0.15) / 0.15)


def _stream(schedule: PromoteSchedule, curves: list[list[float]], batches: list[int], member_cost: float | None):
    """A stream fed the configs in order (8 slots, 128 rows a chunk, one micro-batch of each member a pass):
    per pass, how many members trained; and each COMPLETE trial's final value in the order they completed."""
    capacity, total, values = 8, len(curves[0]), {}
    pending, live, seats, sizes, completed = list(range(len(curves))), [], {}, [], []
    while True:
        waiting = schedule.waiting([e.view() for e in live], Reports(values, capacity=capacity))
        while pending and len(live) - len(waiting) < capacity:
            live.append(_waiting(pending.pop(0), 0))
        if len(seats) < capacity:
            reports = Reports(
                values,
                capacity=capacity,
                more_trials=bool(pending) or False,
                streaming=bool(seats),
                member_cost=member_cost,
            )
            choice = schedule.choose([e.view() for e in live], fuse=True, now=0.0, reports=reports)
            if isinstance(choice, Stop):
                live = [e for e in live if e.number not in choice.reasons]
                continue
            for view in choice[: capacity - len(seats)] if isinstance(choice, list) else []:
                entry = next(e for e in live if e.number == view.number)
                entry.status = Status.TRAINING
                seats[entry.number] = 128 // batches[entry.number]
        if not seats:
            return sizes, completed
        sizes.append(len(seats))
        for number in list(seats):
            seats[number] -= 1
            if not seats[number]:
                del seats[number]
                entry = next(e for e in live if e.number == number)
                values.setdefault(entry.chunks_done, {})[number] = curves[number][entry.chunks_done]
                entry.chunks_done += 1
                entry.status = Status.READY
                if entry.chunks_done == total:
                    live.remove(entry)
                    completed.append(curves[number][-1])


def test_filled_slots_keep_the_gang_full_and_complete_more_of_the_best_configs() -> None:
    """A simulation over learning curves (no training) of the search benchmark's shape: 16 configs of batch 4, 8
    or 16 (so 32, 16 or 8 passes a chunk), 8 slots, 8 chunks, 30 seeds. Under ASHA's stop the last promoted
    trials train alone (about 0.74 of the passes have 2+ members); filling free slots where a member costs
    little keeps 0.86 and completes the best config (within 0.03) in 30 seeds of 30, not 25; where a member costs more
    than a pass nothing changes."""
    import random
    import statistics

    shares: dict[str, list[float]] = {"stop": [], "fill": []}
    found = {"stop": 0, "fill": 0}
    for seed in range(30):
        rng = random.Random(seed)
        curves, batches = [], []
        for _ in range(16):
            final, start, speed = rng.uniform(1.0, 3.0), rng.uniform(3.5, 4.5), rng.uniform(0.2, 0.8)
            curves.append([final + (start - final) * (1 - speed) ** k + rng.gauss(0, 0.02) for k in range(1, 9)])
            batches.append(rng.choice([4, 8, 16]))
        best = min(curve[-1] for curve in curves)
        for name, fill in (("stop", False), ("fill", True)):
            sizes, completed = _stream(PromoteSchedule(fill_free_slots=fill), curves, batches, member_cost=0.02)
            shares[name].append(sum(size >= 2 for size in sizes) / len(sizes))
            found[name] += min(completed) <= best + 0.03
        costly = _stream(PromoteSchedule(), curves, batches, member_cost=1.5)
        assert costly == _stream(PromoteSchedule(fill_free_slots=False), curves, batches, member_cost=1.5)
    assert statistics.median(shares["stop"]) < 0.8 < statistics.median(shares["fill"])
    assert found["fill"] > found["stop"]
