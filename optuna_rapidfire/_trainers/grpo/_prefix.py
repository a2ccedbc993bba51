"""Shared prompts in a GRPO gang's policy passes: each prompt's tokens computed once for all its completions.

TRL scores a GRPO step's rows as ``prompt + completion`` each, and a step holds every prompt once per
generation (``num_generations`` rows, 8 by default), so most of a policy pass recomputes the same prompt tokens.
Here, as in tree or prefix-shared attention, the rows of one prompt become one *packed row*: the prompt's
columns once, then each completion's columns after it. Each token keeps the position it has in TRL's row
(prompt column ``c`` at ``c``, completion token ``t`` at the prompt's width plus ``t``) and sees what it sees
there: a prompt token the prompt's tokens before it, a completion token the prompt's tokens and its own
completion's tokens before it, never another completion's (a boolean mask per packed row, ``rows x 1 x
length x length``). Each completion token's log-probability is then read where TRL reads it (the state of
the token before it; the first from the prompt's last token, shared by the prompt's completions, so its
gradient sums theirs as autograd sums a tensor used several times). Values equal TRL's within rounding.

It applies where the result cannot change: decoders whose layers mix tokens only through attention (the
layouts the launched decode knows: :func:`~optuna_rapidfire._fused._workspace.supports`) with PyTorch's
scaled-dot-product attention (which takes such masks), no dropout of the base model drawn in the pass, and
only when packing saves at least a fifth of the pass's work (its tokens through the projections, and its
query-key pairs: a packed row's mask is dense) and the masks its layers keep for the backward take at most
1 GiB more than TRL's rows' (so long completions after a short prompt stay unpacked). The rows of a trial
whose adapter draws dropout in the pass stay one packed row each (sharing a prompt would share its tokens'
dropout masks between completions); their columns are TRL's, so their masks stay the trial's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from optuna_rapidfire._fused._fused_pass import to_device_async
from optuna_rapidfire._fused._workspace import supports

if TYPE_CHECKING:
    from collections.abc import Sequence

SAVING = 0.2
"""Pack a pass's rows only when that saves at least this share of its work (:func:`pass_work`)."""
MASK_BYTES = 2**30
"""How much more memory than TRL's rows the attention masks a packed pass keeps for its backward may take."""


def pair_work(config: Any) -> float:
    """What one query-key pair of attention costs against a token through the projections, for a decoder of
    ``config``: ``4 d / (2 (4 d^2 + 3 d f))`` (per layer: the products with the query and value of each pair,
    against the attention and gated MLP projections; grouped-query attention's smaller projections aside),
    0 when the config does not say."""
    hidden = getattr(config, "hidden_size", None)
    inner = getattr(config, "intermediate_size", None)
    if not hidden or not inner:
        return 0.0
    return 2.0 / (4 * hidden + 3 * inner)


def pass_work(rows: int, width: int, pair: float) -> float:
    """A pass's work in token-equivalents: ``rows`` rows padded to ``width`` tokens (every padded token goes
    through the projections, and every query meets every key: the mask is dense)."""
    return rows * (width + pair * width * width)


