"""Compiling the launched pass in a background thread, on inputs shaped like the pass's, while the device's thread
runs it eagerly: no pass waits for a compilation."""

from __future__ import annotations

import queue
import threading
import time
import warnings
from typing import TYPE_CHECKING, Any, Protocol

import torch

from optuna_rapidfire import _compat
from optuna_rapidfire._engines import _environment, _warm
from optuna_rapidfire._logging import get_logger

if TYPE_CHECKING:
    import contextlib
    from collections.abc import Callable, Sequence

    from optuna_rapidfire._engines._layouts import Layout
    from optuna_rapidfire._fused._decoder import Rows
    from optuna_rapidfire._fused._slots import GangAdamW

_logger = get_logger(__name__)

RECOMPILE_LIMIT = 64
"""Variants of one compiled function the compiler keeps (layouts x shapes) before it stops compiling new ones."""


class Compiler(Protocol):
    """What a :class:`BackgroundCompiler` compiles for (the launched pass)."""

    compiles: int

    @property
    def device(self) -> torch.device: ...

    def compile_layer(self, *args: Any) -> Any:
        """Run the compiled decoder layer (compiling it for these inputs if needed)."""

    def compile_step(self, *args: Any) -> Any:
        """Run the compiled AdamW step (compiling it for these inputs if needed)."""

    def counting(self, layout: Layout | None) -> contextlib.AbstractContextManager[None]:
        """Count the compilations made inside the block for ``layout`` (``None``: the reference pass)."""

    def fall_back(self, layout: Layout, error: BaseException) -> None:
        """Run ``layout`` uncompiled from now on, saying why."""


