"""The best trial, exported for the next step: its adapter at a fixed path, merged into the base for serving
(``--merge``), and logged to the study's MLflow parent run for a registry step."""

from __future__ import annotations

import shutil
from typing import TYPE_CHECKING

from optuna_rapidfire._logging import get_logger

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    import optuna

    from optuna_rapidfire._tune._search import Search

_logger = get_logger(__name__)

BEST_ADAPTER = "best_adapter"
"""The best trial's adapter, copied into the output folder, and its artifact path in MLflow."""
BEST_MERGED = "best_merged"
"""The base model with the best adapter merged in (``--merge``): a plain transformers model and tokenizer."""


def _replace_folder(target: Path, fill: Callable[[Path], None]) -> Path:
    """Fill a temporary folder beside ``target``, then put it in ``target``'s place (no half-written folder)."""
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    fill(partial)
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    return target


def copy_best_adapter(adapter: str, output: Path) -> Path:
    """Copy the best trial's adapter folder to ``output/best_adapter`` (its path does not depend on the trial)."""

    def copy(path: Path) -> None:
        shutil.copytree(adapter, path)

    return _replace_folder(output / BEST_ADAPTER, copy)


def merge_best(search: Search, adapter: Path, output: Path) -> Path:
    """Load the base as the executor does, apply the adapter with PEFT, merge it (``merge_and_unload``) and save
    model and tokenizer to ``output/best_merged``."""
    from peft import PeftModel

    from optuna_rapidfire._resident._model import load_model
    from optuna_rapidfire._tune._inputs import model_path

    _logger.info("Merging the best adapter into %s.", search.model)
    base, tokenizer = load_model(model_path(search.model), tokenizer=None, model_kwargs=dict(search.model_kwargs))
    merged = PeftModel.from_pretrained(base, str(adapter)).merge_and_unload()

    def save(path: Path) -> None:
        merged.save_pretrained(path)
        tokenizer.save_pretrained(path)

    return _replace_folder(output / BEST_MERGED, save)


def log_to_mlflow(tracking_uri: str, study: optuna.Study, best_number: int, adapter: Path) -> str:
    """Log the best adapter under ``best_adapter/`` of the study's parent run (the run the executor nests the
    trials' runs under: tagged ``rapidfire.role=study``, in the experiment named after the study), tag the run
    with the best trial, and return its id."""
    from mlflow.tracking import MlflowClient

    from optuna_rapidfire._study._mlflow import study_run

    client = MlflowClient(tracking_uri=tracking_uri)
    _, run_id = study_run(client, study, study.study_name)
    client.log_artifacts(run_id, str(adapter), artifact_path=BEST_ADAPTER)
    client.set_tag(run_id, "rapidfire.best_trial", str(best_number))
    if study.best_value is not None:
        client.log_metric(run_id, "best_value", float(study.best_value))
    return str(run_id)


def log_files_to_mlflow(tracking_uri: str, run_id: str, files: list[Path]) -> None:
    """Add the step's summary, report and plot to the run, under ``tune/``."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    for path in files:
        if path.is_file():
            client.log_artifact(run_id, str(path), artifact_path="tune")
