"""Behaviour 8: final adapters in PEFT's format, the best one loadable with PeftModel.from_pretrained."""

from __future__ import annotations

import os
import threading

import optuna
import pytest
from _numerics import assert_within_rounding, loss_terms
from helpers import by_number, lora, sft_args
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTTrainer

from optuna_rapidfire import best_adapter_path, events
from optuna_rapidfire._study._attrs import ADAPTER_PATH, FAIL_REASON


@pytest.mark.numerics
def test_complete_trials_save_adapters_and_the_best_reloads(make_executor, tiny_model, eval_ds, tmp_path) -> None:
    executor = make_executor(num_chunks=2, max_concurrent_trials=3)
    study = optuna.create_study(study_name="results", pruner=optuna.pruners.NopPruner())
    configs = [
        (lora(r=2), sft_args(learning_rate=1e-3)),
        (lora(r=8), sft_args(learning_rate=3e-2)),
        (lora(r=4), sft_args()),
    ]
    executor.optimize(study, by_number(configs), n_trials=3)

    for trial in study.trials:
        path = trial.user_attrs[ADAPTER_PATH]
        assert path == str(tmp_path / "out" / "results" / f"trial-{trial.number}")
        assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(path))

    best = best_adapter_path(study)
    assert best == study.best_trial.user_attrs[ADAPTER_PATH]
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), best)
    assert model.peft_config["default"].r == configs[study.best_trial.number][0].r

    # TRL's own evaluate() of the reloaded adapter gives the trial's value: the same loss over the eval set
    # (8 rows of up to sft_args' 128 tokens), from an adapter the model holds on its own.
    trainer = SFTTrainer(
        model=model,
        args=sft_args(output_dir=str(tmp_path / "eval"), report_to="none"),
        train_dataset=eval_ds,
        eval_dataset=eval_ds,
        processing_class=AutoTokenizer.from_pretrained(tiny_model),
    )
    terms = loss_terms(model.config, rows=len(eval_ds), length=128)
    assert_within_rounding(trainer.evaluate()["eval_loss"], study.best_value, terms=terms)


def test_a_trials_adapter_files_are_written_by_its_own_thread_and_an_error_there_fails_it_alone(
    make_executor, tmp_path, listen
) -> None:
    """The device copies a finishing trial's adapter to the host and goes on training the others; the trial's own
    thread writes the files (a slow disk stalls that trial only), and an error there fails that trial alone."""
    writers: dict[int, str] = {}
    listen(lambda event: writers.setdefault(event.trial, threading.current_thread().name), events.AdapterSaved)
    in_the_way = tmp_path / "out" / "writes" / "trial-1"  # a file where trial 1's adapter folder goes
    in_the_way.parent.mkdir(parents=True)
    in_the_way.write_text("not an adapter")
    executor = make_executor(num_chunks=2, max_concurrent_trials=2)
    study = optuna.create_study(study_name="writes", pruner=optuna.pruners.NopPruner())
    executor.optimize(study, by_number([(lora(r=2), sft_args())] * 3), n_trials=3)

    states = [t.state for t in study.trials]
    assert states == [optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL, optuna.trial.TrialState.COMPLETE]
    assert "NotADirectoryError" in study.trials[1].user_attrs[FAIL_REASON]
    assert in_the_way.read_text() == "not an adapter"
    assert sorted(writers) == [0, 2] and all(name.startswith("rapidfire-trial") for name in writers.values())
    for number in (0, 2):
        path = study.trials[number].user_attrs[ADAPTER_PATH]
        assert {"adapter_config.json", "adapter_model.safetensors"} == set(os.listdir(path))
    # No staging folder is left behind, the failed trial's included.
    assert {"trial-0", "trial-1", "trial-2"} <= set(os.listdir(in_the_way.parent))
    assert not [name for name in os.listdir(in_the_way.parent) if name.startswith(".adapter-")]


def test_best_adapter_path_needs_a_complete_trial() -> None:
    study = optuna.create_study()
    with pytest.raises(ValueError):
        best_adapter_path(study)
    study.add_trial(optuna.trial.create_trial(value=1.0))
    with pytest.raises(ValueError, match="no saved adapter"):
        best_adapter_path(study)
