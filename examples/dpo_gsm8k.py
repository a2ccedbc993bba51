"""Tune DPO of a causal LM on GSM8K preference pairs: the reference answer against one with a wrong number.

    python examples/dpo_gsm8k.py                                   # tiny local model, CPU, a few minutes
    python examples/dpo_gsm8k.py --model meta-llama/Llama-3.2-1B   # a real model on a GPU

The reference model is the shared base with the trial's adapter disabled: no second copy of the model.
The metric is DPO's eval loss; TRL's reward metrics are available too (``--metric rewards/accuracies``).
"""

from __future__ import annotations

import argparse

import optuna
import torch
from peft import LoraConfig
from trl import DPOConfig

from optuna_rapidfire import RapidFireExecutor, best_adapter_path
from optuna_rapidfire.demo import build_tiny_model, load_gsm8k


def configure(trial: optuna.Trial) -> tuple[LoraConfig, DPOConfig]:
    lora = LoraConfig(r=trial.suggest_categorical("r", [8, 16]), lora_alpha=16, target_modules=["q_proj", "v_proj"])
    args = DPOConfig(
        beta=trial.suggest_float("beta", 0.02, 0.5, log=True),
        learning_rate=trial.suggest_float("learning_rate", 1e-5, 1e-2, log=True),
        per_device_train_batch_size=4,
        num_train_epochs=1,
        max_length=384,
        bf16=torch.cuda.is_available() and torch.cuda.is_bf16_supported(),
        gradient_checkpointing=False,
    )
    return lora, args


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="path or hub id (default: a tiny local model)")
    parser.add_argument("--n-trials", type=int, default=8)
    parser.add_argument("--train-rows", type=int, default=256)
    parser.add_argument("--metric", default="eval_loss")
    parser.add_argument("--storage", default="sqlite:///dpo.db")
    parser.add_argument("--mlflow", default=None, help="MLflow tracking URI (optional)")
    options = parser.parse_args()

    executor = RapidFireExecutor(
        model=options.model or str(build_tiny_model("tiny-model", vocab_size=2048)),
        train_dataset=load_gsm8k("train", num_rows=options.train_rows, format="preference"),
        eval_dataset=load_gsm8k("test", num_rows=32, format="preference"),
        num_chunks=4,
        max_concurrent_trials=4,
        metric=options.metric,
        mlflow_tracking_uri=options.mlflow,
    )
    direction = "minimize" if options.metric.endswith("loss") else "maximize"
    study = optuna.create_study(
        storage=options.storage,
        study_name="dpo-gsm8k",
        load_if_exists=True,
        direction=direction,
        pruner=optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=1),
    )
    with executor:
        executor.optimize(study, configure, n_trials=options.n_trials)
    print("best params:", study.best_params)
    print("best adapter:", best_adapter_path(study))


if __name__ == "__main__":
    main()
