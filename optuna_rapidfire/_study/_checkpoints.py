"""Per-chunk states of trials: checkpoints a trial survives its worker by, and the states clones branch from.

After every chunk a trial's state (a :class:`~optuna_rapidfire._resident._snapshot.TrialSnapshot`: one safetensors
blob) is written to the study's artifact store under a fresh id; only then is the trial's ``rapidfire:checkpoint``
system attr pointed at it, with its SHA-256. That link is the commit point: a crash mid-write leaves the
previous link (and an orphan blob), never a link to a partial blob, and a blob damaged later fails its
checksum on load. A study without an artifact store keeps the states in this process's memory
(:data:`MEMORY`) instead, for clones only: the snapshots themselves, serialised only if someone reads their bytes.

Each kept state is also listed in the study's ``rapidfire:chunk_states:<trial>`` attr, so a clone can branch
from the chunk boundary at which it was asked for, whatever the parent did after. A live trial keeps every
chunk's state (or its last ``keep_checkpoints``), a finished one its last, and none is dropped while a clone
waits to branch from it; ``checkpoint_budget`` bounds the bytes kept, dropping the oldest with a log line.
Loading checks the checksum, the study and the trial the blob belongs to, and (in the engine) the adapter's
shapes; nothing is unpickled.
"""

from __future__ import annotations

import hashlib
import io
import os
import socket
import threading
import uuid
from typing import TYPE_CHECKING, Any, BinaryIO

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


class MemoryStore:
    """An artifact store in this process's memory: where chunk states are kept when the study has no artifact
    store (no heartbeats, or ``artifact_store=None``), so clones in this process can still branch from them.
    One per process (:data:`MEMORY`); thread-safe."""

    def __init__(self) -> None:
        self._blobs: dict[str, bytes | memoryview | tuple[TrialSnapshot, str]] = {}
        self._lock = threading.Lock()
        self.where = f"{socket.gethostname()}:{os.getpid()}"

    def open_reader(self, artifact_id: str) -> io.BytesIO:
        with self._lock:
            if artifact_id not in self._blobs:
                raise FileNotFoundError(f"no artifact {artifact_id} in the memory of {self.where}")
            found = self._blobs[artifact_id]
        if isinstance(found, tuple):  # a kept snapshot: its bytes, made for this reader (the snapshot keeps none)
            snapshot, study_name = found
            return io.BytesIO(snapshot.to_bytes(study_name))
        return io.BytesIO(found)

    def write(self, artifact_id: str, content_body: BinaryIO) -> None:
        blob = content_body.read()
        with self._lock:
            self._blobs[artifact_id] = blob

    def keep_snapshot(self, artifact_id: str, snapshot: TrialSnapshot, study_name: str) -> None:
        """Keep ``snapshot`` (taken in study ``study_name``, not to change) as the artifact, unserialised: a trial's
        chunk state is read back, if ever, by a clone in this process. Serialising a 1B trial's state (41 MB) took
        30-55 ms on H100 hosts, and at a lock-step boundary every member of the gang checkpoints at once while the
        device's thread waits to start their next chunk."""
        with self._lock:
            self._blobs[artifact_id] = (snapshot, study_name)

    def snapshot(self, artifact_id: str) -> tuple[TrialSnapshot, str] | None:
        """The snapshot kept as ``artifact_id`` and its study's name (``None``: none, or bytes were kept)."""
        with self._lock:
            found = self._blobs.get(artifact_id)
        return found if isinstance(found, tuple) else None

    def remove(self, artifact_id: str) -> None:
        with self._lock:
            self._blobs.pop(artifact_id, None)


MEMORY = MemoryStore()


