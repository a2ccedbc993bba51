"""GRPO gangs generate together: a trial's completions, rewards and per-chunk values are its own, alone or in a
gang, on either engine; the gang's generation requests share decode batches."""

from __future__ import annotations

import logging
from typing import Any

import optuna
import pytest
import torch
from _numerics import assert_within_rounding, gradient_terms
from helpers import by_number, lora, vowel_reward
from optuna.trial import TrialState
from test_dpo_grpo import grpo_args
from transformers import AutoConfig

from optuna_rapidfire.demo import gsm8k_reward, load_gsm8k

MODULES_ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TARGET = (lora(r=4, lora_dropout=0.1), grpo_args(seed=2, temperature=0.9, top_k=50))
OTHERS = [  # mixed ranks, targets, temperatures, generation counts, lengths, batches and KL; no adapter dropout
    (
        lora(r=8, target_modules=MODULES_ALL),
        grpo_args(learning_rate=1e-2, num_generations=4, temperature=0.7, max_completion_length=12, beta=0.1),
    ),
    (lora(r=2), grpo_args(learning_rate=2e-2, top_p=0.9, per_device_train_batch_size=2, num_generations=2)),
]


@pytest.fixture(scope="module")
def prompts():
    return load_gsm8k("train", num_rows=16, format="prompt_only"), load_gsm8k("test", num_rows=4, format="prompt_only")


def _executor(make_executor, prompts, trials: int, engine: str = "fused", reward=vowel_reward, **kwargs):
    """An executor over the prompts, lock-step (gangs of every live trial), 2 chunks, ``trials`` at once."""
    train, evaluation = prompts
    return make_executor(
        engine=engine,
        schedule="lockstep",
        train_dataset=train,
        eval_dataset=evaluation,
        num_chunks=2,
        max_concurrent_trials=trials,
        reward_funcs=[reward],
        **kwargs,
    )


def _run(make_executor, prompts, configs, engine: str):
    """Each trial's completions in the order generated, its chunks' full metrics, and the engine's counters."""
    from optuna_rapidfire import events

    completions: dict[str, list[list[list[int]]]] = {}
    metrics: dict[str, list[dict[str, float]]] = {}

    def recording(event: events.Event) -> None:
        if isinstance(event, events.Decoded) and event.phase != "check":  # not the first trial's metric check
            for trial, found in zip(event.trials, event.completions, strict=True):
                completions.setdefault(f"trial_{trial}", []).append([list(row) for row in found])
        if isinstance(event, events.ChunkTrained):
            metrics.setdefault(f"trial_{event.trial}", []).append(dict(event.metrics))

    executor = _executor(make_executor, prompts, len(configs), engine)
    study = optuna.create_study(direction="maximize", pruner=optuna.pruners.NopPruner())
    with events.listen(recording, events.Decoded, events.ChunkTrained):
        executor.optimize(study, by_number(configs), n_trials=len(configs))
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * len(configs)
    names = [f"trial_{t.number}" for t in study.trials]
    return [completions[n] for n in names], [metrics[n] for n in names], executor.stats()


@pytest.mark.numerics
def test_a_grpo_trial_generates_and_trains_the_same_alone_and_in_a_gang(
    make_executor, prompts, tiny_model, caplog
) -> None:
    """Fused, a gang decodes together and shares its policy passes (its references and evaluations' scores
    too, the rows of one prompt packed into one); a trial's completions, rewards and
    per-chunk metrics are its own alone or in the gang, and those of the time-sliced engine where the
    engines draw the same (no adapter dropout: the fused passes draw masks from the trial's generator)."""
    alone, alone_metrics, alone_stats = _run(make_executor, prompts, [TARGET], "fused")
    with caplog.at_level(logging.INFO, logger="optuna_rapidfire"):
        fused, fused_metrics, fused_stats = _run(make_executor, prompts, [*OTHERS, TARGET], "fused")
    sliced, sliced_metrics, sliced_stats = _run(make_executor, prompts, [*OTHERS, TARGET], "time_sliced")

    # Time-sliced, every request decodes alone and every step scores alone; fused, the members waiting
    # decode together and every training step went through shared passes.
    assert sliced_stats.decodes == sliced_stats.decoded_requests and sliced_stats.fused_steps == 0
    assert sliced_stats.scoring_passes == 0
    assert fused_stats.decoded_requests == sliced_stats.decoded_requests
    assert fused_stats.decodes < fused_stats.decoded_requests
    assert fused_stats.fused_steps > 0 and alone_stats.fused_steps > 0
    # The references (a member has beta > 0) and the evaluations' losses were scored in shared passes too.
    assert fused_stats.scoring_passes > 0
    assert "not together" not in caplog.text and "alone, not in shared passes" not in caplog.text
    # Rows of one prompt shared its tokens in the policy steps' passes too (their members have no dropout); the
    # lone target (adapter dropout) shared them in its evaluations' passes only (its steps' rows stay TRL's).
    assert fused_stats.prefix_passes > fused_stats.scoring_passes
    assert 0 < alone_stats.prefix_passes <= alone_stats.scoring_passes

    # Training moved every trial (a reward that varies gives advantages that are not 0).
    assert all(abs(m[-1]["train_loss"]) > 0 or m[-1].get("train_grad_norm", 1) > 0 for m in fused_metrics)
    assert fused[0][-1] != fused[0][0]
    # The target's completions (training and evaluation) and values are its own, alone or in the gang.
    terms = gradient_terms(AutoConfig.from_pretrained(tiny_model), rows=8, length=64)
    assert fused[2] == alone[0]
    assert_within_rounding(_numbers(fused_metrics[2]), _numbers(alone_metrics[0]), terms=terms)
    # Without adapter dropout, the fused engine's shared passes give the time-sliced engine's steps.
    for position in (0, 1):
        assert fused[position] == sliced[position]
        assert_within_rounding(_numbers(fused_metrics[position]), _numbers(sliced_metrics[position]), terms=terms)


