"""Tune LoRA SFT of a real model by hub id on a GPU, GSM8K prompt -> worked answer.

    python examples/real_model_gpu.py --model meta-llama/Llama-3.2-1B
    python examples/real_model_gpu.py --model TinyLlama/TinyLlama-1.1B-Chat-v1.0 --n-trials 32

The base model is loaded once in bf16; up to ``--concurrent`` trials share it, each with its own LoRA
adapter, optimizer and schedule, and the median pruner stops the losers after each chunk. Any path
accepted by ``AutoModelForCausalLM.from_pretrained`` works in place of a hub id.
"""

from __future__ import annotations

import argparse

import optuna
import torch
from peft import LoraConfig
from trl import SFTConfig

from optuna_rapidfire import RapidFireExecutor, best_adapter_path
from optuna_rapidfire.demo import load_gsm8k


def configure(trial: optuna.Trial) -> tuple[LoraConfig, SFTConfig]:
    rank = trial.suggest_categorical("r", [8, 16, 32, 64])
    lora = LoraConfig(
        r=rank,
        lora_alpha=trial.suggest_categorical("alpha_over_r", [1, 2]) * rank,
        lora_dropout=trial.suggest_float("lora_dropout", 0.0, 0.1),
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        task_type="CAUSAL_LM",
    )
    args = SFTConfig(
        learning_rate=trial.suggest_float("learning_rate", 1e-5, 5e-4, log=True),
        per_device_train_batch_size=trial.suggest_categorical("batch_size", [4, 8]),
        gradient_accumulation_steps=trial.suggest_categorical("grad_accum", [1, 2]),
        weight_decay=trial.suggest_float("weight_decay", 0.0, 0.1),
        lr_scheduler_type="cosine",
        warmup_steps=0.03,
        num_train_epochs=1,
        max_length=512,
        bf16=torch.cuda.is_available() and torch.cuda.is_bf16_supported(),
        gradient_checkpointing=False,
    )
    return lora, args


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="meta-llama/Llama-3.2-1B")
    parser.add_argument("--n-trials", type=int, default=16)
    parser.add_argument("--concurrent", type=int, default=8)
    parser.add_argument("--num-chunks", type=int, default=16)
    parser.add_argument("--train-rows", type=int, default=None, help="default: all 7,473")
    parser.add_argument("--eval-samples", type=int, default=256)
    parser.add_argument("--storage", default="sqlite:///gsm8k-lora.db")
    parser.add_argument("--devices", default="auto")
    options = parser.parse_args()

    executor = RapidFireExecutor(
        model=options.model,
        model_kwargs={"dtype": torch.bfloat16} if torch.cuda.is_available() else {},
        train_dataset=load_gsm8k("train", num_rows=options.train_rows),
        eval_dataset=load_gsm8k("test"),
        eval_samples=options.eval_samples,
        num_chunks=options.num_chunks,
        max_concurrent_trials=options.concurrent,
        devices=options.devices,
    )
    study = optuna.create_study(
        storage=options.storage,
        study_name=f"gsm8k-lora-{options.model.replace('/', '-')}",
        load_if_exists=True,
        pruner=optuna.pruners.MedianPruner(n_startup_trials=4, n_warmup_steps=2),
    )
    with executor:
        executor.optimize(study, configure, n_trials=options.n_trials)
    print("best params:", study.best_params)
    print("best adapter:", best_adapter_path(study))


if __name__ == "__main__":
    main()
