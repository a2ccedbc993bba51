"""The app that ``optuna-rapidfire worker --app _worker_app:app`` runs in the multi-worker tests.

Its settings come from environment variables the test sets: the tiny model's path and the shared
artifact folder (what a team would put on a shared filesystem or S3).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import optuna
from helpers import lora, sft_args
from optuna.artifacts import FileSystemArtifactStore
from peft import LoraConfig
from trl import SFTConfig

from optuna_rapidfire import RapidFireExecutor, events
from optuna_rapidfire.demo import load_gsm8k

LEARNING_RATES = [1e-3, 3e-3, 1e-2, 3e-2]


def configure(trial: optuna.Trial) -> tuple[LoraConfig, SFTConfig]:
    lr = trial.suggest_categorical("learning_rate", LEARNING_RATES)
    args = sft_args(learning_rate=lr, per_device_train_batch_size=2, lr_scheduler_type="cosine", seed=7)
    return lora(r=4, lora_alpha=8, lora_dropout=0.1), args


def executor(devices: str = "cpu", **overrides: Any) -> RapidFireExecutor:
    settings: dict[str, Any] = {
        "model": os.environ["RF_TEST_MODEL"],
        "train_dataset": load_gsm8k("train", num_rows=96),
        "eval_dataset": load_gsm8k("test", num_rows=8),
        "num_chunks": 4,
        "max_concurrent_trials": 2,
        "output_dir": os.environ.get("RF_TEST_OUTPUT", "rapidfire-output"),
        "artifact_store": FileSystemArtifactStore(os.environ["RF_TEST_ARTIFACTS"]),
        "show_progress_bar": False,
        "dashboard_controls": False,
        "devices": devices,
        "schedule": "promote_all",  # every trial trains to the end, as the tests' reference values do
    }
    if "RF_TEST_STORAGE_RETRY" in os.environ:  # how long a worker cut off from the storage keeps retrying
        settings["storage_retry_seconds"] = float(os.environ["RF_TEST_STORAGE_RETRY"])
    settings.update(overrides)
    return RapidFireExecutor(**settings)


def _hold_while(path: str) -> None:
    """Once this process trained a chunk, the next chunks wait (up to 120 s) while ``path`` exists: a test that
    acts on the worker after its first report (a signal) is never overtaken by the trials on a busy machine."""
    trained = threading.Event()

    def wait(event: events.Event) -> None:
        if isinstance(event, events.ChunkTrained):
            trained.set()
            return
        deadline = time.monotonic() + 120
        while trained.is_set() and os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.05)

    events.listen(wait, events.ChunkStarting, events.ChunkTrained)


def app(devices: str) -> tuple[RapidFireExecutor, Any, dict[str, Any]]:
    if "RF_TEST_HOLD" in os.environ:
        _hold_while(os.environ["RF_TEST_HOLD"])
    return executor(devices), configure, {"pruner": optuna.pruners.NopPruner()}
