"""The fused engine: a study trained in shared passes gives the time-sliced study's per-chunk values.

The fused engine also evaluates its gangs in shared forward passes. A trial's values differ between the
engines through its trained weights, whose gradients the fused pass sums in another order (over the
gang's rows), and through its evaluation's forward pass. So values and weights are compared at the
rounding bound of one training gradient (``_numerics.gradient_terms``), which covers both.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import optuna
import pytest
from _numerics import (
    FLOAT32_EPS,
    assert_apart,
    assert_within_rounding,
    gradient_terms,
    loss_terms,
    rounding_bound,
)
from helpers import by_number, lora, sft_args
from transformers import AutoConfig

from optuna_rapidfire._engines import ENGINES

CONFIGS = [  # mixed ranks, target modules, learning rates, batch sizes, accumulation and clipping
    {"r": 4, "modules": "qv", "lr": 1e-2, "batch": 2, "accumulation": 1, "clip": 1.0},
    {"r": 8, "modules": "qkvo", "lr": 3e-3, "batch": 4, "accumulation": 2, "clip": 0.0},
    {"r": 2, "modules": "qv", "lr": 3e-2, "batch": 3, "accumulation": 1, "clip": 0.5},
]
MODULES = {"qv": ["q_proj", "v_proj"], "qkvo": ["q_proj", "k_proj", "v_proj", "o_proj"]}


def _terms(tiny_model: str, rows: int = 8, length: int = 128) -> int:
    """Terms behind a trained value: CONFIGS step on up to 4 x 2 accumulated rows of sft_args' 128 tokens."""
    return gradient_terms(AutoConfig.from_pretrained(tiny_model), rows=rows, length=length)


def configure(trial: optuna.Trial):
    c = CONFIGS[trial.suggest_int("config", 0, len(CONFIGS) - 1)]
    args = sft_args(
        learning_rate=c["lr"],
        per_device_train_batch_size=c["batch"],
        gradient_accumulation_steps=c["accumulation"],
        max_grad_norm=c["clip"],
        lr_scheduler_type="cosine",
        num_train_epochs=1,
        seed=11,
    )
    return lora(r=c["r"], lora_dropout=0.0, target_modules=MODULES[c["modules"]]), args


def _values(make_executor, engine: str, concurrent: int = 3, **kwargs) -> list[dict[int, float]]:
    executor = make_executor(engine=engine, num_chunks=3, max_concurrent_trials=concurrent, **kwargs)
    study = optuna.create_study(pruner=optuna.pruners.NopPruner())
    for i in range(len(CONFIGS)):
        study.enqueue_trial({"config": i})
    executor.optimize(study, configure, n_trials=len(CONFIGS))
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.COMPLETE] * len(CONFIGS)
    if engine == "fused":
        stats = executor.stats()
        assert stats.fused_steps > 0  # the gang really shared passes
        assert stats.launched_steps == stats.fused_steps  # through the launched pass (uncompiled on the CPU)
    if kwargs.get("state_memory_budget") == 1:
        assert executor.stats().offloads > 0
    return [dict(t.intermediate_values) for t in study.trials]


def test_a_fused_study_reports_the_time_sliced_values(make_executor, tiny_model) -> None:
    sliced = _values(make_executor, "time_sliced")
    fused = _values(make_executor, "fused")
    # Two live at a time, the third joins later: idle states are offloaded (a budget of one byte) and
    # a gang is brought back whole.
    offloaded = _values(make_executor, "fused", concurrent=2, state_memory_budget=1)
    for a, b, c in zip(sliced, fused, offloaded, strict=True):
        assert_within_rounding(b, a, terms=_terms(tiny_model))
        assert_within_rounding(c, a, terms=_terms(tiny_model))


