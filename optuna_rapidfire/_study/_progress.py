"""Progress: on a terminal, one bar per live trial (chunk i/n, its latest metric, its own seconds per chunk
and what is left at that pace); elsewhere (a log file, CI, nohup), one log line per trial start and chunk.

A trial's pace counts its own chunks' training and evaluation only, not the time it waits for its turn
(under the promote schedule a trial may wait at a rung for minutes): an estimate from wall time between
updates would mean nothing.
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any

from optuna_rapidfire import events
from optuna_rapidfire._logging import get_logger

_logger = get_logger(__name__)


class Progress:
    """Thread-safe progress bars on a terminal, log lines elsewhere, nothing when disabled.

    Args:
        enabled: ``show_progress_bar`` as the user set it.
        total_trials: Trials the study will run, if known (for the summary line).
    """

    def __init__(self, enabled: bool, total_trials: int | None = None) -> None:
        self.enabled = enabled and sys.stderr.isatty()
        self.lines = enabled and not self.enabled  # one log line per event, off a terminal
        self._lock = threading.Lock()
        self._chunks: dict[int, list[float]] = {}  # trial -> [done, total, its own seconds so far, chunks timed]
        self._bars: dict[int, Any] = {}
        self._free_positions: list[int] = []
        self._summary: Any = None
        self._finished = 0
        self._redirect: Any = None
        if self.enabled:
            from tqdm.auto import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self._tqdm = tqdm
            self._summary = tqdm(total=total_trials, desc="trials", unit="trial", position=0, leave=True)
            # Log lines (Optuna's and ours) are written above the bars instead of onto the bars' line.
            self._redirect = logging_redirect_tqdm(
                loggers=[logging.getLogger("optuna"), logging.getLogger("optuna_rapidfire")], tqdm_class=tqdm
            )
            self._redirect.__enter__()

    def hear(self, event: events.Event) -> None:
        """Show a study event of the trials of this ``optimize`` call (a listener of its :class:`Run`)."""
        if isinstance(event, events.TrialReady):
            self.trial_started(event.trial, event.total_chunks, done=event.start)
        elif isinstance(event, events.TrialActivity):
            self.trial_activity(event.trial, event.activity)
        elif isinstance(event, events.ChunkReported):
            self.chunk_done(event.trial, event.metric, event.value, event.seconds)
        elif isinstance(event, events.TrialEnded):
            self.trial_ended(event.trial, event.state, event.value)

    def trial_started(self, number: int, total_chunks: int, done: int = 0) -> None:
        with self._lock:
            self._chunks[number] = [done, total_chunks, 0.0, 0]
        if self.lines:
            start = f" (from chunk {done + 1})" if done else ""
            _logger.info("Trial %d started: %d chunk(s)%s.", number, total_chunks, start)
        if not self.enabled:
            return
        with self._lock:
            position = self._free_positions.pop(0) if self._free_positions else len(self._bars) + 1
            self._bars[number] = _bar_class(self._tqdm)(
                total=total_chunks,
                initial=done,
                desc=f"trial {number}",
                unit="chunk",
                position=position,
                leave=False,
                mininterval=0,  # one update per chunk: each is shown
                bar_format="{desc}: {n_fmt}/{total_fmt} |{bar}| {status}",  # no wall-clock rate: see the module
            )

    def trial_activity(self, number: int, activity: str) -> None:
        """What trial ``number`` does now (``training``, ``waiting at its rung after chunk 3``, ``paused``...): a
        bar of a trial that is not training says so, without a time left."""
        if not self.enabled:
            return
        with self._lock:
            bar = self._bars.get(number)
            if bar is not None:
                bar.activity = activity
                bar.refresh()

    def chunk_done(self, number: int, metric: str, value: float, seconds: float | None = None) -> None:
        """Trial ``number`` reported ``value`` after a chunk that took it ``seconds`` (training and evaluation)."""
        with self._lock:
            counts = self._chunks.setdefault(number, [0, 0, 0.0, 0])
            counts[0] += 1
            if seconds is not None:
                counts[2] += seconds
                counts[3] += 1
            done, total, spent, timed = counts
        pace = spent / timed if timed else None
        if self.lines:
            took = "" if seconds is None else f" in {seconds:.1f} s"
            _logger.info("Trial %d: chunk %d/%d%s, %s=%.4g.", number, done, total, took, metric, value)
        if not self.enabled:
            return
        with self._lock:
            bar = self._bars.get(number)
            if bar is not None:
                bar.latest = f"{metric}={value:.4g}"
                if pace is not None:
                    bar.pace = f"{pace:.1f} s/chunk, {_duration(pace * max(total - done, 0))} left"
                bar.update(1)

    def trial_ended(self, number: int, state: str, value: float | None = None) -> None:
        with self._lock:
            self._chunks.pop(number, None)
        if not self.enabled:
            return
        with self._lock:
            bar = self._bars.pop(number, None)
            if bar is not None:
                self._free_positions.append(bar.pos if isinstance(bar.pos, int) else abs(bar.pos))
                self._free_positions.sort()
                bar.close()
            self._finished += 1
            note = f"trial {number} {state}" + ("" if value is None else f" ({value:.4g})")
            self._summary.set_postfix_str(note, refresh=False)
            self._summary.update(1)

    def close(self) -> None:
        if not self.enabled:
            return
        with self._lock:
            for bar in self._bars.values():
                bar.close()
            self._bars.clear()
            self._summary.close()
            self._redirect.__exit__(None, None, None)


def _bar_class(tqdm: Any) -> Any:
    """A tqdm bar whose right side says the trial's latest value and what it does now: its own pace and the time
    left while it trains, its state otherwise (tqdm's ``{postfix}`` would start with a comma)."""

    class TrialBar(tqdm):
        latest, pace, activity = "", "", "training"

        @property
        def format_dict(self) -> dict[str, Any]:
            shown = self.pace if self.activity == "training" else self.activity
            return {**super().format_dict, "status": ", ".join(part for part in (self.latest, shown) if part)}

    return TrialBar


def _duration(seconds: float) -> str:
    """``seconds`` as h:mm:ss or m:ss."""
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"
