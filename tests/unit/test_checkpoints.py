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

from optuna_rapidfire._resident import _snapshot as snapshot_module
from optuna_rapidfire._resident._snapshot import TrialSnapshot
from optuna_rapidfire._resident._state import Position, RngState, SwapState
from optuna_rapidfire._study import _attrs
from optuna_rapidfire._study._checkpoints import MEMORY, CheckpointError, Checkpoints


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


def _kept(study: optuna.Study, number: int) -> list[int]:
    attrs = study._storage.get_study_system_attrs(study._study_id)
    return sorted(int(step) for step in attrs.get(f"{_attrs.CHUNK_STATES_PREFIX}{number}", {}))


def test_a_trial_keeps_its_last_chunk_states_and_once_finished_its_last_unless_a_clone_waits_for_one(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "artifacts"
    folder.mkdir()
    checkpoints = Checkpoints(FileSystemArtifactStore(str(folder)), keep=2)
    study = optuna.create_study(study_name="s")
    trial = study.ask()
    links = [checkpoints.save(study, trial._trial_id, _snapshot(trial.number, chunks)) for chunks in (1, 2, 3, 4)]
    assert _kept(study, trial.number) == [3, 4]
    assert sorted(p.name for p in folder.iterdir()) == sorted(link["artifact_id"] for link in links[2:])
    # A clone asked for at chunk 3 waits in the queue: the trial ends, and keeps chunk 3 for it besides its last.
    study.enqueue_trial({}, user_attrs={_attrs.CLONE_OF: {"parent": trial.number, "warm": True, "from_chunk": 3}})
    checkpoints.trim(study, trial.number, finished=True)
    assert _kept(study, trial.number) == [3, 4]
    # Another worker (a checkpoint store of its own over the same folder) branches from it.
    other = Checkpoints(FileSystemArtifactStore(str(folder)))
    assert other.load_chunk(study, trial.number, 3).position.chunks_done == 3
    with pytest.raises(CheckpointError, match=r"after chunk 1 is not kept \(kept: 3, 4;"):
        other.load_chunk(study, trial.number, 1)


def test_a_link_without_a_hash_is_refused_from_an_artifact_store(tmp_path: Path) -> None:
    """Only a state kept in this process's memory goes unhashed; a store's link that lost its hash reads as damaged."""
    _, checkpoints, study, trial, first = _one_saved(tmp_path)
    assert isinstance(first["sha256"], str) and len(first["sha256"]) == 64
    with pytest.raises(CheckpointError, match="is corrupted"):
        checkpoints.load(study, {**first, "sha256": None}, [trial.number])
    assert checkpoints.load(study, first, [trial.number]).position.chunks_done == 1


def test_the_budget_drops_the_oldest_states_but_never_a_trial_s_latest_and_says_so(tmp_path: Path, caplog) -> None:
    study = optuna.create_study(study_name="s")
    trial = study.ask()
    size = len(_snapshot(trial.number, 1).to_bytes("s"))
    checkpoints = Checkpoints(MEMORY, budget=int(2.5 * size))
    with caplog.at_level(logging.WARNING, logger="optuna_rapidfire"):
        for chunks in (1, 2, 3):
            checkpoints.save(study, trial._trial_id, _snapshot(trial.number, chunks))
    assert _kept(study, trial.number) == [2, 3]
    assert "Dropped the state of trial 0 after chunk 1" in caplog.text and "checkpoint_budget" in caplog.text
    tiny = Checkpoints(MEMORY, budget=1)  # even below one state, each trial's latest stays
    other = study.ask()
    tiny.save(study, other._trial_id, _snapshot(other.number, 1))
    assert _kept(study, other.number) == [1]


def test_a_state_kept_in_memory_is_serialised_only_when_read_and_each_reader_gets_its_own_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A lock-step gang's members checkpoint at once while the device waits: a state kept in this process's memory
    is kept as it was taken (no blob, no hash), its size still the blob's; reading it serialises it then, and what a
    reader changes in its copy never reaches the kept state."""
    made: list[int] = []
    serialise = snapshot_module.safetensors_blob
    monkeypatch.setattr(snapshot_module, "safetensors_blob", lambda *a: made.append(1) or serialise(*a))
    study = optuna.create_study(study_name="s")
    trial = study.ask()
    snapshot = _snapshot(trial.number, 2)
    link = Checkpoints(MEMORY).save(study, trial._trial_id, snapshot)
    assert made == [] and link["sha256"] is None and link["bytes"] == len(snapshot.to_bytes("s"))
    made.clear()
    first = Checkpoints(MEMORY).load(study, link, [trial.number])
    assert made == [1] and first is not snapshot and first.position.chunks_done == 2
    for name, tensor in snapshot.weights.items():
        assert torch.equal(first.weights[name], tensor)
        first.weights[name].add_(1.0)  # a reader's training
    second = Checkpoints(MEMORY).load(study, link, [trial.number])
    assert all(torch.equal(second.weights[n], t) for n, t in snapshot.weights.items())
    with MEMORY.open_reader(link["artifact_id"]) as reader:  # the bytes, for whoever reads the store
        assert TrialSnapshot.from_bytes(reader.read())[0].position.chunks_done == 2


def test_states_kept_in_memory_branch_clones_here_and_say_where_they_are_elsewhere() -> None:
    study = optuna.create_study(study_name="s")
    trial = study.ask()
    checkpoints = Checkpoints(MEMORY)
    link = checkpoints.save(study, trial._trial_id, _snapshot(trial.number, 1))
    assert link["memory"] == MEMORY.where and _attrs.CHECKPOINT not in study.trials[0].system_attrs  # no retries
    assert link["sha256"] is None  # the blob itself is kept: nothing a hash would catch
    assert checkpoints.load_chunk(study, trial.number, None).position.chunks_done == 1
    key = f"{_attrs.CHUNK_STATES_PREFIX}{trial.number}"
    study._storage.set_study_system_attr(study._study_id, key, {"1": {**link, "memory": "elsewhere:1"}})
    with pytest.raises(CheckpointError, match="kept in the memory of worker elsewhere:1; give the executors a shared"):
        checkpoints.load_chunk(study, trial.number, 1)
