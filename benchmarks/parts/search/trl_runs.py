"""Plain TRL, what a user runs without the executor: one trial as a user trains it, and the untimed warm-up."""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import optuna
import torch
from transformers import PrinterCallback, TrainerCallback
from trl import SFTTrainer

from benchmarks.harness.hooks import ChunkPlan
from benchmarks.harness.measure import release, sync
from benchmarks.parts.search.base import load_base
from benchmarks.parts.search.settings import Settings, eval_rows, lora_config, sft_config, train_rows
from optuna_rapidfire.demo import load_gsm8k

WORKER = "benchmarks.parts.search.worker"
"""The module a plain-TRL worker process runs (``python -m WORKER --worker SPEC``): calibration and (c)."""


class InOrderSFTTrainer(SFTTrainer):
    """TRL's trainer visiting the train set in the order given: the executor's shuffled chunks, so that its
    per-chunk values can be compared with the executor's recorded ones (a user would shuffle otherwise)."""

    def _get_train_sampler(self, train_dataset: Any = None) -> Any:
        return torch.utils.data.SequentialSampler(train_dataset or self.train_dataset)  # type: ignore[arg-type]


class ChunkCallback(TrainerCallback):
    """What a user adds to a TRL trainer for Optuna: after each chunk's evaluation, ``trial.report`` and
    ``trial.should_prune`` (stop training when it says so); also timestamps and optional stop conditions."""

    def __init__(
        self,
        steps_per_chunk: int,
        *,
        trial: optuna.Trial | None = None,
        stop_after: int | None = None,
        done_after: int | None = None,
        done_file: Path | None = None,
        stop_file: Path | None = None,
    ) -> None:
        self.steps_per_chunk = steps_per_chunk
        self.trial = trial
        self.stop_after = stop_after
        self.done_after = done_after
        self.done_file = done_file
        self.stop_file = stop_file
        self.mark = time.time()
        self.train_seconds: list[float] = []
        self.eval_seconds: list[float] = []
        self.values: list[float] = []
        self.pruned = False

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step % self.steps_per_chunk == 0:
            sync()
            now = time.time()
            self.train_seconds.append(now - self.mark)
            self.mark = now
        if self.stop_file is not None and self.stop_file.exists():
            control.should_training_stop = True

    def on_evaluate(self, args: Any, state: Any, control: Any, metrics: Any = None, **kwargs: Any) -> None:
        now = time.time()
        self.eval_seconds.append(now - self.mark)
        self.mark = now
        value = float(metrics["eval_loss"])
        self.values.append(value)
        chunk = len(self.values)
        if self.trial is not None:
            self.trial.report(value, chunk - 1)
            if self.trial.should_prune():
                self.pruned = True
                control.should_training_stop = True
        if self.stop_after is not None and chunk >= self.stop_after:
            control.should_training_stop = True
        if self.done_file is not None and chunk == self.done_after:
            self.done_file.touch()


def ordered_train(settings: Settings, seed: int) -> Any:
    """The train rows in the executor's order for ``seed``: its chunks, one after another."""
    rows = train_rows(settings)
    plan = ChunkPlan(num_rows=len(rows), num_chunks=settings.num_chunks, seed=seed)
    return rows.select([int(i) for c in range(settings.num_chunks) for i in plan.rows(c)])


def trl_trial(
    params: dict[str, Any],
    settings: Settings,
    base: Path,
    seed: int,
    *,
    per_chunk_eval: bool = True,
    **callback: Any,
) -> dict[str, Any]:
    """One trial as a user runs it with plain TRL: load the model, build the trainer, train (and evaluate).

    ``per_chunk_eval``: evaluate after every chunk through ``ChunkCallback`` (``callback`` are its options);
    else train to the end and evaluate once. Times are wall seconds; ``start``/``end`` are ``time.time()``.
    """
    start = time.time()
    model, tokenizer = load_base(base)
    steps_per_chunk = settings.rows_per_chunk() // int(params["batch_size"])
    hook = ChunkCallback(steps_per_chunk, **callback)
    extra: dict[str, Any] = {"eval_strategy": "steps", "eval_steps": steps_per_chunk} if per_chunk_eval else {}
    with tempfile.TemporaryDirectory(prefix="search-trl-") as scratch:
        trainer = InOrderSFTTrainer(
            model=model,
            args=sft_config(params, settings, scratch, **extra),
            train_dataset=ordered_train(settings, seed),
            eval_dataset=eval_rows(settings),
            processing_class=tokenizer,
            peft_config=lora_config(params),
            callbacks=[hook] if per_chunk_eval else [],
        )
        trainer.remove_callback(PrinterCallback)  # metrics go to the result, not to the log
        sync()
        built = time.time()
        hook.mark = built
        trainer.train()
        sync()
        trained = time.time()
        result: dict[str, Any] = {"params": params, "build": built - start, "start": start}
        if per_chunk_eval:
            result.update(train=hook.train_seconds, eval=hook.eval_seconds, values=hook.values, pruned=hook.pruned)
        else:
            value = float(trainer.evaluate()["eval_loss"])
            result.update(train=[trained - built], eval=[time.time() - trained], values=[value], pruned=False)
    result["end"] = time.time()
    del trainer, model
    release()
    return result


_WARM = threading.Event()


def warm_up(settings: Settings, base: Path) -> float:
    """Once per process, untimed: CUDA context, kernels and allocator, as every timed method's process has."""
    if _WARM.is_set():
        return 0.0
    start = time.perf_counter()
    params = {
        "learning_rate": 1e-4,
        "r": 8,
        "alpha_multiple": 1.0,
        "target_modules": "all",
        "lora_dropout": 0.05,
        "batch_size": 4,
        "warmup_ratio": 0.0,
    }
    model, tokenizer = load_base(base)
    with tempfile.TemporaryDirectory(prefix="search-warm-") as scratch:
        trainer = SFTTrainer(
            model=model,
            args=sft_config(params, settings, scratch, max_steps=3),
            train_dataset=load_gsm8k("train", num_rows=16, format="prompt_completion"),
            eval_dataset=load_gsm8k("test", num_rows=8, format="prompt_completion"),
            processing_class=tokenizer,
            peft_config=lora_config(params),
        )
        trainer.remove_callback(PrinterCallback)
        trainer.train()
        trainer.evaluate()
    del trainer, model
    release()
    _WARM.set()
    return time.perf_counter() - start
