"""Shared policy passes of a GRPO gang: one forward and one backward for every member's step.

A GRPO trial's step computes its completions' per-token log-probabilities under its adapter (TRL's
``_get_per_token_logps_and_entropies``), its loss from them (TRL's own code: importance ratios, clipping,
KL to the reference, its loss type), then backpropagates (``accelerator.backward``). In a gang
(:class:`~optuna_rapidfire._trainers.grpo._turns.Turns`), each member's first call hands its rows over as a
:class:`LogpsRequest`: the members waiting share one forward pass over the frozen base, each row segment
through its own adapter (:func:`~optuna_rapidfire._fused._fused_pass.fused_forward`), and each gets its
log-probabilities and entropies, scored at its own ``temperature`` with TRL's chunked kernel (as TRL's
fused LM head scores them), still attached to the shared graph. Each member then computes its loss as
TRL does and hands it over as a :class:`BackwardRequest`: one backward of the losses' sum gives every
adapter the gradient of its own loss (adapters share no parameters; the base is frozen). Each member
then clips and steps its own optimizer, as alone.

The rows of one prompt (a GRPO step repeats each prompt once per generation) share its tokens: one packed
row holds the prompt once and then each completion, which sees the prompt and itself only
(:mod:`~optuna_rapidfire._trainers.grpo._prefix`; where the model and dropout allow it). Other rows are padded
on the right to the pass's longest (causal attention: a row's tokens never see its padding), adapter dropout
masks come from each trial's own stream (as in the fused engine's SFT passes), and the base's RMS norms run as
fused kernels (:mod:`~optuna_rapidfire._fused._norms`). The log-probabilities TRL
computes without gradients are shared too where that changes nothing: the references (adapters off: one pass
of the frozen base over every member's rows), the policies of evaluations (eval mode), and the old policies
TRL scores in train mode when it reuses a rollout (``num_iterations`` > 1) of members for which nothing drops
(:meth:`PolicyPasses.drops`); an old policy that would draw dropout masks stays the trial's own.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from optuna_rapidfire._fused._fused_pass import (
    Gang,
    attention_kernels,
    backbone_and_head,
    base_only,
    fused_forward,
    layer_plans,
    pad_right,
    pad_token_id,
)
from optuna_rapidfire._fused._norms import fused_norms, rms_norms
from optuna_rapidfire._fused._stacks import GangStacks, KeptStacks, computing_dtype
from optuna_rapidfire._fused._token_stats import token_stats
from optuna_rapidfire._trainers.grpo._prefix import pair_work, prefix_layout
from optuna_rapidfire._trainers.grpo._prefix import refusal as prefix_refusal

if TYPE_CHECKING:
    from collections.abc import Sequence

    from optuna_rapidfire._trainers._host import GangHost, Member


@dataclass(eq=False)
class LogpsRequest:
    """A member's rows to score: token ids and attention (prompt then completion), and the completion's
    last ``logits_to_keep`` positions to score; ``entropy``: whether it needs each position's entropy.

    ``grad``: scored for the member's backward (its policy step); else without gradients: its ``reference``
    (TRL's pass with the adapters off, for the KL term), its old policy (a ``rollout`` scored before its rewards,
    when TRL reuses it for several steps), or its policy in eval mode (an evaluation's loss). ``training``: the
    model's mode when the member asked.
    """

    runtime: Member
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    logits_to_keep: int
    entropy: bool
    grad: bool = True
    reference: bool = False
    training: bool = True
    rollout: bool = False


@dataclass(eq=False)
class BackwardRequest:
    """A member's loss, computed from the log-probabilities of a shared pass."""

    runtime: Member
    loss: torch.Tensor


class PolicyPasses:
    """Runs the shared forward and backward passes of a gang's GRPO steps on ``trials``' device."""

    def __init__(self, trials: GangHost) -> None:
        self.trials = trials
        self.passes = 0
        self.scoring_passes = 0  # shared passes without gradients (references, old policies, evaluations)
        self.prefix_passes = 0  # passes (of either kind) whose rows shared their prompts
        self.stacked_passes = 0  # passes (of either kind) whose layers read the gang's adapters stacked
        self._open: set[Member] = set()  # members of passes whose backward has not run yet
        self._trainable: set[str] = set()
        # Each layer's plan for a gang's adapters and rows (see layer_plans): the same for every pass of one
        # layout while no adapter is added or removed.
        self._plans: dict[tuple[int, tuple[str, ...], tuple[int, ...]], list[Any]] = {}
        # The gangs' adapters stacked for their passes (see _fused/_stacks.py), kept from pass to pass; and for each
        # member of an open pass, the stacks that pass read and its position in them.
        self._stacks = KeptStacks()
        self._stacked: dict[Member, tuple[GangStacks, int]] = {}

    def forward(self, requests: Sequence[LogpsRequest]) -> list[tuple[torch.Tensor, torch.Tensor | None, None]]:
        """Each member's ``(log-probabilities, entropies or None, None)`` of its scored positions, as TRL's
        ``_get_per_token_logps_and_entropies`` returns them: one pass for the members scoring their policy
        step, one for those scoring their reference, one for those scoring an evaluation."""
        answers: list[Any] = [None] * len(requests)
        groups: dict[tuple[bool, bool, bool], list[int]] = {}
        for i, request in enumerate(requests):
            groups.setdefault((request.grad, request.reference, request.training), []).append(i)
        for positions in groups.values():
            for i, answer in zip(positions, self._pass([requests[i] for i in positions]), strict=True):
                answers[i] = answer
        return answers

    def _pass(self, requests: Sequence[LogpsRequest]) -> list[tuple[torch.Tensor, torch.Tensor | None, None]]:
        """One forward pass over the rows of ``requests``, which agree on ``grad``, ``reference`` and the mode.

        Without gradients nothing is kept for a backward, and no dropout stream moves: a reference has its
        adapters off, an evaluation runs in eval mode, and an old policy in train mode is shared only where
        nothing drops (other no-grad calls are not shared).
        """
        trials, first, grad = self.trials, requests[0].runtime, requests[0].grad
        resident = trials.resident
        names = [request.runtime.state.adapter_name for request in requests]
        rows = [len(request.input_ids) for request in requests]
        pad = pad_token_id(first.trainer)
        base = resident.base
        training = grad or requests[0].training
        dropout_off = first.spec.kind.base_dropout_off(first.args)
        layout = None
        if self._prefix_refused is None and not (training and not dropout_off and resident.has_base_dropout()):
            dropping = training and not requests[0].reference  # a reference pass runs the base alone
            share = [not (dropping and self._adapter_dropout(name)) for name in names]
            layers = int(getattr(base.config, "num_hidden_layers", 1) or 1)
            layout = prefix_layout(requests, share, pad, trials.device, pair_work(base.config), layers)
        streams = [trials.dropout_stream(request.runtime) for request in requests] if grad else []
        gang = Gang(
            names,
            rows if layout is None else layout.rows,
            [stream.next_key() for stream in streams] if grad else [0] * len(requests),
        )
        backbone, head = backbone_and_head(base)
        resident.set_base_dropout(dropout_off)  # the gang's members agree
        model = resident.module
        if grad:
            resident.set_trainable(names, True)
            self._trainable.update(names)
        if model.training != training:  # a walk of every module: only when it changes
            model.train(training)
        key = (resident.adapters_version, tuple(gang.names), tuple(gang.rows))
        plans = self._plans.get(key)
        if plans is None:
            if len(self._plans) >= 64:
                self._plans.clear()
            plans = self._plans[key] = layer_plans(model, gang, resident.lora_layers())
        stacks = None if requests[0].reference else self._loaded_stacks(gang, plans, grad, first)
        self.stacked_passes += stacks is not None
        if stacks is not None and grad:  # open until each member's backward (or its leaving) hands it out
            self._stacked.update((request.runtime, (stacks, i)) for i, request in enumerate(requests))
        adapters = base_only(plans) if requests[0].reference else fused_forward(model, gang, plans, stacks)
        if layout is None:
            length = max(request.input_ids.shape[1] for request in requests)
            inputs = {
                "input_ids": torch.cat([pad_right(request.input_ids, length, pad) for request in requests]),
                "attention_mask": torch.cat([pad_right(request.attention_mask, length, 0) for request in requests]),
            }
        else:
            inputs = {
                "input_ids": layout.input_ids,
                "attention_mask": layout.attention_mask,
                "position_ids": layout.position_ids,
            }
            self.prefix_passes += 1
        with (
            adapters,
            fused_norms(self._norms),
            attention_kernels(),
            first.spec.kind.autocast(first.args, trials.device),
            contextlib.nullcontext() if grad else torch.no_grad(),
        ):
            hidden = backbone(**inputs, use_cache=False).last_hidden_state
        # Each member's scored positions (position j predicts token j + 1: the last ``keep`` tokens are predicted
        # from the ``keep`` before), then one LM-head call for all members that share a temperature and ask
        # alike for entropies (the head's statistics are per token).
        spans: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (states, targets, mask) per member
        start = 0
        for index, (request, count) in enumerate(zip(requests, rows, strict=True)):
            own, keep = request.input_ids.shape[1], request.logits_to_keep
            if layout is None:
                states = hidden[start : start + count, own - keep - 1 : own - 1].reshape(-1, hidden.shape[-1])
            else:
                states = hidden.view(-1, hidden.shape[-1]).index_select(0, layout.states[index].view(-1))
            mask = request.attention_mask[:, own - keep :].bool()
            spans.append((states, request.input_ids[:, own - keep :].masked_fill(~mask, 0).reshape(-1), mask))
            start += count
        answers: list[Any] = [None] * len(requests)
        groups: dict[tuple[float, bool], list[int]] = {}
        for index, request in enumerate(requests):
            temperature = float(getattr(request.runtime.trainer, "temperature", 1.0))
            groups.setdefault((temperature, request.entropy), []).append(index)
        for (temperature, entropy), members in groups.items():
            with first.spec.kind.autocast(first.args, trials.device), torch.set_grad_enabled(grad):
                stats = token_stats(
                    _joined([spans[i][0] for i in members]),
                    head,
                    _joined([spans[i][1] for i in members]),
                    base.config,
                    ("entropy",) if entropy else (),
                    temperature=temperature,
                )
            sizes = [spans[i][1].numel() for i in members]
            entropies = stats.entropy.split(sizes) if stats.entropy is not None else [None] * len(members)
            for i, log_probs, own_entropy in zip(members, stats.log_probs.split(sizes), entropies, strict=True):
                mask = spans[i][2]
                answers[i] = (
                    log_probs.view(mask.shape).masked_fill(~mask, 0.0),
                    None if own_entropy is None else own_entropy.view(mask.shape).masked_fill(~mask, 0.0),
                    None,
                )
        if grad:
            for request, stream in zip(requests, streams, strict=True):
                request.runtime.state.dropout_rng = stream.state()
            self.passes += 1
            self._open.update(request.runtime for request in requests)
        else:
            self.scoring_passes += 1
        return answers

    def _loaded_stacks(self, gang: Gang, plans: list[Any], grad: bool, first: Member) -> GangStacks | None:
        """The gang's adapters stacked and loaded for a pass, in the dtype ``first``'s mixed precision computes them
        in (``None``: no layer of the pass reads stacks; see :meth:`KeptStacks.loaded`)."""
        compute = computing_dtype(first.spec.kind.autocast(first.args, self.trials.device), self.trials.device)
        version = self.trials.resident.adapters_version
        return self._stacks.loaded(plans, gang.names, gang.rows, version, compute, grad)

    @functools.cached_property
    def _norms(self) -> list[torch.nn.Module]:
        """The base's RMS norms, which the shared passes run as fused kernels (``_fused/_norms.py``)."""
        return rms_norms(self.trials.resident.base)

    @functools.cached_property
    def _prefix_refused(self) -> str | None:
        """Why the model's passes cannot share their rows' prompts (``None``: they can)."""
        return prefix_refusal(self.trials.resident.base)

    def drops(self, member: Member) -> bool:
        """Whether a pass in train mode draws dropout masks for ``member``: its adapter's, the attention's (a
        config's ``attention_dropout``), or the base's own dropout layers where its arguments keep them."""
        resident = self.trials.resident
        if self._adapter_dropout(member.state.adapter_name):
            return True
        if float(getattr(resident.base.config, "attention_dropout", 0.0) or 0.0) > 0:
            return True
        return resident.has_base_dropout() and not member.spec.kind.base_dropout_off(member.args)

    def _adapter_dropout(self, name: str) -> bool:
        """Whether adapter ``name`` draws dropout (in train mode)."""
        config: Any = getattr(self.trials.resident.module, "peft_config", {})
        return name in config and float(getattr(config[name], "lora_dropout", 0.0) or 0.0) > 0

    def backward(self, requests: Sequence[BackwardRequest]) -> list[None]:
        """One backward of the members' losses; the graph is kept while a member of its pass has not come.

        Other members ran since the forward pass, and PEFT may have frozen adapters meanwhile (leaving
        ``disable_adapter()``, as TRL's reference pass does, makes only the active adapter trainable):
        autograd would then skip their gradients. So the open passes' adapters are made trainable again
        first.
        """
        members = {request.runtime for request in requests}
        retain = not self._open <= members
        self.trials.resident.set_trainable(sorted(runtime.state.adapter_name for runtime in self._open), True)
        torch.autograd.backward([request.loss for request in requests], retain_graph=retain)
        # Members of passes that read stacked adapters get their gradients from the stacks' (one hand-out per pass).
        handed: dict[GangStacks, list[int]] = {}
        for request in requests:
            stacks, position = self._stacked.pop(request.runtime, (None, -1))
            if stacks is not None:
                handed.setdefault(stacks, []).append(position)
        try:
            for stacks, positions in handed.items():
                stacks.hand_out(positions)
        finally:  # after a failure too: no pass waits for these members
            for stacks, positions in handed.items():
                stacks.forget(positions)
        self._open -= members
        if not self._open:
            self.close()
        return [None] * len(requests)

    def leave(self, runtime: Member) -> None:
        """The trial's work in the gang ended (a failure between its forward and backward passes included):
        later backwards need not keep the graph for it."""
        self._open.discard(runtime)
        stacks, position = self._stacked.pop(runtime, (None, -1))
        if stacks is not None:
            stacks.forget([position])
        if not self._open:
            self.close()

    def release(self) -> None:
        """The gang's run ended: :meth:`close`, and free the stacks kept for its passes."""
        self.close()
        self._stacks.clear()

    def close(self) -> None:
        """Forget open passes (a member failed before its backward) and freeze their adapters again."""
        self._open.clear()
        for stacks, position in self._stacked.values():
            stacks.forget([position])
        self._stacked.clear()
        if self._trainable:
            self.trials.resident.set_trainable(sorted(self._trainable), False)
            self._trainable.clear()


def _joined(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``tensors`` concatenated along their first dimension (the one tensor itself, uncopied, when alone)."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)