def test_gangs_that_cannot_share_a_pass_train_time_sliced_and_say_why(make_executor, caplog) -> None:
    def mixed_losses(trial: optuna.Trial):
        peft_config, args = configure(trial)
        if trial.number == 0:
            args.loss_type = "dft"  # a loss the fused pass does not compute
        return peft_config, args

    executor = make_executor(engine="fused", num_chunks=2, max_concurrent_trials=2)
    study = optuna.create_study()
    for i in range(2):
        study.enqueue_trial({"config": i})
    with caplog.at_level(logging.INFO, logger="optuna_rapidfire"):
        executor.optimize(study, mixed_losses, n_trials=2)
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials)
    assert "Training time-sliced, not fused: trial 0 uses a loss other than plain NLL" in caplog.text


def test_default_packing_is_padding_free_and_trains_time_sliced(make_executor, caplog) -> None:
    """``packing=True`` with TRL's default strategy ("bfd") packs padding-free (the trainer says so, not the
    args' ``padding_free``): the fused pass, which drops the packed rows' positions, refuses it."""
    configs = [(lora(r=4), sft_args(packing=True, max_length=64)), (lora(r=2), sft_args(packing=True, max_length=64))]
    executor = make_executor(engine="fused", num_chunks=2, max_concurrent_trials=2)
    study = optuna.create_study()
    with caplog.at_level(logging.INFO, logger="optuna_rapidfire"):
        executor.optimize(study, by_number(configs), n_trials=2)
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials)
    assert "Training time-sliced, not fused: trial 0 uses padding-free packing" in caplog.text
    assert executor.stats().fused_steps == 0


def _with_dropout(trial: optuna.Trial):
    peft_config, args = configure(trial)
    peft_config.lora_dropout = 0.2
    return peft_config, args


def test_with_adapter_dropout_a_trial_reports_the_same_alone_or_in_a_gang(make_executor, tiny_model) -> None:
    def run(configs: list[int]) -> list[dict[int, float]]:
        executor = make_executor(engine="fused", num_chunks=3, max_concurrent_trials=3)
        study = optuna.create_study(pruner=optuna.pruners.NopPruner())
        for i in configs:
            study.enqueue_trial({"config": i})
        executor.optimize(study, _with_dropout, n_trials=len(configs))
        assert executor.stats().fused_steps > 0
        return [dict(t.intermediate_values) for t in study.trials]

    together = run([0, 1, 2])
    for position, config in enumerate([0, 1, 2]):
        assert_within_rounding(together[position], run([config])[0], terms=_terms(tiny_model))
    # Dropout really acts: the values differ from the same configs without it.
    assert together[0] != _values_without_dropout(make_executor)[0]


def _values_without_dropout(make_executor) -> list[dict[int, float]]:
    executor = make_executor(engine="fused", num_chunks=3, max_concurrent_trials=3)
    study = optuna.create_study(pruner=optuna.pruners.NopPruner())
    study.enqueue_trial({"config": 0})
    executor.optimize(study, configure, n_trials=1)
    return [dict(t.intermediate_values) for t in study.trials]


def test_engine_must_be_known_and_auto_time_slices_on_the_cpu(make_executor, caplog) -> None:
    with pytest.raises(
        ValueError, match="engine must be one of 'time_sliced', 'fused' or 'auto', but got engine='warp'"
    ):
        make_executor(engine="warp")
    with caplog.at_level(logging.INFO, logger="optuna_rapidfire"):
        assert make_executor(devices="cpu").engine == "time_sliced"  # "auto" is the default
    assert "engine='auto' on cpu: time-sliced" in caplog.text


# Trials that learn (learning rate 3e-2) and trials that hardly move from the base model's loss (3e-5,
# a thousand times lower): the pruning threshold lies between them, far from every value.
PRUNING_THRESHOLD = 7.52
FAST_AND_SLOW = [(0, 3e-2), (2, 3e-5), (1, 3e-2), (0, 3e-5), (2, 3e-2)]  # (config, learning rate)


def _configure_rate(trial: optuna.Trial):
    peft_config, args = configure(trial)
    return peft_config, dataclasses.replace(args, learning_rate=trial.suggest_float("lr", 1e-5, 1e-1, log=True))


