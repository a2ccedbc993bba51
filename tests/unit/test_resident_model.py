"""The resident model's adapters: a trial's adapter is built with the other adapters hidden from PEFT's and the
trainer's walks (``ResidentModel.alone``), and nothing about the model may differ from PEFT's own result."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest
import torch
from peft import LoraConfig, PeftModel

from optuna_rapidfire._engines._trials import _Writes
from optuna_rapidfire._resident._model import ResidentModel, load_model

CPU = torch.device("cpu")
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL_LINEAR = [*ATTENTION, "gate_proj", "up_proj", "down_proj"]
# Mixed ranks and targets, as a search makes them; the later all-linear ones wrap modules the first did not.
CONFIGS = [
    LoraConfig(r=4, lora_alpha=8, lora_dropout=0.05, target_modules=ATTENTION, task_type="CAUSAL_LM"),
    LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=ALL_LINEAR, task_type="CAUSAL_LM"),
    LoraConfig(r=2, lora_alpha=4, lora_dropout=0.1, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    LoraConfig(r=16, lora_alpha=16, lora_dropout=0.05, target_modules=ALL_LINEAR, task_type="CAUSAL_LM"),
]


def _resident(tiny_model: str, dtype: torch.dtype = torch.float32) -> ResidentModel:
    model, tokenizer = load_model(tiny_model, tokenizer=None, model_kwargs={})
    return ResidentModel(model.to(dtype), tokenizer, CPU)


def _lora_layout(module: torch.nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    """Every module's and parameter's name, in the order the model's walks visit them, with shapes."""
    modules = [(name, ()) for name, _ in module.named_modules()]
    return modules + [(name, tuple(p.shape)) for name, p in module.named_parameters()]


