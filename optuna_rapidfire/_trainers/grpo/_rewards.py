"""Rewards of a GRPO gang: each reward function called once for every member waiting, its results split back.

TRL's ``GRPOTrainer._calculate_rewards`` scores a step's completions with each reward function in turn: a
reward model (an ``nn.Module``) on the prompts and completions tokenized by its processing class, any other
function with ``prompts``, ``completions``, ``completion_ids`` and the dataset's other columns as keyword
lists. In a gang (:class:`~optuna_rapidfire._trainers.grpo._turns.Turns`) the members' calls meet instead: the
members whose trainers share their reward functions (the executor's ``reward_funcs``, reward models loaded
once) have each function called once over all their rows, in member order, with the same arguments TRL gives
it (the lists concatenated; ``trainer_state`` the first member's, whose step the others share in a gang;
``log_extra`` splits its column back to each member, ``log_metric`` logs to each), and each member gets its own
rows' rewards, as TRL's own call would give them. A reward model scores all rows in one forward pass.

What TRL does around a single process's call that a gang cannot share (async reward functions, tool
environments) is refused by :func:`refusal`: those trials score their own rewards, as TRL does.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from optuna_rapidfire._trainers.grpo._turns import each_alone_after_failure

if TYPE_CHECKING:
    from collections.abc import Sequence

    from optuna_rapidfire._trainers._host import Member


@dataclass(eq=False)
class RewardRequest:
    """A member's call of TRL's ``_calculate_rewards``: its inputs (one dict per row), prompts, completions
    (text or messages) and completion token ids."""

    runtime: Member
    inputs: list[dict[str, Any]]
    prompts: list[Any]
    completions: list[Any]
    completion_ids: list[list[int]]


def refusal(trainer: Any) -> str | None:
    """Why a GRPO trainer's rewards cannot be computed with its gang's (``None``: they can)."""
    if getattr(trainer, "environments", None) is not None:
        return "has tool environments"
    if any(_is_async(f) for f in trainer.reward_funcs):
        return "has an async reward function"
    return None


def _is_async(function: Any) -> bool:
    """Whether calling ``function`` returns a coroutine (an ``async def``, or an object whose ``__call__`` is)."""
    call = function if inspect.isroutine(function) else type(function).__call__
    return inspect.iscoroutinefunction(call)


def _group_key(request: RewardRequest) -> tuple[Any, ...]:
    """Members with the same reward functions, processing classes and input columns are scored together."""
    trainer: Any = request.runtime.trainer
    columns = tuple(sorted(key for key in request.inputs[0] if key not in ("prompt", "completion", "completion_ids")))
    return (
        tuple(id(f) for f in trainer.reward_funcs),
        tuple(id(p) for p in trainer.reward_processing_classes),
        columns,
    )


def rewards(requests: Sequence[RewardRequest]) -> list[torch.Tensor]:
    """Each member's ``rewards_per_func`` (its rows by reward functions), as TRL's call returns it."""
    answers: list[torch.Tensor] = [torch.empty(0)] * len(requests)
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, request in enumerate(requests):
        groups.setdefault(_group_key(request), []).append(i)
    for positions in groups.values():
        for i, found in zip(positions, _score([requests[i] for i in positions]), strict=True):
            answers[i] = found
    return answers


def _score(requests: Sequence[RewardRequest]) -> list[torch.Tensor]:
    """One call per reward function over the rows of ``requests`` (which share their functions)."""
    from trl.data_utils import apply_chat_template, is_conversational

    trainers: list[Any] = [request.runtime.trainer for request in requests]
    first = trainers[0]
    counts = [len(request.prompts) for request in requests]
    starts = [sum(counts[:i]) for i in range(len(counts))]
    prompts = [p for request in requests for p in request.prompts]
    completions = [c for request in requests for c in request.completions]
    completion_ids = [c for request in requests for c in request.completion_ids]
    inputs = [row for request in requests for row in request.inputs]
    keys = [key for key in inputs[0] if key not in ("prompt", "completion", "completion_ids")]
    kwargs: dict[str, Any] = {key: [row[key] for row in inputs] for key in keys}

    def log_extra(column: str, values: list[Any]) -> None:
        for trainer, start, count in zip(trainers, starts, counts, strict=True):
            trainer._log_completion_extra(column, list(values[start : start + count]))

    def log_metric(name: str, value: float) -> None:
        for trainer in trainers:
            trainer._log_metric(name, value)

    kwargs |= {"trainer_state": first.state, "log_extra": log_extra, "log_metric": log_metric}
    device = first.accelerator.device
    table = torch.zeros(len(prompts), len(first.reward_funcs), device=device)
    for i, (function, processing, name) in enumerate(
        zip(first.reward_funcs, first.reward_processing_classes, first.reward_func_names, strict=True)
    ):
        if isinstance(function, torch.nn.Module):
            if is_conversational({"prompt": prompts[0]}):
                messages = [{"messages": p + c} for p, c in zip(prompts, completions, strict=True)]
                texts = [apply_chat_template(x, processing, **first.chat_template_kwargs)["text"] for x in messages]
            else:
                texts = [p + c for p, c in zip(prompts, completions, strict=True)]
            batch = processing(
                text=texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False
            )
            batch = {key: value.to(device) for key, value in batch.items()}
            with torch.inference_mode():
                table[:, i] = function(**batch).logits[:, 0]
            continue
        found = function(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs)
        found = [torch.nan if reward is None else reward for reward in found]
        if len(found) != len(prompts):
            raise ValueError(
                f"The reward function {name!r} returned {len(found)} rewards for {len(prompts)} completions of "
                f"{len(requests)} trials scored together (one reward per prompt-completion pair)."
            )
        table[:, i] = torch.tensor(found, dtype=torch.float32, device=device)
    return [table[start : start + count] for start, count in zip(starts, counts, strict=True)]


def shared_rewards(requests: list[RewardRequest]) -> list[torch.Tensor | BaseException]:
    """The gang's rewards; after a failure with several members, each member's alone, so that only a
    member whose rows fail fails."""
    return each_alone_after_failure(rewards, requests, "reward call", "scoring")
