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
import os
from typing import TYPE_CHECKING, Any

from safetensors import safe_open

from optuna_rapidfire._resident._snapshot import copied_to_cpu, safetensors_blob

if TYPE_CHECKING:
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

    def write(
        self, peft: PeftModel, name: str, params: dict[str, torch.Tensor], layers: list[Any], directory: str
    ) -> None:
        """Write adapter ``name`` (its parameters ``params``, keyed with the adapter's name removed, as
        :meth:`~optuna_rapidfire._resident._model.ResidentModel.adapter_weights` gives them; ``layers``: the model's
        adapter layers) into ``directory``, a folder made here (it must not exist; its parent must)."""
        config = peft.peft_config[name]
        plain = plain_lora(config) and not _own_extras(layers, name)
        if self.direct and plain:
            os.makedirs(directory)
            self._direct(peft, config, params, directory)
            return
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
            with safe_open(os.path.join(directory, WEIGHTS_FILE), framework="pt") as saved:
                self.direct = set(saved.keys()) == set(params)

    @staticmethod
    def _direct(peft: PeftModel, config: Any, params: dict[str, torch.Tensor], directory: str) -> None:
        """PEFT's ``save_pretrained`` of a plain LoRA adapter, without its walks."""
        names = list(params)
        tensors = dict(zip(names, copied_to_cpu([params[key] for key in names]), strict=True))
        with open(os.path.join(directory, WEIGHTS_FILE), "wb") as out:  # the writer snapshots use (see its text)
            out.write(safetensors_blob(tensors, {"format": "pt"}))
        config = copy.copy(config)  # as PEFT saves it: in inference mode, naming its base model
        if config.base_model_name_or_path is None:
            config.base_model_name_or_path = peft.base_model.model.__dict__.get("name_or_path", None) or None
        config.inference_mode = True
        mapping = None
        if config.task_type is None:
            base = type(peft.base_model.model)
            mapping = {"base_model_class": base.__name__, "parent_library": base.__module__}
        config.save_pretrained(directory, auto_mapping_dict=mapping)


def _no_card(*args: Any, **kwargs: Any) -> None:
    return None
