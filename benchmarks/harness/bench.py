"""One benchmark call's context: its options, scratch folder, tokenizer, data, and executors over a model shape."""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness.models import build_model
from optuna_rapidfire import RapidFireExecutor
from optuna_rapidfire.demo import build_tiny_model, load_gsm8k


class Bench:
    """What the parts of one ``python -m benchmarks.run`` call share: the options (``--smoke``, ``--batch``,
    ``--out`` and each part's own), a scratch folder, a small BPE tokenizer trained on the bundled GSM8K text,
    the device, and the command line every result file records."""

    def __init__(self, options: argparse.Namespace) -> None:
        self.options = options
        self.smoke = options.smoke
        self.workdir = Path(tempfile.mkdtemp(prefix="rapidfire-bench-"))
        self.tokenizer_dir = str(build_tiny_model(self.workdir / "tokenizer", vocab_size=2048))
        self.device = "cuda:0" if torch.cuda.is_available() else "cpu"
        self.batch = options.batch
        self.command = " ".join([sys.executable, "-m", "benchmarks.run", *sys.argv[1:]])

    def rows(self, n: int, format: str = "text") -> Any:
        return load_gsm8k("train", num_rows=n, format=format)

    def eval_rows(self, format: str = "text") -> Any:
        return load_gsm8k("test", num_rows=64 if not self.smoke else 8, format=format)

    def factory(self, shape: str) -> Callable[[], tuple[Any, Any]]:
        return functools.partial(build_model, shape, self.tokenizer_dir)

    def executor(self, shape: str, rows: int, num_chunks: int, concurrent: int, **kwargs: Any) -> RapidFireExecutor:
        """An executor over ``rows`` GSM8K examples; time-sliced unless ``engine`` says otherwise."""
        kwargs.setdefault("engine", "time_sliced")
        data = kwargs.pop("data", "text")
        return RapidFireExecutor(
            model=self.factory(shape),
            train_dataset=self.rows(rows, data),
            eval_dataset=self.eval_rows(data),
            num_chunks=num_chunks,
            max_concurrent_trials=concurrent,
            output_dir=self.workdir / "out",
            show_progress_bar=False,
            dashboard_controls=False,
            **kwargs,
        )
