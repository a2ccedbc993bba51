"""A gang's adapters kept stacked, so that a shared pass neither stacks them per layer nor splits their gradients.

In a shared pass (:func:`~optuna_rapidfire._fused._fused_pass.fused_forward`) a LoRA layer whose gang is
*uniform* (every member targets it with one rank, on equal rows) multiplies each member's rows by its own
adapter with two batched matmuls over the members' projections stacked as ``[K, r, in]`` and ``[K, out, r]``.
Stacked in the layer, that is two copies per layer and pass, and in the backward the stacked gradient is split
back into every member's parameters: an accumulation node and a copy per parameter (16 per layer in a gang of
8, over a thousand a pass on a 16-layer model with attention adapters), each launched on its own.

:class:`GangStacks` keeps those stacks as tensors of their own, leaves of the pass's graph: :meth:`GangStacks.load`
copies every member's current weights into them with one ``foreach`` copy before a pass, the layers read them
(:meth:`GangStacks.of`), and after a backward :meth:`GangStacks.hand_out` gives the members' parameters their
slices of the stacks' gradients, with one ``foreach`` copy per member into a buffer of its own (added to a
gradient a parameter has already). The values are the ones the layer would have stacked itself, so the pass's
results do not change.

A loaded stack is saved by its pass's graph: loading it again before that pass's backward would change what the
backward reads (autograd then refuses the backward), so the owner keeps a stack whose pass is open apart
(:attr:`GangStacks.open`) and loads another one meanwhile. :class:`KeptStacks` keeps a few gangs' stacks from pass to
pass that way; GRPO gangs' shared policy passes use it, and so do SFT and DPO gangs that train in the model's own
modules rather than the launched pass (activation checkpointing, for one).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch

from optuna_rapidfire import _compat

if TYPE_CHECKING:
    from collections.abc import Collection, Hashable, Sequence
    from contextlib import AbstractContextManager


class _Plan(Protocol):
    """What a stack needs of a layer's plan (``_fused_pass._LayerPlan``)."""

    uniform: bool
    shared_scale: float | None


