"""Samplers for optuna-rapidfire studies (each also an OptunaHub package under ``samplers/``)."""

from optuna_rapidfire.samplers.clone_sampler import CloneSampler

__all__ = ["CloneSampler"]
