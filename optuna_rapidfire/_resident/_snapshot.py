"""Snapshots of a trial's state at a chunk boundary: what a warm clone starts from.

A snapshot holds CPU copies of everything a trial needs to continue: adapter weights (keyed by their
name without the adapter's own name), optimizer state, LR-schedule position, grad-scaler state, RNG
states, data position, and the per-chunk metrics so far. It is one safetensors blob (the tensors, with
everything else as JSON in the header's metadata), written atomically and loaded back without unpickling:
to a local folder (clones on the same machine) or to an artifact store (per-chunk checkpoints).
"""

from __future__ import annotations

import functools
import json
import os
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
from safetensors.torch import load, save

from optuna_rapidfire import _compat
from optuna_rapidfire._resident._state import Position, RngState

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence

    from optuna_rapidfire._resident._state import SwapState

_FORMAT = 2
_FILE = "snapshot.safetensors"


@dataclass
class TrialSnapshot:
    """A trial's state at a chunk boundary, on the CPU.

    Attributes:
        trial_number: The trial it was taken from.
        kind: Trainer kind name ("sft", ...); a clone of another kind cannot be warm.
        weights: Adapter weights by name (the adapter's own name removed).
        optimizer: The optimizer's ``state_dict()``.
        scheduler_steps: Optimizer steps taken, i.e. the LR schedule's position.
        scaler: The fp16 grad scaler's ``state_dict()``, if any.
        rng: Generator states to continue from.
        position: Chunks and optimizer steps done.
        history: Per-chunk metrics, one dict per chunk trained.
        dropout_rng: The shared passes' adapter-dropout stream (key and passes taken), if any.
        sample_rng: The generator state of the trial's sampling of completions (GRPO), if any.
    """

    trial_number: int
    kind: str
    weights: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    scheduler_steps: int
    scaler: dict[str, Any] | None
    rng: RngState
    position: Position
    history: list[dict[str, float]] = field(default_factory=list)
    dropout_rng: torch.Tensor | None = None
    sample_rng: torch.Tensor | None = None
    _blobs: dict[str, memoryview] = field(default_factory=dict, init=False, repr=False, compare=False)
    _blob_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)

    @classmethod
    def capture(
        cls,
        trial_number: int,
        kind: str,
        state: SwapState,
        weights: dict[str, torch.Tensor],
        history: list[dict[str, float]],
    ) -> TrialSnapshot:
        """Copy ``state`` (and the adapter ``weights``) to the CPU."""
        return cls.capture_together([(trial_number, kind, state, weights, history)])[0]

    @classmethod
    def capture_together(
        cls, trials: Sequence[tuple[int, str, SwapState, dict[str, torch.Tensor], list[dict[str, float]]]]
    ) -> list[TrialSnapshot]:
        """:meth:`capture` of each of ``trials`` (trial number, kind, state, adapter weights, history), their copies
        apart from each other's but read from the device with one wait for it (:func:`copied_to_cpu_apart`): a gang's
        members at the end of their chunk, before any of their drivers runs (their checkpoints take Python's global
        lock, which every one of these copies' operators would wait for)."""
        copied = _to_cpu_apart([[weights, state.optimizer.state_dict()] for _, _, state, weights, _ in trials])
        return [
            cls(
                trial_number=trial_number,
                kind=kind,
                weights=on_cpu,
                optimizer=optimizer,
                scheduler_steps=state.position.optimizer_steps,
                scaler=None if state.scaler is None else dict(state.scaler.state_dict()),
                rng=RngState(
                    cpu=state.rng.cpu.clone(),
                    device=None if state.rng.device is None else state.rng.device.clone(),
                    python=state.rng.python,
                    numpy=state.rng.numpy,
                ),
                position=Position(state.position.chunks_done, state.position.optimizer_steps),
                history=[dict(h) for h in history],
                dropout_rng=None if state.dropout_rng is None else state.dropout_rng.clone(),
                sample_rng=None if state.sample_rng is None else state.sample_rng.clone(),
            )
            for (trial_number, kind, state, _, history), (on_cpu, optimizer) in zip(trials, copied, strict=True)
        ]

    def compatible_with(self, kind: str, shapes: dict[str, torch.Size]) -> str | None:
        """Why a trial of ``kind`` with adapter weight ``shapes`` cannot continue from here (or None)."""
        if kind != self.kind:
            return f"trainer kind {kind!r} differs from the parent's {self.kind!r}"
        mine = {k: tuple(v.shape) for k, v in self.weights.items()}
        theirs = {k: tuple(v) for k, v in shapes.items()}
        if mine != theirs:
            changed = sorted(set(mine) ^ set(theirs)) or sorted(k for k in mine if mine[k] != theirs.get(k))
            return f"the adapter's weights differ from the parent's (rank or target modules), e.g. {changed[0]}"
        return None

    # -- bytes and files ---------------------------------------------------------------------------

    def to_bytes(self, study_name: str = "") -> bytes:
        """One safetensors blob: the tensors, with everything else as JSON in its header's metadata."""
        return bytes(safetensors_blob(*self._parts(study_name)))

    def blob(self, study_name: str = "") -> memoryview:
        """:meth:`to_bytes`'s blob as a read-only view, made once per study name and kept (the snapshot is not to
        change afterwards): a trial's chunk state goes to its checkpoint and to its snapshot file, from two threads.

        Serialising takes a few operators, which run without Python's global lock (:func:`safetensors_blob`), while the
        device's thread trains on: beside a thread that serialises a 1B trial's state (41 MB, 513 tensors) without
        pause, a thread of small torch operators ran 2.0-2.8x slower with safetensors' writer and 1.1-1.2x with this one
        (``python -m benchmarks.snapshot_gil``, a 2-core CPU).
        """
        with self._blob_lock:
            found = self._blobs.get(study_name)
            if found is None:
                found = self._blobs[study_name] = safetensors_blob(*self._parts(study_name))
            return found

    def blob_size(self, study_name: str = "") -> int:
        """The bytes of :meth:`blob` (without making it, unless it is made already)."""
        with self._blob_lock:
            found = self._blobs.get(study_name)
        return found.nbytes if found is not None else blob_size(*self._parts(study_name))

    def _parts(self, study_name: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """The blob's tensors by name and its header's metadata."""
        tensors = {f"weights/{k}": v for k, v in self.weights.items()}
        optimizer_meta: dict[str, Any] = {"param_groups": self.optimizer["param_groups"], "state": {}}
        for index, entries in self.optimizer["state"].items():
            meta: dict[str, Any] = {}
            for name, value in entries.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"optimizer/{index}/{name}"] = value
                else:
                    meta[name] = value
            optimizer_meta["state"][str(index)] = meta
        tensors["rng/cpu"] = self.rng.cpu
        if self.rng.device is not None:
            tensors["rng/device"] = self.rng.device
        if self.dropout_rng is not None:
            tensors["rng/dropout"] = self.dropout_rng
        if self.sample_rng is not None:
            tensors["rng/sample"] = self.sample_rng
        meta_json = {
            "format": _FORMAT,
            "study_name": study_name,
            "trial_number": self.trial_number,
            "kind": self.kind,
            "optimizer": optimizer_meta,
            "scheduler_steps": self.scheduler_steps,
            "scaler": self.scaler,
            "rng_python": [self.rng.python[0], list(self.rng.python[1]), self.rng.python[2]],
            "rng_numpy": _numpy_state_to_json(self.rng.numpy),
            "position": {"chunks_done": self.position.chunks_done, "optimizer_steps": self.position.optimizer_steps},
            "history": self.history,
        }
        return tensors, {"rapidfire": json.dumps(meta_json)}

    @classmethod
    def from_bytes(cls, blob: bytes, *, source: str = "snapshot") -> tuple[TrialSnapshot, str]:
        """Read :meth:`to_bytes` output (safetensors and JSON only: nothing is unpickled).

        Returns:
            The snapshot and the study name it was taken in.

        Raises:
            ValueError: If ``blob`` is not a snapshot of this format (truncated, corrupted, foreign).
        """
        try:
            header_size = int.from_bytes(blob[:8], "little")
            header = json.loads(blob[8 : 8 + header_size])
            meta = json.loads(header["__metadata__"]["rapidfire"])
            tensors = load(blob)
        except Exception as error:  # any damage to the blob: say so, never half-load
            raise ValueError(f"{source} is not a readable trial snapshot ({type(error).__name__}: {error}).") from None
        if meta.get("format") != _FORMAT:
            raise ValueError(f"{source} holds a snapshot of an unknown format ({meta.get('format')!r}).")
        weights = {k.removeprefix("weights/"): v for k, v in tensors.items() if k.startswith("weights/")}
        state: dict[int, dict[str, Any]] = {}
        for index, entries in meta["optimizer"]["state"].items():
            state[int(index)] = dict(entries)
        for key, value in tensors.items():
            if key.startswith("optimizer/"):
                _, index, name = key.split("/", 2)
                state.setdefault(int(index), {})[name] = value
        python = meta["rng_python"]
        snapshot = cls(
            trial_number=meta["trial_number"],
            kind=meta["kind"],
            weights=weights,
            optimizer={"state": state, "param_groups": meta["optimizer"]["param_groups"]},
            scheduler_steps=meta["scheduler_steps"],
            scaler=meta["scaler"],
            rng=RngState(
                cpu=tensors["rng/cpu"],
                device=tensors.get("rng/device"),
                python=(python[0], tuple(python[1]), python[2]),
                numpy=_numpy_state_from_json(meta["rng_numpy"]),
            ),
            position=Position(**meta["position"]),
            history=meta["history"],
            dropout_rng=tensors.get("rng/dropout"),
            sample_rng=tensors.get("rng/sample"),
        )
        return snapshot, str(meta.get("study_name", ""))

    def save(self, directory: str, study_name: str = "") -> None:
        """Write the snapshot to ``directory/snapshot.safetensors`` atomically (old one or new one, never half).

        A snapshot kept unserialised (a chunk state in this process's memory) is not made to keep its blob too.
        """
        os.makedirs(directory, exist_ok=True)
        with self._blob_lock:  # the checkpoint's blob when it has one; else one made for the file alone, not kept
            blob = self._blobs.get(study_name)
        if blob is None:
            blob = safetensors_blob(*self._parts(study_name))
        handle, staging = tempfile.mkstemp(prefix=".snapshot-", dir=directory)
        try:
            with os.fdopen(handle, "wb") as out:
                out.write(blob)
                out.flush()
                os.fsync(out.fileno())
            os.replace(staging, os.path.join(directory, _FILE))
        finally:
            if os.path.exists(staging):
                os.remove(staging)

    @classmethod
    def load(cls, directory: str) -> TrialSnapshot:
        """Read a snapshot written by :meth:`save`."""
        path = os.path.join(directory, _FILE)
        with open(path, "rb") as source:
            return cls.from_bytes(source.read(), source=path)[0]

    @staticmethod
    def exists(directory: str) -> bool:
        return os.path.isfile(os.path.join(directory, _FILE))


