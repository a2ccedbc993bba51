"""Behaviour 10: clear errors before any training; a failing trial fails alone and frees its state."""

from __future__ import annotations

import optuna
import pytest
import torch
from helpers import by_number, lora, sft_args
from optuna.trial import TrialState
from transformers import TrainingArguments
from trl import DPOConfig

from optuna_rapidfire import RapidFireExecutor
from optuna_rapidfire._study._attrs import FAIL_REASON


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_chunks": 0}, "num_chunks"),
        ({"num_chunks": -3}, "num_chunks"),
        ({"num_chunks": 1000}, "num_chunks=1000 is more than the 48 rows"),
        ({"max_concurrent_trials": 0}, "max_concurrent_trials"),
        ({"eval_samples": 0}, "eval_samples"),
        ({"state_memory_budget": "lots"}, "state_memory_budget"),
        ({"state_memory_budget": -1}, "state_memory_budget"),
        ({"devices": "cuda:7"} if not torch.cuda.is_available() else {"devices": "cuda:99"}, "devices"),
        ({"devices": "not-a-device"}, "devices"),
    ],
)
def test_executor_arguments_are_checked_up_front(tiny_model, train_ds, eval_ds, kwargs, message) -> None:
    settings = {"model": tiny_model, "train_dataset": train_ds, "eval_dataset": eval_ds, **kwargs}
    with pytest.raises(ValueError, match=message):
        RapidFireExecutor(**settings)


def test_empty_or_wrong_datasets_are_rejected(tiny_model, train_ds, eval_ds) -> None:
    with pytest.raises(ValueError, match="train_dataset is empty"):
        RapidFireExecutor(model=tiny_model, train_dataset=train_ds.select([]), eval_dataset=eval_ds)
    with pytest.raises(ValueError, match="eval_dataset is empty"):
        RapidFireExecutor(model=tiny_model, train_dataset=train_ds, eval_dataset=eval_ds.select([]))
    with pytest.raises(TypeError, match=r"train_dataset must be a datasets\.Dataset"):
        RapidFireExecutor(model=tiny_model, train_dataset=list(train_ds), eval_dataset=eval_ds)


def test_bad_model_fails_before_the_study(train_ds, eval_ds, tmp_path) -> None:
    executor = RapidFireExecutor(model=str(tmp_path / "missing"), train_dataset=train_ds, eval_dataset=eval_ds)
    with pytest.raises(OSError):
        executor.objective(by_number([(lora(), sft_args())]))
    with pytest.raises(TypeError, match="model must be"):
        RapidFireExecutor(model=42, train_dataset=train_ds, eval_dataset=eval_ds).objective(lambda t: None)


def test_metric_the_evaluation_does_not_produce_stops_before_training(make_executor, chunk_log) -> None:
    executor = make_executor(metric="bleu")
    study = optuna.create_study()
    with pytest.raises(ValueError, match="metric='eval_bleu' is not among the evaluation's metrics"):
        executor.optimize(study, by_number([(lora(), sft_args())] * 4), n_trials=4)
    assert chunk_log == []
    with pytest.raises(ValueError, match="eval_bleu"):  # the executor stays unusable for this mistake
        executor.optimize(study, by_number([(lora(), sft_args())]), n_trials=1)


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        (TrainingArguments(output_dir="x", use_cpu=True), TypeError, "supports SFTConfig"),
        (DPOConfig(output_dir="x", bf16=False, precompute_ref_log_probs=True), ValueError, "precompute_ref_log_probs"),
        (sft_args(max_steps=5), ValueError, "max_steps=5 is not supported"),
        (sft_args(lr_scheduler_type="reduce_lr_on_plateau", eval_strategy="epoch"), ValueError, "reduce_lr_on_plateau"),
        (sft_args(load_best_model_at_end=True, eval_strategy="steps", save_strategy="steps"), ValueError, "load_best"),
    ],
)
def test_unusable_training_args_raise_clearly(make_executor, args, error, message) -> None:
    executor = make_executor()
    with pytest.raises(error, match=message):
        executor.optimize(optuna.create_study(), lambda trial: (lora(), args), n_trials=1)


def test_configure_must_return_a_peft_config_and_args(make_executor) -> None:
    executor = make_executor()
    with pytest.raises(TypeError, match=r"must return \(peft_config, training_args\)"):
        executor.optimize(optuna.create_study(), lambda trial: sft_args(), n_trials=1)
    with pytest.raises(TypeError, match="peft config"):
        executor.optimize(optuna.create_study(), lambda trial: (sft_args(), lora()), n_trials=1)


def test_study_direction_and_objectives_are_checked(make_executor) -> None:
    executor = make_executor()
    configure = by_number([(lora(), sft_args())])
    with pytest.raises(ValueError, match="is a loss but the study maximizes"):
        executor.optimize(optuna.create_study(direction="maximize"), configure, n_trials=1)
    with pytest.raises(ValueError, match="one direction"):
        executor.optimize(optuna.create_study(directions=["minimize", "minimize"]), configure, n_trials=1)


def test_ignored_fields_are_reported_once(make_executor, rapidfire_logs) -> None:
    executor = make_executor(num_chunks=2, max_concurrent_trials=2)
    args = sft_args(eval_strategy="steps", eval_steps=3)
    executor.optimize(optuna.create_study(), by_number([(lora(), args), (lora(), args)]), n_trials=2)
    notes = [r.getMessage() for r in rapidfire_logs.records if "eval_strategy" in r.getMessage()]
    assert len(notes) == 1 and "is ignored" in notes[0]


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        ((lora(target_modules=["nonexistent_proj"]), sft_args()), "Target modules"),
        ((lora(r=0), sft_args()), "positive integer"),
        ((lora(), sft_args(per_device_train_batch_size=16, dataloader_drop_last=True)), "fewer than one batch"),
    ],
)
def test_a_bad_config_fails_alone(make_executor, bad, reason) -> None:
    executor = make_executor(num_chunks=4, max_concurrent_trials=3)
    study = optuna.create_study()
    configs = [(lora(), sft_args()), bad, (lora(r=4), sft_args())]
    executor.optimize(study, by_number(configs), n_trials=3)

    assert [t.state for t in study.trials] == [TrialState.COMPLETE, TrialState.FAIL, TrialState.COMPLETE]
    assert reason in study.trials[1].user_attrs[FAIL_REASON]
    assert executor.stats().adapters == ()


def test_out_of_memory_fails_that_trial_only_and_keeps_its_reports(make_executor) -> None:
    from optuna_rapidfire import events

    def out_of_memory(event: events.Event) -> None:  # as trial 1's third chunk would
        if isinstance(event, events.ChunkStarting) and (event.trials, event.steps) == ((1,), (2,)):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    executor = make_executor(num_chunks=4, max_concurrent_trials=3)
    study = optuna.create_study(pruner=optuna.pruners.NopPruner())
    with events.listen(out_of_memory, events.ChunkStarting):
        executor.optimize(study, by_number([(lora(), sft_args())] * 4), n_trials=4)

    states = [t.state for t in study.trials]
    assert states == [TrialState.COMPLETE, TrialState.FAIL, TrialState.COMPLETE, TrialState.COMPLETE]
    failed = study.trials[1]
    assert list(failed.intermediate_values) == [0, 1]  # what it reported before failing is kept
    assert "OutOfMemoryError" in failed.user_attrs[FAIL_REASON]
    assert executor.stats().live_trials == 0
