"""optuna-rapidfire: many Optuna trials of LLM fine-tuning trained together on the same GPUs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["RapidFireExecutor", "StorageUnavailableError", "__version__", "best_adapter_path", "tune"]

if TYPE_CHECKING:
    from optuna_rapidfire._executor import RapidFireExecutor, best_adapter_path
    from optuna_rapidfire._study._storages import StorageUnavailableError
    from optuna_rapidfire._tune import tune


def __getattr__(name: str) -> Any:
    # The executor pulls in torch; `control` and the CLI do not need it, so it loads on first use.
    if name in ("RapidFireExecutor", "best_adapter_path"):
        from optuna_rapidfire import _executor

        return getattr(_executor, name)
    if name == "StorageUnavailableError":
        from optuna_rapidfire._study._storages import StorageUnavailableError

        return StorageUnavailableError
    if name == "tune":
        from optuna_rapidfire._tune import tune

        return tune
    raise AttributeError(f"module 'optuna_rapidfire' has no attribute {name!r}")