def _pruned_study(make_executor, engine: str) -> list[tuple[str, dict[int, float]]]:
    # Two live at a time: pruned trials leave their gang at a chunk boundary and the next trial joins.
    executor = make_executor(engine=engine, num_chunks=3, max_concurrent_trials=2)
    study = optuna.create_study(pruner=optuna.pruners.ThresholdPruner(upper=PRUNING_THRESHOLD))
    for config, lr in FAST_AND_SLOW:
        study.enqueue_trial({"config": config, "lr": lr})
    executor.optimize(study, _configure_rate, n_trials=len(FAST_AND_SLOW))
    if engine == "fused":
        assert executor.stats().fused_steps > 0
    return [(t.state.name, dict(t.intermediate_values)) for t in study.trials]


@pytest.mark.numerics
def test_pruning_and_replacement_behave_as_in_time_sliced_mode(make_executor, tiny_model) -> None:
    sliced = _pruned_study(make_executor, "time_sliced")
    fused = _pruned_study(make_executor, "fused")
    states = [state for state, _ in sliced]
    assert states == ["COMPLETE" if lr > 1e-3 else "PRUNED" for _, lr in FAST_AND_SLOW]
    # Every decision is far from a tie: rounding (of either engine, on any machine) cannot decide it.
    for _, values in sliced:
        for step, value in values.items():
            assert_apart(value, PRUNING_THRESHOLD, terms=_terms(tiny_model), what=f"step {step}")
    assert [state for state, _ in fused] == states
    for (_, a), (_, b) in zip(sliced, fused, strict=True):
        assert_within_rounding(b, a, terms=_terms(tiny_model))


def test_with_activation_checkpointing_a_fused_study_reports_the_time_sliced_values(make_executor, tiny_model) -> None:
    def checkpointed(trial: optuna.Trial):
        peft_config, args = configure(trial)
        return peft_config, dataclasses.replace(args, activation_checkpointing=True)

    def run(engine: str) -> list[dict[int, float]]:
        executor = make_executor(engine=engine, num_chunks=2, max_concurrent_trials=3)
        study = optuna.create_study(pruner=optuna.pruners.NopPruner())
        for i in range(len(CONFIGS)):
            study.enqueue_trial({"config": i})
        executor.optimize(study, checkpointed, n_trials=len(CONFIGS))
        if engine == "fused":
            assert executor.stats().fused_steps > 0
        return [dict(t.intermediate_values) for t in study.trials]

    for a, b in zip(run("time_sliced"), run("fused"), strict=True):
        assert_within_rounding(b, a, terms=_terms(tiny_model))


def _configure_equal(trial: optuna.Trial):
    """Adapters of one shape (rank, targets, batch) on packed rows: the pass needs no padding or masks."""
    lr = trial.suggest_float("lr", 1e-4, 1e-2, log=True)
    args = sft_args(
        learning_rate=lr,
        per_device_train_batch_size=2,
        packing=True,
        packing_strategy="wrapped",
        max_length=64,
        max_grad_norm=1.0,
        seed=5,
    )
    return lora(r=4, lora_dropout=0.0, target_modules=MODULES["qkvo"]), args


def _engines_agree(make_executor, objective, params: list[dict], terms: int, **executor_kwargs) -> int:
    """The same enqueued trials on both engines: every trial completes and reports the same values (up to
    the rounding of ``terms`` products). Returns the fused run's shared steps."""
    values = {}
    for engine in ENGINES:
        executor = make_executor(engine=engine, num_chunks=2, max_concurrent_trials=len(params), **executor_kwargs)
        study = optuna.create_study(pruner=optuna.pruners.NopPruner())
        for trial_params in params:
            study.enqueue_trial(trial_params)
        executor.optimize(study, objective, n_trials=len(params))
        assert [t.state for t in study.trials] == [optuna.trial.TrialState.COMPLETE] * len(params)
        values[engine] = [dict(t.intermediate_values) for t in study.trials]
    assert executor.stats().fused_steps > 0  # the gang really shared passes
    for a, b in zip(values["time_sliced"], values["fused"], strict=True):
        assert_within_rounding(b, a, terms=terms)
    return executor.stats().fused_steps


