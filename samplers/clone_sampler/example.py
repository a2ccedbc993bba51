"""Population Based Training of LoRA fine-tuning with CloneSampler and RapidFireExecutor.

    python samplers/clone_sampler/example.py

Bad trials are pruned after each chunk; when one is replaced, the new trial is a warm clone of a
top-quartile trial with perturbed learning rate and dropout, continuing from its current weights.
"""

from __future__ import annotations

import optuna
import optunahub
from peft import LoraConfig
from trl import SFTConfig

from optuna_rapidfire import RapidFireExecutor
from optuna_rapidfire.demo import build_tiny_model, load_gsm8k

# Installed as optuna_rapidfire.samplers.CloneSampler; loaded here the OptunaHub way.
CloneSampler = optunahub.load_local_module("clone_sampler", registry_root="samplers").CloneSampler


def configure(trial: optuna.Trial) -> tuple[LoraConfig, SFTConfig]:
    lora = LoraConfig(
        r=8,
        lora_alpha=16,
        lora_dropout=trial.suggest_float("lora_dropout", 0.0, 0.3),
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
    )
    args = SFTConfig(
        learning_rate=trial.suggest_float("learning_rate", 1e-4, 1e-1, log=True),
        per_device_train_batch_size=8,
        num_train_epochs=1,
        max_length=256,
        bf16=False,
        gradient_checkpointing=False,
    )
    return lora, args


def main() -> None:
    executor = RapidFireExecutor(
        model=str(build_tiny_model("tiny-model", vocab_size=2048)),
        train_dataset=load_gsm8k("train", num_rows=256),
        eval_dataset=load_gsm8k("test", num_rows=32),
        num_chunks=8,
        max_concurrent_trials=4,
    )
    study = optuna.create_study(
        sampler=CloneSampler(seed=0),
        pruner=optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=1),
    )
    with executor:
        executor.optimize(study, configure, n_trials=12)
    clones = [t for t in study.trials if "rapidfire:parent" in t.user_attrs]
    print(f"best value {study.best_value:.4f} with {study.best_params}")
    print(f"{len(clones)} warm clones: " + ", ".join(f"{t.number}<-{t.user_attrs['rapidfire:parent']}" for t in clones))


if __name__ == "__main__":
    main()
