"""Samplers for optuna-rapidfire studies (each also an OptunaHub package under ``samplers/``)."""

import os

# Installed, the clone sampler is a subpackage here (pyproject maps samplers/clone_sampler to it). From a plain
# checkout (the benchmarks on a GPU machine, without `pip install`), it is found in the repository's samplers/.
_CHECKOUT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "samplers")
if os.path.isdir(os.path.join(_CHECKOUT, "clone_sampler")) and _CHECKOUT not in __path__:
    __path__.append(_CHECKOUT)

from optuna_rapidfire.samplers.clone_sampler import CloneSampler  # noqa: E402

__all__ = ["CloneSampler"]
