"""The observation seam: listeners get the package's events in order, are removed, and a failing one fails
what it watched."""

from __future__ import annotations

import pytest

from optuna_rapidfire import events


def test_listeners_get_every_event_in_order_until_removed() -> None:
    seen: list[tuple[str, events.Event]] = []
    first = events.listen(lambda event: seen.append(("first", event)))
    with events.listen(lambda event: seen.append(("second", event))):
        assert events.listening()
        events.emit(events.ChunkStarting((3,), (0,)))
    events.emit(events.Switched(3, None, 0.01))
    first()
    assert not events.listening()
    events.emit(events.Switched(4, 3, 0.01))  # nobody listens
    assert seen == [
        ("first", events.ChunkStarting((3,), (0,))),
        ("second", events.ChunkStarting((3,), (0,))),
        ("first", events.Switched(3, None, 0.01)),
    ]


def test_a_listener_s_error_reaches_the_emitter_and_a_non_callable_is_refused() -> None:
    def failing(event: events.Event) -> None:
        raise RuntimeError("injected")

    with events.listen(failing), pytest.raises(RuntimeError, match="injected"):
        events.emit(events.ChunkStarting((0,), (0,)))
    with pytest.raises(TypeError, match="listener must be a callable"):
        events.listen("print")  # type: ignore[arg-type]


def test_a_listener_of_named_kinds_gets_only_those_and_the_device_is_timed_only_for_them(monkeypatch) -> None:
    import types

    import torch

    synchronized: list[object] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synchronized.append(device))
    gpu = types.SimpleNamespace(type="cuda")
    seen: list[events.Event] = []
    with events.listen(seen.append, events.PassTrained):
        assert events.listening() and events.listening(events.PassTrained)
        assert not events.listening(events.GangTrained) and not events.listening(events.Switched)
        events.emit(events.Switched(3, None, 0.01))
        events.emit(events.PassTrained((3,), (0,), 0.1, "stream"))
        with events.window((3,), gpu):  # nobody wants a gang's window: no synchronize, no event
            pass
        assert synchronized == [] and seen == [events.PassTrained((3,), (0,), 0.1, "stream")]
        with events.listen(seen.append, events.GangTrained), events.window((3,), gpu):
            pass
    assert synchronized == [gpu, gpu] and isinstance(seen[-1], events.GangTrained)
    assert not events.listening()
    with pytest.raises(TypeError, match="kinds of event of this module"):
        events.listen(seen.append, dict)