# All-linear targets (which PEFT's injection lists in the config it stores), rsLoRA and dropout changing between them.
ALL_LINEAR_CONFIGS = [
    LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"),
    LoraConfig(r=8, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM", use_rslora=True),
    LoraConfig(r=2, lora_alpha=4, lora_dropout=0.1, target_modules="all-linear", task_type="CAUSAL_LM"),
]


@pytest.mark.parametrize(
    ("configs", "searched_for", "dtype"),
    [
        (CONFIGS, ["trial_1", "trial_2"], torch.float32),
        (ALL_LINEAR_CONFIGS, ["trial_1"], torch.float32),
        (CONFIGS, ["trial_1", "trial_2"], torch.bfloat16),
    ],
    ids=["mixed-targets", "all-linear", "mixed-targets-bf16"],
)
def test_adapters_built_among_others_are_what_peft_builds_with_every_adapter_in_view(
    tiny_model: str,
    monkeypatch: pytest.MonkeyPatch,
    configs: list[LoraConfig],
    searched_for: list[str],
    dtype: torch.dtype,
) -> None:
    """An adapter whose config differs from one PEFT's add_adapter injected before only in rank, alpha, rsLoRA or
    dropout skips PEFT's search of the model; whichever way, the model and its stored configs are PEFT's own (on a
    bf16 base too, whose adapters' weights PEFT's cast makes float32)."""
    ours = _resident(tiny_model, dtype)
    searched: list[str] = []  # the adapters PEFT's own add_adapter injected (searching the model for their targets)
    peft_add = PeftModel.add_adapter

    def add(self: PeftModel, name: str, *args: Any, **kwargs: Any) -> None:
        searched.append(name)
        peft_add(self, name, *args, **kwargs)

    monkeypatch.setattr(PeftModel, "add_adapter", add)
    for index, config in enumerate(configs):
        ours.add_adapter(f"trial_{index}", config, seed=100 + index)
    monkeypatch.undo()
    # The last config targets what the second did (rank, alpha and dropout aside): PEFT's search is skipped for it.
    assert searched == searched_for
    # PEFT's own add_adapter with every adapter in view, the same seeds: the reference.
    reference = _resident(tiny_model, dtype)
    reference.add_adapter("trial_0", configs[0], seed=100)
    assert reference.peft is not None
    for index, config in enumerate(configs[1:], start=1):
        with torch.random.fork_rng():
            torch.manual_seed(100 + index)
            reference.peft.add_adapter(f"trial_{index}", config)
    assert ours.peft is not None
    assert _lora_layout(ours.peft) == _lora_layout(reference.peft)  # same modules, same order
    theirs = dict(reference.peft.named_parameters())
    for name, param in ours.peft.named_parameters():
        assert param.dtype == theirs[name].dtype, name
        assert torch.equal(param, theirs[name]), name
    if dtype != torch.float32:
        assert all(p.dtype == torch.float32 for name, p in ours.peft.named_parameters() if "lora_" in name)
    assert {n: c.to_dict() for n, c in ours.peft.peft_config.items()} == {
        n: c.to_dict() for n, c in reference.peft.peft_config.items()
    }
    assert ours.peft.base_model.targeted_module_names == reference.peft.base_model.targeted_module_names
    # Only the adapter added last is trainable; its weights are the ones adapter_params returns.
    last = f"trial_{len(configs) - 1}"
    trainable = [name for name, p in ours.peft.named_parameters() if p.requires_grad]
    assert trainable and all(f".{last}." in name for name in trainable)
    assert {id(p) for p in ours.adapter_params(last)} == {
        id(p) for _, p in ours.peft.named_parameters() if p.requires_grad
    }
    # Each layer's active adapter is the new one, and a forward pass sees it.
    assert ours.peft.active_adapter == last


def test_adapters_deleted_among_others_leave_what_peft_leaves_with_every_adapter_in_view(tiny_model: str) -> None:
    """Deleting hides the other adapters from PEFT's walks: the model is left as PEFT's own deletion leaves it."""
    ours, reference = _resident(tiny_model), _resident(tiny_model)
    for resident in (ours, reference):
        for index, config in enumerate(CONFIGS):
            resident.add_adapter(f"trial_{index}", config, seed=100 + index)
    assert ours.peft is not None and reference.peft is not None
    for name in ("trial_1", "trial_3", "trial_0"):  # one in the middle, the active one, the first
        active = ours.peft.active_adapter
        ours.delete_adapter(name)
        if name == active:  # as ResidentModel does: PEFT is pointed at another adapter first
            reference._point_at(next(n for n in reference.peft.peft_config if n != name))
        reference.peft.delete_adapter(name)
        assert _lora_layout(ours.peft) == _lora_layout(reference.peft), name
        assert list(ours.peft.peft_config) == list(reference.peft.peft_config)
        theirs = dict(reference.peft.named_parameters())
        assert all(torch.equal(param, theirs[key]) for key, param in ours.peft.named_parameters())
    assert list(ours.peft.peft_config) == ["trial_2"] and ours.peft.active_adapter == "trial_2"


def test_an_adapter_added_after_a_gang_was_trainable_is_the_only_trainable_one(tiny_model: str) -> None:
    resident = _resident(tiny_model)
    for index, config in enumerate(CONFIGS[:3]):
        resident.add_adapter(f"trial_{index}", config, seed=index)
    resident.set_trainable(["trial_0", "trial_1", "trial_2"], True)  # a fused gang's pass
    resident.add_adapter("trial_9", CONFIGS[3], seed=9)
    assert resident.peft is not None
    trainable = {name for name, p in resident.peft.named_parameters() if p.requires_grad}
    assert trainable == {name for name in trainable if ".trial_9." in name} and trainable


def test_the_other_adapters_come_back_whole_when_a_build_fails_inside_alone(tiny_model: str) -> None:
    resident = _resident(tiny_model)
    for index, config in enumerate(CONFIGS[:3]):
        resident.add_adapter(f"trial_{index}", config, seed=index)
    assert resident.peft is not None
    before = _lora_layout(resident.peft)
    with pytest.raises(RuntimeError, match="a failing build"), resident.alone("trial_1"):
        seen = {name.split(".")[-1] for name, _ in resident.peft.named_modules() if ".lora_A." in name}
        assert seen == {"trial_1"}
        raise RuntimeError("a failing build")
    assert _lora_layout(resident.peft) == before
    # A config PEFT refuses (no module matches) leaves the model as it was.
    with pytest.raises(ValueError):
        resident.add_adapter("bad", LoraConfig(r=4, target_modules=["no_such_module"]), seed=0)
    assert _lora_layout(resident.peft) == before
    assert "bad" not in resident.peft.peft_config


def test_a_snapshot_write_runs_off_the_caller_and_a_reader_waits_for_it(caplog: pytest.LogCaptureFixture) -> None:
    writes = _Writes()
    release = threading.Event()
    written: list[str] = []

    def slow() -> None:
        release.wait(10)
        written.append("a")

    writes.submit("a", slow)  # returns at once: the write waits for the event
    assert written == []
    waiter = threading.Thread(target=writes.wait, args=("a",))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()  # the reader of "a" waits for its write
    writes.wait("b")  # nothing pending for another path
    release.set()
    waiter.join(10)
    assert written == ["a"] and not waiter.is_alive()

    def failing() -> Any:
        raise OSError("disk full")

    with caplog.at_level(logging.WARNING, logger="optuna_rapidfire"):
        writes.submit("c", failing)
        writes.wait()  # a failed write is waited for like any other, and logged
    assert any("Could not write c: disk full" in r.getMessage() for r in caplog.records)
    # Once every write is waited for, the writer thread ends (one per study's optimize, not one per executor).
    assert writes._pool is None
    writes.submit("d", lambda: written.append("d"))
    writes.wait()
    assert written == ["a", "d"]


def test_snapshot_writes_of_other_paths_go_on_beside_a_slow_one_and_one_paths_land_in_order() -> None:
    """A gang's members' files are written by several threads at once; a path written twice gets its second write
    after its first, however long the first takes."""
    writes = _Writes()
    release = threading.Event()
    landed: list[str] = []

    def slow_first() -> None:
        release.wait(10)
        landed.append("a1")

    writes.submit("a", slow_first)
    writes.submit("a", lambda: landed.append("a2"))
    writes.submit("b", lambda: landed.append("b"))
    writes.wait("b")  # another path's write is not held up by "a"'s
    assert landed == ["b"]
    release.set()
    writes.wait()
    assert landed == ["b", "a1", "a2"]


def _modes(module: torch.nn.Module) -> dict[str, bool]:
    return {name: m.training for name, m in module.named_modules()}


def test_train_and_eval_set_every_module_as_torch_does_also_after_an_adapter_is_added(tiny_model: str) -> None:
    resident = _resident(tiny_model)
    resident.add_adapter("trial_0", CONFIGS[0], seed=0)
    peft = resident.peft
    assert peft is not None and "train" in peft.__dict__  # the flat pass is installed
    for index, config in enumerate(CONFIGS[1:], start=1):
        peft.eval()
        assert not any(_modes(peft).values())
        resident.add_adapter(f"trial_{index}", config, seed=index)  # new modules (made in train mode)
        peft.eval()  # reaches the new modules too
        assert not any(_modes(peft).values())
        assert peft.train() is peft
        assert all(_modes(peft).values())
    # Inside alone(), only the modules in view change, as torch's recursion changes them.
    with resident.alone("trial_0"):
        peft.eval()
    hidden = [name for name, training in _modes(peft).items() if training]
    assert hidden and all(".trial_0" not in name for name in hidden)
    with pytest.raises(ValueError, match="boolean"):
        peft.train("no")  # type: ignore[arg-type]


def test_a_module_with_its_own_train_takes_torchs_recursion() -> None:
    from optuna_rapidfire._resident._walks import ModeSwitch

    calls: list[bool] = []

    class Counting(torch.nn.Linear):
        def train(self, mode: bool = True) -> Counting:
            calls.append(mode)
            return super().train(mode)

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(Counting(2, 2)))
    switch = ModeSwitch(model, lambda: 0, lambda: False)
    assert switch(False) is model
    assert calls == [False] and not any(m.training for m in model.modules())


