"""A real study on embedded defaults: ``python -m optuna_rapidfire.demo``.

Builds a tiny Llama-shape model with a BPE tokenizer trained on the bundled GSM8K text, then tunes its
LoRA fine-tuning (rank, alpha, dropout, learning rate, batch size) with TPE and the median pruner, 4
trials at a time, in a SQLite study. Runs on the GPU when there is one, else on the CPU (a few minutes).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import optuna

if TYPE_CHECKING:
    from collections.abc import Callable

    from peft import LoraConfig
    from trl import SFTConfig


def _configure(bf16: bool) -> Callable[[optuna.Trial], tuple[LoraConfig, SFTConfig]]:
    from peft import LoraConfig
    from trl import SFTConfig

    def configure(trial: optuna.Trial) -> tuple[LoraConfig, SFTConfig]:
        rank = trial.suggest_categorical("r", [4, 8, 16])
        lora = LoraConfig(
            r=rank,
            lora_alpha=trial.suggest_categorical("alpha_over_r", [1, 2]) * rank,
            lora_dropout=trial.suggest_float("lora_dropout", 0.0, 0.2),
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        )
        args = SFTConfig(
            learning_rate=trial.suggest_float("learning_rate", 1e-4, 5e-2, log=True),
            per_device_train_batch_size=trial.suggest_categorical("batch_size", [4, 8]),
            lr_scheduler_type="cosine",
            warmup_steps=0.05,
            num_train_epochs=1,
            max_length=256,
            bf16=bf16,
            gradient_checkpointing=False,
        )
        return lora, args

    return configure


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m optuna_rapidfire.demo", description=__doc__)
    parser.add_argument("--workdir", default="rapidfire_demo", help="folder for the model, study and adapters")
    parser.add_argument("--n-trials", type=int, default=12)
    parser.add_argument("--train-rows", type=int, default=512)
    parser.add_argument("--eval-rows", type=int, default=64)
    parser.add_argument("--num-chunks", type=int, default=8)
    parser.add_argument("--concurrent", type=int, default=4, help="max_concurrent_trials")
    parser.add_argument("--storage", default=None, help="Optuna storage URL (default: SQLite in the workdir)")
    parser.add_argument("--study-name", default="rapidfire-demo")
    parser.add_argument("--devices", default="auto")
    options = parser.parse_args(argv)

    import torch

    from optuna_rapidfire import RapidFireExecutor, best_adapter_path
    from optuna_rapidfire.demo import build_tiny_model, load_gsm8k

    workdir = Path(options.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    storage = options.storage or f"sqlite:///{workdir / 'demo.db'}"
    print(f"Building the tiny model in {workdir / 'model'} ...", flush=True)
    model_path = build_tiny_model(workdir / "model", hidden_size=64, vocab_size=2048)
    executor = RapidFireExecutor(
        model=str(model_path),
        train_dataset=load_gsm8k("train", num_rows=options.train_rows),
        eval_dataset=load_gsm8k("test", num_rows=options.eval_rows),
        num_chunks=options.num_chunks,
        max_concurrent_trials=options.concurrent,
        output_dir=workdir / "adapters",
        devices=options.devices,
    )
    study = optuna.create_study(
        storage=storage,
        study_name=options.study_name,
        load_if_exists=True,
        sampler=optuna.samplers.TPESampler(seed=0),
        pruner=optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=2),
    )
    device = executor.devices[0].type
    print(f"Running {options.n_trials} trials, {options.concurrent} at a time, on {device} ...", flush=True)
    with executor:
        executor.optimize(study, _configure(bf16=device == "cuda" and torch.cuda.is_bf16_supported()), options.n_trials)

    frame = study.trials_dataframe(attrs=("number", "state", "value", "params", "user_attrs"))
    columns = [c for c in frame.columns if c.startswith(("number", "state", "value", "params_"))]
    columns.append("user_attrs_rapidfire:chunks_done")
    print()
    table = frame[columns].rename(columns=lambda c: c.replace("params_", "").replace("user_attrs_rapidfire:", ""))
    print(table.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    print()
    print(f"Best trial: {study.best_trial.number} (eval_loss {study.best_value:.4f})")
    print(f"Best adapter: {best_adapter_path(study)}")
    in_venv = sys.prefix != sys.base_prefix
    activate = f". {Path(sys.prefix) / 'bin' / 'activate'} && " if in_venv else ""
    print(f"Look at the per-chunk curves with:  {activate}optuna-dashboard {storage}")
    print(
        f"List or control its trials with:    {activate}optuna-rapidfire ls --storage {storage} "
        f"--study-name {options.study_name}"
    )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
