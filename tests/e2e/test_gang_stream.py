"""Streamed gangs: members at different steps share the fused engine's passes, each leaving at the pass where its
chunk ends while another takes its slot; what each member reports is what it reports alone, a member leaving
compiles nothing, and the background compiler gives the eager values."""

from __future__ import annotations

import logging
import time

import optuna
import pytest
from _numerics import assert_within_rounding, gradient_terms
from helpers import lora, sft_args
from transformers import AutoConfig

from optuna_rapidfire import events
from optuna_rapidfire._engines import _environment
from optuna_rapidfire._engines._gang_passes import row_bucket
from optuna_rapidfire.schedules import BaseSchedule

# batch size, rank, targets, dropout, learning rate: three batch sizes, so the members' chunks end at different
# passes (a chunk of batch 8 takes a quarter of the steps of batch 2)
CONFIGS = [
    (8, 8, ["q_proj", "v_proj", "gate_proj"], 0.1, 5e-3),
    (2, 4, ["q_proj", "k_proj", "v_proj", "o_proj"], 0.0, 1e-2),
    (4, 8, ["q_proj", "v_proj"], 0.2, 2e-3),
]


def _configure(trial: optuna.Trial):
    batch, rank, targets, dropout, lr = CONFIGS[trial.suggest_categorical("config", [0, 1, 2])]
    args = sft_args(
        per_device_train_batch_size=batch,
        learning_rate=lr,
        lr_scheduler_type="cosine",
        max_grad_norm=1.0,
        packing=True,
        packing_strategy="wrapped",
        max_length=64,
        seed=5,
    )
    return lora(r=rank, lora_alpha=2 * rank, lora_dropout=dropout, target_modules=targets), args


class EveryReady(BaseSchedule):
    """Every ready trial trains at once, no rungs: a trial whose chunk ends goes on to its next chunk at once."""

    def choose(self, live, *, fuse, now, reports=None):
        ready = [e for e in live if e.status.value == "ready"]
        return (ready if fuse else ready[:1]) or None


def _values(make_executor, concurrent: int, configs=(0, 1, 2), **kwargs):
    executor = make_executor(engine="fused", num_chunks=2, max_concurrent_trials=concurrent, **kwargs)
    study = optuna.create_study(pruner=optuna.pruners.NopPruner())
    for config in configs:
        study.enqueue_trial({"config": config})
    executor.optimize(study, _configure, n_trials=len(configs))
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.COMPLETE] * len(configs)
    return [dict(t.intermediate_values) for t in study.trials], executor


def _terms(tiny_model: str) -> int:
    return gradient_terms(AutoConfig.from_pretrained(tiny_model), rows=8, length=64)


def test_row_buckets_are_a_few_sizes_of_whole_units() -> None:
    assert [row_bucket(rows, 4) for rows in (1, 4, 5, 8, 9, 17, 33)] == [8, 8, 8, 8, 16, 32, 64]
    assert {row_bucket(rows, 2) for rows in range(1, 33)} == {4, 8, 16, 32}


@pytest.mark.numerics
def test_members_at_different_steps_report_what_they_report_alone(make_executor, tiny_model, listen) -> None:
    """Two slots, three trials of batch 8, 2 and 4: the first ends its chunk after a quarter of the second's
    passes and goes on to its second chunk beside the second's first, then the third takes its slot while the
    second is midway. Each trial's per-chunk values are those of the trial trained alone, and each chunk's
    training time is its share of the passes it was in (the members' times add up to the passes')."""
    seen: list[list[tuple[int, int]]] = []  # each stream pass: each member's chunk and micro-batch in it
    alone = [_values(make_executor, 1, configs=(config,))[0][0] for config in range(3)]
    shares: dict[int, float] = {}
    passes: dict[int, float] = {}

    def timed(event: events.Event) -> None:
        if isinstance(event, events.ChunkTrained):
            shares[event.trial] = shares.get(event.trial, 0.0) + event.train_seconds
        elif isinstance(event, events.PassTrained) and event.engine == "stream":
            seen.append(list(zip(event.steps, event.batches, strict=True)))
            for trial in event.trials:
                passes[trial] = passes.get(trial, 0.0) + event.seconds / len(event.trials)

    listen(timed)
    together, executor = _values(make_executor, 2, schedule=EveryReady())
    assert shares.keys() == passes.keys() == {0, 1, 2}
    for trial, seconds in passes.items():  # the same float terms summed in another order
        assert shares[trial] == pytest.approx(seconds, rel=1e-9)
    assert any(len(set(members)) > 1 and len({index for _, index in members}) > 1 for members in seen)
    assert any(len({chunk for chunk, _ in members}) > 1 for members in seen)  # different chunks in one pass
    fill = executor.stats().gang_fill
    assert fill[2] > fill[1] and sum(fill) == len(seen)
    for own, shared in zip(alone, together, strict=True):
        assert_within_rounding(shared, own, terms=_terms(tiny_model))


