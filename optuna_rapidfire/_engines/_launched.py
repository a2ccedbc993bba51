"""The fused engine's launched pass: a gang's forward/backward compiled once per layout and reused by every gang.

A *layout* is what a gang's pass graph depends on: which projections of the model carry LoRA (the union of
the members' targets), the rank bucket their ranks are padded to, the adapters' dtype, and whether any member
drops. A gang runs in the smallest layout seen so far that covers its own (a member's projections and rank
fit in it with zeros around them), and only a gang that no seen layout covers makes a new one: a schedule
whose gangs change composition from chunk to chunk compiles a handful of layouts, not one per gang. Gangs of
one layout share a :class:`Layout`: the slot storage of their adapters and Adam moments
(:class:`~optuna_rapidfire._fused._slots.GangSlots`), the slots' AdamW (one launch per step for the whole
gang) and the per-layer LoRA inputs. The pass itself is :func:`~optuna_rapidfire._fused._decoder.
decoder_layer`, compiled by ``torch.compile`` (``fullgraph``, one graph for every layer of the model) the
first time a layout and shape is met, and reused afterwards: a trial joining a gang of a seen layout only
changes the values in the slots, so it triggers no compilation. Shapes (rows, tokens) that change make the
compiler generalise them once (``torch.compile``'s automatic dynamic shapes).

With ``compile="auto"`` on a GPU a stream's passes are not compiled: its training passes, the gang's AdamW step
and its evaluation passes are recorded as CUDA graphs, one per shape, over the active layout's slot storage, and
replayed (:attr:`LaunchedPasses.graphs`, :mod:`~optuna_rapidfire._engines._pass_graphs`); a layout's
recordings go with its storage. What is not recorded (fixed gangs) is compiled. Compilation is counted
(:attr:`LaunchedPasses.compiles`) and on a GPU never stalls training: the pass of a
layout and shape that is not compiled yet runs eagerly (the same functions, uncompiled) while a background
thread compiles it on inputs of the same shapes (:class:`_Background`); the passes after that take the compiled
code. The device's thread only ever *runs* compiled code (``torch._dynamo.run``): a shape no compiled graph
covers runs eagerly and is compiled in the background in turn, so compilation never happens inside a pass.
Compiled graphs are kept in Inductor's caches on disk (``TORCHINDUCTOR_CACHE_DIR``, ``/tmp/torchinductor_<user>``
by default), so a later study of the same layout on the machine compiles from them in seconds. Synchronous
compilation (``background=False``, the default on the CPU) compiles inside the first pass of each layout and
shape, and times and logs that pass. A layout whose compilation fails runs the same functions uncompiled, with
the reason logged: results are the same (up to the rounding of fused kernels). ``compile=False`` runs every
layout uncompiled.
"""

from __future__ import annotations

import contextlib
import threading
import time
import types
import warnings
from typing import TYPE_CHECKING, Any

import torch

from optuna_rapidfire import _compat, events
from optuna_rapidfire._engines import _environment
from optuna_rapidfire._engines._background import RECOMPILE_LIMIT, BackgroundCompiler
from optuna_rapidfire._engines._layouts import Layout, LayoutKey, Member, covering, member_of
from optuna_rapidfire._engines._pass_graphs import CudaGraphs, PassGraphs, Reenactment
from optuna_rapidfire._fused._decoder import (
    PROJECTIONS,
    Decoder,
    Lora,
    Rows,
    decoder_layer,
    projection_of,
    salts_of,
)
from optuna_rapidfire._fused._dropout import layer_salt
from optuna_rapidfire._fused._slots import (
    GangAdamW,
    GangSlots,
    adamw_step,
    rank_bucket,
)
from optuna_rapidfire._logging import get_logger

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence

    from optuna_rapidfire._engines._types import TrialRuntime
    from optuna_rapidfire._resident._model import ResidentModel

_logger = get_logger(__name__)


