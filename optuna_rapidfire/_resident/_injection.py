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
global generator in the same order), then PEFT's own dtype cast (over those modules only); its config is stored
completed as PEFT's injection completed the earlier one's (all-linear targets listed, default targets filled in).
What PEFT's injection does besides (the active adapter, ``requires_grad``) the resident model sets itself right
after, whichever way the adapter was made.
The parity test (``tests/unit/test_resident_model.py``) compares the model, its weights and its stored configs with
PEFT's own ``add_adapter``.

Configs with anything PEFT's search does more for (replicated layers, modules to save, trainable tokens, target
parameters, tied targets) or of another class than ``LoraConfig`` always take PEFT's own ``add_adapter``.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from optuna_rapidfire import _compat

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


@dataclass
class _Known:
    """What PEFT's injection did for an adapter of one signature: the fields of its config it completed (all-linear
    targets listed, default targets filled in), with their values, and the modules it wrapped, in the model's order,
    each as ``(name, parent, attribute)``."""

    completed: dict[str, Any]
    wrapped: list[tuple[str, torch.nn.Module, str]]


class Injections:
    """The modules each kind of adapter wrapped (by its config, less :data:`VARYING`), to add the next one of that
    kind without PEFT's search. One per resident model; used from its thread only. Learnt from adapters that
    ``PeftModel.add_adapter`` added (``get_peft_model`` also records the base model's path in the first config)."""

    def __init__(self) -> None:
        self._known: dict[str, _Known] = {}

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

    def add_adapter(self, peft: PeftModel, name: str, config: PeftConfig, signature: str | None) -> None:
        """``peft.add_adapter(name, config)``, without PEFT's search when an adapter of the same ``signature`` was
        added before (``config`` is stored as PEFT would store it). Call it where the model shows no other adapter
        (``ResidentModel.alone``)."""
        if signature is None:
            peft.add_adapter(name, config)
            return
        if self._add(peft, name, config, signature):
            return
        given = config.to_dict()
        peft.add_adapter(name, config)
        self._learn(peft, name, signature, given)

    def _learn(self, peft: PeftModel, name: str, signature: str, given: dict[str, Any]) -> None:
        """Record what PEFT's injection of adapter ``name`` did (``given``: its config's fields before), for the next
        adapter of its ``signature``: a walk of every module the model shows."""
        from peft.tuners.lora import LoraLayer

        tuner: Any = peft.base_model  # PEFT's LoraModel
        named = dict(tuner.model.named_modules())
        wrapped = []
        for key, module in named.items():
            if isinstance(module, LoraLayer) and any(
                name in getattr(module, attribute) for attribute in module.adapter_layer_names
            ):
                parent_key, _, attribute = key.rpartition(".")
                wrapped.append((key, named[parent_key], attribute))
        stored = peft.peft_config[name]
        completed = {
            field: copy.deepcopy(getattr(stored, field))
            for field, value in stored.to_dict().items()
            if field not in VARYING and given.get(field) != value and hasattr(stored, field)
        }
        if wrapped:
            self._known[signature] = _Known(completed, wrapped)

    def _add(self, peft: PeftModel, name: str, config: PeftConfig, signature: str) -> bool:
        """Add adapter ``name`` of ``config`` on the modules recorded for its signature, as PEFT's injection would;
        ``False`` (nothing done) when none are recorded."""
        known = self._known.get(signature)
        if known is None:
            return False
        for field, value in known.completed.items():  # as PEFT's injection completes the config it stores
            setattr(config, field, copy.deepcopy(value))
        peft.peft_config[name] = config
        try:
            _compat.inject_lora_on(peft, name, config, known.wrapped)
        except BaseException:
            peft.peft_config.pop(name, None)
            raise
        return True
