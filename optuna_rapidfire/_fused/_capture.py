"""Capturing a CUDA graph without emptying PyTorch's memory caches first.

``torch.cuda.graph`` empties the device allocator's cache and the page-locked host cache at every capture (so that
a graph that reads host memory starts from a clean pool). The graphs this package captures (a decode step, a
recorded training pass) read device memory only, and each capture costs the process what the caches held: freeing
page-locked memory takes ~0.4 s per GB (a published measurement), and the next page-locked copy (a gang's members'
states at a chunk's end: 8 x 41 MB for 1B trials) allocates it again; the device's cached blocks are given back to
the driver and allocated again by the next passes. A study captures a graph for each new decode shape (fewer slots
once requests end) and each recorded pass layout, so these flushes recur while it runs. :func:`capture_graph`
captures as ``torch.cuda.graph`` does (a side stream, thread-local capture mode), emptying the device cache only
when the device is short of free memory, and never the host cache.
"""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from optuna_rapidfire._logging import get_logger

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

_logger = get_logger(__name__)

T = TypeVar("T")

ROOM_BYTES = 1 << 30
"""Free device memory below which a capture empties the device cache first (or a twentieth of the device's memory,
whichever is more): the graph's own memory pool grows by fresh allocations during the capture, and no cached block
can be given back to the driver then."""

_STREAMS: dict[int, torch.cuda.Stream] = {}
_LOCK = threading.Lock()  # over _STREAMS: each device's worker captures in a thread of its own


def short_of_room(free: int, total: int) -> bool:
    """Whether a device with ``free`` of ``total`` bytes free should empty its cache before a capture."""
    return free < max(ROOM_BYTES, total // 20)


def capture_graph(
    body: Callable[[], T], *, pool: Any = None, stream: torch.cuda.Stream | None = None
) -> tuple[torch.cuda.CUDAGraph, T]:
    """A CUDA graph of ``body`` (run once, captured) and what ``body`` returned, on the current device.

    Args:
        body: Device work only (what it launches is recorded, not run; it reads no page-locked host memory).
        pool: The memory pool the graph allocates from (``torch.cuda.graph_pool_handle()``; ``None``: its own).
        stream: The stream to capture on (``None``: a side stream of the device's own).

    If the capture fails (the device out of memory, for one), it is made again by ``torch.cuda.graph``, which
    empties both caches first.
    """
    graph = torch.cuda.CUDAGraph()
    try:
        with _capturing(graph, pool, stream):
            out = body()
        return graph, out
    except Exception as error:  # the stock capture is the fallback, whatever went wrong
        _logger.warning(
            "A CUDA graph capture without emptying the memory caches failed (%s: %s); capturing again after "
            "emptying them.",
            type(error).__name__,
            error,
        )
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
        out = body()
    return graph, out


@contextlib.contextmanager
def _capturing(graph: torch.cuda.CUDAGraph, pool: Any, stream: torch.cuda.Stream | None) -> Iterator[None]:
    """``torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local")`` less its flushes:
    another thread's synchronising call (a trial's state saved meanwhile) is not an error of this capture."""
    device = torch.cuda.current_device()
    torch.cuda.synchronize(device)
    if short_of_room(*torch.cuda.mem_get_info(device)):
        torch.cuda.empty_cache()
    if stream is None:
        with _LOCK:
            stream = _STREAMS.get(device)
            if stream is None:
                stream = _STREAMS[device] = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            yield
        finally:
            graph.capture_end()