class LaunchedPasses:
    """The launched passes of one device's fused engine.

    Args:
        resident: The base model with the trials' adapters.
        compile: ``False`` (run uncompiled), or the ``torch.compile`` backend (``"inductor"``...).
        capacity: Slots per layout: the most trials a gang holds.
        background: Compile in a background thread while the passes run eagerly (``None``: as the environment's
            ``RAPIDFIRE_COMPILE_IN_BACKGROUND`` says, by default on a GPU only).
        graphs: Replay streamed training passes, optimizer steps and evaluations from CUDA graphs, one per shape
            (:mod:`~optuna_rapidfire._engines._pass_graphs`): those passes run uncompiled kernels and never ask
            the compiler for anything. A CPU has no CUDA graphs: its replays run the recorded function again
            (:class:`~optuna_rapidfire._engines._pass_graphs.Reenactment`, a check that a pass reads only its
            inputs).

    Attributes:
        graphs: The recorded passes (``None``: every pass is launched kernel by kernel).
    """

    def __init__(
        self,
        resident: ResidentModel,
        compile: str | bool,
        capacity: int,
        background: bool | None = None,
        graphs: bool = False,
    ) -> None:
        self.resident = resident
        self.backend = compile if isinstance(compile, str) else ("inductor" if compile else None)
        self.capacity = capacity
        self.compiles = 0
        self.compile_failures = 0
        self._layouts: dict[LayoutKey, Layout] = {}
        self._active: Layout | None = None
        self._decoder: Decoder | None = None
        self._refusal = Decoder.refusal(resident.base)
        # What each trial is in slot terms, for the model's adapters as they are (see :meth:`member`).
        self._members_of: int | None = None
        self._members: dict[str, Member | str] = {}
        self._layer_fn: Callable[..., torch.Tensor] = decoder_layer
        self._step_fn: Callable[..., None] = adamw_step
        self._local = threading.local()  # the layout whose compilations are counted, per thread
        self.background: BackgroundCompiler | None = None
        self.graphs: PassGraphs | None = None
        if graphs and resident.device.type == "cuda":
            self.graphs = PassGraphs(CudaGraphs(), torch.cuda.Stream(resident.device))
        elif graphs:
            self.graphs = PassGraphs(Reenactment())
        if self.backend is not None and self._refusal is None:
            # Functions of their own (fresh code objects): the compiler's cache lives and dies with this engine.
            layer, step = _fresh(decoder_layer), _fresh(adamw_step)
            self._compile_layer = torch.compile(layer, fullgraph=True, backend=self._count)
            self._compile_step = torch.compile(step, fullgraph=True, backend=self._count)
            if background is None:
                background = _environment.flag(_environment.COMPILE_IN_BACKGROUND)
            if background if background is not None else resident.device.type == "cuda":
                # The device's thread runs only what is compiled (never compiles); the thread compiles.
                _compat.run_beside_compiler()
                self.background = BackgroundCompiler(self)
                self._layer_fn, self._step_fn = torch._dynamo.run(layer), torch._dynamo.run(step)
            else:
                self._layer_fn, self._step_fn = self._compile_layer, self._compile_step

    # -- which gangs it runs ---------------------------------------------------------------------

    def refusal(self, runtimes: Sequence[TrialRuntime]) -> str | None:
        """Why these trials cannot take the launched pass (``None``: they can)."""
        if self._refusal is not None:
            return self._refusal
        first = runtimes[0]
        if first.spec.kind.checkpointing(first.args)[0]:
            return "activation checkpointing is on"
        for runtime in runtimes:
            found = self.member(runtime)
            if isinstance(found, str):
                return f"trial {runtime.spec.number} {found}"
        return None

    def member(self, runtime: TrialRuntime) -> Member | str:
        """The trial as the launched pass sees it, or why it cannot take it (kept until an adapter is added to
        or removed from the model: a trial of a later study may have an earlier trial's adapter name)."""
        version = self.resident.adapters_version
        if self._members_of != version:
            self._members_of, self._members = version, {}
        name = runtime.state.adapter_name
        found = self._members.get(name)
        if found is None:
            found = self._members[name] = member_of(self.resident.lora_layers(), runtime)
        return found

    @property
    def decoder(self) -> Decoder:
        if self._decoder is None:
            self._decoder = Decoder(self.resident.base)
        return self._decoder

    # -- layouts ---------------------------------------------------------------------------------

    def load(self, runtimes: Sequence[TrialRuntime]) -> Layout:
        """Put the gang's members into the slots of their layout (member k in slot k) and return it."""
        members = [self.member(runtime) for runtime in runtimes]
        assert all(isinstance(m, Member) for m in members), "refusal() lets only such gangs through"
        typed = [m for m in members if isinstance(m, Member)]
        if len(typed) > self.capacity:
            raise ValueError(f"A gang of {len(typed)} trials exceeds the {self.capacity} slots of a layout.")
        key = LayoutKey(
            projections=frozenset(p for m in typed for p in m.adapter.projections),
            rank=rank_bucket(max(m.adapter.rank for m in typed)),
            dtype=next(iter(typed[0].adapter.projections.values()))[0].dtype,
            dropout=any(m.adapter.dropout > 0 for m in typed),
        )
        layout = self._layouts.get(key) or covering(self._layouts, key, self.backend is not None)
        if layout is None:
            layout = self._layouts[key] = Layout(key, compiled=self.backend is not None)
        self._activate(layout)
        slots, optimizer = layout.slots, layout.optimizer
        assert slots is not None and optimizer is not None
        for slot, (member, runtime) in enumerate(zip(typed, runtimes, strict=True)):
            slots.load(slot, member.adapter, runtime.state.optimizer)
            optimizer.configure(slot, member.settings)
        return layout

    def store(self, layout: Layout, runtimes: Sequence[TrialRuntime]) -> None:
        """Copy every member's slot back into its own parameters and optimizer state."""
        assert layout.slots is not None
        for slot, runtime in enumerate(runtimes):
            layout.slots.store(slot, runtime.state.optimizer)

    def _activate(self, layout: Layout) -> None:
        """Give ``layout`` its storage, freeing the previous layout's (one layout's storage lives at a time)."""
        if self._active is layout:
            return
        self.release()
        device = self.resident.device
        projections = sorted(layout.key.projections, key=lambda p: (p.layer, PROJECTIONS.index(p.name)))
        slots = GangSlots(projections, layout.key.rank, self.capacity, layout.key.dtype, device)
        layout.slots = slots
        layout.optimizer = GangAdamW(slots, self._step_fn if self.backend is not None else None)
        by_layer: list[list[Lora | None]] = [[None] * len(PROJECTIONS) for _ in self.decoder.layers]
        for p in projections:
            by_layer[p.layer][PROJECTIONS.index(p.name)] = Lora(slots.a[p], slots.b[p], slots.scale[p])
        layout.loras = [tuple(entries) for entries in by_layer]
        named = [(projection_of(n), n) for n, _ in self.resident.lora_layers()]
        places = [(where, layer_salt(n)) for where, n in named if where is not None]
        table = salts_of(len(self.decoder.layers), [w for w, _ in places], [s for _, s in places])
        layout.salts = torch.tensor(table, dtype=torch.int64, device=device)
        self._active = layout

    def release(self) -> None:
        """Free the active layout's storage and its recorded passes (the compiled code stays)."""
        if self._active is not None:
            if self.graphs is not None and self._active.slots is not None:
                self.graphs.forget(self._active.slots)
            self._active.slots = self._active.optimizer = self._active.salts = None
            self._active.loras = []
            self._active = None

    def close(self) -> None:
        """Drop every reference to the model and the slots. The compiler keeps its compiled code (and with it
        this object, through the counting backend) for the life of the process: without this, a closed
        executor's model would stay on the device."""
        if self.background is not None:
            self.background.close()
        self.release()
        self._layouts.clear()
        self._members, self._decoder = {}, None
        del self.resident

    def storage_bytes(self) -> int:
        """Bytes of the active layout's slot storage."""
        slots = None if self._active is None else self._active.slots
        return 0 if slots is None else slots.nbytes()

    # -- the pass --------------------------------------------------------------------------------

    def hidden(
        self, input_ids: torch.Tensor, rows: Rows, layout: Layout | None, *, eager: bool = False
    ) -> torch.Tensor:
        """The final hidden states ``[rows, tokens, hidden]`` of a pass: the frozen base with every member's
        LoRA on its units (``layout``), or the base alone (``None``, a reference pass); ``eager``: uncompiled
        kernels, nothing asked of the compiler (a pass recorded as a CUDA graph)."""
        decoder = self.decoder
        _compat.allow_recompiles(RECOMPILE_LIMIT)  # on the thread that compiles
        h = decoder.embed(input_ids)
        if layout is not None and torch.is_grad_enabled():
            # Every layer then sees an input that requires grad: one compiled graph serves the first layer too.
            h.requires_grad_(True)
        cos, sin = decoder.tables(input_ids.shape[1], h.dtype, h.device)
        compiled = (layout is None or layout.compiled) and not eager
        fn = self._layer_fn if compiled and self.backend is not None else decoder_layer
        loras: Sequence[tuple[Lora | None, ...]] = (
            layout.loras if layout is not None else [(None,) * len(PROJECTIONS)] * len(decoder.layers)
        )
        salts = layout.salts if layout is not None else None
        zeros = torch.zeros(len(PROJECTIONS), dtype=torch.int64, device=h.device) if salts is None else None
        if self.background is not None and compiled and decoder.layers:
            first_salts = salts[0] if salts is not None else zeros
            assert first_salts is not None
            self.background.layer(layout, h, cos, sin, decoder.layers[0], loras[0], rows, first_salts, decoder.shape)
        for index, weights in enumerate(decoder.layers):
            layer_salts = salts[index] if salts is not None else zeros
            assert layer_salts is not None
            h = fn(h, cos, sin, weights, loras[index], rows, layer_salts, decoder.shape)
        return decoder.norm(h)

    @contextlib.contextmanager
    def compiling(self, layout: Layout) -> Iterator[None]:
        """Context of one pass of ``layout``: compilations in it are counted for the layout, and its first pass
        is timed (compilation included) and logged once."""
        self._local.current = layout
        first = layout.first_pass_seconds is None and layout.compiled and self.backend is not None
        first = first and self.background is None  # compiled in the background: no pass waits for it
        start = time.perf_counter()
        try:
            with warnings.catch_warnings():
                # The slots' gradients are views of one matrix (the gradient layout contract is about speed).
                warnings.filterwarnings("ignore", message=".*gradient layout contract.*")
                yield
        finally:
            self._local.current = None
        if first:
            layout.first_pass_seconds = time.perf_counter() - start
            _logger.info(
                "Compiled the launched pass for layout [%s]: first pass %.1f s, %d compilation(s).",
                layout.key.describe(),
                layout.first_pass_seconds,
                layout.compiles,
            )
            if events.listening(events.Compiled):
                events.emit(events.Compiled(layout.key.describe(), layout.first_pass_seconds))

    # -- what the background compiler uses (:class:`~optuna_rapidfire._engines._background.Compiler`) -----------

    @property
    def device(self) -> torch.device:
        return self.resident.device

    def compile_layer(self, *args: Any) -> Any:
        return self._compile_layer(*args)

    def compile_step(self, *args: Any) -> Any:
        return self._compile_step(*args)

    @contextlib.contextmanager
    def counting(self, layout: Layout | None) -> Iterator[None]:
        self._local.current = layout
        try:
            yield
        finally:
            self._local.current = None

    def fall_back(self, layout: Layout, error: BaseException) -> None:
        """Run ``layout`` uncompiled from now on, and say why."""
        layout.compiled = False
        self.compile_failures += 1
        lines = str(error).strip().splitlines()
        _logger.warning(
            "Compiling the launched pass for layout [%s] failed (%s: %s); running it uncompiled.",
            layout.key.describe(),
            type(error).__name__,
            lines[0] if lines else "",
        )
        # What the compiler said (a kernel that failed in a compile worker says it on the following lines).
        _logger.info("The compiler's error, in full:\n%s", "\n".join(lines[-60:]))

    def step(self, layout: Layout, ready: torch.Tensor, lr: torch.Tensor, *, eager: bool = False) -> None:
        """The gang's optimizer step (compiled with the layout unless it fell back; a step whose compilation
        fails runs uncompiled: the compiler fails before anything is updated); ``eager``: uncompiled (a step
        recorded as a CUDA graph)."""
        optimizer = layout.optimizer
        assert optimizer is not None
        if eager:
            optimizer.step(ready, lr, eager=True)
            return
        _compat.allow_recompiles(RECOMPILE_LIMIT)  # on the thread that compiles
        if not (layout.compiled and self.backend is not None):
            optimizer.compiled = False
        elif self.background is not None:
            self.background.step(layout, optimizer)  # asked once per layout: compiled while the steps run eagerly
        try:
            optimizer.step(ready, lr)
        except Exception as error:
            if not (optimizer.compiled and _compat.is_compile_error(error)):
                raise
            self.fall_back(layout, error)
            optimizer.compiled = False
            optimizer.step(ready, lr)

    def _count(self, graph: Any, example_inputs: Any) -> Any:
        """The compile backend: count the compilation, then hand the graph to the chosen backend."""
        self.compiles += 1
        current = getattr(self._local, "current", None)
        if current is not None:
            current.compiles += 1
        assert self.backend is not None
        return _compat.compile_backend(self.backend)(graph, example_inputs)


def _fresh(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A copy of ``fn`` with a code object of its own (``torch.compile`` keeps its cache on the code object)."""
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__doc__ = fn.__doc__
    return copy