def test_equal_adapters_on_packed_rows_report_the_time_sliced_values(make_executor, tiny_model) -> None:
    params = [{"lr": lr} for lr in (1e-4, 1e-3, 3e-3)]
    # Lock-step: the three train every chunk as one gang (promote would split the last chunk's gangs).
    terms = _terms(tiny_model, rows=2, length=64)
    gang_steps = _engines_agree(make_executor, _configure_equal, params, terms, schedule="lockstep")
    # Exactly one shared pass per step of the gang: as many as one of its trials takes alone.
    lone = make_executor(engine="fused", num_chunks=2, max_concurrent_trials=1, schedule="lockstep")
    study = optuna.create_study(pruner=optuna.pruners.NopPruner())
    study.enqueue_trial(params[0])
    lone.optimize(study, _configure_equal, n_trials=1)
    assert gang_steps == lone.stats().fused_steps > 0


def test_equal_adapters_in_the_models_own_modules_read_them_stacked_and_report_the_time_sliced_values(
    make_executor, tiny_model, monkeypatch
) -> None:
    """Activation checkpointing keeps a gang out of the launched pass: in the model's own modules, adapters of one
    shape are read from the gang's stacks (_fused/_stacks.py; the checkpoints' recomputed forwards too), and the
    values are the time-sliced engine's."""
    from optuna_rapidfire._fused._stacks import GangStacks

    handed: list[int] = []
    hand_out = GangStacks.hand_out

    def counted(self: GangStacks, positions: Any) -> None:
        handed.append(len(positions))
        hand_out(self, positions)

    monkeypatch.setattr(GangStacks, "hand_out", counted)

    def checkpointed(trial: optuna.Trial):
        peft_config, args = _configure_equal(trial)
        return peft_config, dataclasses.replace(args, activation_checkpointing=True)

    params = [{"lr": lr} for lr in (1e-4, 1e-3, 3e-3)]
    terms = _terms(tiny_model, rows=2, length=64)
    _engines_agree(make_executor, checkpointed, params, terms, schedule="lockstep")
    assert handed and max(handed) == len(params)  # whole gangs' passes read the stacks


def test_a_fused_dpo_study_reports_the_time_sliced_values(make_executor, tiny_model, caplog) -> None:
    """DPO gangs: one reference pass (adapters off) and one fused pass; mixed betas, ranks, batches.

    The values compared are the chosen completions' log-probabilities (``eval_logps/chosen``) of the trained
    adapters: sums of same-signed terms, whose rounding the bound covers (a step takes up to 3 x 2 accumulated
    pairs, 12 rows of dpo_args' 256 tokens). DPO's loss is a small difference of those large sums: its relative
    rounding is theirs times beta times their size over the loss (tens), which a relative bound does not cover
    (it went 1.1x past it on one AVX-512 machine)."""
    from test_dpo_grpo import dpo_args

    from optuna_rapidfire.demo import load_gsm8k

    configs = [
        (lora(r=4, lora_dropout=0.0), dpo_args(beta=0.1, learning_rate=1e-2, max_grad_norm=1.0, seed=3)),
        (
            lora(r=8, lora_dropout=0.0, target_modules=MODULES["qkvo"]),
            dpo_args(beta=0.5, learning_rate=3e-3, per_device_train_batch_size=3, gradient_accumulation_steps=2),
        ),
        (lora(r=2, lora_dropout=0.1), dpo_args(beta=0.2, learning_rate=2e-2, per_device_train_batch_size=1)),
    ]
    with caplog.at_level(logging.INFO, logger="optuna_rapidfire"):
        _engines_agree(
            make_executor,
            lambda t: configs[t.number],
            [{}] * len(configs),
            _terms(tiny_model, rows=12, length=256),
            train_dataset=load_gsm8k("train", num_rows=24, format="preference"),
            eval_dataset=load_gsm8k("test", num_rows=4, format="preference"),
            metric="logps/chosen",
        )
    assert "not fused" not in caplog.text


