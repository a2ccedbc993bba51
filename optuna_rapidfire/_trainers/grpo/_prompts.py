"""Prompts tokenized once per device: a GRPO trial's prompts as TRL tokenizes them, kept for the other trials.

Every GRPO step and evaluation batch of a trial tokenizes its prompts in TRL (``_tokenize_prompts``: the chat
template rendered, then encoded), and every trial of a study trains on the same prompts and evaluates on the same
eval prompts. Here each trial's trainer looks its prompts up first, so a prompt is rendered and encoded once per
device and setting, whichever trial meets it first. A prompt's token ids do not depend on the other prompts of
its batch (TRL pads nothing there), so a batch takes the ids it finds and tokenizes only the prompts it does not.

A setting is what TRL's tokenization reads besides the prompt: the tokenizer (one per resident model), the chat
template TRL renders with and its keyword arguments. Trainers whose tokenization does more than render and encode
(tools, environments, images) tokenize as TRL does every time, as do prompts that are neither text nor messages
of JSON values.
"""

from __future__ import annotations

import json
import threading
import weakref
from typing import Any, cast

from optuna_rapidfire import _compat

LIMIT = 65_536
"""Token lists kept per tokenizer; the store is emptied when full (a study's prompts rarely come near)."""

_STORES: weakref.WeakKeyDictionary[Any, dict[tuple[str, tuple[str, str]], list[int]]] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def share_tokenized_prompts(trainer: Any) -> bool:
    """Make ``trainer`` (a ``GRPOTrainer``) look its prompts' token ids up among those its tokenizer produced for
    any trainer of the same setting before; ``False`` (nothing changed) where its tokenization does more than
    render and encode text, or where its TRL tokenizes elsewhere."""
    original = _compat.grpo_tokenization(trainer)
    if original is None:
        return False
    if getattr(trainer, "tools", None) or getattr(trainer, "environment_factories", None) is not None:
        return False
    if _compat.grpo_vision(trainer):
        return False
    tokenizer = trainer.processing_class
    try:
        setting = json.dumps([trainer.chat_template, trainer.chat_template_kwargs], sort_keys=True)
    except (AttributeError, TypeError, ValueError):
        return False
    try:
        with _LOCK:
            store = _STORES.setdefault(tokenizer, {})
    except TypeError:  # a tokenizer that cannot be a weak dictionary's key: TRL's own tokenization
        return False

    def tokenize(prompts: list[Any]) -> tuple[list[list[int]], Any, dict[str, Any]]:
        keys = _keys(prompts)
        if keys is None:
            return original(prompts)
        found = [store.get((setting, key)) for key in keys]
        missing = [i for i, ids in enumerate(found) if ids is None]
        if missing:
            whole = len(missing) == len(prompts)
            result = original(prompts if whole else [prompts[i] for i in missing])
            ids, images, fields = result
            if images is not None or fields:  # images after all: nothing kept, TRL's answer for the whole batch
                return result if whole else original(prompts)
            if len(store) + len(missing) > LIMIT:
                store.clear()
            for i, own in zip(missing, ids, strict=True):
                found[i] = store[(setting, keys[i])] = list(own)
        return [list(ids) for ids in cast("list[list[int]]", found)], None, {}  # every prompt's ids found now

    _compat.set_grpo_tokenization(trainer, tokenize)
    return True


def _keys(prompts: list[Any]) -> list[tuple[str, str]] | None:
    """Each prompt's kind and content, or ``None`` when one is neither text nor messages of JSON values, or when
    text and messages mix (TRL tokenizes a batch by its first prompt's kind)."""
    if not prompts:
        return None
    if all(isinstance(prompt, str) for prompt in prompts):
        return [("text", prompt) for prompt in prompts]
    keys = []
    for prompt in prompts:
        if not isinstance(prompt, list) or not all(isinstance(message, dict) for message in prompt):
            return None
        try:
            keys.append(("messages", json.dumps(prompt, sort_keys=True, ensure_ascii=False, allow_nan=False)))
        except (TypeError, ValueError):
            return None
    return keys