def _to_cpu(value: Any) -> Any:
    """``value`` (tensors in dicts and lists) with every tensor copied to the CPU (:func:`copied_to_cpu`). The
    device's tensors travel in a few bulk copies (one per dtype, up to :data:`_BULK_BYTES` each) instead of one
    synchronous copy per tensor (a trial's LoRA weights and optimizer moments are hundreds of small tensors:
    about 90 ms a snapshot one by one on an H200 host)."""
    return _to_cpu_apart([value])[0]


def _to_cpu_apart(values: list[Any]) -> list[Any]:
    """:func:`_to_cpu` of each of ``values``, their copies apart from each other's (:func:`copied_to_cpu_apart`)."""
    found: list[list[torch.Tensor]] = [[] for _ in values]
    for value, tensors in zip(values, found, strict=True):
        _mapped(value, tensors.append)
    return [
        _mapped(value, functools.partial(_next_of, iter(copies)))
        for value, copies in zip(values, copied_to_cpu_apart(found), strict=True)
    ]


def _next_of(copies: Iterator[torch.Tensor], _: torch.Tensor) -> torch.Tensor:
    return next(copies)


def _mapped(value: Any, change: Callable[[torch.Tensor], Any]) -> Any:
    """``value`` with ``change(tensor)`` in place of each tensor in its dicts and lists, in their order."""
    if isinstance(value, torch.Tensor):
        return change(value)
    if isinstance(value, dict):
        return {k: _mapped(v, change) for k, v in value.items()}
    if isinstance(value, list):
        return [_mapped(v, change) for v in value]
    return value