def test_dpo_losses_the_fused_pass_does_not_compute_train_time_sliced_and_say_why(make_executor, caplog) -> None:
    from test_dpo_grpo import dpo_args

    from optuna_rapidfire.demo import load_gsm8k

    train = load_gsm8k("train", num_rows=8, format="preference")
    evaluation = load_gsm8k("test", num_rows=2, format="preference")
    configs = [(lora(r=4), dpo_args(loss_type=["hinge"])), (lora(r=4), dpo_args())]
    executor = make_executor(
        engine="fused", train_dataset=train, eval_dataset=evaluation, num_chunks=2, max_concurrent_trials=2
    )
    study = optuna.create_study()
    with caplog.at_level(logging.INFO, logger="optuna_rapidfire"):
        executor.optimize(study, lambda t: configs[t.number], n_trials=2)
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials)
    assert "not fused: trial 0 uses DPO loss_type ['hinge']" in caplog.text


def test_a_failed_shared_pass_fails_only_the_trial_that_fails_alone(make_executor, tiny_model, listen, caplog) -> None:
    """A pass that runs out of memory with several members is retried one by one (and later passes get
    smaller); a trial that fails on its own fails alone, the others report the time-sliced values."""
    import torch

    from optuna_rapidfire import events

    sliced = _values(make_executor, "time_sliced")

    def crowded(event: events.Event) -> None:  # a shared pass of several members runs out of memory
        assert isinstance(event, events.PassStarting)
        if len(event.trials) > 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")

    def broken(event: events.Event) -> None:  # trial 1 fails whenever the device is set up for it alone
        assert isinstance(event, events.Switched)
        if event.trial == 1:
            raise RuntimeError("trial 1 breaks on its own")

    listen(crowded, events.PassStarting)
    listen(broken, events.Switched)
    executor = make_executor(engine="fused", num_chunks=3, max_concurrent_trials=3)
    study = optuna.create_study(pruner=optuna.pruners.NopPruner())
    for i in range(len(CONFIGS)):
        study.enqueue_trial({"config": i})
    with caplog.at_level(logging.WARNING, logger="optuna_rapidfire"):
        executor.optimize(study, configure, n_trials=len(CONFIGS))
    states = [t.state for t in study.trials]
    assert states == [optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL, optuna.trial.TrialState.COMPLETE]
    assert "A shared pass of trials [0, 1, 2] failed (OutOfMemoryError" in caplog.text
    assert executor.stats().pass_tokens < 16_384
    for position in (0, 2):
        got = dict(study.trials[position].intermediate_values)
        assert_within_rounding(got, sliced[position], terms=_terms(tiny_model))


def test_a_fused_study_exports_and_checkpoints_what_a_time_sliced_study_does(
    make_executor, tiny_model, tmp_path
) -> None:
    """Final adapters and per-chunk checkpoints (with their optimizer state) equal the time-sliced ones."""
    from optuna.artifacts import FileSystemArtifactStore
    from safetensors.torch import load_file

    from optuna_rapidfire._study import _attrs

    saved = {}
    for engine in ENGINES:
        folder = tmp_path / f"artifacts-{engine}"
        folder.mkdir()
        store = FileSystemArtifactStore(str(folder))
        executor = make_executor(engine=engine, num_chunks=2, max_concurrent_trials=3, artifact_store=store)
        study = optuna.create_study(pruner=optuna.pruners.NopPruner())
        for i in range(len(CONFIGS)):
            study.enqueue_trial({"config": i})
        executor.optimize(study, configure, n_trials=len(CONFIGS))
        adapters = [load_file(f"{t.user_attrs[_attrs.ADAPTER_PATH]}/adapter_model.safetensors") for t in study.trials]
        links = [t.system_attrs[_attrs.CHECKPOINT] for t in study.trials]
        saved[engine] = (adapters, links, sorted(p.name for p in folder.iterdir()))
    sliced, fused = saved["time_sliced"], saved["fused"]
    for ours, theirs in zip(fused[0], sliced[0], strict=True):
        assert ours.keys() == theirs.keys() and ours
        for key, value in theirs.items():
            # By norm: Adam divides each gradient element by its own size, so an element near zero (where
            # rounding is large relative to it) may step differently; the whole matrix stays within bound.
            assert_within_rounding(ours[key], value, terms=_terms(tiny_model), what=key)
    assert [link["step"] for link in fused[1]] == [link["step"] for link in sliced[1]] == [2, 2, 2]
    assert len(fused[2]) == len(sliced[2]) > 0


