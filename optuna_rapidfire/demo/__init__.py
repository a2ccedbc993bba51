"""Embedded defaults for demos, examples and tests: the bundled GSM8K data and a tiny local model."""

from optuna_rapidfire.demo._data import gsm8k_reward, load_gsm8k
from optuna_rapidfire.demo._tiny_model import build_tiny_model

__all__ = ["build_tiny_model", "gsm8k_reward", "load_gsm8k"]
