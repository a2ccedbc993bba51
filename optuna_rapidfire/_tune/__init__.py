"""A tuning step for pipelines: a declared search (``_search``), run to its study (``_run``, from the data and
objects of ``_inputs``), with the best trial exported (``_export``) and reported (``_report``)."""

from __future__ import annotations

from optuna_rapidfire._tune._run import NoCompleteTrialError, TuneResult, tune
from optuna_rapidfire._tune._search import Search, load_search

__all__ = ["NoCompleteTrialError", "Search", "TuneResult", "load_search", "tune"]
