"""Prompts tokenized once per device (``_trainers/grpo/_prompts.py``): each trainer gets TRL's own token ids, and a
prompt one trainer tokenized is not tokenized again by another of the same setting."""

from __future__ import annotations

import copy
import functools
import types
from typing import Any

import pytest
from transformers import AutoTokenizer
from trl import GRPOTrainer

from optuna_rapidfire._trainers.grpo._prompts import share_tokenized_prompts

TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}{% if shout %}!{% endif %}"
)


@pytest.fixture(scope="module")
def loaded(tiny_model: str) -> Any:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tokenizer.chat_template = TEMPLATE
    return tokenizer


@pytest.fixture
def tokenizer(loaded: Any) -> Any:
    """A tokenizer of its own per test (the prompts kept are per tokenizer object)."""
    return copy.deepcopy(loaded)


def _trainer(tokenizer: Any, calls: list[list[Any]], **settings: Any) -> Any:
    """What TRL's ``_tokenize_prompts`` reads of a ``GRPOTrainer``, with TRL's own method (each call's prompts
    recorded in ``calls``)."""
    trainer = types.SimpleNamespace(
        processing_class=tokenizer,
        _is_vlm=False,
        environment_factories=None,
        tools=[],
        chat_template=None,
        chat_template_kwargs={},
    )
    vars(trainer).update(settings)
    own = functools.partial(GRPOTrainer._tokenize_prompts, trainer)

    def tokenize(prompts: list[Any]) -> Any:
        calls.append(list(prompts))
        return own(prompts)

    trainer._tokenize_prompts = tokenize
    return trainer


def _messages(text: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": text}]


@pytest.mark.parametrize("conversational", [False, True], ids=["text", "messages"])
def test_trials_get_trls_token_ids_and_each_prompt_is_tokenized_once(tokenizer: Any, conversational: bool) -> None:
    texts = ["What is 2 + 3?", "Name a prime above 10.", "How many legs has a spider?", "Spell 'seven'."]
    prompts = [_messages(t) if conversational else t for t in texts]
    reference = _trainer(tokenizer, [])
    calls: list[list[Any]] = []
    first, second = _trainer(tokenizer, calls), _trainer(tokenizer, calls)
    assert share_tokenized_prompts(first) and share_tokenized_prompts(second)
    # The first trainer tokenizes its batch; the second meets two of those prompts and two new ones.
    batch = [prompts[0], prompts[1], prompts[0], prompts[1]]
    assert first._tokenize_prompts(batch) == reference._tokenize_prompts(batch)
    other = [prompts[1], prompts[2], prompts[0], prompts[3]]
    ids, images, fields = second._tokenize_prompts(other)
    assert (ids, images, fields) == reference._tokenize_prompts(other)
    assert calls == [batch, [prompts[2], prompts[3]]]  # only the prompts no trainer had tokenized
    ids[0].append(-1)  # a caller's lists are its own
    assert first._tokenize_prompts([prompts[1]]) == reference._tokenize_prompts([prompts[1]])
    assert len(calls) == 2


def test_another_chat_setting_tokenizes_again_and_tools_or_images_take_trls_path(tokenizer: Any) -> None:
    prompts = [_messages("What is 2 + 3?")]
    calls: list[list[Any]] = []
    plain, shouting = _trainer(tokenizer, calls), _trainer(tokenizer, calls, chat_template_kwargs={"shout": True})
    assert share_tokenized_prompts(plain) and share_tokenized_prompts(shouting)
    plain_ids = plain._tokenize_prompts(prompts)[0]
    shouting_ids = shouting._tokenize_prompts(prompts)[0]
    assert plain_ids != shouting_ids and len(calls) == 2  # the template's arguments are part of the setting
    # Another tokenizer (a copy) keeps its own prompts.
    other = _trainer(copy.deepcopy(tokenizer), calls)
    assert share_tokenized_prompts(other)
    assert other._tokenize_prompts(prompts)[0] == plain_ids and len(calls) == 3
    # Trainers with tools or environments, vision-language ones, or a tokenizer that cannot key a weak dictionary,
    # keep TRL's own tokenization.
    unhashable = type("Unhashable", (), {"__hash__": None})()
    for settings in (
        {"tools": [len]},
        {"environment_factories": {None: object}},
        {"_is_vlm": True},
        {"processing_class": unhashable},
    ):
        trainer = _trainer(tokenizer, calls, **settings)
        assert not share_tokenized_prompts(trainer)
    assert not share_tokenized_prompts(types.SimpleNamespace())  # a TRL without the method: nothing to share
    # A prompt that is not JSON (an image object in a message) goes to TRL every time.
    image = object()
    odd = [[{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image", "image": image}]}]]
    _, images, _ = plain._tokenize_prompts(odd)
    assert images == [[image]] and calls[-1] == odd
    plain._tokenize_prompts(odd)
    assert calls[-2:] == [odd, odd]
    # So does a batch that mixes text and messages (TRL reads the batch's kind from its first prompt).
    mixed = ["What is 2 + 3?", *prompts]
    with pytest.raises(Exception):  # noqa: B017 (TRL's own error, whatever it is)
        plain._tokenize_prompts(mixed)
    assert calls[-1] == mixed
