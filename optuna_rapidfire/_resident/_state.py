"""Per-trial state: everything that is swapped when the device moves from one trial to another.

The base model is never part of it. A trial's state is its LoRA weights (held in the shared
``PeftModel`` under the trial's adapter name), its optimizer and LR scheduler, its grad scaler, its
random number generators and its position in the data. While a memory budget allows, the tensors stay
on the device; past it, idle trials' tensors move to pinned CPU memory and back (:meth:`SwapState.offload`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from torch.optim import Optimizer
    from torch.optim.lr_scheduler import LRScheduler


@dataclass
class RngState:
    """The generators a training step may draw from (dropout masks above all)."""

    cpu: torch.Tensor
    device: torch.Tensor | None
    python: tuple[Any, ...]
    numpy: dict[str, Any]

    @classmethod
    def seeded(cls, seed: int, device: torch.device) -> RngState:
        """Seed every generator with ``seed`` and return their state (restoring what was there before)."""
        saved = cls.capture(device)
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed % 2**32)
        state = cls.capture(device)
        saved.restore(device)
        return state

    @classmethod
    def capture(cls, device: torch.device) -> RngState:
        """Read the current state of the CPU, device, Python and NumPy generators."""
        device_state = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        return cls(
            cpu=torch.get_rng_state(),
            device=device_state,
            python=random.getstate(),
            numpy=np.random.get_state(legacy=False),
        )

    def restore(self, device: torch.device) -> None:
        """Make this the current state of every generator."""
        torch.set_rng_state(self.cpu)
        if self.device is not None and device.type == "cuda":
            torch.cuda.set_rng_state(self.device, device)
        random.setstate(self.python)
        np.random.set_state(self.numpy)


@dataclass
class Position:
    """Where a trial is in the data: chunks trained so far (its next report step) and optimizer steps."""

    chunks_done: int = 0
    optimizer_steps: int = 0

    def chunk(self, num_chunks: int) -> tuple[int, int]:
        """Return ``(epoch, chunk index within the epoch)`` of the next chunk."""
        return divmod(self.chunks_done, num_chunks)


@dataclass
class SwapState:
    """The swappable state of one trial on one device.

    Attributes:
        adapter_name: Name of the trial's adapter in the shared ``PeftModel``.
        params: The adapter's trainable parameters (what the optimizer updates).
        optimizer: The trial's optimizer, built by its TRL trainer from its training args.
        lr_scheduler: The trial's LR schedule, laid over the trial's whole run.
        scaler: Gradient scaler for fp16 training, else ``None``.
        rng: Generator states to restore before the trial's next chunk.
        position: Progress through the chunks.
    """

    adapter_name: str
    params: list[torch.nn.Parameter]
    optimizer: Optimizer
    lr_scheduler: LRScheduler
    scaler: torch.amp.GradScaler | None
    rng: RngState
    position: Position = field(default_factory=Position)
    resident: bool = True
    # The shared passes' adapter-dropout stream (``DropoutStream.state()``: key and passes), once it has one.
    dropout_rng: torch.Tensor | None = None
    # The generator state of the trial's own sampling when it generates completions (GRPO), once it has one.
    sample_rng: torch.Tensor | None = None
    _moved: list[tuple[dict[str, Any], str]] = field(default_factory=list, repr=False)
    _nbytes: tuple[tuple[int, int, int], int] | None = field(default=None, repr=False)  # (key, bytes) last counted

    def nbytes(self) -> int:
        """Bytes of the adapter weights and optimizer moments.

        Counted again only when the optimizer's state has gained or lost entries (its moments appear at the
        first step), not at each call: a gang's members ask at every resumption.
        """
        states = self.optimizer.state
        key = (len(self.params), len(states), sum(len(state) for state in states.values()))
        if self._nbytes is not None and self._nbytes[0] == key:
            return self._nbytes[1]
        total = sum(p.numel() * p.element_size() for p in self.params)
        for state in list(states.values()):
            for value in list(state.values()):
                if isinstance(value, torch.Tensor):
                    total += value.numel() * value.element_size()
        self._nbytes = (key, total)
        return total

    def offload(self, device: torch.device) -> None:
        """Move the adapter weights and optimizer moments to (pinned) CPU memory.

        Parameters keep their identity (only ``.data`` moves), so the optimizer, the scheduler and the
        ``PeftModel`` still refer to the same objects; the copies are ordered on the current stream, so
        no synchronisation is needed before the device memory is reused.
        """
        if not self.resident:
            return
        pin = device.type == "cuda"
        self._moved = []
        for p in self.params:
            p.data = _to_cpu(p.data, pin)
            state = self.optimizer.state.get(p)
            if not state:
                continue
            for key, value in state.items():
                # Tensors kept on the CPU by the optimizer itself (Adam's step count) stay where they are.
                if isinstance(value, torch.Tensor) and value.device == device:
                    state[key] = _to_cpu(value, pin)
                    self._moved.append((state, key))
        self.resident = False

    def onload(self, device: torch.device) -> None:
        """Bring the state back to ``device`` after :meth:`offload`."""
        if self.resident:
            return
        for p in self.params:
            if p.device != device:
                p.data = p.data.to(device, non_blocking=True)
        for state, key in self._moved:
            state[key] = state[key].to(device, non_blocking=True)
        self._moved = []
        self.resident = True


def _to_cpu(tensor: torch.Tensor, pin: bool) -> torch.Tensor:
    out = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)
    out.copy_(tensor, non_blocking=pin)
    return out
