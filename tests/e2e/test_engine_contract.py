"""The engine layer's seams without training: kinds' fused refusals, stats before the model loads."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from optuna_rapidfire._engines import ENGINES
from optuna_rapidfire._engines._types import EngineStats
from optuna_rapidfire._trainers._dpo import DPOKind
from optuna_rapidfire._trainers._sft import SFTKind
from optuna_rapidfire._trainers.grpo._kind import GRPOKind


@pytest.mark.parametrize(
    ("kind", "trainer", "args", "reason"),
    [
        (SFTKind(), SimpleNamespace(), SimpleNamespace(loss_type="nll", label_smoothing_factor=0.0), None),
        (SFTKind(), SimpleNamespace(), SimpleNamespace(loss_type="dft"), "uses a loss other than plain NLL"),
        (SFTKind(), SimpleNamespace(), SimpleNamespace(label_smoothing_factor=0.1), "uses a loss other than plain NLL"),
        (DPOKind(), SimpleNamespace(loss_types=["sigmoid"]), SimpleNamespace(), None),
        (
            DPOKind(),
            SimpleNamespace(loss_types=["hinge"]),
            SimpleNamespace(),
            "uses DPO loss_type ['hinge'] (the fused pass computes 'sigmoid')",
        ),
        (GRPOKind(), SimpleNamespace(), SimpleNamespace(), "is a GRPO trial (SFT and DPO trials are fused)"),
    ],
)
def test_each_trainer_kind_says_whether_its_trial_can_share_a_pass(kind, trainer, args, reason) -> None:
    assert kind.fused_refusal(trainer, args) == reason
    assert (kind.fused_loss is None) == isinstance(kind, GRPOKind)


def test_stats_are_zeros_before_the_model_is_loaded(make_executor) -> None:
    assert make_executor().stats() == EngineStats()


@pytest.mark.parametrize("engine", list(ENGINES))
def test_a_study_tells_its_listeners_what_happens_on_the_device(make_executor, listen, engine: str) -> None:
    """Each trial is built once, each chunk starts before it is trained and reported with the values Optuna
    gets, every pass names its trials, switches name the trial switched to."""
    import optuna
    from helpers import by_number, lora, sft_args

    from optuna_rapidfire import events

    seen: list[events.Event] = []
    listen(seen.append)
    executor = make_executor(num_chunks=2, max_concurrent_trials=2, engine=engine)
    study = optuna.create_study(pruner=optuna.pruners.NopPruner())
    executor.optimize(study, by_number([(lora(r=4), sft_args(seed=i)) for i in range(2)]), n_trials=2)

    built = [e.trial for e in seen if isinstance(e, events.TrialBuilt)]
    started = [
        (t, s) for e in seen if isinstance(e, events.ChunkStarting) for t, s in zip(e.trials, e.steps, strict=True)
    ]
    trained = [e for e in seen if isinstance(e, events.ChunkTrained)]
    assert sorted(built) == [0, 1]
    assert sorted(started) == sorted((e.trial, e.step) for e in trained) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for event in trained:  # what the listener saw is what Optuna got
        assert study.trials[event.trial].intermediate_values[event.step] == event.metrics["eval_loss"]
        assert event.last == (event.step == 1) and event.train_seconds > 0 and event.tokens > 0
    passes = [e for e in seen if isinstance(e, events.PassTrained)]
    if engine == "time_sliced":  # one pass a chunk
        assert sorted((t, s) for e in passes for t, s in zip(e.trials, e.steps, strict=True)) == sorted(started)
    else:  # gangs, or streams: one entry a shared pass, each member at its chunk
        assert {(t, s) for e in passes for t, s in zip(e.trials, e.steps, strict=True)} == set(started)
    assert {e.engine for e in passes} <= ({"time_sliced"} if engine == "time_sliced" else {"fused", "stream"})
    for event in seen:
        if isinstance(event, events.ChunkStarting):
            trained_before = [
                (e.trial, e.step) for e in seen[: seen.index(event)] if isinstance(e, events.ChunkTrained)
            ]
            assert not set(zip(event.trials, event.steps, strict=True)) & set(
                trained_before
            )  # a chunk starts before it ends
    windows = [e for e in seen if isinstance(e, events.GangTrained)]
    if engine == "time_sliced":
        assert {e.trial for e in seen if isinstance(e, events.Switched)} == {0, 1} and not windows
    else:  # each shared training has its window, within the run
        assert windows and all(e.start_ns <= e.end_ns and set(e.trials) <= {0, 1} for e in windows)
    kept = [e for e in seen if isinstance(e, events.Checkpointed)]  # every chunk's state, copied once
    assert sorted((e.trial, e.step) for e in kept) == sorted((e.trial, e.step) for e in trained)
    assert all(e.bytes > 0 and e.capture_seconds > 0 and e.where == "memory" for e in kept)