EVAL_CONFIGS = [  # mixed ranks, targets, adapter dropout (off when evaluating) and eval batch sizes
    (lora(r=4, lora_dropout=0.1), sft_args(per_device_eval_batch_size=3, per_device_train_batch_size=2, seed=5)),
    (lora(r=8, target_modules=MODULES["qkvo"]), sft_args(per_device_eval_batch_size=8, learning_rate=3e-3)),
    (lora(r=2, lora_dropout=0.0), sft_args(per_device_eval_batch_size=2, per_device_train_batch_size=3)),
]


def _evaluated(make_executor, monkeypatch, *, shared: bool, configs=None, **executor_kwargs) -> tuple[dict, list, int]:
    """Every chunk's full metrics (trial, step -> metrics) of a lock-step fused study, the token sums of
    each eval micro-batch of the shared evaluation, and how many trials were evaluated one at a time."""
    from optuna_rapidfire import events
    from optuna_rapidfire._engines import _environment

    configs = EVAL_CONFIGS if configs is None else configs

    metrics: dict[tuple[int, int], dict[str, float]] = {}
    sums: list[int] = []
    alone = [0]

    def hear(event: events.Event) -> None:
        if isinstance(event, events.ChunkTrained):
            metrics[(event.trial, event.step)] = dict(event.metrics)
        elif isinstance(event, events.Evaluated) and event.phase == "eval":  # not the metric names' check
            if event.shared:
                sums.extend(tokens for member in event.batch_tokens for tokens in member)
            else:
                alone[0] += 1

    if not shared:  # every member by its own trainer's loop, as for a kind without shared evaluation
        monkeypatch.setenv(_environment.SHARED_EVALUATION, "0")
    with events.listen(hear, events.ChunkTrained, events.Evaluated):
        executor = make_executor(
            engine="fused", schedule="lockstep", num_chunks=2, max_concurrent_trials=3, **executor_kwargs
        )
        study = optuna.create_study(pruner=optuna.pruners.NopPruner())
        executor.optimize(study, by_number(configs), n_trials=len(configs))
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.COMPLETE] * len(configs)
    monkeypatch.undo()
    return metrics, sums, alone[0]


@pytest.mark.numerics
def test_a_gang_evaluates_in_shared_passes_with_each_trials_own_metrics(
    make_executor, tiny_model, monkeypatch, caplog
) -> None:
    """Shared evaluation gives every metric a trial's own trainer reports (loss, entropy, token accuracy,
    trained tokens), on each trial's own eval batches, up to the rounding of one forward pass; a kind that
    cannot evaluate that way evaluates trial by trial and says so once."""
    shared, sums, alone = _evaluated(make_executor, monkeypatch, shared=True)
    assert alone == 0 and sums  # nobody was evaluated on its own
    with caplog.at_level(logging.INFO, logger="optuna_rapidfire"):
        own, _, alone = _evaluated(make_executor, monkeypatch, shared=False)
    assert alone == len(own) == 2 * len(EVAL_CONFIGS)
    said = "Evaluating trial by trial, not in shared passes: RAPIDFIRE_SHARED_EVALUATION=0."
    assert caplog.text.count(said) == 1

    config = AutoConfig.from_pretrained(tiny_model)
    terms = loss_terms(config, rows=8, length=128)
    one_token = 1 / min(sums)  # one prediction of the smallest eval batch
    assert shared.keys() == own.keys()
    for key, expected in own.items():
        got = shared[key]
        assert got.keys() == expected.keys(), key
        assert {"eval_loss", "eval_entropy", "eval_mean_token_accuracy", "eval_num_tokens"} <= got.keys()
        for name in ("eval_loss", "eval_entropy"):
            assert_within_rounding(got[name], expected[name], terms=terms, what=f"{key} {name}")
        assert abs(got["eval_mean_token_accuracy"] - expected["eval_mean_token_accuracy"]) <= one_token
        assert got["eval_num_tokens"] == expected["eval_num_tokens"]
        assert got["train_loss"] == expected["train_loss"]  # the same gangs trained the same way


