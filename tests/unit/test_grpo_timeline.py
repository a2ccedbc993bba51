"""benchmarks/grpo_timeline's bookkeeping: each moment goes to the phase running then, with the GPU's busy time."""

from __future__ import annotations

import inspect
import threading

from benchmarks.grpo_timeline import (
    BACKGROUND,
    MEET,
    TURN,
    Busy,
    Recorder,
    attribute,
    background,
    clock_offset,
    named_spans,
)


def test_moments_go_to_the_running_member_or_the_innermost_phase_with_the_gpus_busy_time() -> None:
    coordinator, member_a, member_b = 1, 2, 3
    spans = [
        (0, 100, "build", coordinator),
        (10, 20, "build: adapter", coordinator),
        (100, 200, TURN, coordinator),  # member a runs, then b
        (100, 150, "TRL: loss", member_a),
        (140, 200, MEET, member_a),  # a waits from 140 on: b runs
        (140, 200, "TRL: generate and score", member_b),
        (200, 260, "shared forward", coordinator),
    ]
    busy = Busy([(15, 25), (20, 30), (150, 170), (210, 250)])  # overlapping kernels count once
    table = attribute(spans, 0, 300, busy)
    expected = {  # host ns, busy ns
        "build": (90, 10),
        "build: adapter": (10, 5),
        "TRL: loss": (40, 0),  # until a meets
        "TRL: generate and score": (60, 20),
        "shared forward": (60, 40),
        "outside": (40, 0),
    }
    assert table.keys() == expected.keys()
    for phase, (host, device) in expected.items():
        assert round(table[phase][0] * 1e9) == host and round(table[phase][1] * 1e9) == device, phase


def test_the_clocks_are_aligned_on_the_profiles_second_kernel() -> None:
    assert clock_offset([(500, 600), (1_000, 1_100), (1_200, 1_300)], marker_host_ns=900) == 100


def test_checkpoints_of_other_threads_are_summed_apart_and_leave_the_attribution_alone() -> None:
    device, trial_a, trial_b = 1, 2, 3
    spans = [
        (0, 100, "waiting for a task", device),
        (10, 60, "checkpoint (a trial's thread)", trial_a),
        (30, 90, "checkpoint (a trial's thread)", trial_b),
    ]
    table = attribute([span for span in spans if span[2] not in BACKGROUND], 0, 100, None)
    assert table.keys() == {"waiting for a task"}
    found = background(spans)
    checkpoints = found["checkpoint (a trial's thread)"]
    assert checkpoints["calls"] == 2 and round(checkpoints["seconds"] * 1e9) == 110
    assert round(checkpoints["wall_seconds"] * 1e9) == 80  # from 10 to 90
    assert found["snapshot file (the writer's thread)"] == {"calls": 0, "seconds": 0.0, "wall_seconds": 0.0}


def test_every_phase_names_a_function_that_exists_and_is_put_back() -> None:
    """The timeline wraps each phase's function by name: a renamed one fails here, not on the GPU."""
    from benchmarks.grpo_timeline import PHASES, Recorder

    recorder = Recorder()
    recorder.install()
    try:
        assert len(recorder._undo) == len(PHASES)
        assert all(getattr(owner, name) is not original for owner, name, original, _ in recorder._undo)
        undo = list(recorder._undo)
    finally:
        recorder.uninstall()
    assert all(inspect.getattr_static(owner, name) is original for owner, name, original, _ in undo)


def test_spans_are_written_with_their_threads_names_in_seconds_from_the_studys_start() -> None:
    """``--spans``: each wrapped call's span, named by the thread it ran in (a chunk's end on a trial's thread)."""
    recorder = Recorder()
    work = recorder._wrapped(lambda: None, "a chunk's end (a trial's thread)")
    for name in ("rapidfire-trial-3", "rapidfire-writes_0"):  # one after the other: the second may reuse the id
        thread = threading.Thread(target=work, name=name)
        thread.start()
        thread.join()
    work()
    begin = min(start for start, *_ in recorder.spans)
    found = named_spans(recorder, begin)
    assert [name for *_, name in found] == ["rapidfire-trial-3", "rapidfire-writes_0", threading.current_thread().name]
    assert {phase for _, _, phase, _ in found} == {"a chunk's end (a trial's thread)"}
    assert found[0][0] == 0.0 and all(end >= start for start, end, _, _ in found)