def test_a_member_leaving_or_joining_mid_chunk_compiles_nothing(make_executor, listen) -> None:
    """Members leave and join inside their chunks, and the passes' rows take a few sizes: the compiler compiles
    the training pass for the first, generalises it at the second (two compilations), and compiles nothing after
    that whatever the gang does."""
    counts: list[int] = []  # each stream pass: the compilations its forward and backward waited for
    listen(lambda event: counts.append(event.compiles) if event.engine == "stream" else None, events.PassTrained)
    _, executor = _values(make_executor, 2, compile="aot_eager")
    stats = executor.stats()
    assert stats.compiles > 0 and stats.compile_failures == 0
    compiled_at = [i for i, c in enumerate(counts) if c]
    assert counts[0] > 0 and sum(counts) <= 2 and len(counts) > compiled_at[-1] + 10, compiled_at
    assert stats.gang_fill[2] > 0


def test_compiling_in_the_background_gives_the_eager_values(make_executor, tiny_model, monkeypatch, caplog) -> None:
    """The passes run eagerly while a thread compiles the pass for their shapes, then take the compiled code: the
    values are those of the uncompiled study, and the compiled graphs are counted."""
    eager, _ = _values(make_executor, 2, compile=False)
    monkeypatch.setenv(_environment.COMPILE_IN_BACKGROUND, "1")
    with caplog.at_level(logging.INFO, logger="optuna_rapidfire"):
        compiled, executor = _values(make_executor, 2, compile="aot_eager")
        deadline = time.monotonic() + 120
        while executor.stats().compiles == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
    stats = executor.stats()
    assert stats.compiles > 0 and stats.compile_failures == 0
    assert "Background compilation of the launched pass" in caplog.text
    assert "Compiled the launched pass" not in caplog.text  # no pass waited for a compilation
    for a, b in zip(eager, compiled, strict=True):
        assert_within_rounding(b, a, terms=_terms(tiny_model))


@pytest.mark.numerics
def test_recorded_passes_replay_what_the_passes_compute(make_executor, tiny_model, monkeypatch) -> None:
    """The streamed passes recorded once per shape and replayed on static copies of their inputs (on the CPU a
    replay runs the recorded function again on those copies, so a pass that read anything else of its own would
    train on another pass's data): the loss tokens padded, the values those of the unrecorded study, and most
    training passes, optimizer steps and evaluation passes replayed."""
    plain, _ = _values(make_executor, 2, schedule=EveryReady())
    monkeypatch.setenv(_environment.RECORD_PASSES, "1")  # on the CPU: each replay re-runs the recorded pass
    replayed, executor = _values(make_executor, 2, schedule=EveryReady())
    stats = executor.stats()
    # training passes, optimizer steps and evaluation passes
    assert {"pass", "step", "eval"} <= {kind for kind, calls in stats.graph_calls.items() if calls}
    passes = sum(stats.gang_fill)
    assert stats.graphs_recorded > 0 and stats.graph_failures == 0
    # every shape's first call runs as it is, its second is recorded and replayed: the rest are replays
    assert stats.graph_replays > passes - stats.graphs_recorded, (stats.graph_replays, passes)
    for a, b in zip(plain, replayed, strict=True):
        assert_within_rounding(b, a, terms=_terms(tiny_model))


def test_recorded_passes_ask_nothing_of_the_compiler(make_executor, tiny_model, monkeypatch) -> None:
    """``compile="auto"`` on a GPU: Inductor compiles in the background what is not recorded (fixed gangs, DPO's),
    while a stream's passes, steps and evaluations are recorded from uncompiled kernels. A streamed study with a
    compiling backend and a background compiler then compiles nothing, and reports the uncompiled values."""
    plain, _ = _values(make_executor, 2, schedule=EveryReady(), compile=False)
    monkeypatch.setenv(_environment.COMPILE_IN_BACKGROUND, "1")
    monkeypatch.setenv(_environment.RECORD_PASSES, "1")
    replayed, executor = _values(make_executor, 2, schedule=EveryReady(), compile="aot_eager")
    stats = executor.stats()
    assert stats.compiles == 0 and stats.graphs_recorded > 0 and stats.graph_failures == 0
    for a, b in zip(plain, replayed, strict=True):
        assert_within_rounding(b, a, terms=_terms(tiny_model))
