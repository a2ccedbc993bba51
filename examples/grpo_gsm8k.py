"""Tune GRPO on GSM8K prompts with a rule-based reward: the right final number, plus the "#### n" format.

    python examples/grpo_gsm8k.py                                   # tiny local model, CPU, a few minutes
    python examples/grpo_gsm8k.py --model meta-llama/Llama-3.2-1B   # a real model on a GPU

Completions are generated with the shared base and the trial's adapter, from the trial's own random
generator; on a GPU (the fused engine) the live trials generate together, in one decode batch, and share
the forward and backward passes of their policy steps. Each chunk ends with the mean reward on the eval
prompts, which the study maximizes. Reward models work too: pass their path or hub id in
``reward_funcs`` and they are loaded once for all trials.
"""

from __future__ import annotations

import argparse

import optuna
import torch
from peft import LoraConfig
from trl import GRPOConfig

from optuna_rapidfire import RapidFireExecutor, best_adapter_path
from optuna_rapidfire.demo import build_tiny_model, gsm8k_reward, load_gsm8k


def configure(trial: optuna.Trial) -> tuple[LoraConfig, GRPOConfig]:
    lora = LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    generations = trial.suggest_categorical("num_generations", [4, 8])
    args = GRPOConfig(
        learning_rate=trial.suggest_float("learning_rate", 1e-6, 1e-3, log=True),
        beta=trial.suggest_float("beta", 0.0, 0.1),
        temperature=trial.suggest_float("temperature", 0.6, 1.2),
        num_generations=generations,
        per_device_train_batch_size=generations * 2,
        per_device_eval_batch_size=8,
        num_generations_eval=4,
        max_completion_length=64 if torch.cuda.is_available() else 16,
        num_train_epochs=1,
        bf16=torch.cuda.is_available() and torch.cuda.is_bf16_supported(),
        gradient_checkpointing=False,
    )
    return lora, args


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="path or hub id (default: a tiny local model)")
    parser.add_argument("--n-trials", type=int, default=6)
    parser.add_argument("--train-rows", type=int, default=64)
    parser.add_argument("--storage", default="sqlite:///grpo.db")
    parser.add_argument("--mlflow", default=None, help="MLflow tracking URI (optional)")
    options = parser.parse_args()

    executor = RapidFireExecutor(
        model=options.model or str(build_tiny_model("tiny-model", vocab_size=2048)),
        train_dataset=load_gsm8k("train", num_rows=options.train_rows, format="prompt_only"),
        eval_dataset=load_gsm8k("test", num_rows=8, format="prompt_only"),
        reward_funcs=[gsm8k_reward],
        num_chunks=4,
        max_concurrent_trials=3,
        mlflow_tracking_uri=options.mlflow,
    )
    study = optuna.create_study(
        storage=options.storage,
        study_name="grpo-gsm8k",
        load_if_exists=True,
        direction="maximize",
        pruner=optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=1),
    )
    with executor:
        executor.optimize(study, configure, n_trials=options.n_trials)
    print("best params:", study.best_params, "mean eval reward:", study.best_value)
    print("best adapter:", best_adapter_path(study))


if __name__ == "__main__":
    main()
