"""Behaviour 9: per-trial progress on a terminal only, off with show_progress_bar=False."""

from __future__ import annotations

import io
import sys

import optuna
from helpers import by_number, lora, sft_args

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


def test_no_progress_when_disabled_or_not_a_terminal(make_executor, monkeypatch) -> None:
    for stream, enabled in ((_Terminal(), False), (io.StringIO(), True)):
        monkeypatch.setattr(sys, "stderr", stream)
        executor = make_executor(num_chunks=2, max_concurrent_trials=1, show_progress_bar=enabled)
        executor.optimize(optuna.create_study(), by_number([(lora(), sft_args())]), n_trials=1)
        assert "trial 0" not in stream.getvalue()


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
