"""The bundled GSM8K data set (MIT licence, see ``data/LICENSE-GSM8K``)."""

from __future__ import annotations

import gzip
import json
import re
from importlib import resources
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from datasets import Dataset

_FINAL_ANSWER = re.compile(r"####\s*(-?[\d,\.]+)")


def _read_rows(split: str) -> list[dict[str, Any]]:
    path = resources.files("optuna_rapidfire.demo") / "data" / f"gsm8k_{split}.jsonl.gz"
    with path.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as lines:
        return [json.loads(line) for line in lines]


def final_answer(answer: str) -> str | None:
    """Return the number after ``####`` in a GSM8K answer, without thousands separators."""
    match = _FINAL_ANSWER.search(answer)
    return None if match is None else match.group(1).replace(",", "")


DemoFormat = Literal["prompt_completion", "text", "preference", "prompt_only", "raw"]
"""The shapes :func:`load_gsm8k` gives the rows."""


def load_gsm8k(
    split: Literal["train", "test"] = "train",
    *,
    num_rows: int | None = None,
    format: DemoFormat = "prompt_completion",
) -> Dataset:
    """Load the bundled GSM8K split as a :class:`datasets.Dataset`.

    Args:
        split: ``"train"`` (7,473 rows) or ``"test"`` (1,319 rows).
        num_rows: Keep only the first ``num_rows`` rows.
        format: ``"prompt_completion"`` gives ``prompt``/``completion`` columns (TRL's prompt-completion
            format, so the loss covers the answer only), ``"text"`` one ``text`` column,
            ``"preference"`` ``prompt``/``chosen``/``rejected`` for DPO (chosen: the reference answer,
            rejected: the same answer with a wrong final number), ``"prompt_only"`` ``prompt`` and the
            final ``answer`` for GRPO (see :func:`gsm8k_reward`), ``"raw"`` the original
            ``question``/``answer`` columns.

    Returns:
        The rows in their original order.
    """
    from datasets import Dataset

    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', but got {split=}.")
    if num_rows is not None and num_rows < 1:
        raise ValueError(f"num_rows must be at least 1, but got {num_rows=}.")
    rows = _read_rows(split)[:num_rows]
    if format == "raw":
        return Dataset.from_list(rows)
    prompts = [f"Question: {row['question']}\nAnswer:" for row in rows]
    completions = [f" {row['answer']}" for row in rows]
    if format == "prompt_completion":
        return Dataset.from_dict({"prompt": prompts, "completion": completions})
    if format == "text":
        return Dataset.from_dict({"text": [p + c for p, c in zip(prompts, completions, strict=True)]})
    if format == "preference":
        rejected = [_with_wrong_final_number(c, i) for i, c in enumerate(completions)]
        return Dataset.from_dict({"prompt": prompts, "chosen": completions, "rejected": rejected})
    if format == "prompt_only":
        answers = [final_answer(row["answer"]) or "" for row in rows]
        return Dataset.from_dict({"prompt": prompts, "answer": answers})
    raise ValueError(
        f"format must be 'prompt_completion', 'text', 'preference', 'prompt_only' or 'raw', but got {format=}."
    )


def _with_wrong_final_number(completion: str, index: int) -> str:
    """The completion with its final number changed (deterministically, by 1 to 9)."""
    answer = final_answer(completion)
    if answer is None:
        return completion + " (wrong)"
    try:
        wrong = str(int(float(answer)) + 1 + index % 9)
    except ValueError:
        wrong = answer + "1"
    head, _, _ = completion.rpartition("####")
    return f"{head}#### {wrong}"


def gsm8k_reward(completions: list[Any], answer: list[str], **kwargs: Any) -> list[float]:
    """GRPO reward for the ``"prompt_only"`` format: 1 for the right final number, plus 0.2 for the format.

    A completion earns the format bonus when it states a final answer as ``#### <number>``, and the
    full reward when that number equals the reference ``answer``. Takes TRL's reward-function arguments.
    """
    rewards = []
    for completion, expected in zip(completions, answer, strict=True):
        text = completion if isinstance(completion, str) else completion[-1]["content"]
        stated = final_answer(text)
        rewards.append(
            (0.2 if stated is not None else 0.0) + (1.0 if stated is not None and stated == expected else 0.0)
        )
    return rewards
