"""Quick start: tune LoRA fine-tuning of a causal LM with Optuna, many trials at once.

Runs anywhere in a few minutes: it builds a tiny random-weight model locally (no download) and uses
the bundled GSM8K slice. Point ``--model`` at any causal LM path or hub id to tune a real one.

    python examples/quickstart.py
    optuna-dashboard sqlite:///quickstart.db
"""

from __future__ import annotations

import argparse

import optuna
import torch
from peft import LoraConfig
from trl import SFTConfig

from optuna_rapidfire import RapidFireExecutor, best_adapter_path
from optuna_rapidfire.demo import build_tiny_model, load_gsm8k


def configure(trial: optuna.Trial) -> tuple[LoraConfig, SFTConfig]:
    """Suggest one config: the user's own LoraConfig and SFTConfig, as for TRL."""
    lora = LoraConfig(
        r=trial.suggest_categorical("r", [8, 32]),
        lora_alpha=16,
        target_modules=["q_proj", "v_proj"],
    )
    args = SFTConfig(
        learning_rate=trial.suggest_float("learning_rate", 1e-5, 1e-2, log=True),
        per_device_train_batch_size=8,
        num_train_epochs=1,
        max_length=256,
        bf16=torch.cuda.is_available(),
        gradient_checkpointing=False,
    )
    return lora, args


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="path or hub id (default: a tiny local model)")
    parser.add_argument("--n-trials", type=int, default=16)
    parser.add_argument("--train-rows", type=int, default=512)
    parser.add_argument("--storage", default="sqlite:///quickstart.db")
    options = parser.parse_args()

    model = options.model or str(build_tiny_model("tiny-model", vocab_size=2048))
    executor = RapidFireExecutor(
        model=model,
        train_dataset=load_gsm8k("train", num_rows=options.train_rows),
        eval_dataset=load_gsm8k("test", num_rows=64),
        num_chunks=8,
        max_concurrent_trials=8,
        seed=0,
    )
    study = optuna.create_study(storage=options.storage, study_name="quickstart", load_if_exists=True)
    executor.optimize(study, configure, n_trials=options.n_trials)
    executor.close()

    print("best params:", study.best_params)
    print("best adapter:", best_adapter_path(study))


if __name__ == "__main__":
    main()