@pytest.mark.numerics
def test_a_member_out_of_phase_with_a_kl_member_trains_as_alone(make_executor, prompts, tiny_model) -> None:
    """A member whose shared pass is still open while another member computes its reference (adapters
    off, as TRL does for ``beta`` > 0) still gets its whole gradient: the other finishes its chunk first
    (fewer steps) and evaluates while this one trains, and this one trains as alone."""
    early = (lora(r=4), grpo_args(seed=1, beta=0.1))  # 2 prompts a step: its chunk ends first
    late = (lora(r=2), grpo_args(seed=2, per_device_train_batch_size=2, num_generations=2))
    alone, alone_metrics, _ = _run(make_executor, prompts, [late], "fused")
    gang, gang_metrics, stats = _run(make_executor, prompts, [early, late], "fused")
    assert stats.fused_steps > 0
    assert gang[1] == alone[0]
    terms = gradient_terms(AutoConfig.from_pretrained(tiny_model), rows=8, length=64)
    assert_within_rounding(_numbers(gang_metrics[1]), _numbers(alone_metrics[0]), terms=terms)


@pytest.mark.numerics
def test_old_policies_of_reused_rollouts_share_a_pass_where_nothing_drops(
    make_executor, prompts, tiny_model, monkeypatch
) -> None:
    """With ``num_iterations`` = 2, TRL scores each rollout's old policy without gradients in train mode: the
    members for which nothing drops score theirs in one shared pass (before their references and rewards), a
    member with adapter dropout scores its own as TRL does; each trains as on the time-sliced engine or (the
    one with dropout) as alone."""
    from optuna_rapidfire._trainers.grpo._policy_pass import PolicyPasses

    plain = (lora(r=4), grpo_args(seed=1, num_iterations=2))
    kl = (lora(r=2), grpo_args(seed=3, num_iterations=2, beta=0.1))
    dropping = (lora(r=4, lora_dropout=0.1), grpo_args(seed=2, num_iterations=2))
    passes: list[tuple[tuple[str, ...], bool, bool, bool]] = []  # (adapters, grad, reference, rollout)
    shared_pass = PolicyPasses._pass

    def recording(self: PolicyPasses, requests: Any) -> Any:
        names = tuple(request.runtime.state.adapter_name for request in requests)
        if requests[0].training:
            passes.append((names, requests[0].grad, requests[0].reference, requests[0].rollout))
        return shared_pass(self, requests)

    monkeypatch.setattr(PolicyPasses, "_pass", recording)
    alone, alone_metrics, _ = _run(make_executor, prompts, [dropping], "fused")
    passes.clear()
    gang, gang_metrics, _ = _run(make_executor, prompts, [plain, kl, dropping], "fused")
    trained = list(passes)
    sliced, sliced_metrics, _ = _run(make_executor, prompts, [plain, kl, dropping], "time_sliced")

    olds = [names for names, grad, reference, rollout in trained if not grad and not reference]
    assert olds and all(names == ("trial_0", "trial_1") for names in olds)  # trial 2 (dropout) scores alone
    assert all(rollout for _, grad, reference, rollout in trained if not grad and not reference)
    assert any(grad and "trial_2" in names for names, grad, _, _ in trained)  # its steps' passes stay shared
    terms = gradient_terms(AutoConfig.from_pretrained(tiny_model), rows=8, length=64)
    for position in (0, 1):
        assert gang[position] == sliced[position]
        assert_within_rounding(_numbers(gang_metrics[position]), _numbers(sliced_metrics[position]), terms=terms)
    assert gang[2] == alone[0]
    assert_within_rounding(_numbers(gang_metrics[2]), _numbers(alone_metrics[0]), terms=terms)