class Checkpoints:
    """Writes and reads trials' per-chunk states in ``store``, and keeps as many of them as asked.

    Args:
        store: An artifact store shared by the study's workers, or :data:`MEMORY` (this process only).
        keep: Chunk states kept per trial for clones to branch from (``None``: every one of a live trial, and
            the last of a finished one); never one a waiting clone still needs.
        budget: Bytes of chunk states this process keeps in ``store`` (``None``: no limit); over it, the
            oldest states that are neither a trial's latest nor awaited by a clone are dropped, each with a
            log line.
    """

    def __init__(self, store: ArtifactStore, *, keep: int | None = None, budget: int | None = None) -> None:
        self.store = store
        self.keep = keep
        self.budget = budget
        self.shared = store is not MEMORY
        self._lock = threading.Lock()
        # (trial number, chunks done) -> link, of the states this process wrote and still keeps, oldest first.
        self._kept: dict[tuple[int, int], dict[str, Any]] = {}

    def save(self, study: optuna.Study, trial_id: int, snapshot: TrialSnapshot, previous: Any = None) -> dict[str, Any]:
        """Write ``snapshot``, the trial's state after a chunk, and link it: from the trial (its latest
        checkpoint, which a retry resumes from; shared stores only) and from the study's chunk states of the
        trial (what clones branch from). ``previous`` is the trial's latest link until now: removed when it
        is not one of this trial's kept chunk states (a retry's inherited link), unless a clone awaits it.

        Returns:
            The new link.
        """
        blob = snapshot.blob(study.study_name) if self.shared else None  # in memory: the snapshot itself is kept
        artifact_id = f"rapidfire-{uuid.uuid4().hex}"
        folder = _compat.artifact_folder(self.store)
        if folder is not None and not os.path.isdir(folder):
            # Deleted while the study runs (a cleanup, a remount): make it again rather than stop checkpointing.
            os.makedirs(folder, exist_ok=True)
            _logger.warning("The artifact folder %s was gone; it is made again for the next checkpoints.", folder)
        link: dict[str, Any] = {
            "artifact_id": artifact_id,
            "step": snapshot.position.chunks_done,
            # A state kept in this process's memory is the snapshot itself, never copied or sent: no hash to check it
            # against (35-50 ms of a 1B trial's checkpoint on H100 hosts, paid by a lock-step gang's eight members
            # at once while the device waits for their next chunk).
            "sha256": None if blob is None else hashlib.sha256(blob).hexdigest(),
            "bytes": snapshot.blob_size(study.study_name) if blob is None else blob.nbytes,
        }
        if not self.shared:
            link["memory"] = MEMORY.where
        # Nothing half-written: a blob cut short (a full disk) or refused its link (the trial was failed
        # elsewhere meanwhile) is removed; the trial's link still names its previous, whole checkpoint. A link
        # whose write may have reached the storage (it stayed unreachable) keeps its blob.
        try:
            if blob is None:
                assert isinstance(self.store, MemoryStore)
                self.store.keep_snapshot(artifact_id, snapshot, study.study_name)
            else:
                self.store.write(artifact_id, io.BytesIO(blob))
        except BaseException:
            self.remove(link)
            raise
        number = snapshot.trial_number
        try:
            if self.shared:
                _compat.storage(study).set_trial_system_attr(trial_id, _attrs.CHECKPOINT, link)
        except UpdateFinishedTrialError:
            self.remove(link)
            raise
        with self._lock:
            mine = {key[1] for key in self._kept if key[0] == number}
            self._kept[(number, link["step"])] = link
        self._publish(study, number)
        inherited = isinstance(previous, dict) and previous.get("step") not in mine
        if inherited and not awaited_steps(study, number):
            self.remove(previous)
        self.trim(study, number)
        return link

    def trim(self, study: optuna.Study, number: int, *, finished: bool = False, keep: int | None = None) -> None:
        """Drop trial ``number``'s chunk states beyond what is kept: ``keep`` (default: :attr:`keep`; once the trial
        has ``finished``, 1 unless :attr:`keep` says more; 0 drops all), never one a waiting clone branches from;
        then enforce the budget."""
        limit = keep if keep is not None else ((self.keep or 1) if finished else self.keep)
        dropped = False
        if limit is not None:
            awaited = awaited_steps(study, number)
            with self._lock:
                steps = sorted(step for n, step in self._kept if n == number)
                doomed = [s for s in steps[: max(0, len(steps) - limit)] if s not in awaited]
                links = [self._kept.pop((number, s)) for s in doomed]
            for link in links:
                self.remove(link)
            dropped = bool(links)
        if dropped:
            self._publish(study, number)
        self._enforce_budget(study)

    def _enforce_budget(self, study: optuna.Study) -> None:
        if self.budget is None:
            return
        while True:
            with self._lock:
                total = sum(int(link["bytes"]) for link in self._kept.values())
                if total <= self.budget:
                    return
                latest: dict[int, int] = {}
                for n, step in self._kept:
                    latest[n] = max(step, latest.get(n, step))
                candidates = [key for key in self._kept if latest[key[0]] != key[1]]
            victim = next((key for key in candidates if key[1] not in awaited_steps(study, key[0])), None)
            if victim is None:
                return
            with self._lock:
                link = self._kept.pop(victim, None)
            if link is None:
                continue
            self.remove(link)
            self._publish(study, victim[0])
            _logger.warning(
                "Dropped the state of trial %d after chunk %d: the chunk states kept here (%.1f MB) exceed "
                "checkpoint_budget=%d bytes. A clone can no longer branch from that chunk.",
                victim[0],
                victim[1],
                total / 1e6,
                self.budget,
            )

    def _publish(self, study: optuna.Study, number: int) -> None:
        """Write the trial's kept chunk states to the study (a study attr: writable after the trial ended)."""
        with self._lock:
            kept = {str(step): link for (n, step), link in sorted(self._kept.items()) if n == number}
        try:
            _compat.storage(study).set_study_system_attr(
                _compat.study_id(study), f"{_attrs.CHUNK_STATES_PREFIX}{number}", kept
            )
        except Exception:  # a clone then finds no state there and starts cold, saying why
            _logger.debug("Trial %d: its kept chunk states could not be recorded.", number, exc_info=True)

    def load_chunk(self, study: optuna.Study, number: int, step: int | None) -> TrialSnapshot:
        """Trial ``number``'s state after chunk ``step`` (``None``: its latest kept one), for a clone.

        Raises:
            CheckpointError: If it is not kept, kept in another worker's memory, or unusable.
        """
        attrs = _compat.storage(study).get_study_system_attrs(_compat.study_id(study))
        kept = attrs.get(f"{_attrs.CHUNK_STATES_PREFIX}{number}") or {}
        if step is None and kept:
            step = max(int(s) for s in kept)
        link = kept.get(str(step)) if step is not None else None
        if link is None:
            if step is None:
                raise CheckpointError(f"no state of trial {number} is kept")
            have = ", ".join(sorted(kept, key=int)) or "none"
            raise CheckpointError(
                f"the state of trial {number} after chunk {step} is not kept (kept: {have}; keep_checkpoints and "
                "checkpoint_budget decide how many are)"
            )
        where = link.get("memory")
        if where is not None and where != MEMORY.where:
            raise CheckpointError(
                f"the state of trial {number} after chunk {step} is kept in the memory of worker {where}; give "
                "the executors a shared artifact_store to branch from it on another worker"
            )
        store = MEMORY if where is not None else self.store
        return _load(store, study, link, {number})

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
        return _load(self.store, study, link, trials)


