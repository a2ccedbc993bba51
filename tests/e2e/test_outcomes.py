"""What a person sees of each trial's end: its status, why it failed or was pruned, and nothing left behind."""

from __future__ import annotations

import logging
import os
from typing import Any

import optuna
import pytest
from datasets import Dataset
from helpers import by_number, lora, sft_args
from optuna.trial import TrialState
from trl import DPOConfig, GRPOConfig

from optuna_rapidfire._study import _attrs
from optuna_rapidfire.demo import load_gsm8k


class _PruneOne(optuna.pruners.BasePruner):
    """Prunes one trial at one step: the decision does not depend on any value, so rounding cannot change it."""

    def __init__(self, number: int, step: int) -> None:
        self.number, self.step = number, step

    def prune(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> bool:
        return trial.number == self.number and trial.last_step == self.step


def test_each_finished_trial_says_how_it_ended_and_why(make_executor) -> None:
    executor = make_executor(num_chunks=4, max_concurrent_trials=3)
    study = optuna.create_study(pruner=_PruneOne(number=1, step=1))
    configs = [(lora(), sft_args()), (lora(), sft_args()), (lora(target_modules=["nonexistent_proj"]), sft_args())]
    executor.optimize(study, by_number(configs), n_trials=3)

    complete, pruned, failed = study.trials
    assert [t.state for t in study.trials] == [TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL]
    assert [t.user_attrs[_attrs.STATUS] for t in study.trials] == ["complete", "pruned", "failed"]
    assert _attrs.FAIL_REASON not in complete.user_attrs and _attrs.PRUNED_REASON not in complete.user_attrs
    # One numbering: pruned at step 1 is after its second chunk, and it has trained two chunks.
    assert pruned.user_attrs[_attrs.CHUNKS_DONE] == 2 and pruned.last_step == 1
    reason = pruned.user_attrs[_attrs.PRUNED_REASON]
    assert reason.startswith("_PruneOne stopped it after chunk 2/4 (step 1): eval_loss=")
    assert "compared with 1 other trial(s) at that step" in reason  # trial 0 (trial 2 never trained)
    assert "Target modules" in failed.user_attrs[_attrs.FAIL_REASON]


def test_a_diverging_trial_stops_at_its_first_non_finite_loss_and_says_so_in_one_line(make_executor, caplog) -> None:
    executor = make_executor(num_chunks=4, max_concurrent_trials=2)
    study = optuna.create_study()
    configs = [(lora(), sft_args()), (lora(), sft_args(learning_rate=float("inf")))]
    optuna.logging.enable_propagation()  # Optuna's own lines too
    try:
        with caplog.at_level(logging.INFO):
            executor.optimize(study, by_number(configs), n_trials=2)
    finally:
        optuna.logging.disable_propagation()
    fine, diverged = study.trials
    assert fine.state == TrialState.COMPLETE and sorted(fine.intermediate_values) == [0, 1, 2, 3]
    assert diverged.state == TrialState.FAIL and diverged.user_attrs[_attrs.STATUS] == "failed"
    reason = diverged.user_attrs[_attrs.FAIL_REASON]
    assert reason.startswith("DivergedError: ") and "=nan after chunk 1:" in reason, reason
    assert diverged.intermediate_values == {}  # it stopped at its first chunk: nothing non-finite was reported
    said = [r for r in caplog.records if r.levelno >= logging.WARNING and "Trial 1 " in r.getMessage()]
    assert [r.getMessage() for r in said] == [f"Trial 1 failed: {reason}"]
    assert "not acceptable" not in caplog.text and "Traceback" not in caplog.text


@pytest.mark.parametrize(
    ("returned", "message"),
    [
        (lambda trial: sft_args(), "must return (peft_config, training_args)"),
        (lambda trial: (lora(), sft_args(max_steps=5)), "max_steps=5 is not supported"),
    ],
)
def test_a_trial_ended_by_a_bad_config_records_the_error(make_executor, returned, message) -> None:
    study = optuna.create_study()
    with pytest.raises((TypeError, ValueError)):
        make_executor().optimize(study, returned, n_trials=1)
    trial = study.trials[0]
    assert trial.state == TrialState.FAIL and trial.user_attrs[_attrs.STATUS] == "failed"
    assert message in trial.user_attrs[_attrs.FAIL_REASON]


def test_a_missing_metric_is_the_fail_reason(make_executor) -> None:
    study = optuna.create_study()
    with pytest.raises(ValueError, match="eval_bleu"):
        make_executor(metric="bleu", max_concurrent_trials=1).optimize(
            study, by_number([(lora(), sft_args())]), n_trials=1
        )
    assert "metric='eval_bleu' is not among" in study.trials[0].user_attrs[_attrs.FAIL_REASON]


@pytest.mark.parametrize(
    ("train_format", "args", "needed"),
    [
        ("raw", sft_args(), "'text' column"),
        ("prompt_completion", DPOConfig(output_dir="x", bf16=False), "'chosen' and 'rejected'"),
        ("raw", GRPOConfig(output_dir="x", bf16=False, num_generations=2, per_device_train_batch_size=2), "'prompt'"),
    ],
)
def test_data_without_the_columns_the_trainer_needs_is_refused_before_any_training(
    make_executor, chunk_log, caplog, train_format, args, needed
) -> None:
    train = load_gsm8k("train", num_rows=16, format=train_format)
    executor = make_executor(train_dataset=train, eval_dataset=train, max_concurrent_trials=2, reward_funcs=[len])
    study = optuna.create_study(direction="maximize" if isinstance(args, GRPOConfig) else "minimize")
    optuna.logging.enable_propagation()
    try:
        with caplog.at_level(logging.INFO), pytest.raises(ValueError, match="train_dataset has the columns") as raised:
            executor.optimize(study, lambda trial: (lora(), args), n_trials=6)
    finally:
        optuna.logging.disable_propagation()
    assert str(train.column_names) in str(raised.value) and needed in str(raised.value)
    # Said once in the log (then raised), without Optuna's lines and traceback for each trial of the wave.
    assert caplog.text.count("train_dataset has the columns") == 1 and "Traceback" not in caplog.text
    assert chunk_log == []
    assert len(study.trials) <= 2  # the first wave; the study stopped instead of failing trial after trial


def test_a_chunk_emptied_by_preparation_says_how_many_rows_were_dropped(make_executor, eval_ds) -> None:
    # Every prompt fills max_length, so TRL truncates away each completion and drops the fully masked rows.
    train = Dataset.from_dict({"prompt": ["word " * 200] * 16, "completion": [" answer"] * 16})
    executor = make_executor(train_dataset=train, num_chunks=2, max_concurrent_trials=1)
    study = optuna.create_study()
    executor.optimize(study, by_number([(lora(), sft_args(max_length=16))]), n_trials=1)
    reason = study.trials[0].user_attrs[_attrs.FAIL_REASON]
    assert "Chunk 1 of 2 holds 0 examples" in reason and "preparation dropped 8 of its 8 rows" in reason


def test_a_finished_study_leaves_no_trainer_folders_and_no_lock_file(make_executor, tmp_path) -> None:
    executor = make_executor(num_chunks=2, max_concurrent_trials=2)
    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 'study.db'}", study_name="tidy")
    executor.optimize(study, by_number([(lora(), sft_args())] * 3), n_trials=3)
    assert all(t.state == TrialState.COMPLETE for t in study.trials)
    assert sorted(os.listdir(tmp_path / "out")) == ["tidy"]  # no .trainer/trial_N folders
    assert sorted(os.listdir(tmp_path / "out" / "tidy")) == ["state", "trial-0", "trial-1", "trial-2"]
    assert [name for name in os.listdir(tmp_path) if "lock" in name] == []