class GangStacks:
    """The uniform layers' adapters of the gang ``names`` (in gang order), stacked (see the module's docstring).

    Args:
        plans: :func:`~optuna_rapidfire._fused._fused_pass.layer_plans` of the gang: the layers whose plan is
            uniform and whose members' projections share a dtype and a device are stacked; the others are left
            to the layer (:meth:`of` gives ``None``).
        names: The gang's adapters, in the order of its row segments.
        key: What the stacks were made for (the owner's cache key).
        compute: The dtype the passes compute the adapters' matmuls in under mixed precision (autocast's), when it
            differs from the parameters': the stacks of layers whose adapters share a scaling then hold the weights
            cast to it, as autocast would cast them for each matmul (the same values), and their gradients come
            back in the parameters' dtype with the hand-out's copy instead of a cast per stack in the backward.

    Attributes:
        open: Members (gang positions) whose pass read the stacks and has not had its backward yet: while any
            is, the stacks must not be loaded again.
    """

    def __init__(
        self,
        plans: Sequence[tuple[Any, _Plan]],
        names: Sequence[str],
        key: Hashable = None,
        compute: torch.dtype | None = None,
    ) -> None:
        self.names = list(names)
        self.key = key
        self.open: set[int] = set()
        self._of: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # Each stack with the members' parameters it holds (an adapter keeps its parameter objects; a new adapter
        # makes a new owner's key), and the slices of the stacks they are copied into, in the parameters' order.
        self._stacks: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
        self._sources: list[torch.Tensor] = []
        self._targets: list[torch.Tensor] = []
        for layer, plan in plans:
            if not plan.uniform:
                continue
            downs = [layer.lora_A[name].weight for name in self.names]
            ups = [layer.lora_B[name].weight for name in self.names]
            if len({(w.dtype, w.device) for w in downs + ups}) != 1:
                continue
            # Adapters with their own scalings scale the stacked up-projections in the pass: that product is made in
            # the parameters' dtype (as before autocast casts it), so those layers keep it.
            dtype = compute if compute is not None and plan.shared_scale is not None else downs[0].dtype
            down, up = (ws[0].new_empty((len(ws), *ws[0].shape), dtype=dtype) for ws in (downs, ups))
            self._of[id(layer)] = (down, up)
            for stack, params in ((down, downs), (up, ups)):
                self._stacks.append((stack, params))
                self._sources += params
                # Copied into through detached views: they share the stack's version counter, so a pass that saved
                # the stack and finds it loaded again fails its backward rather than use other weights.
                self._targets += stack.detach().unbind(0)

    def __len__(self) -> int:
        """The layers stacked."""
        return len(self._of)

    def of(self, layer: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``layer``'s stacked down- and up-projections (``None``: the layer stacks its adapters itself)."""
        return self._of.get(id(layer))

    def load(self, grad: bool) -> None:
        """Copy the members' weights in (one operator); with ``grad``, the stacks collect the pass's gradients and
        every member is :attr:`open` until :meth:`hand_out` (or :meth:`forget`) says otherwise.

        Raises:
            RuntimeError: If a pass that read the stacks still waits for its backward (see :attr:`open`).
        """
        if self.open:
            raise RuntimeError(f"The stacks of gang {self.names} are loaded while a pass that read them is open.")
        if not self._stacks:
            return
        if grad:
            self.open = set(range(len(self.names)))
        with torch.no_grad():
            torch._foreach_copy_(self._targets, self._sources)
        for stack, _ in self._stacks:
            stack.grad = None
            if stack.requires_grad != grad:
                stack.requires_grad_(grad)

    def hand_out(self, positions: Collection[int]) -> None:
        """After a backward of losses of the members at ``positions`` (gang positions): each of their stacked
        parameters gets its slice of the stacks' gradient, in a buffer of the member's own (one per dtype: its
        gradients keep no other member's alive), or adds it to the gradient it has; one ``foreach`` copy per
        member, one ``foreach`` add for all. The stacks' gradients are cleared for the next backward, and those
        members are no longer :attr:`open`."""
        try:
            self._hand_out(positions)
        finally:  # after a failure too: no pass waits for these members any more
            self.open.difference_update(positions)

    def _hand_out(self, positions: Collection[int]) -> None:
        found = [(stack.grad.unbind(0), params) for stack, params in self._stacks if stack.grad is not None]
        for stack, _ in self._stacks:
            stack.grad = None
        fresh: dict[tuple[int, torch.dtype], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        held: list[torch.Tensor] = []
        adding: list[torch.Tensor] = []
        for position in positions:
            for slices, params in found:
                param = params[position]
                if param.grad is None:
                    group = fresh.setdefault((position, param.dtype), ([], []))
                    group[0].append(param)
                    group[1].append(slices[position])
                else:
                    held.append(param.grad)
                    adding.append(slices[position])
        for (_, dtype), (params, parts) in fresh.items():
            grads = _compat.unflatten_dense_tensors(
                parts[0].new_empty(sum(param.numel() for param in params), dtype=dtype), params
            )
            torch._foreach_copy_(grads, parts)  # in the parameters' dtype
            for param, grad in zip(params, grads, strict=True):
                param.grad = grad
        if held:
            torch._foreach_add_(held, adding)

    def forget(self, positions: Collection[int]) -> None:
        """The members at ``positions`` will not come to a backward (they failed, or left the gang)."""
        self.open.difference_update(positions)


class KeptStacks:
    """Stacks kept from pass to pass by their owner (an engine's shared passes): those of the last ``size`` gangs and
    layouts, so that a gang's passes load its stacks rather than make them, and an evaluation of some of its members
    (or rows that differ) does not make the gang's made again after it."""

    def __init__(self, size: int = 2) -> None:
        self.size = size
        self._kept: dict[Hashable, GangStacks] = {}

    def loaded(
        self,
        plans: Sequence[tuple[Any, _Plan]],
        names: Sequence[str],
        rows: Sequence[int],
        version: Hashable,
        compute: torch.dtype | None,
        grad: bool,
    ) -> GangStacks | None:
        """The gang's adapters stacked and loaded for a pass (``None``: no layer of it stacks them): the kept stacks
        of this gang, layout (``rows``), model (``version``: the owner's count of adapters added and removed) and
        ``compute`` dtype when no open pass still needs what they hold; else new ones, kept unless this gang's
        kept ones wait for a backward (a pass keeps its own stacks alive until then)."""
        key = (version, tuple(names), len(set(rows)) == 1, compute)
        stacks = self._kept.get(key)
        if stacks is None or stacks.open:
            fresh = GangStacks(plans, names, key, compute)
            if stacks is None:
                if len(self._kept) >= self.size:
                    del self._kept[next(iter(self._kept))]  # the oldest
                self._kept[key] = fresh
            stacks = fresh
        if not len(stacks):
            return None
        stacks.load(grad)
        return stacks

    def clear(self) -> None:
        """Free the kept stacks (their owner's gangs ended)."""
        self._kept.clear()


def computing_dtype(autocast: AbstractContextManager[Any], device: torch.device) -> torch.dtype | None:
    """The dtype matmuls compute in inside ``autocast`` (a trial kind's mixed precision context) on ``device``, or
    ``None`` without mixed precision."""
    with autocast:
        return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