_BULK_BYTES = 256 * 2**20
"""The most bytes one bulk copy to the CPU gathers on the device (its transient copy there)."""
_STAGED_BYTES = 4 * _BULK_BYTES
"""The most bytes of bulk copies :func:`copied_to_cpu_apart` has in flight (on the device and page-locked on the
host) before it waits for them."""


def copied_to_cpu(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """A CPU copy of each of ``tensors``: detached, contiguous unless sparse, and apart from its source (a change to
    one never shows in the other). The copies of one bulk run are views of one buffer of their own (pickling one
    alone writes the whole buffer; ``torch.save`` of them all writes it once), gathered and cut by one operator each
    whatever the number of tensors: a device's thread that copied each tensor out by an operator of its own waited
    for Python's global lock at each of them while another thread ran Python code (a 1B trial's state, 513 tensors,
    beside such a thread: 4.9 s against 0.10 s on a 2-core CPU, ``python -m benchmarks.snapshot_gil``)."""
    return copied_to_cpu_apart([tensors])[0]


def copied_to_cpu_apart(groups: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
    """:func:`copied_to_cpu` of each group of tensors, no copy of one group sharing memory with another group's, but
    the bulk copies of every group read from the devices before one wait for them (up to :data:`_STAGED_BYTES` in
    flight): a gang's members' states, 8 x 41 MB for 1B trials, each copied with a wait of its own paid that wait
    8 times and let the members' drivers take Python's global lock in between."""
    out: list[list[torch.Tensor | None]] = [[None] * len(tensors) for tensors in groups]
    staged: list[_Staged] = []
    in_flight = 0
    for tensors, copies in zip(groups, out, strict=True):
        for run in _bulk_runs(tensors, copies):
            chosen = [tensors[i] for i in run]
            if len(run) == 1:  # flattening one tensor gives a view of it, not a copy
                copies[run[0]] = _one_to_cpu(chosen[0])
                continue
            if in_flight and in_flight + sum(t.nbytes for t in chosen) > _STAGED_BYTES:
                _cut(staged)
                in_flight = 0
            with torch.no_grad():
                host, device = _stage(_compat.flatten_dense_tensors(chosen))
            staged.append((copies, run, chosen, host, device))
            in_flight += host.nbytes
    _cut(staged)
    return [cast("list[torch.Tensor]", copies) for copies in out]


def _bulk_runs(tensors: list[torch.Tensor], copies: list[torch.Tensor | None]) -> list[list[int]]:
    """The indices of ``tensors`` gathered per (device, dtype), up to :data:`_BULK_BYTES` a run; a tensor with
    nothing to gather (or too large to gather on the device) is copied into ``copies`` here."""
    batches: dict[tuple[torch.device, torch.dtype], list[list[int]]] = {}
    filled: dict[tuple[torch.device, torch.dtype], int] = {}  # bytes in each key's last run
    for i, tensor in enumerate(tensors):
        if tensor.layout != torch.strided or tensor.numel() == 0 or tensor.nbytes > _BULK_BYTES:
            copies[i] = _one_to_cpu(tensor)
            continue
        key = (tensor.device, tensor.dtype)
        runs = batches.setdefault(key, [[]])
        if runs[-1] and filled[key] + tensor.nbytes > _BULK_BYTES:
            runs.append([])
            filled[key] = 0
        runs[-1].append(i)
        filled[key] = filled.get(key, 0) + tensor.nbytes
    return [run for runs in batches.values() for run in runs]


_Staged = tuple[list[torch.Tensor | None], list[int], list[torch.Tensor], torch.Tensor, torch.device | None]
"""A bulk run on its way to the CPU: its copies' slots, their indices, their sources, the host buffer and the device
whose stream is still copying into it (``None``: the buffer is the run's copy already)."""


def _stage(flat: torch.Tensor) -> tuple[torch.Tensor, torch.device | None]:
    """Start copying ``flat`` (a tensor made for this copy) to the CPU: from a GPU, into a page-locked buffer, read
    once the device's stream got there (:func:`_cut`); a copy into pageable memory goes through the driver's staging
    buffers at a fraction of the bus's pace (35 ms against 2 ms for a 1B trial's 41 MB of LoRA weights and moments on
    an H200 host). The buffer comes from torch's cache of page-locked memory and is only read (copied out by one
    operator), so later copies reuse it. On the CPU, ``flat`` itself, in memory of its own."""
    if flat.device.type != "cuda":
        return flat, None
    try:
        host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
    except RuntimeError:  # no page-locked memory to be had (a locked-memory limit): the driver's staging
        return flat.cpu(), None
    host.copy_(flat, non_blocking=True)
    return host, flat.device


def _cut(staged: list[_Staged]) -> None:
    """Wait for the staged copies' devices once, then give each run's copies memory of their own (out of the
    page-locked buffers) and cut them into their tensors; ``staged`` is emptied."""
    for waited in {device for *_, device in staged if device is not None}:
        torch.cuda.current_stream(waited).synchronize()
    for copies, run, chosen, host, device in staged:
        flat = host if device is None else host.clone()
        # Cut with grad mode as the caller has it: views made under no_grad refuse in-place changes under grad.
        for i, copy in zip(run, _compat.unflatten_dense_tensors(flat, chosen), strict=True):
            copies[i] = copy
    staged.clear()


def _one_to_cpu(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU copy of ``tensor`` (contiguous where the layout is strided)."""
    if tensor.layout != torch.strided:
        return tensor.detach().to("cpu", copy=True)
    return torch.empty(tensor.shape, dtype=tensor.dtype).copy_(tensor.detach())


# safetensors' names of the dtypes a snapshot holds (others go through safetensors' own writer).
_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def safetensors_blob(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> memoryview:
    """``tensors`` and ``metadata`` in the safetensors format, as ``safetensors.torch.load`` reads it: the header's
    length, the JSON header padded to 8 bytes, then the tensors' bytes, by dtype (larger items first) and name (the
    same tensors as ``safetensors.torch.save`` writes, not always in its order).

    The bytes are gathered by two operators per dtype (the buffer's region cut into views shaped like the tensors,
    one copy into them all) whatever the number of tensors, each byte copied once: each runs outside Python's
    global lock, which another thread (the device's, training meanwhile) takes back at every operator it runs.
    Tensors of other dtypes or layouts, or a big-endian machine, take safetensors' own writer.
    """
    if sys.byteorder != "little" or any(
        t.dtype not in _DTYPES or t.layout != torch.strided or t.device.type != "cpu" or t.is_neg()
        for t in tensors.values()
    ):
        # safetensors' writer takes no two tensors of one storage (copies of one bulk run share theirs)
        alone = {
            k: v.clone(memory_format=torch.contiguous_format) if v.layout == torch.strided else v
            for k, v in tensors.items()
        }
        return memoryview(save(alone, metadata=metadata)).toreadonly()
    text, groups, dtypes, offset = _layout(tensors, metadata)
    start = 8 + len(text)
    buffer = torch.empty(start + offset, dtype=torch.uint8)
    buffer[:start] = torch.frombuffer(bytearray(len(text).to_bytes(8, "little") + text), dtype=torch.uint8)
    with torch.no_grad():
        for dtype in dtypes:  # larger items first: each dtype's region starts aligned to its item size
            chosen = [tensors[name] for name in groups[dtype]]
            size = sum(t.nbytes for t in chosen)
            if size:
                region = buffer[start : start + size].view(dtype)
                torch._foreach_copy_(_compat.unflatten_dense_tensors(region, chosen), chosen)
            start += size
    return buffer.numpy().data.toreadonly()


def blob_size(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> int:
    """The bytes of :func:`safetensors_blob`'s blob of ``tensors`` and ``metadata``, without making it."""
    text, _, _, data = _layout(tensors, metadata)
    return 8 + len(text) + data


def _layout(
    tensors: dict[str, torch.Tensor], metadata: dict[str, str]
) -> tuple[bytes, dict[torch.dtype, list[str]], list[torch.dtype], int]:
    """The blob's JSON header (padded to 8 bytes with its length), the tensors' names by dtype, the dtypes in the
    order their regions come, and the bytes of the tensors."""
    groups: dict[torch.dtype, list[str]] = {}
    for name in sorted(tensors):
        groups.setdefault(tensors[name].dtype, []).append(name)
    dtypes = sorted(groups, key=lambda dtype: (-dtype.itemsize, _DTYPES.get(dtype, str(dtype))))
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for dtype in dtypes:
        for name in groups[dtype]:
            tensor, end = tensors[name], offset + tensors[name].nbytes
            header[name] = {
                "dtype": _DTYPES.get(dtype, str(dtype)),
                "shape": list(tensor.shape),
                "data_offsets": [offset, end],
            }
            offset = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    return text, groups, dtypes, offset


def _numpy_state_to_json(state: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(state, default=lambda v: {"__ndarray__": v.tolist(), "dtype": str(v.dtype)}))


def _numpy_state_from_json(state: Any) -> Any:
    if isinstance(state, dict):
        if "__ndarray__" in state:
            return np.asarray(state["__ndarray__"], dtype=state["dtype"])
        return {k: _numpy_state_from_json(v) for k, v in state.items()}
    return state
