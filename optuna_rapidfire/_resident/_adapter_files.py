"""Writing a trial's adapter in PEFT's format (``adapter_config.json`` and ``adapter_model.safetensors``).

PEFT's ``PeftModel.save_pretrained`` walks the whole model (its ``state_dict``, then every module twice) and
renders a model card for each adapter: about 0.1 s a trial on the 1B shape, paid at every trial's end. A plain
LoRA adapter's file holds its parameters only, named as PEFT names them without the adapter's name, so
:class:`AdapterWriter` writes those directly, from the parameters listed once. Whether PEFT would add more
(the base's embedding layer, when the vocabulary was resized) depends on the model, not the adapter: the
first plain adapter of a model is saved by PEFT and its file's names compared with the parameters'; only
when they agree are the later ones written directly. Anything else (DoRA, biases, modules to save, trainable
tokens, targeted embeddings, other PEFT methods) is always saved by PEFT.
"""

from __future__ import annotations

import copy
import functools
import os
import shutil
import tempfile
from typing import TYPE_CHECKING, Any

from safetensors import safe_open

from optuna_rapidfire._resident._snapshot import copied_to_cpu_apart, safetensors_blob

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    from peft import PeftModel

WEIGHTS_FILE = "adapter_model.safetensors"
_EMBEDDINGS = ("embed_tokens", "lm_head")  # PEFT's EMBEDDING_LAYER_NAMES


_EXTRAS = (
    "use_dora",
    "modules_to_save",
    "trainable_token_indices",
    "target_parameters",
    "lora_bias",
    "velora_config",
    "monteclora_config",
    "kasa_config",
    "arrow_config",
    "use_bdlora",
    "use_qalora",
    "alora_invocation_tokens",
    "megatron_config",
    "layer_replication",
)
"""LoraConfig fields that add weights, buffers or saving rules of their own (set: saved by PEFT)."""


def plain_lora(config: Any) -> bool:
    """Whether ``config`` is a plain LoRA adapter: its saved file holds its own LoRA parameters only."""
    from peft import LoraConfig

    if type(config) is not LoraConfig or config.bias != "none":
        return False
    if any(getattr(config, field, None) for field in _EXTRAS):
        return False
    targets = config.target_modules
    names = [targets] if isinstance(targets, str) else list(targets or [])
    return not any(layer in target for target in names for layer in _EMBEDDINGS)


def _own_extras(layers: list[Any], name: str) -> bool:
    """Whether adapter ``name`` has a LoRA variant or buffers of its own in any of the adapter ``layers``
    (what a newer PEFT may add without a config field listed here): PEFT saves those, not the direct writer."""
    marker = f".{name}."
    for layer in layers:
        if name in getattr(layer, "lora_variant", {}):
            return True
        if any(marker in f".{buffer}." for buffer, _ in layer.named_buffers()):
            return True
    return False


