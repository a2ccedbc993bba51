"""Cheaper answers to two calls TRL makes on the resident model at every step.

With many adapters resident, the model holds thousands of modules (the 1B shape with 8 adapters: about
3,000), and two calls walk all of them each time:

- ``model.train()`` / ``model.eval()``: transformers' ``Trainer.training_step`` and TRL's evaluation call them
  at every step; torch recurses through the tree (about 10 ms a call). :class:`ModeSwitch` sets the same
  flags in one flat pass over the modules, listed once per adapter change.
- ``model.is_gradient_checkpointing``: TRL's GRPO step reads it around its no-grad passes, and transformers
  answers by scanning every module. The resident model is the one that turns checkpointing on and off, so
  :func:`publish_checkpointing` records the answer where the attribute is looked up (the PEFT tuner, which
  the ``PeftModel`` forwards unknown attributes to), each time it changes.

On the H200 (a GRPO study of 8 trials on the 1B shape) these two walks took about 2.2 s of the gang's 8 s of
host time outside the shared steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from transformers.modeling_utils import PreTrainedModel

if TYPE_CHECKING:
    from collections.abc import Callable

_PLAIN_TRAIN = (torch.nn.Module.train, PreTrainedModel.train)
"""``train()`` methods that only set ``training`` on the module and its children (transformers' adds a kernel
mode for models that use kernels, which :class:`ModeSwitch` leaves to transformers)."""

_CHECKPOINTING = ("is_gradient_checkpointing", "is_activation_checkpointing")


class ModeSwitch:
    """A ``PeftModel``'s ``train(mode)`` in one flat pass (see the module's docstring).

    ``version`` says when the module tree may have changed (the resident model's adapter count of changes);
    ``hidden`` whether part of the tree is hidden now (a trial's build): then, or when a module has a
    ``train()`` of its own, torch's recursion runs, as without this object.
    """

    def __init__(self, model: torch.nn.Module, version: Callable[[], int], hidden: Callable[[], bool]) -> None:
        self._model = model
        self._version = version
        self._hidden = hidden
        self._modules: tuple[int, list[torch.nn.Module] | None] | None = None

    def __call__(self, mode: bool = True) -> torch.nn.Module:
        if not isinstance(mode, bool):
            raise ValueError(f"training mode is expected to be boolean, got {mode!r}")
        modules = self._listed()
        if modules is None:
            return type(self._model).train(self._model, mode)
        for module in modules:
            module.__dict__["training"] = mode
        return self._model

    def _listed(self) -> list[torch.nn.Module] | None:
        if self._hidden():
            return None
        version = self._version()
        if self._modules is None or self._modules[0] != version:
            modules = list(self._model.modules())
            plain = all(
                type(module).train in _PLAIN_TRAIN and not getattr(module, "use_kernels", False) for module in modules
            )
            self._modules = (version, modules if plain else None)
        return self._modules[1]


def publish_checkpointing(peft: Any, base: PreTrainedModel) -> None:
    """Record on ``peft``'s tuner whether ``base`` checkpoints its activations now (one scan of its modules),
    so that reading ``peft.is_gradient_checkpointing`` does not scan them again (see the module's docstring)."""
    tuner = peft.base_model
    enabled = any(bool(getattr(module, "gradient_checkpointing", False)) for module in base.modules())
    for name in _CHECKPOINTING:
        tuner.__dict__[name] = enabled
