"""A streamed gang's passes replayed from CUDA graphs: launched once per shape, not kernel by kernel.

An 82M model's fused pass is some 3,500 small kernels; launched one by one from one Python thread, the GPU
waits on the launches (a pass of 2 members took 0.15 s on an H200 whose work is a few milliseconds). A CUDA
graph records a pass's kernels once and replays them with one launch, as vLLM and Unsloth do for their
steps. The stream (:mod:`~optuna_rapidfire._engines._gang_stream`) keeps its passes' shapes few (rows padded
to a row bucket, tokens to the stream's width, loss tokens to a power of two): each shape (a *signature*) is
one graph over the layout's slot storage, whose tensors never move while the layout is active.

How a signature's calls go (:meth:`PassGraphs.run`): its first call runs eagerly (a real pass, on the capture
stream: it also creates what a pass creates lazily, cuBLAS workspaces, the rotary tables, Triton's kernels);
its second captures the function on static copies of the inputs (nothing runs while capturing) and replays
the graph once; every later call copies its inputs into those static tensors and replays. So a shape met
once costs nothing, and recording costs about one eager pass. The function must read the pass's varying
data only from its arguments and the layout's fixed tensors (weights, slots, optimizer settings): that is
what a CPU checks with a recorder that re-runs the function on the static copies (:class:`Reenactment`, where
``RAPIDFIRE_RECORD_PASSES=1`` records a CPU's passes). A capture that fails (an operation a graph cannot hold)
leaves that signature eager, with the reason logged once; nothing of the failed capture ran.

Graphs of one device share one memory pool (they are replayed one after another on one stream, and their
outputs are copied out at once); a layout's graphs are dropped with its slot storage (:meth:`forget`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Protocol

import torch

from optuna_rapidfire._fused._capture import capture_graph
from optuna_rapidfire._logging import get_logger

if TYPE_CHECKING:
    from collections.abc import Callable, Hashable, Sequence

_logger = get_logger(__name__)


class Recording(Protocol):
    """One recorded function: replays it on the static inputs it was recorded with."""

    def replay(self) -> torch.Tensor | None:
        """Run the recorded work again; its output (the same tensor every time for a CUDA graph)."""
        ...


class Recorder(Protocol):
    """Records a function called on static inputs (a CUDA graph capture)."""

    def record(
        self, fn: Callable[[Sequence[torch.Tensor | None]], torch.Tensor | None], inputs: Sequence[torch.Tensor | None]
    ) -> Recording:
        """Record ``fn(inputs)`` without running it."""
        ...


@dataclasses.dataclass
class _Signature:
    calls: int = 0
    inputs: list[torch.Tensor | None] | None = None
    recording: Recording | None = None
    refused: bool = False


class PassGraphs:
    """The recorded passes of one device's launched layouts.

    Args:
        recorder: What records a signature's function (:class:`CudaGraphs` on a GPU).
        stream: The stream the eager first calls and the captures run on (``None``: the current one).

    Attributes:
        captured: Signatures recorded so far.
        replays: Calls answered by a replay.
        failures: Captures that failed (their signatures run eagerly).
        calls: Calls by kind (a key's first element, or the key: ``"pass"``, ``"step"``, ``"eval"``), eager,
            recorded or replayed.
    """

    def __init__(self, recorder: Recorder, stream: torch.cuda.Stream | None = None) -> None:
        self.recorder = recorder
        self.stream = stream
        self.captured = 0
        self.replays = 0
        self.failures = 0
        self.calls: dict[str, int] = {}
        self._by_owner: dict[int, tuple[object, dict[Hashable, _Signature]]] = {}

    def run(
        self,
        owner: object,
        key: Hashable,
        inputs: Sequence[torch.Tensor | None],
        fn: Callable[[Sequence[torch.Tensor | None]], torch.Tensor | None],
    ) -> torch.Tensor | None:
        """``fn(inputs)``, eagerly or from the recording of this signature; its output is the caller's own.

        ``owner``: the storage ``fn`` reads besides its inputs (a layout's slots: its graphs die with it);
        ``key``: what else ``fn`` depends on (its mode, the shapes it was laid out for). The inputs' shapes and
        dtypes are part of the signature.
        """
        kind = str(key[0] if isinstance(key, tuple) else key)
        self.calls[kind] = self.calls.get(kind, 0) + 1
        entry = self._by_owner.get(id(owner))
        if entry is None or entry[0] is not owner:
            entry = self._by_owner[id(owner)] = (owner, {})
        shapes = tuple(None if t is None else (tuple(t.shape), t.dtype) for t in inputs)
        signature = entry[1].setdefault((key, shapes), _Signature())
        signature.calls += 1
        if signature.recording is None and (signature.refused or signature.calls == 1):
            return self._on_stream(lambda: fn(inputs))
        if signature.recording is None:
            static = [None if t is None else t.clone() for t in inputs]
            try:
                recording = self._on_stream(lambda: self.recorder.record(fn, static))
            except Exception as error:
                signature.refused = True
                self.failures += 1
                _logger.warning(
                    "A launched pass could not be recorded as a CUDA graph (%s: %s); that shape runs kernel by kernel.",
                    type(error).__name__,
                    str(error).strip().splitlines()[0] if str(error).strip() else "",
                )
                return self._on_stream(lambda: fn(inputs))
            signature.inputs, signature.recording = static, recording
            self.captured += 1
        else:
            assert signature.inputs is not None
            for target, source in zip(signature.inputs, inputs, strict=True):
                if target is not None and source is not None:
                    target.copy_(source, non_blocking=True)
        self.replays += 1
        out = signature.recording.replay()
        return None if out is None else out.clone()

    def _on_stream(self, work: Callable[[], Any]) -> Any:
        if self.stream is None:
            return work()
        current = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            result = work()
        current.wait_stream(self.stream)
        return result

    def forget(self, owner: object) -> None:
        """Drop the recordings over ``owner`` (its storage is being freed)."""
        entry = self._by_owner.get(id(owner))
        if entry is not None and entry[0] is owner:
            del self._by_owner[id(owner)]


class _CudaGraph:
    def __init__(self, graph: torch.cuda.CUDAGraph, out: torch.Tensor | None) -> None:
        self.graph, self.out = graph, out

    def replay(self) -> torch.Tensor | None:
        self.graph.replay()
        return self.out


class CudaGraphs:
    """Records functions as CUDA graphs sharing one memory pool."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()

    def record(
        self, fn: Callable[[Sequence[torch.Tensor | None]], torch.Tensor | None], inputs: Sequence[torch.Tensor | None]
    ) -> Recording:
        # The capture stream is the current one (PassGraphs runs captures on its stream): the eager first call
        # ran there too, so the lazily made workspaces belong to it. The caches stay (see _fused/_capture.py).
        graph, out = capture_graph(lambda: fn(inputs), pool=self.pool, stream=torch.cuda.current_stream())
        return _CudaGraph(graph, out)


class Reenactment:
    """A recorder for devices without CUDA graphs (a CPU): a replay calls the function again on the static
    inputs, so a function that reads anything else that varies from call to call gives wrong values."""

    def __init__(self) -> None:
        self.recorded = 0

    def record(
        self, fn: Callable[[Sequence[torch.Tensor | None]], torch.Tensor | None], inputs: Sequence[torch.Tensor | None]
    ) -> Recording:
        self.recorded += 1
        return _Reenacted(fn, list(inputs))


@dataclasses.dataclass
class _Reenacted:
    fn: Callable[[Sequence[torch.Tensor | None]], torch.Tensor | None]
    inputs: list[torch.Tensor | None]

    def replay(self) -> torch.Tensor | None:
        return self.fn(self.inputs)


def replayed(
    graphs: PassGraphs | None,
    owner: object,
    key: Hashable,
    inputs: Sequence[torch.Tensor | None],
    fn: Callable[[Sequence[torch.Tensor | None]], torch.Tensor | None],
) -> torch.Tensor | None:
    """:meth:`PassGraphs.run` where passes are recorded (``graphs``), else ``fn(inputs)`` as it is."""
    return fn(inputs) if graphs is None else graphs.run(owner, key, inputs, fn)


def token_bucket(tokens: int) -> int:
    """The loss tokens a recorded pass is padded to: the next power of two, at least 64."""
    return max(64, 1 << max(tokens - 1, 0).bit_length())
