"""DPO and GRPO trials: the same guarantees as SFT (interleaving, reports, pruning, clones, same results)."""

from __future__ import annotations

import math
import threading

import optuna
import pytest
import torch
from helpers import by_number, lora, until_the_clone_is_taken, vowel_reward, wait_until
from optuna.trial import TrialState
from peft import get_peft_model_state_dict
from safetensors.torch import load_file
from torch.utils.data import SequentialSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForSequenceClassification
from trl import DPOConfig, DPOTrainer, GRPOConfig, SFTConfig

from optuna_rapidfire import control
from optuna_rapidfire._engines import ENGINES
from optuna_rapidfire._resident._data import ChunkPlan
from optuna_rapidfire._study import _attrs
from optuna_rapidfire.demo import gsm8k_reward, load_gsm8k

FAST = {"bf16": False, "gradient_checkpointing": False, "num_train_epochs": 1, "report_to": "none"}


def dpo_args(**overrides) -> DPOConfig:
    settings = {**FAST, "per_device_train_batch_size": 2, "max_length": 256, "learning_rate": 1e-2, "beta": 0.1}
    settings.update(overrides)
    return DPOConfig(**settings)


def grpo_args(**overrides) -> GRPOConfig:
    settings = {
        **FAST,
        "per_device_train_batch_size": 4,
        "per_device_eval_batch_size": 4,
        "num_generations": 2,
        "max_completion_length": 8,
        "learning_rate": 1e-2,
    }
    settings.update(overrides)
    return GRPOConfig(**settings)


@pytest.fixture(scope="module")
def preference():
    return load_gsm8k("train", num_rows=24, format="preference"), load_gsm8k("test", num_rows=4, format="preference")


@pytest.fixture(scope="module")
def prompts():
    return load_gsm8k("train", num_rows=16, format="prompt_only"), load_gsm8k("test", num_rows=4, format="prompt_only")


def _values(trial):
    return [trial.intermediate_values[s] for s in sorted(trial.intermediate_values)]


# -- DPO -----------------------------------------------------------------------------------------------


def test_dpo_trials_interleave_report_and_expose_reward_metrics(make_executor, preference, chunk_log) -> None:
    train, evaluation = preference
    executor = make_executor(
        train_dataset=train, eval_dataset=evaluation, num_chunks=3, max_concurrent_trials=3, schedule="lockstep"
    )
    study = optuna.create_study(pruner=optuna.pruners.NopPruner())
    configs = [(lora(r=4 * (i + 1)), dpo_args(beta=0.05 * (i + 1))) for i in range(3)]
    executor.optimize(study, by_number(configs), n_trials=3)

    assert [step for _, step in chunk_log] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert all(t.state == TrialState.COMPLETE and list(t.intermediate_values) == [0, 1, 2] for t in study.trials)
    assert "ref" not in executor.stats().adapters
    assert executor.metric == "eval_loss"

    accuracy = make_executor(
        train_dataset=train, eval_dataset=evaluation, num_chunks=3, max_concurrent_trials=1, metric="rewards/margins"
    )
    margin_study = optuna.create_study(direction="maximize")
    accuracy.optimize(margin_study, by_number(configs[:1]), n_trials=1)
    assert margin_study.trials[0].state == TrialState.COMPLETE
    assert accuracy.metric == "eval_rewards/margins"


class _InOrderDPOTrainer(DPOTrainer):
    def _get_train_sampler(self, train_dataset=None):
        return SequentialSampler(train_dataset or self.train_dataset)


def test_dpo_trial_matches_trl_with_the_adapter_disabled_reference(make_executor, tiny_model, preference, tmp_path):
    train, evaluation = preference
    rows = train.select(range(8))
    config = lora(r=4, lora_dropout=0.0)
    settings = {"learning_rate": 5e-2, "warmup_steps": 1, "max_grad_norm": 0.5, "seed": 3, "beta": 0.2}
    executor = make_executor(train_dataset=rows, eval_dataset=evaluation, num_chunks=2, max_concurrent_trials=1)
    study = optuna.create_study(pruner=optuna.pruners.NopPruner())
    executor.optimize(study, by_number([(config, dpo_args(**settings))]), n_trials=1)
    ours = load_file(f"{study.trials[0].user_attrs[_attrs.ADAPTER_PATH]}/adapter_model.safetensors")

    plan = ChunkPlan(num_rows=len(rows), num_chunks=2, seed=0)
    order = [int(i) for c in range(2) for i in plan.rows(c)]
    trainer = _InOrderDPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_model),
        args=dpo_args(output_dir=str(tmp_path / "trl"), save_strategy="no", logging_strategy="no", **settings),
        train_dataset=rows.select(order),
        processing_class=AutoTokenizer.from_pretrained(tiny_model),
        peft_config=config,
    )
    trainer.train()
    theirs = get_peft_model_state_dict(trainer.model)
    assert set(ours) == set(theirs)
    for key, value in theirs.items():
        torch.testing.assert_close(ours[key], value.detach(), rtol=1e-5, atol=1e-6, msg=key)


