"""GRPO gangs generate together: a trial's completions, rewards and per-chunk values are its own, alone or in a
gang, on either engine; the gang's generation requests share decode batches."""

from __future__ import annotations

import logging

import optuna
import pytest
from helpers import by_number, lora
from optuna.trial import TrialState
from test_dpo_grpo import grpo_args

from optuna_rapidfire.demo import gsm8k_reward, load_gsm8k

MODULES_ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TARGET = (lora(r=4, lora_dropout=0.1), grpo_args(seed=2, temperature=0.9, top_k=50))
OTHERS = [  # mixed ranks, targets, temperatures, generation counts and lengths
    (
        lora(r=8, target_modules=MODULES_ALL),
        grpo_args(learning_rate=5e-2, num_generations=4, temperature=0.7, max_completion_length=12),
    ),
    (lora(r=2), grpo_args(learning_rate=2e-2, top_p=0.9, per_device_train_batch_size=2, num_generations=2)),
]


@pytest.fixture(scope="module")
def prompts():
    return load_gsm8k("train", num_rows=16, format="prompt_only"), load_gsm8k("test", num_rows=4, format="prompt_only")


def _run(make_executor, monkeypatch, prompts, configs, engine: str):
    """Each trial's completions in the order generated, its per-chunk values, and the engine's counters."""
    from optuna_rapidfire._engines._generation import Generation
    from optuna_rapidfire._engines._trials import DeviceTrials

    train, evaluation = prompts
    completions: dict[str, list[list[list[int]]]] = {}
    original, evaluate = Generation._generate, DeviceTrials.evaluate
    checking = [False]

    def recording(self, runtime, prompt_ids):
        found = original(self, runtime, prompt_ids)
        if not checking[0]:  # not the check of the metric's name on the first trial built
            completions.setdefault(runtime.state.adapter_name, []).append(found)
        return found

    def flagging(self, runtime, max_batches=None):
        checking[0] = max_batches is not None
        try:
            return evaluate(self, runtime, max_batches)
        finally:
            checking[0] = False

    monkeypatch.setattr(Generation, "_generate", recording)
    monkeypatch.setattr(DeviceTrials, "evaluate", flagging)
    executor = make_executor(
        engine=engine,
        schedule="lockstep",
        train_dataset=train,
        eval_dataset=evaluation,
        num_chunks=2,
        max_concurrent_trials=len(configs),
        reward_funcs=[gsm8k_reward],
    )
    study = optuna.create_study(direction="maximize", pruner=optuna.pruners.NopPruner())
    executor.optimize(study, by_number(configs), n_trials=len(configs))
    monkeypatch.undo()
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * len(configs)
    values = [dict(t.intermediate_values) for t in study.trials]
    by_trial = [completions[f"trial_{t.number}"] for t in study.trials]
    return by_trial, values, executor.stats()


def test_a_grpo_trial_generates_the_same_alone_and_in_a_gang_on_either_engine(
    make_executor, monkeypatch, prompts, caplog
) -> None:
    alone, alone_values, _ = _run(make_executor, monkeypatch, prompts, [TARGET], "time_sliced")
    with caplog.at_level(logging.INFO, logger="optuna_rapidfire"):
        fused, fused_values, fused_stats = _run(make_executor, monkeypatch, prompts, [*OTHERS, TARGET], "fused")
    sliced, sliced_values, sliced_stats = _run(make_executor, monkeypatch, prompts, [*OTHERS, TARGET], "time_sliced")

    # Time-sliced, every request decodes alone; fused, the members waiting decode together.
    assert sliced_stats.decodes == sliced_stats.decoded_requests
    assert fused_stats.decoded_requests == sliced_stats.decoded_requests
    assert fused_stats.decodes < fused_stats.decoded_requests
    assert "not together" not in caplog.text

    # The target's completions (training and evaluation), rewards and values are its own.
    assert fused[2] == alone[0] == sliced[2]
    assert fused_values[2] == alone_values[0] == sliced_values[2]
    # So are the other members', on either engine, and the members really differ from each other.
    assert fused[:2] == sliced[:2]
    assert fused_values[:2] == sliced_values[:2]
    assert fused[0][0] != fused[2][0][: len(fused[0][0])]
    assert all(0.0 <= v <= 1.2 for trial in fused_values for v in trial.values())


def test_what_the_shared_decode_does_not_cover_generates_as_trl_does_and_one_failure_stays_its_own(
    make_executor, monkeypatch, prompts, caplog
) -> None:
    """A trial with a generation option the decode does not apply generates with TRL's own ``generate`` (the
    log says why, once); a member whose step fails fails alone, the rest of its gang completes."""
    from optuna_rapidfire._trainers._grpo import GRPOKind

    train, evaluation = prompts
    accumulate = GRPOKind.accumulate

    def breaking(self, trainer, model, batches, device, scaler):
        if trainer.args.learning_rate == 3e-2:
            raise RuntimeError("this trial's step breaks")
        return accumulate(self, trainer, model, batches, device, scaler)

    monkeypatch.setattr(GRPOKind, "accumulate", breaking)
    configs = [
        (lora(r=4), grpo_args(generation_kwargs={"no_repeat_ngram_size": 2})),
        (lora(r=2), grpo_args(learning_rate=3e-2)),
        (lora(r=8), grpo_args(temperature=0.8)),
    ]
    executor = make_executor(
        engine="fused",
        schedule="lockstep",
        train_dataset=train,
        eval_dataset=evaluation,
        num_chunks=2,
        max_concurrent_trials=3,
        reward_funcs=[gsm8k_reward],
    )
    study = optuna.create_study(direction="maximize", pruner=optuna.pruners.NopPruner())
    with caplog.at_level(logging.INFO, logger="optuna_rapidfire"):
        executor.optimize(study, by_number(configs), n_trials=3)
    assert [t.state for t in study.trials] == [TrialState.COMPLETE, TrialState.FAIL, TrialState.COMPLETE]
    said = "Trial 0 generates alone, as TRL does: it sets generation_kwargs ['no_repeat_ngram_size']"
    assert caplog.text.count(said) == 1
    assert "this trial's step breaks" in caplog.text
