"""optuna-rapidfire: many Optuna trials of LLM fine-tuning trained together on the same GPUs."""

from __future__ import annotations

from optuna_rapidfire._executor import RapidFireExecutor, best_adapter_path

__version__ = "0.1.0"

__all__ = ["RapidFireExecutor", "__version__", "best_adapter_path"]