class BackgroundCompiler:
    """Compiles the launched pass's functions in a thread of their own, on inputs shaped like the pass's, while
    the device's thread runs them eagerly (:class:`~optuna_rapidfire._engines._launched.LaunchedPasses` with
    ``background``), for its ``owner`` (a :class:`Compiler`).

    Each job is asked for once per *signature* (the layout, the inputs' shapes, grad and autocast modes): the
    thread calls the compiling function on copies of the inputs (the frozen weights and slot tensors are read,
    never written), which compiles the graph (its backward too) and keeps it in the function's cache; a graph
    that already covers the signature compiles nothing. A compilation that fails makes its layout run uncompiled,
    as a failure in the device's thread would.
    """

    def __init__(self, owner: Compiler) -> None:
        self.owner = owner
        self._asked: set[Any] = set()
        self._jobs: queue.Queue[tuple[Layout | None, Callable[[], None]] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._closed = False
        # Each compiled function's calls so far, in order: a child replays them, so that it makes the same graphs
        # (the compiler generalises a shape the second time it changes).
        self._history: dict[str, list[dict[str, Any]]] = {}
        # Off by default: on the H200 its first study did not finish in time (not yet understood, see issue 31).
        self.warms = _environment.flag(_environment.WARM_COMPILER) is True
        self.warmed = 0  # calls whose child ended well
        self.warm_seconds = 0.0  # spent waiting for children (the training thread runs meanwhile)

    def layer(self, layout: Layout | None, h: torch.Tensor, *rest: Any) -> None:
        """Compile :func:`decoder_layer` for a pass's first layer's inputs (``h`` and the rest of its arguments)."""
        device = h.device.type
        grad = torch.is_grad_enabled()
        autocast = (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        rows: Rows = rest[4]  # cos, sin, weights, loras, rows, salts, shape
        # One graph per layout and mode covers every row count and width (marked dynamic); a size of 1 stays
        # static, so it asks for a graph of its own.
        ones = tuple(size < 2 for size in (*h.shape[:2], rows.units.shape[0]))
        key = None if layout is None else layout.key
        signature = ("layer", key, h.dtype, h.requires_grad, grad, autocast, ones, rows.keys is not None)
        if signature in self._asked:
            return
        self._asked.add(signature)
        dummy = torch.zeros_like(h).requires_grad_(h.requires_grad)
        args = _apart((dummy, *rest), {}, {})
        calls = self._history.setdefault("layer", [])
        call = {"function": "layer", "args": _described(args), "grad": grad, "autocast": autocast, "dynamic": True}
        calls.append(call)
        warming = list(calls)

        def job() -> None:
            self._warm(warming)
            with torch.set_grad_enabled(grad), torch.autocast(device, dtype=autocast[1], enabled=autocast[0]):
                try:
                    self.owner.compile_layer(*_warm.dynamic_pass(args))
                except Exception as error:  # the dynamic graph failed: this shape's own graph instead
                    _logger.info("A dynamic launched pass did not compile (%s); compiling its shape.", error)
                    call["dynamic"] = False
                    self.owner.compile_layer(*args)

        self._submit(layout, job)

    def step(self, layout: Layout, optimizer: GangAdamW | None) -> None:
        """Compile the gang's AdamW step for ``layout``'s slots (on copies: the step writes its inputs)."""
        signature = ("step", layout.key)
        if optimizer is None or signature in self._asked:
            return
        self._asked.add(signature)
        s = optimizer.slots
        copies = [t.clone() for t in (s.params, s.grad, s.exp_avg, s.exp_avg_sq, s.step, optimizer.last_norm)]
        ready = torch.zeros(s.slots, dtype=torch.float32, device=s.device)
        lr = torch.zeros(s.slots, dtype=torch.float64, device=s.device)
        settings = [t.clone() for t in (optimizer.beta1, optimizer.beta2, optimizer.eps, optimizer.weight_decay)]
        settings.append(optimizer.max_norm.clone())
        args = (*copies, ready, lr, *settings)
        calls = self._history.setdefault("step", [])
        calls.append({"function": "step", "args": _described(args), "grad": False, "autocast": (False, torch.float32)})
        warming = list(calls)

        def job() -> None:
            self._warm(warming)
            self.owner.compile_step(*args)

        self._submit(layout, job)

    def _warm(self, calls: list[dict[str, Any]]) -> None:
        """Compile ``calls`` in a child process first (:mod:`~optuna_rapidfire._engines._warm`): this thread then
        compiles from the caches, holding the interpreter's lock seconds instead of the whole compilation."""
        if self.warms:
            start = time.perf_counter()
            self.warmed += _warm.warm(str(self.owner.device), calls)
            self.warm_seconds += time.perf_counter() - start

    def _submit(self, layout: Layout | None, job: Callable[[], None]) -> None:
        if self._closed:
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="rapidfire-compile", daemon=True)
            self._thread.start()
        self._jobs.put((layout, job))

    def _work(self) -> None:
        device = self.owner.device
        if device.type == "cuda":
            torch.cuda.set_device(device)
        _compat.allow_recompiles(RECOMPILE_LIMIT)  # on the thread that compiles
        _compat.compile_backward_ahead()
        while (item := self._jobs.get()) is not None:
            layout, job = item
            try:
                if not self._closed and (layout is None or layout.compiled):
                    self._run(layout, job)
            finally:
                self._jobs.task_done()
        self._jobs.task_done()

    def _run(self, layout: Layout | None, job: Callable[[], None]) -> None:
        owner = self.owner
        before = layout.compiles if layout is not None else owner.compiles
        start, warmed_before = time.perf_counter(), self.warm_seconds
        try:
            with owner.counting(layout), warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*gradient layout contract.*")
                job()
        except Exception as error:
            if layout is not None and layout.compiled:
                owner.fall_back(layout, error)
            else:
                _logger.warning("Compiling the launched reference pass failed (%s: %s).", type(error).__name__, error)
            return
        child = self.warm_seconds - warmed_before
        seconds = time.perf_counter() - start - child
        made = (layout.compiles if layout is not None else owner.compiles) - before
        if layout is not None:
            layout.background_seconds += seconds
        if made:
            _logger.info(
                "Background compilation of the launched pass for layout [%s]: %.1f s in this process after %.1f s "
                "in a warming child, %d graph(s); passes ran eagerly meanwhile.",
                "reference, adapters off" if layout is None else layout.key.describe(),
                seconds,
                child,
                made,
            )

    def wait(self) -> None:
        """Block until every job asked for so far is done (tests)."""
        self._jobs.join()

    def close(self) -> None:
        """Run no more jobs (the one running finishes in its thread)."""
        self._closed = True
        if self._thread is not None:
            self._jobs.put(None)


def _apart(value: Any, storages: dict[int, tuple[int, int, str]], bases: dict[int, torch.Tensor]) -> Any:
    """``value`` (tensors in tuples) with each tensor that requires grad replaced by its look-alike
    (:func:`_warm.build`: a zeroed leaf of its layout, the ones that shared a storage sharing one copy of it, so the
    compiler sees the same aliasing).

    The compiling thread reads every input's autograd state (``is_leaf``) holding Python's global lock, and a
    tensor's autograd lock is taken by the device's thread while it runs the pass eagerly on the same tensor
    (an operator that records its input's gradient edge), which then waits for the global lock to count a reference
    to the tensor's Python object: the two threads waited for each other for ever (seen on a 2-core CPU, torch 2.11).
    So the thread never gets a tensor the passes train."""
    if isinstance(value, torch.Tensor) and value.requires_grad:
        return _warm.build(_warm.describe(value, storages), value.device, bases)
    if isinstance(value, tuple):
        items = [_apart(item, storages, bases) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    return value


def _described(args: Sequence[Any]) -> list[Any]:
    """A call's arguments for a warming child (tensors that share a storage keep sharing one)."""
    storages: dict[int, tuple[int, int, str]] = {}
    return [_warm.describe(arg, storages) for arg in args]
