"""Per-chunk checkpoints in an artifact store (``_study/_checkpoints.py``): written, linked, read back."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import optuna
import pytest
import torch
from optuna.artifacts import FileSystemArtifactStore

from optuna_rapidfire._resident._snapshot import TrialSnapshot
from optuna_rapidfire._resident._state import Position, RngState, SwapState
from optuna_rapidfire._study import _attrs
from optuna_rapidfire._study._checkpoints import Checkpoints


def _snapshot(number: int, chunks: int) -> TrialSnapshot:
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=0.1)
    state = SwapState(
        adapter_name=f"trial_{number}",
        params=list(layer.parameters()),
        optimizer=optimizer,
        lr_scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
        scaler=None,
        rng=RngState.seeded(11, torch.device("cpu")),
        position=Position(chunks_done=chunks, optimizer_steps=2 * chunks),
    )
    weights = {"q_proj.lora_A.weight": layer.weight.data, "q_proj.lora_B.weight": layer.bias.data}
    return TrialSnapshot.capture(number, "sft", state, weights, [{"eval_loss": 1.0}] * chunks)


def _one_saved(tmp_path: Path) -> tuple[Path, Checkpoints, optuna.Study, optuna.Trial, dict[str, Any]]:
    """An artifact folder, its checkpoints, a study with one running trial, and that trial's first checkpoint."""
    folder = tmp_path / "artifacts"
    folder.mkdir()
    checkpoints = Checkpoints(FileSystemArtifactStore(str(folder)))
    study = optuna.create_study(study_name="s")
    trial = study.ask()
    first = checkpoints.save(study, trial._trial_id, _snapshot(trial.number, 1))
    return folder, checkpoints, study, trial, first


def test_an_artifact_folder_deleted_mid_study_is_made_again_and_checkpoints_go_on(tmp_path: Path, caplog) -> None:
    folder, checkpoints, study, trial, first = _one_saved(tmp_path)
    shutil.rmtree(folder)  # a cleanup job, an unmounted share
    with caplog.at_level(logging.WARNING, logger="optuna_rapidfire"):
        second = checkpoints.save(study, trial._trial_id, _snapshot(trial.number, 2), previous=first)
    assert f"The artifact folder {folder} was gone" in caplog.text
    assert study.trials[0].system_attrs[_attrs.CHECKPOINT] == second
    assert checkpoints.load(study, second, {trial.number}).position.chunks_done == 2
    assert [p.name for p in folder.iterdir()] == [second["artifact_id"]]


def test_a_checkpoint_whose_trial_was_failed_meanwhile_leaves_no_blob(tmp_path: Path) -> None:
    # Another worker's heartbeat check failed the trial while this worker wrote its checkpoint: the link is
    # refused, and the blob nobody links is removed at once (no orphan per lost trial).
    from optuna.exceptions import UpdateFinishedTrialError
    from optuna.trial import TrialState

    folder, checkpoints, study, trial, first = _one_saved(tmp_path)
    study._storage.set_trial_state_values(trial._trial_id, TrialState.FAIL)
    with pytest.raises(UpdateFinishedTrialError):
        checkpoints.save(study, trial._trial_id, _snapshot(trial.number, 2), previous=first)
    assert [p.name for p in folder.iterdir()] == [first["artifact_id"]]
    assert study.trials[0].system_attrs[_attrs.CHECKPOINT] == first
