"""An adapter added on the modules an earlier adapter of the same targets wraps: PEFT's own per-module step
(``_create_and_replace``) on the modules found then, without PEFT's search of the model.

``PeftModel.add_adapter`` searches the whole model for the modules an adapter targets: it lists every module,
checks each name against the targets and against the prefixes of every LoRA layer already there (names times
layers), then walks the model again to set the active adapter, to freeze what is not an adapter, to cast the new
weights and to check tied modules. On the 1B shape with one adapter in view that search costs about as much as
creating the adapter's weights (an H100 host: 231 ms a trial, 121 of them creating the weights). A search
proposes configs that differ in rank, alpha, dropout and rsLoRA far more often than in targets; an adapter whose
config differs from an earlier one's in those fields only wraps the same modules, in the same order, and each of
them gets what PEFT's injection gives it: the same call (``_create_and_replace``, which draws the weights from the
global generator in the same order), then PEFT's own dtype cast. What PEFT's injection does besides (the active
adapter, ``requires_grad``) the resident model sets itself right after, whichever way the adapter was made.

Configs with anything PEFT's search does more for (replicated layers, modules to save, trainable tokens, target
parameters, tied targets) or of another class than ``LoraConfig`` always take PEFT's own ``add_adapter``.
"""

from __future__ import annotations

import copy
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from peft import PeftConfig, PeftModel

VARYING = ("r", "lora_alpha", "lora_dropout", "use_rslora")
"""The config fields two adapters may differ in and still wrap the same modules the same way (``_create_and_replace``
reads them for each module)."""

_SEARCHED = (
    "layer_replication",
    "modules_to_save",
    "trainable_token_indices",
    "target_parameters",
    "ensure_weight_tying",
)
"""Config fields that make PEFT's injection do more than wrap the targeted modules: a config that sets one is
injected by PEFT itself."""


def _jsonable(value: Any) -> Any:
    return sorted(value, key=repr) if isinstance(value, (set, frozenset)) else repr(value)


class Injections:
    """The modules each kind of adapter wrapped (by its config, less :data:`VARYING`), to add the next one of that
    kind without PEFT's search. One per resident model; used from its thread only."""

    def __init__(self) -> None:
        # signature -> (the config PEFT stored for the adapter it found the modules for, [(name, parent, attribute)])
        self._known: dict[str, tuple[PeftConfig, list[tuple[str, torch.nn.Module, str]]]] = {}

    @staticmethod
    def signature(config: PeftConfig) -> str | None:
        """What decides which modules ``config``'s adapter wraps (its fields but :data:`VARYING`), as a string; ``None``
        when PEFT's own injection must add it."""
        from peft import LoraConfig

        if type(config) is not LoraConfig:
            return None
        fields = config.to_dict()
        if any(fields.get(name) for name in _SEARCHED):
            return None
        kept = {name: value for name, value in fields.items() if name not in VARYING}
        return json.dumps(kept, sort_keys=True, default=_jsonable)

    def learn(self, peft: PeftModel, name: str, signature: str | None) -> None:
        """Record the modules adapter ``name`` (just injected by PEFT, its config's :meth:`signature` given) wraps, in
        the model's order, for the next adapter of that signature. Call it where the model shows that adapter alone
        (``ResidentModel.alone``): a walk of every module."""
        from peft.tuners.lora import LoraLayer

        if signature is None or signature in self._known:
            return
        tuner: Any = peft.base_model  # PEFT's LoraModel (its private steps are what its injection calls)
        named = dict(tuner.model.named_modules())
        wrapped = []
        for key, module in named.items():
            if isinstance(module, LoraLayer) and any(
                name in getattr(module, attribute) for attribute in module.adapter_layer_names
            ):
                parent_key, _, attribute = key.rpartition(".")
                wrapped.append((key, named[parent_key], attribute))
        if wrapped:
            self._known[signature] = (peft.peft_config[name], wrapped)

    def add_adapter(self, peft: PeftModel, name: str, config: PeftConfig, signature: str | None) -> None:
        """``peft.add_adapter(name, config)``, without PEFT's search when an adapter of the same ``signature`` was
        added before. Call it where the model shows no other adapter (``ResidentModel.alone``)."""
        if not self._add(peft, name, config, signature):
            peft.add_adapter(name, config)
            self.learn(peft, name, signature)

    def _add(self, peft: PeftModel, name: str, config: PeftConfig, signature: str | None) -> bool:
        """Add adapter ``name`` of ``config`` on the modules recorded for its signature, as PEFT's injection would;
        ``False`` (nothing done) when none are recorded."""
        known = self._known.get(signature) if signature is not None else None
        if known is None:
            return False
        template, wrapped = known
        stored = copy.deepcopy(template)  # what PEFT stored for an adapter of the same targets, with this one's fields
        for field in VARYING:
            setattr(stored, field, getattr(config, field))
        tuner: Any = peft.base_model  # PEFT's LoraModel (its private steps are what its injection calls)
        peft.peft_config[name] = stored
        try:
            tuner._check_new_adapter_config(stored)
            for key, parent, attribute in wrapped:
                tuner._create_and_replace(stored, name, getattr(parent, attribute), attribute, parent, current_key=key)
            targeted = set(tuner.targeted_module_names)
            tuner.targeted_module_names.extend(key for key, _, _ in wrapped if key not in targeted)
            tuner._cast_adapter_dtype(adapter_name=name, autocast_adapter_dtype=True)
        except BaseException:
            peft.peft_config.pop(name, None)
            raise
        return True