def _load(store: ArtifactStore, study: optuna.Study, link: Any, trials: Collection[int]) -> TrialSnapshot:
    if not isinstance(link, dict) or not {"artifact_id", "sha256", "step"} <= set(link):
        raise CheckpointError(f"the checkpoint link {link!r} is malformed")
    artifact_id = str(link["artifact_id"])
    kept = store.snapshot(artifact_id) if isinstance(store, MemoryStore) else None
    if kept is not None:  # this process's own snapshot: a copy of it (a reader's optimizer may take its tensors)
        snapshot, study_name = kept
        copy, _ = TrialSnapshot.from_bytes(snapshot.to_bytes(study_name), source=f"checkpoint {artifact_id}")
        return _checked(copy, study_name, artifact_id, study, link, trials)
    try:
        with store.open_reader(artifact_id) as reader:
            blob = reader.read()
    except Exception as error:
        raise CheckpointError(f"checkpoint {artifact_id} cannot be read ({type(error).__name__}: {error})") from None
    if hashlib.sha256(blob).hexdigest() != link["sha256"]:
        raise CheckpointError(f"checkpoint {artifact_id} is corrupted (its SHA-256 does not match the link)")
    try:
        snapshot, study_name = TrialSnapshot.from_bytes(blob, source=f"checkpoint {artifact_id}")
    except ValueError as error:
        raise CheckpointError(str(error)) from None
    return _checked(snapshot, study_name, artifact_id, study, link, trials)


def _checked(
    snapshot: TrialSnapshot, study_name: str, artifact_id: str, study: optuna.Study, link: Any, trials: Collection[int]
) -> TrialSnapshot:
    """``snapshot`` (taken in study ``study_name``), once it is known to be the study's, one of ``trials``' and at
    the link's step."""
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


def awaited_steps(study: optuna.Study, number: int) -> set[int | None]:
    """The chunk boundaries of trial ``number`` that clones still to be built branch from (``None``: a clone of
    its latest state): enqueued clones, and running ones that have not branched yet."""
    steps: set[int | None] = set()
    for trial in _compat.storage(study).get_all_trials(
        _compat.study_id(study),
        deepcopy=False,
        states=(optuna.trial.TrialState.WAITING, optuna.trial.TrialState.RUNNING),
    ):
        if trial.state == optuna.trial.TrialState.RUNNING and _attrs.BRANCH_STEP in trial.user_attrs:
            continue
        request = trial.user_attrs.get(_attrs.CLONE_OF) or trial.system_attrs.get(_attrs.CLONE_OF)
        if isinstance(request, dict) and request.get("parent") == number and request.get("warm", True):
            step = request.get("from_chunk")
            steps.add(step if isinstance(step, int) else None)
    return steps