class AdapterWriter:
    """Writes adapters of one ``PeftModel`` into folders in PEFT's format (see the module's text)."""

    def __init__(self) -> None:
        self.direct: bool | None = None  # whether plain adapters are written directly (None: not known yet)

    def savers(
        self, peft: PeftModel, adapters: list[tuple[str, dict[str, torch.Tensor], str]], layers: list[Any]
    ) -> list[Callable[[], None]]:
        """Start saving each ``(name, params, directory)`` adapter (``params``: its parameters, keyed with the adapter's
        name removed, as :meth:`~optuna_rapidfire._resident._model.ResidentModel.adapter_weights` gives them;
        ``layers``: the model's adapter layers): this call does what needs the model (copies the weights of the plain
        adapters written directly to the host, all together with one wait for the device, or has PEFT save the
        others), and each function returned (call it once, from any thread: it needs nothing of the model, which may
        go on training or drop the adapter meanwhile) writes the rest and puts the folder at its ``directory``,
        replacing any there. The files are written into a staging folder beside ``directory`` first, so that a reader
        never sees half an adapter."""
        staged = [_staging(directory) for _, _, directory in adapters]
        writes: dict[int, Callable[[], None]] = {}
        try:
            plain = [plain_lora(peft.peft_config[name]) and not _own_extras(layers, name) for name, _, _ in adapters]
            if self.direct is None and any(plain):  # PEFT saves the first: it shows whether the rest may go direct
                first = plain.index(True)
                writes[first] = self._by_peft(peft, adapters[first][0], adapters[first][1], staged[first][1], True)
            chosen = [i for i, p in enumerate(plain) if p and self.direct and i not in writes]
            copies = copied_to_cpu_apart([list(adapters[i][1].values()) for i in chosen])
            for i, tensors in zip(chosen, copies, strict=True):
                name, params, _ = adapters[i]
                saved, mapping = _saved_config(peft, peft.peft_config[name])
                tensors_by_name = dict(zip(params, tensors, strict=True))
                writes[i] = functools.partial(_write_direct, tensors_by_name, saved, mapping, staged[i][1])
            for i, (name, params, _) in enumerate(adapters):
                if i not in writes:
                    writes[i] = self._by_peft(peft, name, params, staged[i][1], plain[i])
        except BaseException:
            for staging, _ in staged:
                shutil.rmtree(staging, ignore_errors=True)
            raise
        return [
            functools.partial(_put_in_place, writes[i], written, directory, staging)
            for i, ((_, _, directory), (staging, written)) in enumerate(zip(adapters, staged, strict=True))
        ]

    def _by_peft(
        self, peft: PeftModel, name: str, params: dict[str, torch.Tensor], directory: str, plain: bool
    ) -> Callable[[], None]:
        """Have PEFT save adapter ``name`` into ``directory`` (a folder made here: it must not exist; its parent
        must); the function returned does nothing. The first ``plain`` adapter's file tells whether plain ones may be
        written directly (its names are the parameters' own)."""
        peft.__dict__["create_or_update_model_card"] = _no_card  # a README per adapter: not ours to write
        try:
            peft.save_pretrained(directory, selected_adapters=[name], safe_serialization=True)
        finally:
            peft.__dict__.pop("create_or_update_model_card", None)
        written = os.path.join(directory, name)  # PEFT writes a non-default adapter into a sub-folder
        if os.path.isdir(written):
            for entry in os.listdir(written):
                os.replace(os.path.join(written, entry), os.path.join(directory, entry))
            os.rmdir(written)
        if self.direct is None and plain:
            with safe_open(os.path.join(directory, WEIGHTS_FILE), framework="pt") as saved_file:
                self.direct = set(saved_file.keys()) == set(params)
        return _nothing


def _staging(directory: str) -> tuple[str, str]:
    """A staging folder beside ``directory`` and the path of the adapter's folder in it (made later, with the
    process's umask: mkdtemp's own is private to the user)."""
    parent = os.path.dirname(os.path.abspath(directory))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".adapter-", dir=parent)
    return staging, os.path.join(staging, "adapter")


def _saved_config(peft: PeftModel, config: Any) -> tuple[Any, dict[str, str] | None]:
    """``config`` as PEFT saves it (in inference mode, naming its base model) and the auto-mapping it writes."""
    config = copy.copy(config)
    if config.base_model_name_or_path is None:
        config.base_model_name_or_path = peft.base_model.model.__dict__.get("name_or_path", None) or None
    config.inference_mode = True
    mapping = None
    if config.task_type is None:
        base = type(peft.base_model.model)
        mapping = {"base_model_class": base.__name__, "parent_library": base.__module__}
    return config, mapping


def _write_direct(
    tensors: dict[str, torch.Tensor], config: Any, mapping: dict[str, str] | None, directory: str
) -> None:
    """PEFT's ``save_pretrained`` of a plain LoRA adapter (host copies of its weights, its config as saved), without
    its walks of the model."""
    os.makedirs(directory)
    with open(os.path.join(directory, WEIGHTS_FILE), "wb") as out:  # the writer snapshots use (see its text)
        out.write(safetensors_blob(tensors, {"format": "pt"}))
    config.save_pretrained(directory, auto_mapping_dict=mapping)


def _put_in_place(write: Callable[[], None], written: str, directory: str, staging: str) -> None:
    """Write the adapter's files into ``written`` (in ``staging``), then move that folder to ``directory``."""
    try:
        write()
        if os.path.isdir(directory):
            shutil.rmtree(directory)
        os.replace(written, directory)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _nothing() -> None:
    return None


def _no_card(*args: Any, **kwargs: Any) -> None:
    return None
