"""A trial's snapshot at a chunk boundary (``_resident/_snapshot.py``): a CPU copy that later training leaves
alone, bytes and files that give back exactly what a trial continues from, damage said plainly, and the
clones it can start. A small layer and AdamW stand in for an adapter and its optimizer."""

from __future__ import annotations

import json
import os
import random
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load, save

from optuna_rapidfire._engines._trials import DeviceTrials, _boundary, _kept
from optuna_rapidfire._resident import _snapshot as snapshot_module
from optuna_rapidfire._resident._snapshot import TrialSnapshot, safetensors_blob
from optuna_rapidfire._resident._state import Position, RngState, SwapState

CPU = torch.device("cpu")
SCALER = {"scale": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000, "_growth_tracker": 3}


def _train(layer: torch.nn.Linear, optimizer: torch.optim.Optimizer, steps: int) -> None:
    for step in range(steps):
        layer(torch.full((1, 3), 1.0 + step)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()


def _trial(steps: int = 2) -> tuple[SwapState, torch.nn.Linear]:
    """A trial after ``steps`` optimizer steps: its layer's weights are the adapter's."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=0.1, betas=(0.8, 0.9))
    _train(layer, optimizer, steps)
    state = SwapState(
        adapter_name="trial_3",
        params=list(layer.parameters()),
        optimizer=optimizer,
        lr_scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
        scaler=None,
        rng=RngState.seeded(11, CPU),
        position=Position(chunks_done=3, optimizer_steps=steps),
        dropout_rng=torch.tensor([5, 2]),
        sample_rng=torch.Generator().manual_seed(4).get_state(),
    )
    return state, layer


def _weights(layer: torch.nn.Linear) -> dict[str, torch.Tensor]:
    return {"q_proj.lora_A.weight": layer.weight.data, "q_proj.lora_B.weight": layer.bias.data}


def _snapshot(steps: int = 2) -> tuple[TrialSnapshot, SwapState, torch.nn.Linear]:
    state, layer = _trial(steps)
    snapshot = TrialSnapshot.capture(3, "sft", state, _weights(layer), [{"eval_loss": 1.5}, {"eval_loss": 1.25}])
    return snapshot, state, layer


def _continue(snapshot: TrialSnapshot, steps: int) -> torch.nn.Linear:
    """A fresh trial that continues from ``snapshot`` for ``steps`` more steps (as a clone would)."""
    layer = torch.nn.Linear(3, 2)
    with torch.no_grad():
        layer.weight.copy_(snapshot.weights["q_proj.lora_A.weight"])
        layer.bias.copy_(snapshot.weights["q_proj.lora_B.weight"])
    optimizer = torch.optim.AdamW(layer.parameters(), lr=0.5)
    optimizer.load_state_dict(snapshot.optimizer)
    _train(layer, optimizer, steps)
    return layer


def _draws() -> tuple[list[float], list[float], list[float]]:
    return torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)]


def _assert_same(loaded: TrialSnapshot, snapshot: TrialSnapshot) -> None:
    assert loaded.weights.keys() == snapshot.weights.keys()
    assert all(torch.equal(loaded.weights[k], v) for k, v in snapshot.weights.items())
    assert (loaded.trial_number, loaded.kind, loaded.history) == (
        snapshot.trial_number,
        snapshot.kind,
        snapshot.history,
    )
    assert (loaded.scheduler_steps, loaded.position, loaded.scaler) == (
        snapshot.scheduler_steps,
        snapshot.position,
        snapshot.scaler,
    )
    for mine, theirs in ((loaded.dropout_rng, snapshot.dropout_rng), (loaded.sample_rng, snapshot.sample_rng)):
        assert (mine is None and theirs is None) or (
            mine is not None and theirs is not None and torch.equal(mine, theirs)
        )


def test_a_snapshot_is_a_cpu_copy_that_later_training_leaves_alone() -> None:
    snapshot, state, layer = _snapshot()
    weights = {k: v.clone() for k, v in snapshot.weights.items()}
    moments = snapshot.optimizer["state"][0]["exp_avg"].clone()
    history = [{"eval_loss": 1.5}, {"eval_loss": 1.25}]
    _train(layer, state.optimizer, 2)  # the trial goes on
    state.position.chunks_done = 5
    assert all(torch.equal(snapshot.weights[k], v) for k, v in weights.items())
    assert not torch.equal(snapshot.weights["q_proj.lora_A.weight"], layer.weight.data)  # the trial did move
    assert torch.equal(snapshot.optimizer["state"][0]["exp_avg"], moments)
    assert snapshot.position == Position(chunks_done=3, optimizer_steps=2) and snapshot.scheduler_steps == 2
    assert snapshot.history == history


def test_a_trial_continued_from_a_snapshots_bytes_trains_exactly_as_the_trial_itself() -> None:
    snapshot, state, layer = _snapshot()
    loaded, study_name = TrialSnapshot.from_bytes(snapshot.to_bytes(study_name="gsm8k"))
    assert study_name == "gsm8k"
    _assert_same(loaded, snapshot)
    _train(layer, state.optimizer, 3)
    continued = _continue(loaded, 3)  # its own lr (0.5) is replaced by the snapshot's (0.1), as are AdamW's betas
    assert torch.equal(continued.weight, layer.weight) and torch.equal(continued.bias, layer.bias)


@pytest.fixture
def global_rng() -> Iterator[None]:
    """Leave the process's generators as they were (the test restores a trial's)."""
    saved = RngState.capture(CPU)
    yield
    saved.restore(CPU)


def test_the_random_generators_continue_where_the_snapshot_left_them(global_rng: None) -> None:
    snapshot, state, _ = _snapshot()
    loaded, _ = TrialSnapshot.from_bytes(snapshot.to_bytes())
    state.rng.restore(CPU)
    expected = _draws()
    loaded.rng.restore(CPU)
    assert _draws() == expected


def test_the_parts_a_trial_may_lack_come_back_as_none_and_a_scaler_as_it_was() -> None:
    snapshot, _, _ = _snapshot()
    snapshot.dropout_rng = snapshot.sample_rng = None
    loaded, study_name = TrialSnapshot.from_bytes(snapshot.to_bytes())
    assert loaded.dropout_rng is None and loaded.sample_rng is None and loaded.scaler is None
    assert loaded.rng.device is None and study_name == ""
    snapshot.scaler = dict(SCALER)
    assert TrialSnapshot.from_bytes(snapshot.to_bytes())[0].scaler == SCALER


def test_a_saved_snapshot_is_loaded_back_and_replaced_whole_by_the_next(tmp_path: Path) -> None:
    directory = str(tmp_path / "trial_3")
    assert not TrialSnapshot.exists(directory)
    first, _, _ = _snapshot(steps=1)
    first.save(directory)
    assert TrialSnapshot.exists(directory)
    _assert_same(TrialSnapshot.load(directory), first)
    later, _, _ = _snapshot(steps=3)
    later.save(directory)
    _assert_same(TrialSnapshot.load(directory), later)
    assert os.listdir(directory) == ["snapshot.safetensors"]  # no staging file left behind


def test_a_save_that_fails_midway_leaves_the_previous_snapshot_whole(tmp_path: Path) -> None:
    directory = str(tmp_path / "trial_3")
    good, _, _ = _snapshot()
    good.save(directory)
    bad, _, _ = _snapshot()
    bad.optimizer["state"][0]["note"] = object()  # nothing JSON can write: the blob fails after staging began
    with pytest.raises(TypeError):
        bad.save(directory)
    _assert_same(TrialSnapshot.load(directory), good)
    assert os.listdir(directory) == ["snapshot.safetensors"]


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda blob: blob[: len(blob) // 2], r"is not a readable trial snapshot"),  # truncated
        (lambda blob: b"\x00" * 16, r"is not a readable trial snapshot"),
        (lambda blob: save({"w": torch.zeros(1)}), r"is not a readable trial snapshot \(KeyError"),  # foreign
        (
            lambda blob: save({"w": torch.zeros(1)}, metadata={"rapidfire": json.dumps({"format": 1})}),
            r"holds a snapshot of an unknown format \(1\)",
        ),
    ],
)
def test_a_damaged_or_foreign_blob_is_refused_naming_its_source(damage: Callable[[bytes], bytes], message: str) -> None:
    blob = damage(_snapshot()[0].to_bytes())
    with pytest.raises(ValueError, match=r"^checkpoint 7 .*" + message):
        TrialSnapshot.from_bytes(blob, source="checkpoint 7")


def test_a_damaged_file_is_named_by_its_path(tmp_path: Path) -> None:
    directory = str(tmp_path / "trial_3")
    _snapshot()[0].save(directory)
    path = os.path.join(directory, "snapshot.safetensors")
    with open(path, "r+b") as file:
        file.truncate(100)
    with pytest.raises(ValueError, match=f"^{re.escape(path)} is not a readable trial snapshot"):
        TrialSnapshot.load(directory)


def test_only_a_trial_of_the_same_kind_and_adapter_shapes_can_continue_from_a_snapshot() -> None:
    snapshot = _snapshot()[0]
    shapes = {k: v.shape for k, v in snapshot.weights.items()}
    assert snapshot.compatible_with("sft", shapes) is None
    assert snapshot.compatible_with("dpo", shapes) == "trainer kind 'dpo' differs from the parent's 'sft'"
    other_rank = {**shapes, "q_proj.lora_B.weight": torch.Size([4])}
    assert snapshot.compatible_with("sft", other_rank) == (
        "the adapter's weights differ from the parent's (rank or target modules), e.g. q_proj.lora_B.weight"
    )
    other_modules = {"v_proj.lora_A.weight": shapes["q_proj.lora_A.weight"], "q_proj.lora_B.weight": torch.Size([2])}
    reason = snapshot.compatible_with("sft", other_modules)
    assert reason is not None and reason.endswith("e.g. q_proj.lora_A.weight")


def test_state_is_copied_in_bulk_apart_from_its_sources(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensors of any dtype and layout, in nested dicts and lists, copied in bulk runs (several per dtype here:
    a run holds at most 64 bytes; a larger tensor goes alone): each copy equals its source, is contiguous, shares
    no memory with any source and stays apart from it; both writers of the safetensors format take them (the
    copies of one run share one buffer, which safetensors' own writer refuses as it is)."""
    from optuna_rapidfire._resident import _snapshot

    monkeypatch.setattr(_snapshot, "_BULK_BYTES", 64)
    base = torch.arange(24, dtype=torch.float32).view(4, 6)
    state = {
        "state": {
            0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(3, 5), "exp_avg_sq": base.t()},  # a transposed view
            1: {"step": torch.tensor(4.0), "exp_avg": torch.randn(7).to(torch.bfloat16), "empty": torch.zeros(0, 2)},
        },
        "param_groups": [{"lr": 0.1, "params": [0, 1]}],
        "rng": [torch.randint(0, 255, (9,), dtype=torch.uint8), torch.tensor([5, 6], dtype=torch.int64)],
    }
    copied = _snapshot._to_cpu(state)
    sources = [*state["state"][0].values(), *state["state"][1].values(), *state["rng"]]
    copies = [*copied["state"][0].values(), *copied["state"][1].values(), *copied["rng"]]
    assert copied["param_groups"] == state["param_groups"]
    for source, copy in zip(sources, copies, strict=True):
        assert copy.dtype == source.dtype and copy.shape == source.shape and torch.equal(copy, source)
        assert copy.is_contiguous()
    source_memory = {source.untyped_storage().data_ptr() for source in sources if source.numel()}
    assert not source_memory & {copy.untyped_storage().data_ptr() for copy in copies if copy.numel()}
    shared = {copy.untyped_storage().data_ptr() for copy in copies if copy.numel()}
    assert len(shared) < len(copies) - 1  # some runs hold several copies: gathered, not copied one by one
    base.add_(1)  # the source changes; the copy does not
    assert torch.equal(copied["state"][0]["exp_avg_sq"], (base - 1).t())
    named = {f"t{i}": copy for i, copy in enumerate(copies)}
    odd = {"c64": torch.randn(2, dtype=torch.complex64)}  # takes safetensors' own writer for the whole blob
    for blob in (safetensors_blob(named, {}), safetensors_blob({**named, **odd}, {})):
        loaded = load(bytes(blob))
        assert all(torch.equal(loaded[name], copy) for name, copy in named.items())
    sparse = torch.eye(3).to_sparse()  # not gathered: copied as it is
    assert torch.equal(_snapshot._to_cpu({"s": sparse})["s"].to_dense(), torch.eye(3))


