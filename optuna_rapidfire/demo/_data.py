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


def load_gsm8k(
    split: Literal["train", "test"] = "train",
    *,
    num_rows: int | None = None,
    format: Literal["prompt_completion", "text", "raw"] = "prompt_completion",
) -> Dataset:
    """Load the bundled GSM8K split as a :class:`datasets.Dataset`.

    Args:
        split: ``"train"`` (7,473 rows) or ``"test"`` (1,319 rows).
        num_rows: Keep only the first ``num_rows`` rows.
        format: ``"prompt_completion"`` gives ``prompt``/``completion`` columns (TRL's prompt-completion
            format, so the loss covers the answer only), ``"text"`` one ``text`` column, ``"raw"`` the
            original ``question``/``answer`` columns.

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
    raise ValueError(f"format must be 'prompt_completion', 'text' or 'raw', but got {format=}.")
