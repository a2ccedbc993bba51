"""Per-chunk checkpoints of trials in an Optuna artifact store, so a trial survives its worker.

After every chunk a trial's state (a :class:`~optuna_rapidfire._resident._snapshot.TrialSnapshot`: one safetensors
blob) is written to the artifact store under a fresh id; only then is the trial's ``rapidfire:checkpoint``
system attr pointed at it, with its SHA-256. That link is the commit point: a crash mid-write leaves the
previous link (and an orphan blob), never a link to a partial blob, and a blob damaged later fails its
checksum on load. The previous blob is then removed, unless an enqueued clone still waits to branch from
it. Loading checks the checksum, the study and the trial the blob belongs to, and (in the engine) the
adapter's shapes; nothing is unpickled.
"""

from __future__ import annotations

import hashlib
import io
import os
import uuid
from typing import TYPE_CHECKING, Any

import optuna
from optuna.artifacts import FileSystemArtifactStore
from optuna.exceptions import UpdateFinishedTrialError

from optuna_rapidfire import _compat
from optuna_rapidfire._logging import get_logger
from optuna_rapidfire._resident._snapshot import TrialSnapshot
from optuna_rapidfire._study import _attrs
from optuna_rapidfire._study._storages import file_path

if TYPE_CHECKING:
    from collections.abc import Collection

    from optuna_rapidfire._compat import ArtifactStore

_logger = get_logger(__name__)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: missing, corrupted, or not this trial's."""


def default_store(study: optuna.Study, output_dir: str) -> FileSystemArtifactStore:
    """Beside the storage: ``<db>.artifacts/`` for SQLite and journal files, else ``output_dir/artifacts``.

    A remote RDB (PostgreSQL...) gets a local folder; workers on other machines then need a shared
    ``artifact_store`` (a shared filesystem or S3) to resume each other's trials.
    """
    path = file_path(study)
    base = f"{path}.artifacts" if path else os.path.join(os.path.abspath(output_dir), "artifacts")
    os.makedirs(base, exist_ok=True)
    return FileSystemArtifactStore(base)


class Checkpoints:
    """Writes and reads trials' per-chunk checkpoints in ``store``."""

    def __init__(self, store: ArtifactStore) -> None:
        self.store = store

    def save(self, study: optuna.Study, trial_id: int, snapshot: TrialSnapshot, previous: Any = None) -> dict[str, Any]:
        """Write ``snapshot`` and link it from the trial; remove ``previous``, its link until now.

        Returns:
            The link now on the trial.
        """
        blob = snapshot.to_bytes(study.study_name)
        artifact_id = f"rapidfire-{uuid.uuid4().hex}"
        folder = _compat.artifact_folder(self.store)
        if folder is not None and not os.path.isdir(folder):
            # Deleted while the study runs (a cleanup, a remount): make it again rather than stop checkpointing.
            os.makedirs(folder, exist_ok=True)
            _logger.warning("The artifact folder %s was gone; it is made again for the next checkpoints.", folder)
        link: dict[str, Any] = {
            "artifact_id": artifact_id,
            "step": snapshot.position.chunks_done,
            "sha256": hashlib.sha256(blob).hexdigest(),
            "bytes": len(blob),
        }
        # Nothing half-written: a blob cut short (a full disk) or refused its link (the trial was failed
        # elsewhere meanwhile) is removed; the trial's link still names its previous, whole checkpoint. A link
        # whose write may have reached the storage (it stayed unreachable) keeps its blob.
        try:
            self.store.write(artifact_id, io.BytesIO(blob))
        except BaseException:
            self.remove(link)
            raise
        try:
            _compat.storage(study).set_trial_system_attr(trial_id, _attrs.CHECKPOINT, link)
        except UpdateFinishedTrialError:
            self.remove(link)
            raise
        if isinstance(previous, dict) and not _awaited_by_clone(study, snapshot.trial_number):
            self.remove(previous)
        return link

    def remove(self, link: dict[str, Any]) -> None:
        try:
            self.store.remove(str(link["artifact_id"]))
        except Exception:  # already gone, or the store refuses: an orphan blob is harmless
            _logger.debug("Could not remove checkpoint %s.", link.get("artifact_id"), exc_info=True)

    def load(self, study: optuna.Study, link: Any, trials: Collection[int]) -> TrialSnapshot:
        """Read the checkpoint ``link`` points to; it must belong to ``study`` and one of ``trials``.

        Raises:
            CheckpointError: If it is missing, damaged, or another study's or trial's.
        """
        if not isinstance(link, dict) or not {"artifact_id", "sha256", "step"} <= set(link):
            raise CheckpointError(f"the checkpoint link {link!r} is malformed")
        artifact_id = str(link["artifact_id"])
        try:
            with self.store.open_reader(artifact_id) as reader:
                blob = reader.read()
        except Exception as error:
            raise CheckpointError(
                f"checkpoint {artifact_id} cannot be read ({type(error).__name__}: {error})"
            ) from None
        if hashlib.sha256(blob).hexdigest() != link["sha256"]:
            raise CheckpointError(f"checkpoint {artifact_id} is corrupted (its SHA-256 does not match the link)")
        try:
            snapshot, study_name = TrialSnapshot.from_bytes(blob, source=f"checkpoint {artifact_id}")
        except ValueError as error:
            raise CheckpointError(str(error)) from None
        if study_name != study.study_name:
            raise CheckpointError(f"checkpoint {artifact_id} belongs to study {study_name!r}, not {study.study_name!r}")
        if snapshot.trial_number not in trials:
            raise CheckpointError(
                f"checkpoint {artifact_id} belongs to trial {snapshot.trial_number}, not to {sorted(trials)}"
            )
        if snapshot.position.chunks_done != link["step"]:
            raise CheckpointError(
                f"checkpoint {artifact_id} is at step {snapshot.position.chunks_done}, not {link['step']}"
            )
        return snapshot


def _awaited_by_clone(study: optuna.Study, number: int) -> bool:
    """Whether an enqueued (not yet started) clone of trial ``number`` may still branch from its checkpoint."""
    for trial in _compat.storage(study).get_all_trials(
        _compat.study_id(study), deepcopy=False, states=(optuna.trial.TrialState.WAITING,)
    ):
        request = trial.user_attrs.get(_attrs.CLONE_OF) or trial.system_attrs.get(_attrs.CLONE_OF)
        if isinstance(request, dict) and request.get("parent") == number:
            return True
    return False