@pytest.mark.numerics
def test_a_gang_of_one_adapter_shape_reads_its_adapters_stacked_and_trains_as_time_sliced(
    make_executor, prompts, tiny_model, monkeypatch
) -> None:
    """Members of one rank and targets on equal rows: the shared passes read their adapters from stacks kept for
    the gang (_fused/_stacks.py) and compute the base's RMS norms as fused kernels (_fused/_norms.py), and every
    trial's completions and values are the time-sliced engine's, a KL member's and one that accumulates two
    micro-batches' gradients (its second adds to its first) too."""
    configs = [
        (lora(r=4), grpo_args(seed=seed, beta=0.1 if seed == 2 else 0.0, gradient_accumulation_steps=1 + (seed == 3)))
        for seed in (1, 2, 3)
    ]
    fused_norm, with_grad = torch.nn.functional.rms_norm, []

    def recorded(*args: Any, **kwargs: Any) -> torch.Tensor:
        with_grad.append(torch.is_grad_enabled())  # the decode's run without; the policy steps' passes with
        return fused_norm(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "rms_norm", recorded)
    fused, fused_metrics, stats = _run(make_executor, prompts, configs, "fused")
    assert any(with_grad)
    monkeypatch.undo()
    sliced, sliced_metrics, _ = _run(make_executor, prompts, configs, "time_sliced")
    assert stats.stacked_passes > 0 and stats.fused_steps > 0
    terms = gradient_terms(AutoConfig.from_pretrained(tiny_model), rows=8, length=64)
    for position in range(len(configs)):
        assert fused[position] == sliced[position]
        assert_within_rounding(_numbers(fused_metrics[position]), _numbers(sliced_metrics[position]), terms=terms)


def test_no_member_of_a_running_gang_is_offloaded(make_executor, prompts) -> None:
    """With a state budget that fits no trial, members still paused at a meeting keep their states on the
    device while the others run (the decode and the shared passes read them)."""
    from optuna_rapidfire import events

    offloads: list[events.Offloaded] = []
    executor = _executor(make_executor, prompts, 2, state_memory_budget=1)
    study = optuna.create_study(direction="maximize", pruner=optuna.pruners.NopPruner())
    with events.listen(offloads.append, events.Offloaded):  # type: ignore[arg-type]
        executor.optimize(study, by_number([(lora(r=4), grpo_args()), (lora(r=2), grpo_args(seed=3))]), n_trials=2)
    offloaded_in_gang = [event for event in offloads if event.trial in event.gang]
    assert offloads  # the budget fits no trial: trials were offloaded between their gangs
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2
    assert executor.stats().fused_steps > 0 and not offloaded_in_gang


def test_a_gangs_adapters_are_frozen_again_when_it_ends(make_executor, prompts) -> None:
    """Members resume with the gang's adapters left trainable (no requires_grad churn at each meet); once the gang's
    pass is over, none of them is."""
    from optuna_rapidfire import events

    executor = _executor(make_executor, prompts, 2)
    trainable: list[list[str]] = []

    def after_pass(event: events.PassTrained) -> None:
        resident = executor._device.engine.trials.resident
        trainable.append([name for name, p in resident.module.named_parameters() if p.requires_grad])

    study = optuna.create_study(direction="maximize", pruner=optuna.pruners.NopPruner())
    with events.listen(after_pass, events.PassTrained):  # type: ignore[arg-type]
        executor.optimize(study, by_number([(lora(r=4), grpo_args()), (lora(r=2), grpo_args(seed=3))]), n_trials=2)
    assert executor.stats().fused_steps > 0 and trainable
    assert trainable == [[]] * len(trainable)


def _numbers(chunks: list[dict[str, float]]) -> dict[str, float]:
    """A trial's chunk metrics as one flat mapping (chunk/name -> value), wall times left out."""
    return {
        f"{step}/{name}": value
        for step, found in enumerate(chunks)
        for name, value in found.items()
        if value and not name.endswith("_time")
    }


