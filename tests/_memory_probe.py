"""Run N live trials on a ~60M-parameter model and print the process's memory growth as JSON.

Used by test_hot_swap.py in a fresh process, so the measurement sees only this study.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import optuna
import torch
from helpers import lora, sft_args
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig

from optuna_rapidfire import RapidFireExecutor
from optuna_rapidfire.demo import build_tiny_model, load_gsm8k


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def main() -> None:
    folder = Path(sys.argv[1])
    trials = int(sys.argv[2])
    model = build_tiny_model(
        folder / "model", hidden_size=768, num_hidden_layers=6, num_attention_heads=12, vocab_size=2048
    )
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    loaded: list[torch.nn.Module] = []

    def load() -> tuple[Any, Any]:  # as the executor loads a path, keeping the model to read its weights
        base = AutoModelForCausalLM.from_pretrained(str(model), dtype="auto")
        loaded.append(base)
        return base, AutoTokenizer.from_pretrained(str(model))

    executor = RapidFireExecutor(
        model=load,
        train_dataset=load_gsm8k("train", num_rows=16, format="text"),
        eval_dataset=load_gsm8k("test", num_rows=2, format="text"),
        num_chunks=8,
        max_concurrent_trials=trials,
        output_dir=folder / "out",
        show_progress_bar=False,
        devices="cpu",
        dashboard_controls=False,  # importing optuna-dashboard is not training memory
    )

    def configure(trial: optuna.Trial) -> tuple[LoraConfig, SFTConfig]:
        lr = trial.suggest_float("learning_rate", 1e-4, 1e-2, log=True)
        args = sft_args(
            learning_rate=lr,
            per_device_train_batch_size=1,
            num_train_epochs=0.25,
            max_length=32,
            lr_scheduler_type="linear",
        )
        return lora(r=8, lora_alpha=8), args

    objective = executor.objective(configure)  # loads the base model
    [base] = loaded
    base_bytes = executor.stats().base_bytes
    # from_pretrained may map the weights file lazily: read every weight once so the baseline
    # counts the whole base model.
    with torch.no_grad():
        for param in base.parameters():
            param.sum()
    before = rss_bytes()
    peak = before
    states: list[int] = []
    live: list[int] = []
    stop = threading.Event()

    def watch() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, rss_bytes())
            try:
                stats = executor.stats()
            except RuntimeError:  # a trial's optimizer state grew while it was counted: count again
                continue
            states.extend(stats.state_bytes[:1])
            live.append(stats.live_trials)
            time.sleep(0.01)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    study = optuna.create_study(pruner=optuna.pruners.NopPruner())
    study.optimize(objective, n_trials=trials, n_jobs=trials)
    stop.set()
    watcher.join()
    executor.close()
    print(
        json.dumps(
            {
                "base_bytes": base_bytes,
                "state_bytes_per_trial": max(states),
                "live_trials": max(live),
                "rss_before_bytes": before,
                "peak_growth_bytes": peak - before,
            }
        )
    )


if __name__ == "__main__":
    main()
