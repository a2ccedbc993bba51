"""Behaviour 9: per-trial progress on a terminal only, off with show_progress_bar=False."""

from __future__ import annotations

import io
import sys

import optuna
from helpers import by_number, lora, sft_args

from optuna_rapidfire import events
from optuna_rapidfire._study._progress import Progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_shows_each_live_trial_on_a_terminal(make_executor, monkeypatch) -> None:
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    executor = make_executor(num_chunks=2, max_concurrent_trials=2, show_progress_bar=True)
    executor.optimize(optuna.create_study(), by_number([(lora(), sft_args())] * 2), n_trials=2)
    text = terminal.getvalue()
    assert "trial 0" in text and "trial 1" in text
    assert "2/2" in text and "eval_loss=" in text
    assert "trials" in text


def test_a_listener_hears_each_trial_start_be_built_report_and_end_as_the_bars_do(make_executor, listen) -> None:
    import os

    seen: list[events.Event] = []
    listen(seen.append, events.TrialStarted, events.TrialReady, events.ChunkReported, events.TrialEnded)
    study = optuna.create_study()
    executor = make_executor(num_chunks=2, max_concurrent_trials=2)
    executor.optimize(study, by_number([(lora(), sft_args())] * 2), n_trials=2)
    for trial in study.trials:
        mine = [e for e in seen if e.trial == trial.number]
        kinds = [events.TrialStarted, events.TrialReady, events.ChunkReported, events.ChunkReported, events.TrialEnded]
        assert [type(e) for e in mine] == kinds
        started, ready, *chunks, ended = mine
        assert isinstance(started, events.TrialStarted) and started.study.study_name == study.study_name
        assert (started.kind, started.metric) == ("sft", "eval_loss")
        assert isinstance(ready, events.TrialReady) and (ready.total_chunks, ready.start, ready.parent) == (2, 0, None)
        assert [(c.step, c.value) for c in chunks if isinstance(c, events.ChunkReported)] == sorted(
            trial.intermediate_values.items()
        )
        assert isinstance(ended, events.TrialEnded) and (ended.state, ended.value) == ("COMPLETE", trial.value)
        assert ended.adapter is not None and os.path.isdir(ended.adapter)


def test_off_a_terminal_each_chunk_is_one_log_line_and_disabled_is_silent(make_executor, monkeypatch, caplog) -> None:
    import logging

    for stream, enabled in ((io.StringIO(), True), (_Terminal(), False)):
        monkeypatch.setattr(sys, "stderr", stream)
        caplog.clear()
        executor = make_executor(num_chunks=2, max_concurrent_trials=1, show_progress_bar=enabled)
        with caplog.at_level(logging.INFO, logger="optuna_rapidfire"):
            executor.optimize(optuna.create_study(), by_number([(lora(), sft_args())]), n_trials=1)
        assert "trial 0" not in stream.getvalue()  # no bars
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Trial 0")]
        if enabled:  # under nohup or CI: one line when the trial starts and one per chunk
            assert lines[0] == "Trial 0 started: 2 chunk(s)."
            assert [line.split(" in ")[0] for line in lines[1:]] == ["Trial 0: chunk 1/2", "Trial 0: chunk 2/2"]
            assert all(" s, eval_loss=" in line for line in lines[1:])
        else:
            assert lines == []


def _one_bar(monkeypatch) -> tuple[_Terminal, Progress]:
    """Bars on a fake terminal, with trial 0 started (4 chunks) and its first chunk done in 10 s."""
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    progress = Progress(True, total_trials=1)
    progress.trial_started(0, 4)
    progress.chunk_done(0, "eval_loss", 1.5, seconds=10.0)
    return terminal, progress


def test_a_trial_s_pace_counts_its_own_chunks_not_its_waits(monkeypatch) -> None:
    terminal, progress = _one_bar(monkeypatch)
    progress.chunk_done(0, "eval_loss", 1.25, seconds=20.0)  # however long it waited in between
    progress.close()
    text = terminal.getvalue()
    assert "| eval_loss=1.25, 15.0 s/chunk, 0:30 left" in text  # two chunks left at 15 s each; no stray comma


def test_a_bar_of_a_trial_that_is_not_training_says_what_it_does_without_a_time_left(monkeypatch) -> None:
    terminal, progress = _one_bar(monkeypatch)
    progress.trial_activity(0, "waiting at its rung after chunk 1")

    def shown() -> str:  # the bar as last drawn, without tqdm's cursor moves
        return terminal.getvalue().rsplit("\r", 1)[-1].split("\x1b")[0].rstrip()

    waiting = shown()
    study = optuna.create_study()
    progress.hear(events.TrialActivity(study, 0, "paused"))  # what the trial's driver tells its run's listeners
    paused = shown()
    progress.hear(events.TrialActivity(study, 0, "training"))
    training = shown()
    progress.hear(events.ChunkReported(study, 0, 1, "eval_loss", 1.25, {"eval_loss": 1.25}, 10.0))
    reported = shown()
    progress.close()
    assert waiting.endswith("| eval_loss=1.5, waiting at its rung after chunk 1"), waiting
    assert paused.endswith("| eval_loss=1.5, paused") and "left" not in waiting + paused
    assert training.endswith("| eval_loss=1.5, 10.0 s/chunk, 0:30 left"), training
    assert reported.endswith("| eval_loss=1.25, 10.0 s/chunk, 0:20 left"), reported


def test_progress_reuses_lines_of_finished_trials() -> None:
    progress = Progress(False)
    assert not progress.enabled
    progress.trial_started(0, 3)  # a disabled display accepts every call
    progress.chunk_done(0, "eval_loss", 1.0)
    progress.trial_ended(0, "COMPLETE", 1.0)
    progress.close()


def test_log_lines_go_above_the_bars_on_a_terminal(monkeypatch) -> None:
    """Optuna's and the package's log lines are written through tqdm while bars show, never onto a bar's line."""
    import logging

    from tqdm.contrib.logging import _TqdmLoggingHandler

    monkeypatch.setattr(sys, "stderr", _Terminal())
    loggers = [logging.getLogger("optuna"), logging.getLogger("optuna_rapidfire")]
    before = [list(logger.handlers) for logger in loggers]
    progress = Progress(True, total_trials=2)
    assert progress.enabled
    for logger in loggers:
        assert any(isinstance(h, _TqdmLoggingHandler) for h in logger.handlers), logger.name
    progress.close()
    assert [list(logger.handlers) for logger in loggers] == before