def test_dpo_same_values_alone_and_among_others(make_executor, preference) -> None:
    train, evaluation = preference
    target = (lora(r=4, lora_dropout=0.2), dpo_args(seed=5))
    others = [(lora(r=8), dpo_args(beta=0.5, learning_rate=3e-2)), (lora(r=2, lora_dropout=0.1), dpo_args(seed=1))]

    def run(configs, position):
        executor = make_executor(
            train_dataset=train, eval_dataset=evaluation, num_chunks=3, max_concurrent_trials=len(configs)
        )
        study = optuna.create_study(pruner=optuna.pruners.NopPruner())
        executor.optimize(study, by_number(configs), n_trials=len(configs))
        return _values(study.trials[position])

    alone = run([target], 0)
    together = run([others[0], target, others[1]], 1)
    assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(alone, together, strict=True))


def test_dpo_warm_clone_continues_exactly_and_dpo_is_pruned_in_the_first_wave(
    make_executor, slow_chunks, preference
) -> None:
    train, evaluation = preference
    executor = make_executor(train_dataset=train, eval_dataset=evaluation, num_chunks=4, max_concurrent_trials=2)
    study = optuna.create_study(pruner=optuna.pruners.NopPruner())

    def configure(trial):
        lr = trial.suggest_float("learning_rate", 1e-3, 1e-1, log=True)
        return lora(r=4, lora_dropout=0.1), dpo_args(learning_rate=lr)

    study.enqueue_trial({"learning_rate": 2e-2})
    objective = executor.objective(configure)
    clones: list[int] = []
    slow_chunks(0.0, hold=until_the_clone_is_taken(study, 0, clones))
    parent = threading.Thread(target=study.optimize, args=(objective,), kwargs={"n_trials": 1})
    parent.start()
    wait_until(lambda: 0 in study.trials[0].intermediate_values, what="the parent's first report")
    child = control.clone(study, 0)
    clones.append(child)
    study.optimize(objective, n_trials=1)
    parent.join()
    assert study.trials[child].user_attrs[_attrs.CLONE] == "warm"
    assert _values(study.trials[child]) == _values(study.trials[0])

    pruned = optuna.create_study(pruner=optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=1))
    bad_first = [(lora(r=4), dpo_args(learning_rate=lr)) for lr in (0.1, 0.0, 2e-2, 3e-2)]  # 0.1 overfits worst
    make_executor(
        train_dataset=train, eval_dataset=evaluation, num_chunks=4, max_concurrent_trials=4, schedule="lockstep"
    ).optimize(pruned, by_number(bad_first), n_trials=4)
    assert pruned.trials[0].state == TrialState.PRUNED


# -- GRPO ----------------------------------------------------------------------------------------------


def test_grpo_trials_report_mean_eval_reward_and_match_alone(make_executor, prompts) -> None:
    train, evaluation = prompts
    target = (lora(r=4, lora_dropout=0.1), grpo_args(seed=2, temperature=0.9))
    others = [(lora(r=8), grpo_args(learning_rate=5e-2, num_generations=4, per_device_train_batch_size=4))]

    def run(configs, position):
        executor = make_executor(
            train_dataset=train,
            eval_dataset=evaluation,
            num_chunks=2,
            max_concurrent_trials=len(configs),
            reward_funcs=[gsm8k_reward],
        )
        study = optuna.create_study(direction="maximize", pruner=optuna.pruners.NopPruner())
        executor.optimize(study, by_number(configs), n_trials=len(configs))
        assert executor.metric == "eval_reward"
        assert all(t.state == TrialState.COMPLETE for t in study.trials)
        return study.trials[position]

    alone = run([target], 0)
    together = run([others[0], target], 1)
    assert list(alone.intermediate_values) == [0, 1]
    assert all(0.0 <= v <= 1.2 for v in alone.intermediate_values.values())
    assert _values(alone) == pytest.approx(_values(together), rel=1e-6)


