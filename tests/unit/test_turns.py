"""Turns: one member runs at a time; the members waiting meet in one shared step; failures stay their own."""

from __future__ import annotations

import logging
import threading

import pytest

from optuna_rapidfire._trainers.grpo._turns import Turns, each_alone_after_failure


def test_members_take_turns_and_meet_in_one_shared_step() -> None:
    log: list[str] = []
    calls: list[list[int]] = []
    running = threading.Semaphore(1)  # acquiring without waiting proves nobody else runs

    def shared(requests: list[int]) -> list[int]:
        calls.append(list(requests))
        return [r * 10 for r in requests]

    turns: Turns[int, int] = Turns(shared)

    def member(name: str, requests: list[int]):
        def work() -> list[int]:
            answers = []
            for request in requests:
                assert running.acquire(blocking=False)
                log.append(f"{name} asks {request}")
                running.release()
                answers.append(turns.meet(request))
            assert running.acquire(blocking=False)
            log.append(f"{name} done")
            running.release()
            return answers

        return work

    results = turns.run([member("a", [1, 2]), member("b", [3]), member("c", [])])
    assert results == [[10, 20], [30], []]
    assert calls == [[1, 3], [2]]  # one shared step for everyone waiting, then one for the rest
    assert log == ["a asks 1", "b asks 3", "c done", "a asks 2", "b done", "a done"]


def test_a_members_failure_and_a_failed_answer_stay_its_own() -> None:
    def shared(requests: list[int]) -> list[int | BaseException]:
        return [ValueError(f"no answer to {r}") if r < 0 else r for r in requests]

    turns: Turns[int, int] = Turns(shared)

    def broken() -> None:
        raise RuntimeError("broken on its own")

    def refused() -> int:
        return turns.meet(-1)

    results = turns.run([broken, refused, lambda: turns.meet(5) + 1])
    assert isinstance(results[0], RuntimeError) and isinstance(results[1], ValueError)
    assert results[2] == 6


def test_an_interrupt_in_the_shared_step_ends_the_members_then_is_raised() -> None:
    def shared(requests: list[int]) -> list[int]:
        raise KeyboardInterrupt

    turns: Turns[int, int] = Turns(shared)
    with pytest.raises(KeyboardInterrupt):
        turns.run([lambda: turns.meet(1), lambda: turns.meet(2)])
    assert threading.active_count() == 1 or all(not t.name.startswith("turn-") for t in threading.enumerate())


def test_each_member_thread_is_set_up_first() -> None:
    local = threading.local()
    turns: Turns[int, int] = Turns(lambda requests: requests, setup=lambda: setattr(local, "ready", True))
    assert turns.run([lambda: getattr(local, "ready", False)] * 2) == [True, True]
    assert not getattr(local, "ready", False)  # the caller's thread is not a member


def test_a_shared_step_that_fails_fails_every_member_waiting_and_meet_needs_a_member() -> None:
    turns: Turns[int, int] = Turns(lambda requests: [1 // 0])
    results = turns.run([lambda: turns.meet(1), lambda: 7])
    assert isinstance(results[0], ZeroDivisionError) and results[1] == 7
    assert not turns.inside()
    with pytest.raises(RuntimeError, match="inside a member"):
        turns.meet(1)


def test_a_failed_shared_step_is_retried_request_by_request_and_only_a_request_that_fails_alone_fails(
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls: list[list[int]] = []
    put_back: list[int] = []

    def run(batch: list[int]) -> list[int]:
        calls.append(list(batch))
        if 3 in batch:
            raise ValueError("request 3 breaks")
        return [2 * request for request in batch]

    with caplog.at_level(logging.WARNING, logger="optuna_rapidfire"):
        answers = each_alone_after_failure(run, [1, 3, 5], "decode", "decoding", put_back.append)
    assert calls == [[1, 3, 5], [1], [3], [5]]
    assert put_back == [1, 3, 5]  # each request is put back as it was before it runs alone
    assert answers[0] == 2 and answers[2] == 10 and isinstance(answers[1], ValueError)
    assert "A shared decode of 3 trials failed (ValueError: request 3 breaks); decoding them one by one." in caplog.text
    assert each_alone_after_failure(run, [1, 5], "decode", "decoding") == [2, 10]  # no failure: one call
    with pytest.raises(ValueError, match="request 3 breaks"):  # one request: its failure is the step's
        each_alone_after_failure(run, [3], "decode", "decoding")
