"""Sizes of one search benchmark, the trials' LoRA and training configs, their data, and the part's log line."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import optuna
from peft import LoraConfig
from trl import SFTConfig

from benchmarks.harness.models import SHAPES, quiet_training
from benchmarks.parts.search.space import BATCHES, TARGETS, suggest
from optuna_rapidfire.demo import load_gsm8k

BASE_MODEL: dict[str, Any] = {**SHAPES["search-82m"], "max_position_embeddings": 1024}
"""The base the search part pretrains: an 82M-parameter Llama."""


@dataclass(frozen=True)
class Settings:
    """Sizes of one search benchmark (``--smoke`` shrinks every one of them)."""

    smoke: bool
    configs: int  # configs per replicate
    trial_rows: int  # GSM8K train rows per trial: its data budget (batch size changes steps, not data)
    num_chunks: int
    eval_rows: int  # GSM8K test rows every evaluation uses (the same for every method)
    eval_batch: int
    max_length: int
    pretrain_steps: int
    pretrain_batch: int
    pretrain_length: int
    tokenizer_chars: int | None  # corpus characters the tokenizer trains on (None: all)
    method_timeout: float  # seconds one method may run before its processes are stopped (it then fails)
    model: dict[str, Any]  # LlamaConfig fields

    @staticmethod
    def from_options(options: Any) -> Settings:
        smoke = bool(options.smoke)

        def pick(name: str, full: Any, small: Any) -> Any:
            given = getattr(options, name, None)
            return given if given is not None else (small if smoke else full)

        model: dict[str, Any] = dict(BASE_MODEL)
        if smoke:
            model.update(vocab_size=1024, hidden_size=64, intermediate_size=128, max_position_embeddings=512)
            model.update(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        settings = Settings(
            smoke=smoke,
            configs=pick("search_configs", 16, 6),
            trial_rows=pick("trial_rows", 1024, 64),
            num_chunks=pick("search_chunks", 8, 2),
            eval_rows=128 if not smoke else 8,
            eval_batch=32 if not smoke else 8,
            max_length=512 if not smoke else 256,
            pretrain_steps=pick("pretrain_steps", 800, 20),
            pretrain_batch=64 if not smoke else 8,
            pretrain_length=512 if not smoke else 128,
            tokenizer_chars=None if not smoke else 2_000_000,
            method_timeout=pick("method_timeout", 420.0, 300.0),
            model=model,
        )
        step = settings.num_chunks * max(BATCHES)
        if settings.trial_rows % step:
            raise SystemExit(
                f"--trial-rows must be a multiple of chunks x the largest batch ({step}), so every chunk holds "
                f"whole batches at every batch size, but got {settings.trial_rows}."
            )
        return settings

    def comparable(self) -> dict[str, Any]:
        """What results merged from several calls must share (results of other sizes are another benchmark)."""
        keep = ("smoke", "configs", "trial_rows", "num_chunks", "eval_rows", "eval_batch", "max_length", "model")
        return {name: getattr(self, name) for name in keep} | {"pretrain": self.pretrain_recipe()}

    def pretrain_recipe(self) -> dict[str, Any]:
        """What the base depends on: the same recipe rebuilds the same weights (checked by their fingerprint)."""
        keep = ("pretrain_steps", "pretrain_batch", "pretrain_length", "tokenizer_chars", "model")
        return {name: getattr(self, name) for name in keep}

    def rows_per_chunk(self) -> int:
        return self.trial_rows // self.num_chunks


def lora_config(params: dict[str, Any]) -> LoraConfig:
    r = int(params["r"])
    return LoraConfig(
        r=r,
        lora_alpha=int(params["alpha_multiple"] * r),
        lora_dropout=float(params["lora_dropout"]),
        target_modules=TARGETS[params["target_modules"]],
        task_type="CAUSAL_LM",
    )


# Transformers 5 reads a float warmup_steps below 1 as a ratio of the run's steps; versions that still have
# warmup_ratio get the ratio there (the same schedule).
_WARMUP = "warmup_ratio" if "warmup_ratio" in {f.name for f in dataclasses.fields(SFTConfig)} else "warmup_steps"


def sft_config(params: dict[str, Any], settings: Settings, output_dir: str, **extra: Any) -> SFTConfig:
    """The trial's training args, the same for the executor and for plain TRL (``extra``: TRL-only fields)."""
    return SFTConfig(
        output_dir=output_dir,
        learning_rate=float(params["learning_rate"]),
        per_device_train_batch_size=int(params["batch_size"]),
        per_device_eval_batch_size=settings.eval_batch,
        num_train_epochs=1,
        **{_WARMUP: float(params["warmup_ratio"])},
        max_length=settings.max_length,
        seed=0,
        **quiet_training(),
        **extra,
    )


def configure(trial: optuna.Trial, settings: Settings) -> tuple[LoraConfig, SFTConfig]:
    """The executor's trial: its params from the search space, then its LoRA and training args."""
    params = suggest(trial)
    return lora_config(params), sft_config(params, settings, "")


def train_rows(settings: Settings) -> Any:
    return load_gsm8k("train", num_rows=settings.trial_rows, format="prompt_completion")


def eval_rows(settings: Settings) -> Any:
    return load_gsm8k("test", num_rows=settings.eval_rows, format="prompt_completion")


def say(message: str) -> None:
    """The part's progress line."""
    print(f"search: {message}", flush=True)