def test_grpo_with_kl_and_a_reward_model_by_path(make_executor, prompts, tiny_model, tmp_path, monkeypatch) -> None:
    train, evaluation = prompts
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_labels=1,
        pad_token_id=3,
    )
    LlamaForSequenceClassification(config).save_pretrained(tmp_path / "reward")
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(tmp_path / "reward")
    import transformers

    loads = []
    original = transformers.AutoModelForSequenceClassification.from_pretrained

    def counting(*args, **kwargs):
        loads.append(args[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForSequenceClassification, "from_pretrained", counting)
    executor = make_executor(
        train_dataset=train,
        eval_dataset=evaluation,
        num_chunks=2,
        max_concurrent_trials=2,
        reward_funcs=[gsm8k_reward, str(tmp_path / "reward")],
    )
    study = optuna.create_study(direction="maximize", pruner=optuna.pruners.NopPruner())
    configs = [(lora(r=4), grpo_args(beta=0.1)), (lora(r=2), grpo_args(beta=0.04, learning_rate=3e-2))]
    executor.optimize(study, by_number(configs), n_trials=2)
    assert all(t.state == TrialState.COMPLETE for t in study.trials)
    assert len(loads) == 1  # loaded once, shared by both trials
    assert "ref" not in executor.stats().adapters


def test_grpo_checks(make_executor, prompts, preference) -> None:
    train, evaluation = prompts
    executor = make_executor(train_dataset=train, eval_dataset=evaluation, reward_funcs=[gsm8k_reward])
    with pytest.raises(ValueError, match="direction='maximize'"):
        executor.optimize(optuna.create_study(), by_number([(lora(), grpo_args())]), n_trials=1)
    no_rewards = make_executor(train_dataset=train, eval_dataset=evaluation)
    with pytest.raises(ValueError, match="reward_funcs"):
        no_rewards.optimize(optuna.create_study(direction="maximize"), by_number([(lora(), grpo_args())]), n_trials=1)
    with pytest.raises(ValueError, match="use_vllm"):
        executor.optimize(
            optuna.create_study(direction="maximize"), by_number([(lora(), grpo_args(use_vllm=True))]), n_trials=1
        )


def test_one_study_does_not_mix_trainer_types(make_executor, preference) -> None:
    train, evaluation = preference
    executor = make_executor(train_dataset=train, eval_dataset=evaluation, num_chunks=2, max_concurrent_trials=1)
    sft = SFTConfig(**FAST, per_device_train_batch_size=2, max_length=256, dataset_text_field="prompt")
    study = optuna.create_study()
    executor.optimize(study, by_number([(lora(), dpo_args())]), n_trials=1)
    with pytest.raises(ValueError, match="mixes DPOConfig and SFTConfig trials"):
        executor.optimize(study, by_number([None, (lora(), sft)]), n_trials=1)


@pytest.mark.parametrize("engine", list(ENGINES))
def test_grpo_warm_clone_continues_exactly_and_pauses_like_any_trial(make_executor, prompts, engine) -> None:
    """A paused GRPO trial's warm clone continues exactly as the trial does (its sampling and dropout
    generators included), alone or in a fused gang with it; a reward that varies makes training move."""
    train, evaluation = prompts
    executor = make_executor(
        engine=engine,
        train_dataset=train,
        eval_dataset=evaluation,
        num_chunks=4,
        max_concurrent_trials=2,
        reward_funcs=[vowel_reward],
    )
    study = optuna.create_study(direction="maximize", pruner=optuna.pruners.NopPruner())

    def configure(trial):
        lr = trial.suggest_float("learning_rate", 1e-3, 1e-1, log=True)
        return lora(r=4, lora_dropout=0.1), grpo_args(learning_rate=lr, beta=0.05)

    study.enqueue_trial({"learning_rate": 2e-2})
    objective = executor.objective(configure)
    parent = threading.Thread(target=study.optimize, args=(objective,), kwargs={"n_trials": 1})
    parent.start()
    wait_until(lambda: 0 in study.trials[0].intermediate_values, what="the parent's first report")
    control.stop(study, 0)
    wait_until(lambda: study.trials[0].user_attrs.get(_attrs.STATUS) == "paused", what="the pause")
    child = control.clone(study, 0)
    control.resume(study, 0)
    study.optimize(objective, n_trials=1)
    parent.join()
    clone = study.trials[child]
    assert clone.user_attrs[_attrs.CLONE] == "warm" and clone.user_attrs[_attrs.BRANCH_STEP] >= 1
    assert study.trials[0].state == clone.state == TrialState.COMPLETE
    assert _values(clone) == _values(study.trials[0])
