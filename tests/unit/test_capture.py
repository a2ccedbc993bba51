"""Capturing CUDA graphs without emptying PyTorch's memory caches (optuna_rapidfire/_fused/_capture.py)."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch

from optuna_rapidfire._fused import _capture
from optuna_rapidfire._fused._capture import ROOM_BYTES, capture_graph, short_of_room

GIB = 1 << 30
created: list[_FakeGraph] = []


def test_a_capture_empties_the_device_cache_only_when_the_device_is_short_of_room() -> None:
    total = 141 * GIB  # an H200
    assert not short_of_room(total // 2, total)
    assert not short_of_room(total // 20, total)  # at the margin: room enough
    assert short_of_room(total // 20 - 1, total)
    small = 8 * GIB  # a twentieth is under ROOM_BYTES: ROOM_BYTES is the margin
    assert short_of_room(ROOM_BYTES - 1, small)
    assert not short_of_room(ROOM_BYTES, small)


class _FakeGraph:
    """A CUDA graph that records its capture's calls (every one made is kept in ``created``)."""

    fail_begin = False

    def __init__(self) -> None:
        self.calls: list[str] = []
        created.append(self)

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        self.calls.append(f"begin {pool} {capture_error_mode}")
        if _FakeGraph.fail_begin:
            raise RuntimeError("no capture here")

    def capture_end(self) -> None:
        self.calls.append("end")


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """torch.cuda's calls a capture makes, recorded (the CPU has none)."""
    seen: dict[str, Any] = {"emptied": 0, "stock": 0, "free": 100 * GIB, "total": 141 * GIB}
    created.clear()
    _FakeGraph.fail_begin = False

    @contextlib.contextmanager
    def stock(graph: _FakeGraph, **kwargs: Any) -> Any:
        seen["stock"] += 1
        graph.capture_begin(kwargs.get("pool"), kwargs["capture_error_mode"])
        yield
        graph.capture_end()

    def emptied() -> None:
        seen["emptied"] += 1

    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", stock)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (seen["free"], seen["total"]))
    monkeypatch.setattr(torch.cuda, "empty_cache", emptied)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(_capture, "_STREAMS", {0: object()})
    return seen


def test_a_capture_keeps_the_caches_and_runs_its_body_once_between_begin_and_end(fake_cuda: dict[str, Any]) -> None:
    ran: list[int] = []
    graph, out = capture_graph(lambda: ran.append(1) or "out", pool="pool")
    assert out == "out" and ran == [1]
    assert graph is created[-1] and graph.calls == ["begin pool thread_local", "end"]
    assert fake_cuda["emptied"] == 0 and fake_cuda["stock"] == 0


def test_a_device_short_of_room_empties_its_cache_before_the_capture(fake_cuda: dict[str, Any]) -> None:
    fake_cuda["free"] = GIB // 2
    capture_graph(lambda: None)
    assert fake_cuda["emptied"] == 1 and fake_cuda["stock"] == 0


def test_a_failed_capture_is_made_again_by_torch_with_its_flushes(fake_cuda: dict[str, Any]) -> None:
    _FakeGraph.fail_begin = True
    with pytest.raises(RuntimeError, match="no capture here"):  # the stock capture fails alike: its error shows
        capture_graph(lambda: None)
    assert fake_cuda["stock"] == 1 and len(created) == 2  # a fresh graph for the second try
    _FakeGraph.fail_begin = False
    ran: list[int] = []

    def body() -> int:
        ran.append(1)
        if len(ran) == 1:
            raise ValueError("captured something it may not")
        return 7

    graph, out = capture_graph(body)
    assert out == 7 and ran == [1, 1] and fake_cuda["stock"] == 2
    assert graph.calls == ["begin None thread_local", "end"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures on a GPU (run on the H200)")
def test_a_capture_leaves_the_page_locked_cache_where_torch_cuda_graph_empties_it() -> None:
    stats = torch.cuda.memory.host_memory_stats
    size = 64 << 20
    torch.empty(size, dtype=torch.uint8, pin_memory=True)  # freed at once: cached
    x = torch.arange(1024, device="cuda", dtype=torch.float32)
    out = torch.empty_like(x)

    def body() -> None:
        torch.mul(x, 2, out=out)

    body()  # warm up
    before = stats().get("num_host_free", 0)
    graph, _ = capture_graph(body)
    x.fill_(3.0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, torch.full_like(x, 6.0))
    assert stats().get("num_host_free", 0) == before  # nothing page-locked was given back
    allocs = stats().get("num_host_alloc", 0)
    torch.empty(size, dtype=torch.uint8, pin_memory=True)
    assert stats().get("num_host_alloc", 0) == allocs  # served from the cache
    stock = torch.cuda.CUDAGraph()
    with torch.cuda.graph(stock, capture_error_mode="thread_local"):
        body()
    assert stats().get("num_host_free", 0) > before  # the stock capture empties the page-locked cache
