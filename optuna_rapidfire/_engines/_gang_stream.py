"""A gang that never waits for its slowest member: members at any step share every pass, and each one leaves at
the pass boundary where its chunk ends, while others take its slot.

:meth:`GangTraining.train` trains a fixed gang's chunks and returns when the member with the most micro-batches
is done, so a member of batch 16 idles while one of batch 4 trains 4 times as many steps, and the next chunk of
anyone waits for the whole gang. A stream instead keeps the launched pass's slots full (continuous batching, as
an inference server keeps its batch full): every pass takes the next micro-batch of each seated member, wherever
it stands in its own chunk; a member whose chunk ends is evaluated, stored back into its own state and handed to
its Optuna thread at that pass boundary, and a :class:`Refill` (the device's scheduler) seats whoever the
schedule lets train next in the free slot: a promoted trial, a new config, or the same trial's next chunk. The
stream ends when no member is seated and nobody is ready.

Each member's values are those it gets alone: its micro-batches, loss scales, optimizer steps, learning rates and
dropout masks are its own (drawn from its own stream, per row of its own micro-batch), whatever shares its pass;
the compiled pass's shapes stay few (each pass's rows padded to one of a few sizes, in units of one row count;
the tokens to the widest chunk seen), so once the compiler has generalised the rows (after two sizes) members
coming and going never compile the pass again.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from optuna_rapidfire import _compat, events
from optuna_rapidfire._engines._fusion import train_refusal
from optuna_rapidfire._engines._gang_passes import chunk_width, row_bucket, split_passes
from optuna_rapidfire._engines._pass_graphs import replayed
from optuna_rapidfire._engines._trials import chunks_starting
from optuna_rapidfire._engines._types import clips, train_metrics
from optuna_rapidfire._fused._fused_pass import to_device_async
from optuna_rapidfire._fused._slots import rank_bucket
from optuna_rapidfire._resident._state import RngState

if TYPE_CHECKING:
    from collections.abc import Sequence

    from optuna_rapidfire._engines._gang_evaluation import GangEvaluation
    from optuna_rapidfire._engines._gang_passes import MemberChunk
    from optuna_rapidfire._engines._gang_training import GangTraining
    from optuna_rapidfire._engines._launched import Layout, Member
    from optuna_rapidfire._engines._types import ChunkResult, TrialRuntime
    from optuna_rapidfire._fused._dropout import DropoutStream
    from optuna_rapidfire._trainers._fused_loss import FusedLoss


class Refill(Protocol):
    """What a stream asks of the device between passes."""

    def joiners(self, room: int, fits: Any) -> Sequence[TrialRuntime]:
        """At most ``room`` trials to seat now (``fits(runtime)`` says whether one can join this stream; the first
        that cannot ends the refilling, so it leads the next gang)."""
        ...

    def delivered(self, done: Sequence[tuple[TrialRuntime, ChunkResult | BaseException]]) -> None:
        """Members whose chunk ended at this pass boundary, with their results (or the error that failed one)."""
        ...

    def timed(self, members: int, seconds: float) -> None:
        """A pass of ``members`` members took ``seconds`` (device seconds where the pass clock has CUDA events;
        what one more member costs a pass)."""
        ...


@dataclass(eq=False)
class Seat:
    """A member in a slot: its chunk's micro-batches, where it stands in them, its losses and steps so far."""

    runtime: TrialRuntime
    slot: int
    plan: MemberChunk
    stream: DropoutStream
    index: int = 0
    taken: int = 0
    train_seconds: float = 0.0  # its share of the passes it was in: each pass's wall time over the members in it
    losses: list[torch.Tensor] = field(default_factory=list)


class PassClock:
    """Each pass's seconds as the device spent them: on CUDA, between events recorded on the device around the
    pass and read once both are done (never waiting for them), so a launch-bound pass counts its launch gaps and
    a compute-bound one its arithmetic, though the host runs ahead of it; elsewhere the host's seconds."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.pending: deque[tuple[int, torch.cuda.Event, torch.cuda.Event]] = deque()

    def _mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def start(self) -> torch.cuda.Event | None:
        return self._mark() if self.cuda else None

    def stop(self, began: torch.cuda.Event | None, members: int, host_seconds: float) -> list[tuple[int, float]]:
        """The passes timed so far (``(members, seconds)``, oldest first), this one's once the device is done."""
        if began is None:
            return [(members, host_seconds)]
        self.pending.append((members, began, self._mark()))
        done = []
        while self.pending and self.pending[0][2].query():
            count, first, last = self.pending.popleft()
            done.append((count, first.elapsed_time(last) / 1000))
        return done