def test_groups_copied_together_stay_apart_from_each_other(monkeypatch: pytest.MonkeyPatch) -> None:
    """Groups of tensors copied together (a gang's members' states): each group's copies equal its sources, and no
    copy of one group shares memory with another group's (each member's checkpoint keeps its own memory); with
    little room for copies in flight, they are cut in several waits and still equal."""
    from optuna_rapidfire._resident import _snapshot

    groups = [[torch.randn(4, 3), torch.arange(5), torch.randn(2, 2).t(), torch.randn(6)] for _ in range(3)]
    for room in (_snapshot._STAGED_BYTES, 100):
        monkeypatch.setattr(_snapshot, "_STAGED_BYTES", room)
        copied = _snapshot.copied_to_cpu_apart(groups)
        for sources, copies in zip(groups, copied, strict=True):
            assert all(
                torch.equal(copy, source) and copy.is_contiguous() for copy, source in zip(copies, sources, strict=True)
            )
        memory = [{copy.untyped_storage().data_ptr() for copy in copies} for copies in copied]
        assert all(not memory[i] & memory[j] for i in range(3) for j in range(i + 1, 3))
        assert all(len(m) < 4 for m in memory)  # gathered in bulk within a group
        sources = {source.untyped_storage().data_ptr() for group in groups for source in group}
        assert not sources & set().union(*memory)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="copies from a GPU via page-locked memory (run on the H200)")