def test_is_gradient_checkpointing_follows_the_resident_models_setting(tiny_model: str) -> None:
    resident = _resident(tiny_model)
    resident.add_adapter("trial_0", CONFIGS[1], seed=0)
    peft = resident.peft
    assert peft is not None

    def scanned() -> bool:
        return any(bool(getattr(m, "gradient_checkpointing", False)) for m in resident.base.modules())

    assert peft.is_gradient_checkpointing is False is scanned()
    resident.set_checkpointing(True, None)
    assert peft.is_gradient_checkpointing is True is scanned()
    resident.set_checkpointing(False, None)
    assert peft.is_gradient_checkpointing is False is scanned()


def _saved(directory: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    import json

    from safetensors.torch import load_file

    config = json.loads((directory / "adapter_config.json").read_text())
    return load_file(f"{directory}/adapter_model.safetensors"), config


def test_adapters_written_directly_are_what_peft_saves(tiny_model: str, tmp_path: Any) -> None:
    """After the first plain LoRA adapter (saved by PEFT, which shows that it adds nothing of the model's), plain
    adapters are written without PEFT's walks: the same tensor names and values and the same config file as
    ``save_pretrained``, in a folder as readable as one made with the process's umask; a DoRA adapter (PEFT adds
    its magnitudes) and a VeLoRA one (PEFT adds its buffers) are still saved by PEFT."""
    import os

    from peft import PeftModel
    from peft.tuners.lora.config import VeloraConfig
    from transformers import AutoModelForCausalLM

    ours = _resident(tiny_model)
    configs = [
        *CONFIGS[:3],
        LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=ATTENTION, task_type=None),
        LoraConfig(r=4, lora_alpha=8, target_modules=ATTENTION, task_type="CAUSAL_LM", velora_config=VeloraConfig()),
    ]
    for index, config in enumerate(configs):
        ours.add_adapter(f"trial_{index}", config, seed=100 + index)
    assert ours.peft is not None
    with torch.no_grad():  # B starts at zero: make every weight differ
        for name, param in ours.peft.named_parameters():
            if "lora_" in name:
                param.add_(torch.randn_like(param))
    assert ours._writer.direct is None
    for index in range(len(configs)):
        ours.save_adapter(f"trial_{index}", str(tmp_path / f"ours_{index}"))
        ours.peft.save_pretrained(str(tmp_path / "peft"), selected_adapters=[f"trial_{index}"])
        tensors, config = _saved(tmp_path / f"ours_{index}")
        reference, reference_config = _saved(tmp_path / "peft" / f"trial_{index}")
        assert tensors.keys() == reference.keys() and tensors, index
        assert all(torch.equal(tensors[key], reference[key]) for key in tensors), index
        assert config == reference_config, index
        assert sorted(p.name for p in (tmp_path / f"ours_{index}").iterdir()) == [
            "adapter_config.json",
            "adapter_model.safetensors",
        ]
    assert ours._writer.direct is True  # the adapters after the first were written directly
    assert "lora_magnitude_vector" in " ".join(_saved(tmp_path / "ours_3")[0])
    assert "velora" in " ".join(_saved(tmp_path / "ours_4")[0])
    os.makedirs(tmp_path / "umask")
    modes = {(tmp_path / folder).stat().st_mode & 0o777 for folder in ["umask", "ours_0", "ours_1", "ours_3"]}
    assert len(modes) == 1
    # A directly written adapter loads as PEFT's does.
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), str(tmp_path / "ours_1"))
    own = ours.adapter_weights("trial_1")
    for name, param in loaded.named_parameters():
        if "lora_" in name:
            assert torch.equal(param, own[name.replace(".default.", ".")]), name


