"""Plain TRL, what a user runs without the executor: one Optuna trial as a user trains it, and the untimed warm-up."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import optuna
import torch
from transformers import PrinterCallback, TrainerCallback
from trl import SFTTrainer

from benchmarks.harness.hooks import ChunkPlan
from benchmarks.harness.measure import release
from benchmarks.parts.search.base import load_base
from benchmarks.parts.search.settings import Settings, eval_rows, lora_config, sft_config, train_rows
from optuna_rapidfire.demo import load_gsm8k


class InOrderSFTTrainer(SFTTrainer):
    """TRL's trainer visiting the train set in the order given: the executor's shuffled chunks, so that every
    method trains each config on the same rows in the same order (its values can be compared across methods)."""

    def _get_train_sampler(self, train_dataset: Any = None) -> Any:
        return torch.utils.data.SequentialSampler(train_dataset or self.train_dataset)  # type: ignore[arg-type]


class PruningCallback(TrainerCallback):
    """What a user adds to a TRL trainer for Optuna: after each chunk's evaluation, ``trial.report`` and
    ``trial.should_prune`` (training stops when it says so)."""

    def __init__(self, trial: optuna.Trial) -> None:
        self.trial = trial
        self.values: list[float] = []
        self.pruned = False

    def on_evaluate(self, args: Any, state: Any, control: Any, metrics: Any = None, **kwargs: Any) -> None:
        value = float(metrics["eval_loss"])
        self.values.append(value)
        self.trial.report(value, len(self.values) - 1)
        if self.trial.should_prune():
            self.pruned = True
            control.should_training_stop = True


def ordered_train(settings: Settings, seed: int) -> Any:
    """The train rows in the executor's order for ``seed``: its chunks, one after another."""
    rows = train_rows(settings)
    plan = ChunkPlan(num_rows=len(rows), num_chunks=settings.num_chunks, seed=seed)
    return rows.select([int(i) for c in range(settings.num_chunks) for i in plan.rows(c)])


def trl_trial(
    trial: optuna.Trial, params: dict[str, Any], settings: Settings, base: Path, seed: int, *, compiled: bool
) -> dict[str, Any]:
    """One trial as a user runs it: load the model, build TRL's trainer (it tokenizes the data), train with an
    evaluation after every chunk, reporting to Optuna and stopping when the pruner says so.

    Returns its per-chunk values, whether it was pruned, and its ``build``/``start``/``end`` (``time.time()``).
    """
    start = time.time()
    model, tokenizer = load_base(base)
    steps_per_chunk = settings.rows_per_chunk() // int(params["batch_size"])
    callback = PruningCallback(trial)
    extra = {"eval_strategy": "steps", "eval_steps": steps_per_chunk, "torch_compile": compiled}
    with tempfile.TemporaryDirectory(prefix="search-trl-") as scratch:
        trainer = InOrderSFTTrainer(
            model=model,
            args=sft_config(params, settings, scratch, **extra),
            train_dataset=ordered_train(settings, seed),
            eval_dataset=eval_rows(settings),
            processing_class=tokenizer,
            peft_config=lora_config(params),
            callbacks=[callback],
        )
        trainer.remove_callback(PrinterCallback)  # metrics go to the result, not to the log
        built = time.time()
        trainer.train()
    result = {"values": callback.values, "pruned": callback.pruned, "start": start, "build": built - start}
    result["end"] = time.time()
    del trainer, model
    release()
    return result


def warm_up(settings: Settings, base: Path) -> float:
    """Once per process, untimed: CUDA context, kernels and allocator, the same for every method's processes."""
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
    return time.perf_counter() - start
