"""Progress display: one line per live trial (chunk i/n and its latest metric), on a TTY only."""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any


class Progress:
    """Thread-safe progress bars, or nothing when disabled or not on a terminal.

    Args:
        enabled: ``show_progress_bar`` as the user set it.
        total_trials: Trials the study will run, if known (for the summary line).
    """

    def __init__(self, enabled: bool, total_trials: int | None = None) -> None:
        self.enabled = enabled and sys.stderr.isatty()
        self._lock = threading.Lock()
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

    def trial_started(self, number: int, total_chunks: int, done: int = 0) -> None:
        if not self.enabled:
            return
        with self._lock:
            position = self._free_positions.pop(0) if self._free_positions else len(self._bars) + 1
            self._bars[number] = self._tqdm(
                total=total_chunks, initial=done, desc=f"trial {number}", unit="chunk", position=position, leave=False
            )

    def trial_paused(self, number: int) -> None:
        self._describe(number, f"trial {number} (paused)")

    def trial_resumed(self, number: int) -> None:
        self._describe(number, f"trial {number}")

    def _describe(self, number: int, text: str) -> None:
        if not self.enabled:
            return
        with self._lock:
            bar = self._bars.get(number)
            if bar is not None:
                bar.set_description_str(text)

    def chunk_done(self, number: int, metric: str, value: float) -> None:
        if not self.enabled:
            return
        with self._lock:
            bar = self._bars.get(number)
            if bar is not None:
                bar.set_postfix({metric: f"{value:.4g}"}, refresh=False)
                bar.update(1)

    def trial_ended(self, number: int, state: str, value: float | None = None) -> None:
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
