"""benchmarks/grpo_timeline's bookkeeping: each moment goes to the phase running then, with the GPU's busy time."""

from __future__ import annotations

from benchmarks.grpo_timeline import MEET, TURN, Busy, attribute, clock_offset


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