def test_what_the_shared_decode_does_not_cover_generates_as_trl_does_and_one_failure_stays_its_own(
    make_executor, prompts, caplog
) -> None:
    """A trial with a generation option the decode does not apply generates with TRL's own ``generate`` (the
    log says why, once); a member whose step fails fails alone, the rest of its gang completes."""
    from optuna_rapidfire import events

    def breaking(event: events.Event) -> None:  # a listener that raises fails what it heard: trial 1's steps
        if isinstance(event, events.Decoded) and event.phase == "train" and 1 in event.trials:
            raise RuntimeError("this trial's step breaks")

    configs = [
        (lora(r=4), grpo_args(generation_kwargs={"no_repeat_ngram_size": 2})),
        (lora(r=2), grpo_args(learning_rate=3e-2)),
        (lora(r=8), grpo_args(temperature=0.8)),
    ]
    executor = _executor(make_executor, prompts, 3, reward=gsm8k_reward)
    study = optuna.create_study(direction="maximize", pruner=optuna.pruners.NopPruner())
    with caplog.at_level(logging.INFO, logger="optuna_rapidfire"), events.listen(breaking, events.Decoded):
        executor.optimize(study, by_number(configs), n_trials=3)
    # The gang's decode failed, then each member's alone: trial 1's alone failed, trial 2's went on.
    assert [t.state for t in study.trials] == [TrialState.COMPLETE, TrialState.FAIL, TrialState.COMPLETE]
    assert "decoding them one by one" in caplog.text
    said = "Trial 0 generates alone, as TRL does: it sets generation_kwargs ['no_repeat_ngram_size']"
    assert caplog.text.count(said) == 1
    assert "this trial's step breaks" in caplog.text


class _RecordingReward:
    """A reward (the share of vowels, as :func:`vowel_reward`) that records each call's rows, and checks that
    it was given TRL's keyword arguments."""

    __name__ = "recording_reward"

    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, prompts, completions, completion_ids, trainer_state, log_extra, log_metric, **kwargs):
        assert len(prompts) == len(completions) == len(completion_ids) and trainer_state is not None
        self.calls.append(len(completions))
        log_metric("recorded_rows", float(len(completions)))
        return vowel_reward(completions)


def test_a_gang_calls_each_reward_function_once_and_each_trial_gets_its_own_rewards(make_executor, prompts) -> None:
    """Fused, the members' reward calls meet: one call scores every member's rows (TRL's arguments, the
    lists concatenated) and each trial's rewards, hence its values, are those it gets time-sliced."""
    configs = [(lora(r=4), grpo_args(seed=1)), (lora(r=2), grpo_args(seed=2, learning_rate=2e-2))]
    found = {}
    for engine in ("fused", "time_sliced"):
        reward = _RecordingReward()
        executor = _executor(make_executor, prompts, len(configs), engine, reward=reward)
        study = optuna.create_study(direction="maximize", pruner=optuna.pruners.NopPruner())
        executor.optimize(study, by_number(configs), n_trials=len(configs))
        assert [t.state for t in study.trials] == [TrialState.COMPLETE] * len(configs)
        found[engine] = (reward.calls, [t.intermediate_values for t in study.trials])
    (gang_calls, gang_values), (alone_calls, alone_values) = found["fused"], found["time_sliced"]
    assert max(gang_calls) == 2 * max(alone_calls)  # both members' rows in one call
    assert len(gang_calls) < len(alone_calls)
    for gang, alone in zip(gang_values, alone_values, strict=True):
        assert gang.keys() == alone.keys()
        assert all(gang[step] == pytest.approx(alone[step], rel=1e-5) for step in gang)


@pytest.mark.parametrize("engine", ["time_sliced", "fused"])
def test_training_arguments_made_in_another_thread_mid_step_fail_no_trial(
    make_executor, prompts, tmp_path, engine
) -> None:
    """Every new ``TrainingArguments`` clears accelerate's process-wide state, as ``configure(trial)`` does in a
    trial thread while others train. TRL's GRPO step enters its accelerator's ``autocast()``, which read that
    state afresh: after a clear it raised in the training trial and left the state half made, so that every
    later build failed too. The reward function here makes ``TrainingArguments`` in another thread on its first
    call, mid-step; both trials (and the third, built afterwards) complete."""
    import threading

    from transformers import TrainingArguments

    made: list[TrainingArguments] = []

    def resetting_reward(completions: list[str], **kwargs: object) -> list[float]:
        if not made:  # once, from another thread (a trial thread making its config)
            thread = threading.Thread(
                target=lambda: made.append(TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none"))
            )
            thread.start()
            thread.join()
        return vowel_reward(completions)

    configs = [TARGET, OTHERS[1], TARGET]
    executor = _executor(make_executor, prompts, 2, engine, reward=resetting_reward)
    study = optuna.create_study(direction="maximize", pruner=optuna.pruners.NopPruner())
    executor.optimize(study, by_number(configs), n_trials=len(configs))
    assert made  # the state was cleared mid-step
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * len(configs)
