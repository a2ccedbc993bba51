"""Where the live trials' states sit and whom the model's forward passes go through.

:class:`Placement` keeps the trials' states within the device's memory budget (offloading the least
recently used idle ones to pinned CPU memory and bringing them back when they train), and routes the shared
model through one trial (its adapter, TRL forward, dropout, checkpointing and RNG: a *switch*) or through a
gang (every member's adapter trainable, the plain forward). It owns the switch and offload counters and the
trial the model is set up for; everything here runs on the device's worker thread.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from optuna_rapidfire import events
from optuna_rapidfire._fused._dropout import DropoutStream

if TYPE_CHECKING:
    from collections.abc import Sequence

    from optuna_rapidfire._engines._types import TrialRuntime
    from optuna_rapidfire._resident._model import ResidentModel
    from optuna_rapidfire._resident._state import RngState


class Placement:
    """The live trials' memory and the model's routing on ``resident``'s device.

    Args:
        resident: The base model with the live trials' adapters.
        live: The device's live trials (the list itself, kept up to date by its owner).
        state_budget: Bytes of trial state (adapters + optimizer moments) kept on the device; ``None``: no
            limit.
    """

    def __init__(self, resident: ResidentModel, live: list[TrialRuntime], state_budget: int | None) -> None:
        self.resident = resident
        self.state_budget = state_budget
        self._live = live
        self.switches = 0
        self.switch_seconds: list[float] = []  # host time of each switch between trials
        self.offloads = 0
        self.current: TrialRuntime | None = None
        """The trial the model was last set up to train alone (``None`` after a gang, a pause or a release)."""
        # The trials of a gang whose members run in turns: none is offloaded while another one runs.
        self.gang: list[TrialRuntime] = []

    @property
    def device(self) -> torch.device:
        return self.resident.device

    def forget(self, runtime: TrialRuntime) -> None:
        """The trial was released: the model is set up for no one."""
        if self.current is runtime:
            self.current = None

    def pause(self, runtime: TrialRuntime) -> None:
        """Move an idle trial's state off the device until it trains again."""
        if runtime.state.resident:
            self._offload(runtime)
        if self.current is runtime:
            self.current = None

    def fit_budget(self, keep: Sequence[TrialRuntime]) -> None:
        """Offload least recently used idle trials (never those in ``keep``) until the state fits the budget."""
        if self.state_budget is None:
            return
        resident = [r for r in self._live if r.state.resident]
        idle = [r for r in resident if not any(r is k for k in keep) and not any(r is k for k in self.gang)]
        if not idle:  # nothing may go (a gang's members resuming, every live trial in the gang): nothing to count
            return
        used = sum(r.state.nbytes() for r in resident)
        for victim in sorted(idle, key=lambda r: r.last_used):
            if used <= self.state_budget:
                break
            used -= victim.state.nbytes()
            self._offload(victim)

    def _offload(self, runtime: TrialRuntime) -> None:
        runtime.state.offload(self.device)
        self.offloads += 1
        if events.listening(events.Offloaded):
            events.emit(events.Offloaded(runtime.spec.number, tuple(r.spec.number for r in self.gang)))

    def on_device(self, runtimes: Sequence[TrialRuntime]) -> None:
        """Bring the trials' states onto the device (marked just used) and offload others to fit the budget."""
        for runtime in runtimes:
            if not runtime.state.resident:
                runtime.state.onload(self.device)
            runtime.last_used = time.monotonic()
        self.fit_budget(keep=runtimes)

    def use(self, runtime: TrialRuntime, only: bool = True) -> None:
        """Route the model's forward passes through the trial: its adapter, its TRL head, its dropout
        (``only``: its adapter the only trainable one; else the trainable ones stay so, as in a gang)."""
        self.resident.activate(runtime.state.adapter_name, only)
        self.resident.use_forward(runtime.forward)
        self.resident.set_base_dropout(runtime.spec.kind.base_dropout_off(runtime.args))

    def switch_to(self, runtime: TrialRuntime) -> None:
        """Set the model up to train the trial alone: its state on the device, its forward, activation
        checkpointing and RNG; counted as a switch when the model was set up for another trial."""
        # a listener of switches gets the device's time too
        timed = events.listening(events.Switched) and self.device.type == "cuda"
        if timed:
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        state = runtime.state
        self.on_device([runtime])
        self.use(runtime)
        enabled, kwargs = runtime.spec.kind.checkpointing(runtime.args)
        self.resident.set_checkpointing(enabled, kwargs)
        state.rng.restore(self.device)
        if timed:
            torch.cuda.synchronize(self.device)
        if self.current is not runtime:
            previous = None if self.current is None else self.current.spec.number
            self.switches += 1
            self.current = runtime
            self.switch_seconds.append(time.perf_counter() - start)
            if events.listening(events.Switched):
                events.emit(events.Switched(runtime.spec.number, previous, self.switch_seconds[-1]))

    def resume(self, runtime: TrialRuntime, gang: Sequence[TrialRuntime], rng: RngState, training: bool) -> None:
        """Set the model up again for a trial whose chunk paused midway while other members of its ``gang``
        ran (:class:`~optuna_rapidfire._trainers.grpo._turns.Turns`): the gang's states on the device, the trial's
        adapter, forward and checkpointing, the global RNG as the trial left it, and train or eval mode."""
        self.on_device(gang)
        self.use(runtime, only=False)  # the members' adapters train in turns: no requires_grad churn
        enabled, kwargs = runtime.spec.kind.checkpointing(runtime.args)
        self.resident.set_checkpointing(enabled, kwargs)
        rng.restore(self.device)
        if self.resident.module.training != training:  # a walk of every module: only when it changes
            self.resident.module.train(training)
        self.current = runtime

    @staticmethod
    def dropout_stream(runtime: TrialRuntime) -> DropoutStream:
        """The trial's own adapter-dropout stream for shared passes: keyed by its args' seed, continued from
        its state (whoever uses it saves its state back in ``runtime.state.dropout_rng``)."""
        return DropoutStream.of(runtime.state.dropout_rng, int(runtime.args.seed))

    def enter_gang(self, runtimes: Sequence[TrialRuntime]) -> None:
        """Set the model up to train the trials together: their states on the device, their adapters
        trainable, the gang's settings (those of its first member: the fused engine admits only gangs that
        agree on them), and the plain model forward (the fused pass computes the losses itself)."""
        self.on_device(runtimes)  # the whole gang: only trials outside it may be offloaded
        first = runtimes[0]
        enabled, kwargs = first.spec.kind.checkpointing(first.args)
        self.resident.set_checkpointing(enabled, kwargs)
        self.resident.use_forward(None)
        self.resident.set_base_dropout(first.spec.kind.base_dropout_off(first.args))
        self.resident.set_trainable([runtime.state.adapter_name for runtime in runtimes], True)
        self.current = None

    def leave_gang(self, runtimes: Sequence[TrialRuntime]) -> None:
        """Freeze the gang's adapters again; the next trial trained alone is a switch."""
        self.resident.set_trainable([runtime.state.adapter_name for runtime in runtimes], False)
        self.current = None
