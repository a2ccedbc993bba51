from optuna_rapidfire.demo._data import load_gsm8k
from optuna_rapidfire.demo._tiny_model import build_tiny_model

__all__ = ["build_tiny_model", "load_gsm8k"]
