"""CloneSampler: Population Based Training for optuna-rapidfire (OptunaHub package)."""

from ._impl import CloneSampler

__all__ = ["CloneSampler"]