class _DiskFillsUp(optuna.artifacts.FileSystemArtifactStore):
    """A folder whose disk fills up after ``room`` blobs: later blobs are cut short by the kernel's own ENOSPC
    (the rest of each goes to ``/dev/full``), as a full disk leaves them."""

    def __init__(self, base_path: str, room: int) -> None:
        super().__init__(base_path)
        self.folder, self.room = base_path, room

    def write(self, artifact_id: str, content_body: Any) -> None:
        if self.room > 0:
            self.room -= 1
            return super().write(artifact_id, content_body)
        data = content_body.read()
        with open(os.path.join(self.folder, artifact_id), "wb") as partial:
            partial.write(data[: len(data) // 2])
        with open("/dev/full", "wb") as full:
            full.write(data[len(data) // 2 :])  # OSError: [Errno 28] No space left on device


def test_a_full_disk_costs_the_checkpoints_it_cuts_short_and_nothing_else(make_executor, tmp_path, rapidfire_logs):
    folder = tmp_path / "artifacts"
    folder.mkdir()
    store = _DiskFillsUp(str(folder), room=2)
    executor = make_executor(num_chunks=4, max_concurrent_trials=1, artifact_store=store)
    study = optuna.create_study(pruner=optuna.pruners.NopPruner())
    executor.optimize(study, by_number([(lora(), sft_args())]), n_trials=1)

    trial = study.trials[0]
    assert trial.state == TrialState.COMPLETE and sorted(trial.intermediate_values) == [0, 1, 2, 3]
    failed = [r.getMessage() for r in rapidfire_logs.records if "could not be saved" in r.getMessage()]
    assert len(failed) == 2 and all("No space left on device" in line for line in failed), failed
    assert "after chunk 3" in failed[0] and "after chunk 4" in failed[1]
    # Nothing half-written: the cut blobs are gone, and the link names the last whole checkpoint (chunk 2).
    link = trial.system_attrs[_attrs.CHECKPOINT]
    assert link["step"] == 2 and [p.name for p in folder.iterdir()] == [link["artifact_id"]]
    from optuna_rapidfire._study._checkpoints import Checkpoints

    assert Checkpoints(store).load(study, link, {0}).position.chunks_done == 2


def test_a_trial_pruned_after_its_last_chunk_keeps_its_adapter_and_the_study_names_its_metric(make_executor) -> None:
    class PruneAtTheEnd(optuna.pruners.BasePruner):
        def prune(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> bool:
            return trial.last_step == 1

    executor = make_executor(num_chunks=2, max_concurrent_trials=1)
    study = optuna.create_study(pruner=PruneAtTheEnd())
    executor.optimize(study, by_number([(lora(), sft_args())]), n_trials=1)
    trial = study.trials[0]
    # It trained every chunk: what it trained is kept (a pruner's verdict on its last value is not a crash).
    assert trial.state == TrialState.PRUNED and sorted(trial.intermediate_values) == [0, 1]
    assert os.path.isfile(os.path.join(trial.user_attrs[_attrs.ADAPTER_PATH], "adapter_config.json"))
    assert study.metric_names == ["eval_loss"]  # optuna-dashboard names the objective after it