class Rows(Protocol):
    """A request's rows as TRL scores them: prompt (left-padded) then completion (right-padded), and how many
    last columns are scored (the completion's)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    logits_to_keep: int


@dataclass
class PrefixLayout:
    """A pass's packed rows: ``input_ids``, ``position_ids`` and ``attention_mask`` (packed rows x 1 x length x
    length, True where a token sees another) for the backbone; ``rows``: each request's packed rows (in request
    order, contiguous); ``states``: per request, where each of its rows' scored positions are predicted from
    (indices into the backbone's output flattened to ``packed rows * length``, ``rows x logits_to_keep``)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    rows: list[int]
    states: list[torch.Tensor]


def refusal(base: Any) -> str | None:
    """Why ``base``'s passes cannot share their prompts (``None``: they can)."""
    reason = supports(base)
    if reason is not None:
        return reason
    attention = getattr(base.config, "_attn_implementation", None)
    if attention != "sdpa":
        return f"attention {attention!r} is not 'sdpa' (which takes a mask per packed row)"
    if float(getattr(base.config, "attention_dropout", 0.0) or 0.0) > 0:
        return "the model's attention has dropout"
    return None


def prefix_layout(
    requests: Sequence[Rows],
    share: Sequence[bool],
    pad: int,
    device: torch.device,
    pair: float = 0.0,
    layers: int = 1,
) -> PrefixLayout | None:
    """The packed layout of ``requests``' rows, or ``None`` when it would not save :data:`SAVING` of the work
    (prompts repeated too little, or completions so long that attending over a packed row costs more than the
    prompt tokens saved: ``pair`` is :func:`pair_work`) or when its attention masks, one kept per layer of the
    ``layers``, would take more than :data:`MASK_BYTES` beyond those of TRL's rows. A
    request whose ``share`` is false keeps a packed row per row (its prompt and one completion: TRL's row, the
    same columns, so the same dropout masks)."""
    if any(r.input_ids.shape[1] <= r.logits_to_keep for r in requests):
        return None
    prompts = _prompt_rows(requests, share)
    plans: list[tuple[int, int, int, list[list[int]]]] = []  # per request: width, prompt width, keep, groups
    packed_lengths: list[int] = []
    for request, rows_of in zip(requests, prompts, strict=True):
        width, keep = request.input_ids.shape[1], request.logits_to_keep
        prompt = width - keep
        same: dict[tuple[int, ...], list[int]] = {}
        if rows_of is not None:
            for row, tokens in enumerate(rows_of):
                same.setdefault(tokens, []).append(row)
        else:
            same = {(row,): [row] for row in range(len(request.input_ids))}
        plans.append((width, prompt, keep, list(same.values())))
        packed_lengths += [prompt + len(rows) * keep for rows in same.values()]
    length = max(packed_lengths)
    unpacked = pass_work(sum(len(r.input_ids) for r in requests), max(r.input_ids.shape[1] for r in requests), pair)
    if pass_work(len(packed_lengths), length, pair) > (1 - SAVING) * unpacked:
        return None
    # The attention's masks: each layer keeps one in the compute dtype (2 bytes a pair) for the backward. More
    # query-key pairs than TRL's rows hold only while those copies stay within MASK_BYTES.
    pairs = len(packed_lengths) * length**2
    if pairs > sum(len(r.input_ids) * r.input_ids.shape[1] ** 2 for r in requests) and 2 * layers * pairs > MASK_BYTES:
        return None
    # Each packed column's source: a flat index into the requests' ids (one past them: padding), its
    # position, and its segment (0: the prompt, i + 1: the i-th completion, -1: padding); built in numpy (a
    # pass holds thousands of columns).
    rows_total = len(packed_lengths)
    source = np.full((rows_total, length), -1, dtype=np.int64)
    positions = np.zeros((rows_total, length), dtype=np.int64)
    segments = np.full((rows_total, length), -1, dtype=np.int64)
    states: list[np.ndarray] = []
    offset, packed = 0, 0
    for request, (width, prompt, keep, groups) in zip(requests, plans, strict=True):
        predicted = np.zeros((len(request.input_ids), keep), dtype=np.int64)
        steps = np.arange(keep)
        for rows in groups:
            count, end = len(rows), prompt + len(rows) * keep
            source[packed, :prompt] = offset + rows[0] * width + np.arange(prompt)
            starts = offset + np.asarray(rows) * width + prompt
            source[packed, prompt:end] = (starts[:, None] + steps).reshape(-1)
            positions[packed, :prompt] = np.arange(prompt)
            positions[packed, prompt:end] = np.tile(prompt + steps, count)
            segments[packed, :prompt] = 0
            segments[packed, prompt:end] = np.repeat(np.arange(1, count + 1), keep)
            # Token t of the i-th completion is predicted from column prompt + i * keep + t - 1 (the first from
            # the prompt's last column).
            at = packed * length + prompt + np.arange(count)[:, None] * keep + steps[None, :] - 1
            at[:, 0] = packed * length + prompt - 1
            predicted[rows] = at
            packed += 1
        states.append(predicted)
        offset += request.input_ids.numel()
    flat_ids = torch.cat([r.input_ids.reshape(-1) for r in requests] + [torch.full((1,), pad, device=device)])
    flat_mask = torch.cat(
        [r.attention_mask.reshape(-1).bool() for r in requests] + [torch.zeros(1, dtype=torch.bool, device=device)]
    )
    source[source < 0] = offset
    # One copy to the device for every index the pass needs, which the host does not wait for.
    arrays = [source, positions, segments, *states]
    on_device = to_device_async(torch.from_numpy(np.concatenate([a.reshape(-1) for a in arrays])), device)
    index, *parts = on_device.split([a.size for a in arrays])
    position_ids, segment, *state_rows = (part.view(a.shape) for part, a in zip(parts, arrays[1:], strict=True))
    input_ids = flat_ids.index_select(0, index).view(packed, length)
    keys = flat_mask.index_select(0, index).view(packed, length)
    sees = (
        keys[:, None, :]
        & (position_ids[:, None, :] <= position_ids[:, :, None])
        & ((segment[:, None, :] == 0) | (segment[:, None, :] == segment[:, :, None]))
    )
    # A query that sees nothing (padding) sees itself: no row of the mask is empty.
    sees |= torch.eye(length, dtype=torch.bool, device=device)[None] & ~sees.any(-1, keepdim=True)
    return PrefixLayout(
        input_ids,
        position_ids,
        sees[:, None],
        [len(plan[3]) for plan in plans],
        state_rows,
    )


def _prompt_rows(requests: Sequence[Rows], share: Sequence[bool]) -> list[list[tuple[int, ...]] | None]:
    """Each request's rows' prompt tokens (padding as -1), where its ``share`` is true (else ``None``): the
    requests' prompt columns are copied to the host together, in one wait for the device."""
    widths = [r.input_ids.shape[1] - r.logits_to_keep for r in requests]
    columns = [
        r.input_ids[:, :width].masked_fill(~r.attention_mask[:, :width].bool(), -1).reshape(-1)
        for r, width, shared in zip(requests, widths, share, strict=True)
        if shared
    ]
    flat = torch.cat(columns).tolist() if columns else []
    found: list[list[tuple[int, ...]] | None] = []
    start = 0
    for request, width, shared in zip(requests, widths, share, strict=True):
        if not shared:
            found.append(None)
            continue
        found.append(
            [tuple(flat[start + row * width : start + (row + 1) * width]) for row in range(len(request.input_ids))]
        )
        start += len(request.input_ids) * width
    return found