def test_adapters_saved_together_are_copied_with_one_wait_and_are_what_peft_saves(
    tiny_model: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A gang's members finish together: their plain adapters' weights come off the device in one bulk copy (a DoRA
    one among them is still saved by PEFT), and each folder holds what ``save_pretrained`` writes."""
    from optuna_rapidfire._resident import _adapter_files

    ours = _resident(tiny_model)
    configs = [*CONFIGS[:3], LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=ATTENTION, task_type=None)]
    for index, config in enumerate(configs):
        ours.add_adapter(f"trial_{index}", config, seed=100 + index)
    assert ours.peft is not None
    with torch.no_grad():
        for name, param in ours.peft.named_parameters():
            if "lora_" in name:
                param.add_(torch.randn_like(param))
    ours.save_adapter("trial_0", str(tmp_path / "first"))  # PEFT's, which shows plain adapters may go direct
    groups: list[int] = []
    copy_apart = _adapter_files.copied_to_cpu_apart
    monkeypatch.setattr(
        _adapter_files, "copied_to_cpu_apart", lambda found: groups.append(len(found)) or copy_apart(found)
    )
    writes = ours.adapter_savers([(f"trial_{i}", str(tmp_path / f"ours_{i}")) for i in (1, 2, 3)])
    assert groups == [2]  # trial_1 and trial_2 in one copy; the DoRA adapter is PEFT's to save
    with torch.no_grad():  # the copies were made: what the model does next is not in the files
        for param in ours.adapter_params("trial_1"):
            param.zero_()
    for write in writes:
        write()
    for index in (1, 2, 3):
        tensors, config = _saved(tmp_path / f"ours_{index}")
        ours.peft.save_pretrained(str(tmp_path / "peft"), selected_adapters=[f"trial_{index}"])
        reference, reference_config = _saved(tmp_path / "peft" / f"trial_{index}")
        assert tensors.keys() == reference.keys() and config == reference_config, index
        if index != 1:  # trial_1's weights were zeroed after its copy: its file keeps the values it had
            assert all(torch.equal(tensors[key], reference[key]) for key in tensors), index
    assert all(torch.count_nonzero(t) for t in _saved(tmp_path / "ours_1")[0].values())


def test_adapters_off_computes_the_base_alone_as_peft_disable_adapter_does(tiny_model: str) -> None:
    """TRL's reference pass enters ``disable_adapter()``: ours turns every adapter layer off (PEFT's walks aside),
    computes what PEFT's own context computes, and turns them on again, after an error too."""
    ours = _resident(tiny_model)
    for index, config in enumerate(CONFIGS[:2]):
        ours.add_adapter(f"trial_{index}", config, seed=100 + index)
    assert ours.peft is not None
    with torch.no_grad():  # B starts at zero: give the adapter an effect to turn off
        for param in ours.adapter_params("trial_1"):
            param.add_(0.05)
    ours.activate("trial_1")
    ids = torch.arange(3, 19).view(2, 8)
    peft = ours.peft.eval()
    adapted = peft(input_ids=ids).logits
    assert ours.peft.disable_adapter == ours.adapters_off  # what TRL's reference pass enters
    with ours.adapters_off():
        assert ours.adapters_are_off()
        alone = peft(input_ids=ids).logits
    assert not ours.adapters_are_off()
    with type(peft).disable_adapter(peft):  # PEFT's own context, for the reference
        theirs = peft(input_ids=ids).logits
    assert torch.equal(alone, theirs) and torch.equal(peft(input_ids=ids).logits, adapted)
    assert not torch.allclose(alone, adapted)
    with pytest.raises(RuntimeError, match="inside"), ours.adapters_off():
        raise RuntimeError("inside")
    assert not ours.adapters_are_off() and torch.equal(peft(input_ids=ids).logits, adapted)