@pytest.mark.numerics
def test_a_dpo_gang_evaluates_in_shared_passes_with_trls_reward_metrics(make_executor, tiny_model, monkeypatch) -> None:
    """DPO: a reference pass with the adapters off and the members' own betas give every metric of TRL's
    DPO evaluation (loss, implicit rewards, their accuracy and margin, log-probabilities, mean logits,
    entropy, token accuracy), up to rounding: sums of log-probabilities carry their terms' rounding, and a
    reward is ``beta`` times a difference of two such sums."""
    from test_dpo_grpo import dpo_args

    from optuna_rapidfire.demo import load_gsm8k

    configs = [
        (lora(r=4, lora_dropout=0.1), dpo_args(beta=0.1, per_device_eval_batch_size=3, seed=3)),
        (lora(r=8, target_modules=MODULES["qkvo"]), dpo_args(beta=0.5, per_device_eval_batch_size=2)),
    ]
    data = {
        "train_dataset": load_gsm8k("train", num_rows=16, format="preference"),
        "eval_dataset": load_gsm8k("test", num_rows=5, format="preference"),
    }
    shared, sums, alone = _evaluated(make_executor, monkeypatch, shared=True, configs=configs, **data)
    own, _, _ = _evaluated(make_executor, monkeypatch, shared=False, configs=configs, **data)
    assert alone == 0 and sums and shared.keys() == own.keys()
    terms = loss_terms(AutoConfig.from_pretrained(tiny_model), rows=2, length=256)
    bound = rounding_bound(terms)
    for (number, step), expected in own.items():
        got, beta = shared[(number, step)], configs[number][1].beta
        assert got.keys() == expected.keys() and "eval_rewards/margins" in got, (number, step)
        # A log-ratio's rounding: that of the two sums of its row's log-probabilities.
        logps = max(abs(expected["eval_logps/chosen"]), abs(expected["eval_logps/rejected"]))
        reward_tolerance = 2 * beta * bound * logps
        for name in ("eval_logps/chosen", "eval_logps/rejected", "eval_logits/chosen", "eval_logits/rejected"):
            assert_within_rounding(got[name], expected[name], terms=terms, what=name)
        assert_within_rounding(got["eval_entropy"], expected["eval_entropy"], terms=terms)
        for name in ("eval_rewards/chosen", "eval_rewards/rejected"):
            assert abs(got[name] - expected[name]) <= reward_tolerance, (name, got[name], expected[name])
        assert abs(got["eval_rewards/margins"] - expected["eval_rewards/margins"]) <= 2 * reward_tolerance
        # The loss moves at most by its slope (sigmoid, at most 1) times a margin's rounding.
        assert abs(got["eval_loss"] - expected["eval_loss"]) <= 2 * reward_tolerance + bound * expected["eval_loss"]
        # A share of pairs, which TRL averages in float32.
        assert abs(got["eval_rewards/accuracies"] - expected["eval_rewards/accuracies"]) <= FLOAT32_EPS
        one_token = 1 / min(sums)
        assert abs(got["eval_mean_token_accuracy"] - expected["eval_mean_token_accuracy"]) <= one_token
        assert got["eval_num_tokens"] == expected["eval_num_tokens"]
        assert any(abs(got[n]) > 0 for n in ("eval_rewards/chosen", "eval_rewards/margins"))  # trained away from base
