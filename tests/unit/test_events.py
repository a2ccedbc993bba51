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