def width_bucket(tokens: int) -> int:
    """The tokens a stream pads its rows to: the next multiple of 128."""
    return -(-tokens // 128) * 128


class GangStream:
    """Trains a stream of members through :class:`GangTraining`'s launched pass and :class:`GangEvaluation`.

    Attributes:
        passes: Shared passes trained (counted in :attr:`GangTraining.fused_steps` too).
        members_per_pass: How many members each pass trained (the gang's fill).
    """

    def __init__(self, training: GangTraining, evaluation: GangEvaluation) -> None:
        self.training = training
        self.evaluation = evaluation
        self.passes = training.passes
        self.trials = training.trials
        self.launched = training.launched
        self.device = training.device
        self.members_per_pass: list[int] = []
        self.seated: list[TrialRuntime] = []

    def fill(self) -> tuple[int, ...]:
        """How many passes trained each number of members (index: members)."""
        counts = [0] * (self.launched.capacity + 1)
        for members in list(self.members_per_pass):
            counts[min(members, len(counts) - 1)] += 1
        return tuple(counts)

    # -- who may join --------------------------------------------------------------------------

    def refusal(self, runtimes: Sequence[TrialRuntime]) -> str | None:
        """Why these trials cannot start a stream (``None``: they can)."""
        reason = train_refusal(self.trials.resident, self.trials.extras, runtimes)
        if reason is not None:
            return reason
        reason = self.launched.refusal(runtimes)
        if reason is not None:
            return reason
        if len(runtimes) > self.launched.capacity:
            return f"a gang of {len(runtimes)} trials exceeds the {self.launched.capacity} slots of a layout"
        loss = runtimes[0].spec.kind.fused_loss
        if loss is None or not loss.pads_rows:
            return "its loss reads the rows' layout (a micro-batch cannot get rows of padding)"
        for runtime in runtimes:
            side = getattr(getattr(runtime.trainer, "processing_class", None), "padding_side", "right")
            if side != "right":
                return f"trial {runtime.spec.number} pads on the {side} (the launched pass pads on the right only)"
        return None

    def _fits(self, runtime: TrialRuntime, seats: Sequence[Seat], layout: Layout, unit: int) -> bool:
        """Whether ``runtime`` can take a slot of this stream: it shares a pass with the seated members, its
        adapter fits the layout, and its micro-batch is whole units."""
        member = self.launched.member(runtime)
        if isinstance(member, str) or not _covered(member, layout):
            return False
        if int(runtime.args.per_device_train_batch_size) % unit:
            return False
        gang = [seat.runtime for seat in seats] + [runtime]
        return train_refusal(self.trials.resident, self.trials.extras, gang) is None

    # -- the stream ----------------------------------------------------------------------------

    def run(self, runtimes: Sequence[TrialRuntime], refill: Refill) -> None:
        """Train ``runtimes`` and whoever ``refill`` seats after them until no member is left; every member's
        result goes to ``refill.delivered`` at the pass boundary where its chunk ends. An error of a pass is
        raised (:attr:`GangTraining.stepped` says whether any seated member had stepped by then)."""
        training = self.training
        training.stepped = False
        loss = runtimes[0].spec.kind.fused_loss
        assert loss is not None  # refusal() lets only kinds with a fused loss through
        capacity = self.launched.capacity
        placement = self.trials.placement
        placement.gang = list(runtimes)
        placement.enter_gang(runtimes)
        layout = self.launched.load(runtimes)
        training.layout = layout
        self.trials.resident.module.train()
        unit = 4  # rows of a unit: at most 4, so that a joiner of any batch size a multiple of 4 fits
        for runtime in runtimes:
            unit = math.gcd(unit, int(runtime.args.per_device_train_batch_size))
        if layout.unit and unit % layout.unit == 0:
            unit = layout.unit  # the layout's earlier streams' unit divides these members' rows: keep its shapes
        seats: list[Seat | None] = [None] * capacity
        clock = PassClock(self.device)
        for slot, runtime in enumerate(runtimes):
            seats[slot] = self._seat(runtime, slot, layout, loss, loaded=True)
        accepting = True
        while True:
            seated = [seat for seat in seats if seat is not None]
            if accepting and len(seated) < capacity:
                accepting = self._refill(refill, seats, layout, loss, unit)
                seated = [seat for seat in seats if seat is not None]
            self.seated = [seat.runtime for seat in seated]
            if not seated:
                break
            numbers = tuple(seat.runtime.spec.number for seat in seated)
            start = time.perf_counter()
            began = clock.start()
            heard = events.listening(events.PassTrained)
            batches = tuple(seat.index for seat in seated) if heard else ()
            with events.window(numbers, self.trials.device):
                compiles = self._pass(seated, layout, loss, unit, layout.width)
            elapsed = time.perf_counter() - start
            for seat in seated:
                seat.train_seconds += elapsed / len(seated)
            for members, seconds in clock.stop(began, len(seated), elapsed):
                refill.timed(members, seconds)
            if heard:
                steps = tuple(seat.runtime.state.position.chunks_done for seat in seated)
                events.emit(events.PassTrained(numbers, steps, elapsed, "stream", batches, compiles))
            ended = [seat for seat in seated if seat.index >= len(seat.plan.inputs)]
            if ended:
                for seat in ended:
                    seats[seat.slot] = None
                results = self._end(ended, layout)
                self.seated = [seat.runtime for seat in seats if seat is not None]
                refill.delivered(results)
        self.trials.placement.gang = []

    def _refill(self, refill: Refill, seats: list[Seat | None], layout: Layout, loss: FusedLoss, unit: int) -> bool:
        """Seat the trials the device hands over in the free slots; ``False`` once one could not join."""
        free = [slot for slot, seat in enumerate(seats) if seat is None]
        seated = [seat for seat in seats if seat is not None]
        blocked = False

        def fits(runtime: TrialRuntime) -> bool:
            nonlocal blocked
            blocked = blocked or not self._fits(runtime, seated, layout, unit)
            return not blocked

        for slot, runtime in zip(free, refill.joiners(len(free), fits), strict=False):
            seat = seats[slot] = self._seat(runtime, slot, layout, loss, loaded=False)
            seated.append(seat)
        return not blocked

    def _seat(self, runtime: TrialRuntime, slot: int, layout: Layout, loss: FusedLoss, *, loaded: bool) -> Seat:
        """Put a member in ``slot``: its state on the device and in the slot, its next chunk laid out."""
        chunks_starting(self.trials, [runtime])
        placement = self.trials.placement
        if not loaded:
            placement.gang = [*placement.gang, runtime]
            placement.enter_gang([runtime])
            member = self.launched.member(runtime)
            assert not isinstance(member, str)
            assert layout.slots is not None and layout.optimizer is not None
            layout.slots.load(slot, member.adapter, runtime.state.optimizer)
            layout.optimizer.configure(slot, member.settings)
        plan = self.passes.plan(runtime, loss)
        # The tokens only grow (per layout, across streams); the rows take a few sizes (row_bucket), which the
        # compiler covers with one graph once it has met two (its automatic dynamic shapes): after that no
        # member leaving or joining compiles anything.
        layout.width = max(layout.width, width_bucket(chunk_width([plan])))
        return Seat(runtime, slot, plan, placement.dropout_stream(runtime))

    def _pass(self, seated: Sequence[Seat], layout: Layout, loss: FusedLoss, unit: int, width: int) -> int:
        """One step of every seated member: their micro-batches in shared passes (at most ``pass_tokens`` tokens
        each), then the optimizer step of those whose accumulation is done; the compilations the passes' forward
        and backward waited for."""
        training = self.training
        first = seated[0].runtime
        runtimes = [seat.runtime for seat in seated]
        plans = [seat.plan for seat in seated]
        streams = [seat.stream for seat in seated]
        # Each member's micro-batch takes its batch size in rows (a short one is padded: refusal() admits only
        # losses that allow it).
        sizes = [int(runtime.args.per_device_train_batch_size) for runtime in runtimes]
        graphs = self.launched.graphs
        # Recorded passes need shapes that depend on the rows and width only: the loss tokens padded too.
        sums = self.launched.capacity + 1 if graphs is not None and loss.pads_tokens else None
        groups = split_passes(list(range(len(seated))), [size * width for size in sizes], self.passes.pass_tokens)
        compiles = self.launched.compiles
        for group in groups:
            layout.unit = unit
            shared = self.passes.lay_out(
                runtimes,
                plans,
                streams,
                group,
                0,
                {},
                loss,
                layout,
                width,
                at=[seated[k].index for k in group],
                slots=[seated[k].slot for k in group],
                shape=(unit, row_bucket(sum(sizes[k] for k in group), unit)),
                sums=sums,
            )
            training.starting(runtimes, group)
            for k, value in zip(group, training.run_pass(first, shared), strict=True):
                seated[k].losses.append(value)
        compiles = self.launched.compiles - compiles
        training.fused_steps += 1
        training.launched_steps += 1
        self.members_per_pass.append(len(seated))
        capacity = self.launched.capacity
        ready, lr = [0.0] * capacity, [0.0] * capacity
        for seat in seated:
            if seat.plan.steps_at(seat.index):
                state = seat.runtime.state
                ready[seat.slot] = 1.0
                lr[seat.slot] = _compat.lr_at(state.lr_scheduler, state.position.optimizer_steps + seat.taken)
                seat.taken += 1
            seat.index += 1
        if any(ready):
            training.stepped = True
            ready_t = to_device_async(torch.tensor(ready, dtype=torch.float32), self.device)
            lr_t = to_device_async(torch.tensor(lr, dtype=torch.float64), self.device)
            # A recorded step runs uncompiled kernels (nothing of a stream asks the compiler for anything).
            recorded = graphs is not None
            replayed(
                graphs,
                layout.slots,
                "step",
                [ready_t, lr_t],
                lambda t: self.launched.step(layout, *_both(t), eager=recorded),
            )
        return compiles

    def _end(self, ended: Sequence[Seat], layout: Layout) -> list[tuple[TrialRuntime, ChunkResult | BaseException]]:
        """The members whose chunk ended: evaluated together through their slots, then stored back into their
        own states and finished (each member's error its own)."""
        assert layout.slots is not None and layout.optimizer is not None
        norms = []
        for seat in ended:  # stored first: a member evaluated alone reads its own parameters
            runtime = seat.runtime
            norms.append(layout.optimizer.last_norm[seat.slot].clone() if clips(runtime.args) else None)
            layout.slots.store(seat.slot, runtime.state.optimizer)
            _compat.count_train_tokens(runtime.trainer, seat.plan.tokens)  # the eval metrics report them
        runtimes = [seat.runtime for seat in ended]
        # The slots still hold the members' weights (a store leaves them): evaluate through them.
        evaluated = self.evaluation.evaluate(runtimes, layout, slots=[seat.slot for seat in ended])
        done: list[tuple[TrialRuntime, ChunkResult | BaseException]] = []
        for seat, own, grad_norm in zip(ended, evaluated, norms, strict=True):
            runtime, state = seat.runtime, seat.runtime.state
            state.position.optimizer_steps += seat.taken
            _compat.seek_lr_scheduler(state.lr_scheduler, state.position.optimizer_steps)
            runtime.trainer.state.global_step = state.position.optimizer_steps
            state.position.chunks_done += 1
            state.rng = RngState.capture(self.device)
            state.dropout_rng = seat.stream.state()
            plan = seat.plan
            per_step = [
                torch.stack(seat.losses[i : i + plan.accumulation]).sum()
                for i in range(0, len(seat.losses), plan.accumulation)
            ]
            metrics = train_metrics(runtime, per_step, grad_norm)
            self.trials.placement.leave_gang([runtime])
            self.trials.placement.gang = [r for r in self.trials.placement.gang if r is not runtime]
            try:
                done.append((runtime, self.trials.finish(runtime, metrics, seat.train_seconds, own)))
            except Exception as error:  # this member's evaluation only
                done.append((runtime, error))
        return done


def _both(tensors: Sequence[torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor]:
    first, second = tensors
    assert first is not None and second is not None
    return first, second


def _covered(member: Member, layout: Layout) -> bool:
    """Whether ``member`` runs in ``layout``: its projections in it, its rank within the bucket, its dtype, and
    dropout only if the layout drops."""
    adapter = member.adapter
    dtype = next(iter(adapter.projections.values()))[0].dtype
    return (
        set(adapter.projections) <= layout.key.projections
        and rank_bucket(adapter.rank) <= layout.key.rank
        and dtype == layout.key.dtype
        and (layout.key.dropout or adapter.dropout == 0)
    )
