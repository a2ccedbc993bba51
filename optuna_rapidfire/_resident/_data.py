"""The training data cut into chunks, and the prepared (tokenized) chunks shared by trials.

The train set is shuffled once with the executor's seed and cut into ``num_chunks`` contiguous
slices of rows. Every trial sees the same chunks in the same order; a trial's own settings
(``max_length``, packing...) only change how a chunk is prepared, and trials that prepare data the same
way share one prepared copy.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from datasets import Dataset


@dataclass(frozen=True)
class ChunkPlan:
    """Which train rows form each chunk, and in what order they are visited in each epoch."""

    num_rows: int
    num_chunks: int
    seed: int

    def __post_init__(self) -> None:
        if self.num_chunks < 1:
            raise ValueError(f"num_chunks must be at least 1, but got num_chunks={self.num_chunks}.")
        if self.num_rows < 1:
            raise ValueError("train_dataset is empty: there is nothing to cut into chunks.")
        if self.num_chunks > self.num_rows:
            raise ValueError(
                f"num_chunks={self.num_chunks} is more than the {self.num_rows} rows of train_dataset: "
                "every chunk needs at least one batch. Lower num_chunks."
            )

    @property
    def _bounds(self) -> np.ndarray:
        return np.linspace(0, self.num_rows, self.num_chunks + 1).round().astype(np.int64)

    def rows(self, chunk: int) -> np.ndarray:
        """Indices (into the original train set) of the rows of ``chunk``."""
        order = np.random.default_rng(self.seed).permutation(self.num_rows)
        bounds = self._bounds
        return order[bounds[chunk] : bounds[chunk + 1]]

    def visit_order(self, size: int, epoch: int, chunk: int) -> np.ndarray:
        """Order in which the ``size`` prepared examples of ``chunk`` are visited in ``epoch``.

        The first epoch keeps the shuffled order; later epochs reshuffle within the chunk. The order
        depends only on the seed, the epoch and the chunk, never on the trial.
        """
        if epoch == 0:
            return np.arange(size)
        return np.random.default_rng([self.seed, epoch, chunk]).permutation(size)


Preparer = Callable[["Dataset", str], "Dataset"]
"""Turns raw rows into trainer-ready examples; the ``str`` says which split ("train" or "eval")."""


class PreparedData:
    """Caches prepared chunks and the prepared eval set per data key (one key per way of preparing)."""

    def __init__(
        self,
        train: Dataset,
        eval: Dataset,
        plan: ChunkPlan,
        eval_samples: int | None,
    ) -> None:
        self.train = train
        self.plan = plan
        if eval_samples is not None and eval_samples < len(eval):
            picked = np.random.default_rng(plan.seed).choice(len(eval), size=eval_samples, replace=False)
            eval = eval.select(np.sort(picked).tolist())
        self.eval = eval
        self._chunks: dict[tuple[Hashable, int], Dataset] = {}
        self._evals: dict[Hashable, Dataset] = {}
        self._lock = threading.Lock()

    def chunk(self, key: Hashable, chunk: int, prepare: Preparer) -> Dataset:
        """The prepared examples of ``chunk`` for data key ``key``."""
        with self._lock:
            cached = self._chunks.get((key, chunk))
        if cached is None:
            raw = self.train.select(self.plan.rows(chunk).tolist())
            with quiet_datasets():
                cached = prepare(raw, "train")
            with self._lock:
                cached = self._chunks.setdefault((key, chunk), cached)
        return cached

    def chunk_sizes(self, key: Hashable, prepare: Preparer) -> list[int]:
        """Number of prepared examples in each chunk for ``key`` (prepares every chunk once)."""
        return [len(self.chunk(key, c, prepare)) for c in range(self.plan.num_chunks)]

    def eval_set(self, key: Hashable, prepare: Preparer) -> Dataset:
        """The prepared eval set (or its fixed subsample) for ``key``."""
        with self._lock:
            cached = self._evals.get(key)
        if cached is None:
            with quiet_datasets():
                cached = prepare(self.eval, "eval")
            with self._lock:
                cached = self._evals.setdefault(key, cached)
        return cached


class _QuietDatasets:
    """Counts the preparations under way, so that the first turns ``datasets``' bars off and the last
    restores the user's setting."""

    lock = threading.Lock()
    depth = 0
    restore = False


@contextlib.contextmanager
def quiet_datasets() -> Iterator[None]:
    """No ``datasets`` progress bars while TRL prepares a chunk (about four bars a chunk and trial, which
    would bury the study's own progress); the user's setting is restored afterwards."""
    import datasets

    with _QuietDatasets.lock:
        if _QuietDatasets.depth == 0:
            _QuietDatasets.restore = datasets.is_progress_bar_enabled()
            datasets.disable_progress_bars()
        _QuietDatasets.depth += 1
    try:
        yield
    finally:
        with _QuietDatasets.lock:
            _QuietDatasets.depth -= 1
            if _QuietDatasets.depth == 0 and _QuietDatasets.restore:
                datasets.enable_progress_bars()


def rows_of(dataset: Dataset, indices: list[int]) -> list[dict[str, Any]]:
    """Fetch ``indices`` from ``dataset`` in one batched read, as a list of row dicts."""
    columns = dataset[indices]
    names = list(columns)
    return [dict(zip(names, values, strict=True)) for values in zip(*(columns[n] for n in names), strict=True)]
