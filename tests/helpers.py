"""Helpers the tests share (plain functions and classes; the fixtures are in conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState
from peft import LoraConfig
from transformers import LlamaConfig
from trl import SFTConfig


def sft_args(**overrides: Any) -> SFTConfig:
    """SFTConfig for fast CPU float32 runs; ``overrides`` wins."""
    settings: dict[str, Any] = {
        "per_device_train_batch_size": 4,
        "num_train_epochs": 1,
        "bf16": False,
        "max_length": 128,
        "gradient_checkpointing": False,
        "learning_rate": 1e-2,
        "lr_scheduler_type": "constant",
    }
    settings.update(overrides)
    return SFTConfig(**settings)


def small_llama_config(**overrides: Any) -> LlamaConfig:
    """A 2-layer Llama config with grouped-query attention (32 wide, 4 heads over 2 key-value heads) for
    tests that build the model themselves; ``overrides`` wins."""
    settings: dict[str, Any] = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    settings.update(overrides)
    return LlamaConfig(**settings)


def lora(**overrides: Any) -> LoraConfig:
    settings: dict[str, Any] = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}
    settings.update(overrides)
    return LoraConfig(**settings)


def vowel_reward(completions: list[str], **kwargs: Any) -> list[float]:
    """A GRPO reward that varies between a prompt's completions (the share of vowels), so advantages,
    gradients and updates are not 0 even on a random-weight model (GSM8K's reward is 0 for all there)."""
    return [sum(c in "aeiou" for c in text) / max(len(text), 1) for text in completions]


def by_number(configs: list[tuple[LoraConfig, SFTConfig]]) -> Callable[[optuna.Trial], tuple[LoraConfig, SFTConfig]]:
    """A configure() that returns ``configs[trial.number]`` (and records a dummy param for samplers)."""

    def configure(trial: optuna.Trial) -> tuple[LoraConfig, SFTConfig]:
        trial.suggest_int("index", 0, len(configs) - 1)
        return configs[trial.number]

    return configure


class Background:
    """Runs ``executor.optimize`` in a thread; ``join()`` re-raises what it raised."""

    def __init__(self, target: Callable[[], None]) -> None:
        self.error: BaseException | None = None

        def body() -> None:
            try:
                target()
            except BaseException as error:
                self.error = error

        self.thread = threading.Thread(target=body, daemon=True)
        self.thread.start()

    def join(self, timeout: float = 300) -> None:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the study did not finish"
        if self.error is not None:
            raise self.error


def wait_until(condition: Callable[[], Any], timeout: float = 120, what: str = "condition") -> Any:
    """Poll ``condition`` until it returns something truthy."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            result = condition()
        except (IndexError, KeyError):  # what it looks at does not exist yet
            result = None
        if result:
            return result
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def run_python(args: list[str], cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    """Run ``python *args`` as a user would, on the CPU and offline; fail with its stderr if it fails."""
    result = subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def until_the_clone_is_taken(study: Any, step: int, clones: list[int]) -> Callable[[], bool]:
    """For ``slow_chunks(hold=...)``: once trial 0 has reported ``step``, no chunk starts until every trial
    number in ``clones`` (appended by the test when it clones) has been taken from the queue. A taken clone
    is built before the parent's next chunk, so it branches before the parent ends, however slow the machine."""

    def held() -> bool:
        trials = study.get_trials(deepcopy=False)
        if not trials or step not in trials[0].intermediate_values:
            return False
        return not clones or any(trials[n].state == TrialState.WAITING for n in clones)

    return held
