"""Model shapes, random-weight models, and the LoRA and training configs the parts' trials use.

Models are random-weight Llamas of real shapes, built on the device in bf16 (fp32 on the CPU): speed does
not depend on the weights. Functions handed to an executor are module-level (or ``functools.partial`` of
them), so that they reach worker processes by pickling.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import optuna
import torch
from peft import LoraConfig
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
from trl import SFTConfig

SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": {
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "tie_word_embeddings": True,
    },
    "tinyllama-1.1b": {
        "vocab_size": 32000,
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 22,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "tie_word_embeddings": False,
    },
    "search-82m": {  # the search part's base (benchmarks/parts/search/settings.py BASE_MODEL), random weights
        "vocab_size": 8192,
        "hidden_size": 768,
        "intermediate_size": 2048,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "tie_word_embeddings": True,
    },
    "llama-3.1-8b": {
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "tie_word_embeddings": False,
    },
    "tiny": {  # --smoke: CPU dry runs of the whole harness
        "vocab_size": 2048,
        "hidden_size": 64,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "tie_word_embeddings": False,
    },
}


def build_model(shape: str, tokenizer_dir: str) -> tuple[LlamaForCausalLM, Any]:
    """A random-weight model of ``shape`` (bf16 on the GPU, fp32 on the CPU) and the local tokenizer.

    Module level, so it reaches worker processes by pickling (``functools.partial`` of it).
    """
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(
        **SHAPES[shape],
        max_position_embeddings=2048,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    if torch.cuda.is_available():
        with torch.device("cuda"):
            model = LlamaForCausalLM(config).to(torch.bfloat16)
    else:
        model = LlamaForCausalLM(config)
    return model, tokenizer


TARGETS = {
    "attn": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "all": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}


def lora(rank: int = 16) -> LoraConfig:
    return LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS["attn"])


def trial_lora(params: dict[str, Any]) -> LoraConfig:
    """A trial's LoRA from its params: rank ``r`` (alpha 2r), ``targets`` (attention unless given),
    ``lora_dropout`` (0 unless given). ``{"r": 16}`` is :func:`lora`'s config."""
    rank = int(params["r"])
    return LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        target_modules=TARGETS[params.get("targets", "attn")],
        lora_dropout=float(params.get("lora_dropout", 0.0)),
    )


def quiet_training() -> dict[str, Any]:
    """The training-args settings every benchmark run shares: bf16 on a GPU (the CPU otherwise), no activation
    checkpointing, no reports, checkpoints, logs or progress bars of TRL's own."""
    gpu = torch.cuda.is_available()
    return {
        "bf16": gpu,
        "use_cpu": not gpu,
        "gradient_checkpointing": False,
        "report_to": "none",
        "save_strategy": "no",
        "logging_strategy": "no",
        "disable_tqdm": True,
    }


def sft_args(learning_rate: float, batch: int, **overrides: Any) -> SFTConfig:
    settings: dict[str, Any] = {
        "learning_rate": learning_rate,
        "per_device_train_batch_size": batch,
        "per_device_eval_batch_size": 16,
        "num_train_epochs": 1,
        "max_length": 512,
        "packing": True,
        "packing_strategy": "wrapped",
        **quiet_training(),
        "seed": 0,
    }
    settings.update(overrides)
    return SFTConfig(**settings)


def configure_from_params(batch: int) -> Callable[[optuna.Trial], tuple[LoraConfig, SFTConfig]]:
    """The parts' SFT trial: a learning rate and a rank 8 or 16 (LoRA on q, k, v, o) at ``batch``."""
    return functools.partial(_configure, batch=batch)


def _configure(trial: optuna.Trial, batch: int) -> tuple[LoraConfig, SFTConfig]:
    lr = trial.suggest_float("learning_rate", 1e-5, 1e-2, log=True)
    rank = trial.suggest_categorical("r", [8, 16])
    return lora(rank), sft_args(lr, batch)


def mixed_params(index: int) -> dict[str, Any]:
    """Trial ``index`` of a mixed gang: ranks 8, 16, 32, 64 in turn (alpha 2r), attention-only or
    all-linear targets (each rank gets both in a gang of 8), dropout 0, 0.05, 0.1 in turn."""
    return {
        "learning_rate": 1e-4 * (1 + index),
        "r": (8, 16, 32, 64)[index % 4],
        "targets": ("attn", "all")[(index + index // 4) % 2],
        "lora_dropout": (0.0, 0.05, 0.1)[index % 3],
    }


def configure_mixed(batch: int) -> Callable[[optuna.Trial], tuple[LoraConfig, SFTConfig]]:
    return functools.partial(_configure_mixed, batch=batch)


def _configure_mixed(trial: optuna.Trial, batch: int) -> tuple[LoraConfig, SFTConfig]:
    params: dict[str, Any] = {
        "learning_rate": trial.suggest_float("learning_rate", 1e-5, 1e-2, log=True),
        "r": trial.suggest_categorical("r", [8, 16, 32, 64]),
        "targets": trial.suggest_categorical("targets", list(TARGETS)),
        "lora_dropout": trial.suggest_categorical("lora_dropout", [0.0, 0.05, 0.1]),
    }
    return trial_lora(params), sft_args(params["learning_rate"], batch)


def configure_dpo(batch: int) -> Callable[[optuna.Trial], tuple[LoraConfig, Any]]:
    return functools.partial(_configure_dpo, batch=batch)


def _configure_dpo(trial: optuna.Trial, batch: int) -> tuple[LoraConfig, Any]:
    from trl import DPOConfig

    lr = trial.suggest_float("learning_rate", 1e-5, 1e-2, log=True)
    trial.suggest_categorical("r", [8, 16])
    settings = quiet_training()
    del settings["gradient_checkpointing"]  # the DPO runs keep TRL's default
    args = DPOConfig(
        learning_rate=lr,
        per_device_train_batch_size=batch,
        per_device_eval_batch_size=8,
        max_length=512,
        seed=0,
        **settings,
    )
    return lora(16), args