def test_bulk_copies_from_a_gpu_equal_their_sources_and_outlive_the_staging_buffer() -> None:
    """A GPU's tensors come to the CPU through a page-locked buffer that the next copy reuses: each copy equals its
    source (written just before, on the device's stream), and a later bulk copy leaves the earlier ones as they were."""
    from optuna_rapidfire._resident._snapshot import copied_to_cpu

    device = torch.device("cuda")
    first = [torch.randn(shape, device=device) for shape in [(16, 64), (64, 16), (3,), (5, 5)]]
    for tensor in first:
        tensor.mul_(2)  # queued on the stream before the copy
    copies = copied_to_cpu([*first, torch.tensor(7.0)])
    expected = [tensor.cpu() for tensor in first]
    second = copied_to_cpu([torch.full_like(tensor, -1.0) for tensor in first])
    assert all(copy.device.type == "cpu" and not copy.is_pinned() for copy in copies)
    assert all(torch.equal(copy, source) for copy, source in zip(copies, expected, strict=False))
    assert copies[-1].item() == 7.0 and all(torch.all(copy == -1) for copy in second)


def test_the_blob_holds_what_safetensors_writes_for_every_dtype_and_shape_without_its_writer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tensors = {
        "f32": torch.randn(3, 5),
        "f64": torch.randn(2, dtype=torch.float64),
        "scalar": torch.tensor(2.0),
        "i64": torch.arange(7),
        "i32": torch.arange(3, dtype=torch.int32),
        "i8": torch.arange(-2, 3, dtype=torch.int8),
        "empty": torch.zeros(0, 4),
        "strided": torch.randn(4, 6).t(),
        "bool": torch.tensor([True, False, True]),
        "bf16": torch.randn(3, dtype=torch.bfloat16),
        "f16": torch.randn(5, dtype=torch.float16),
        "u8": torch.arange(9, dtype=torch.uint8),
    }
    writes: list[int] = []

    def counted(found: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
        writes.append(len(found))
        return save(found, metadata=metadata)

    monkeypatch.setattr(snapshot_module, "save", counted)
    odd = {"c64": torch.randn(2, dtype=torch.complex64)}  # a dtype left to safetensors' own writer
    for chosen, expected_writes in ((tensors, []), ({**tensors, **odd}, [len(tensors) + 1])):
        writes.clear()
        blob = safetensors_blob(chosen, {"rapidfire": "{}"})
        assert writes == expected_writes and blob.readonly
        ours, theirs = load(bytes(blob)), load(save({k: v.contiguous() for k, v in chosen.items()}))
        assert ours.keys() == theirs.keys() == chosen.keys()
        for name, tensor in chosen.items():
            assert ours[name].dtype == tensor.dtype and torch.equal(ours[name], tensor), name


def test_a_snapshots_blob_is_made_once_whichever_threads_ask(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[str] = []
    serialized = snapshot_module.safetensors_blob

    def counted(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> memoryview:
        made.append(json.loads(metadata["rapidfire"])["study_name"])
        return serialized(tensors, metadata)

    monkeypatch.setattr(snapshot_module, "safetensors_blob", counted)
    snapshot, _, _ = _snapshot()
    barrier = threading.Barrier(4)
    blobs: list[memoryview] = []

    def ask() -> None:
        barrier.wait()
        blobs.append(snapshot.blob("s"))

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert made == ["s"] and all(blob is blobs[0] for blob in blobs)
    assert bytes(blobs[0]) == snapshot.to_bytes("s") != snapshot.to_bytes("t")  # to_bytes: made anew each time
    assert made == ["s", "s", "t"]
    loaded, study_name = TrialSnapshot.from_bytes(bytes(snapshot.blob("s")))
    assert study_name == "s"
    _assert_same(loaded, snapshot)


def test_a_kept_checkpoint_serves_the_trials_snapshot_file_only_while_the_trial_has_not_moved() -> None:
    snapshot, state, _ = _snapshot()
    runtime = SimpleNamespace(state=state, history=[{"eval_loss": 1.5}], kept_snapshot=None)
    assert _kept(runtime) is None
    runtime.kept_snapshot = (_boundary(runtime), snapshot)
    assert _kept(runtime) is snapshot
    for move in (
        lambda: setattr(state.position, "optimizer_steps", state.position.optimizer_steps + 1),
        lambda: setattr(state.position, "chunks_done", state.position.chunks_done + 1),
        lambda: runtime.history.append({"eval_loss": 1.0}),
    ):
        runtime.kept_snapshot = (_boundary(runtime), snapshot)
        move()
        assert _kept(runtime) is None


def test_a_trials_snapshot_file_is_handed_to_the_writers_once_per_point_it_stands_at(tmp_path: Path) -> None:
    """The last chunk's delivery hands the trial's state over, and its end asks again: one file write, unless the
    trial moved in between."""
    snapshot, state, _ = _snapshot()
    spec = SimpleNamespace(state_dir=str(tmp_path), number=3, study_name="s")
    runtime = SimpleNamespace(state=state, history=[{"eval_loss": 1.5}], kept_snapshot=None, saved_at=None, spec=spec)
    runtime.kept_snapshot = (_boundary(runtime), snapshot)
    writes: list[str] = []
    trials = SimpleNamespace(_writes=SimpleNamespace(submit=lambda path, write: writes.append(path)))
    DeviceTrials.save_snapshot(trials, runtime)  # type: ignore[arg-type]
    DeviceTrials.save_snapshot(trials, runtime)  # type: ignore[arg-type]
    assert writes == [str(tmp_path / "trial-3")]
    state.position.optimizer_steps += 1  # trained on: its state is another one (copied from the device here)
    trials.snapshots = lambda pairs: [snapshot for _ in pairs]
    DeviceTrials.save_snapshot(trials, runtime)  # type: ignore[arg-type]
    assert len(writes) == 2
