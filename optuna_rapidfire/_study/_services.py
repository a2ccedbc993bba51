"""What an executor's trials share about their studies, whichever device they run on.

The metric and the trainer type (fixed by the first trial's training args), the checks of each trial's
config and of each study, each study's checkpoint store and dashboard form, notes logged once, and MLflow
tracking. Trial drivers call these from Optuna's threads; every method is thread-safe.
"""

from __future__ import annotations

import os
import threading
import warnings
from typing import TYPE_CHECKING, Any

import optuna
from optuna.study import StudyDirection

from optuna_rapidfire import _compat
from optuna_rapidfire._logging import get_logger
from optuna_rapidfire._runtime._device import DeviceSettings
from optuna_rapidfire._study._checkpoints import MEMORY, Checkpoints, default_store
from optuna_rapidfire._study._commands import register_dashboard_form
from optuna_rapidfire._trainers import TrainerExtras, TrainerKind, kind_for

if TYPE_CHECKING:
    from collections.abc import Callable

    from peft import PeftConfig
    from transformers import TrainingArguments

    from optuna_rapidfire._compat import ArtifactStore
    from optuna_rapidfire._study._config import ExecutorConfig
    from optuna_rapidfire._study._mlflow import MlflowTracker

_logger = get_logger(__name__)


class StudyServices:
    """Per-executor services for the studies its trials belong to (see the module docstring)."""

    def __init__(self, config: ExecutorConfig) -> None:
        self.config = config
        self.extras = TrainerExtras(
            config.compute_metrics, config.preprocess_logits_for_metrics, config.formatting_func
        )
        self.tracker: MlflowTracker | None = None
        if config.mlflow_tracking_uri is not None:
            from optuna_rapidfire._study._mlflow import MlflowTracker

            self.tracker = MlflowTracker(config.mlflow_tracking_uri)
        self._lock = threading.Lock()
        self._kind: TrainerKind | None = None
        self._metric = config.metric  # resolved by the first trial's trainer type when not given
        self._notes: set[str] = set()
        self._prepared: set[str] = set()
        self._checkpoint_stores: dict[str, Checkpoints] = {}

    @property
    def metric(self) -> str:
        """The metric reported after every chunk and returned as the trials' value."""
        if self._metric is None:
            raise RuntimeError("The metric is known once the first trial's training args are known.")
        return self._metric

    def note_once(self, message: str) -> None:
        """Log ``message`` as a warning, once per executor."""
        with self._lock:
            if message in self._notes:
                return
            self._notes.add(message)
        _logger.warning(message)

    def check_study(self, study: optuna.Study) -> None:
        """One objective, in the direction the metric needs (once the metric is known)."""
        if len(study.directions) > 1:
            raise ValueError("RapidFireExecutor optimizes one metric: create the study with one direction.")
        if self._metric is not None:
            check_direction(self._metric, study.direction)

    def check_config(self, returned: Any, study: optuna.Study) -> tuple[PeftConfig, TrainingArguments, TrainerKind]:
        """Check what ``configure(trial)`` returned, and the data against its trainer type; fix the metric."""
        from peft import PeftConfig

        if not (isinstance(returned, tuple) and len(returned) == 2):
            raise TypeError(
                f"configure(trial) must return (peft_config, training_args), but returned {type(returned).__name__}."
            )
        peft_config, args = returned
        if not isinstance(peft_config, PeftConfig):
            raise TypeError(
                "configure(trial) must return a peft config (e.g. LoraConfig) first, but got "
                f"{type(peft_config).__name__}."
            )
        kind = kind_for(args)
        for note in kind.check_args(args):
            self.note_once(note)
        kind.check_columns(self.config.train_dataset, self.config.eval_dataset, args, self.extras)
        if kind.needs_rewards and not self.config.reward_funcs:
            raise ValueError("GRPOConfig trials need rewards: pass RapidFireExecutor(..., reward_funcs=[...]).")
        given = self.config.metric
        with self._lock:
            if self._kind is None:
                self._kind = kind
                self._metric = self._metric or kind.default_metric
            elif kind is not self._kind and (given is None or given.endswith("loss")):
                raise ValueError(
                    f"This study mixes {self._kind.args_type().__name__} and {kind.args_type().__name__} trials, "
                    f"whose {self.metric} values mean different things. Use one trainer type per study, or pass "
                    "metric= a metric every trial type reports on the same scale (from compute_metrics)."
                )
        check_direction(self.metric, study.direction)
        return peft_config, args, kind

    def device_settings(self) -> DeviceSettings:
        """What a device's runtime needs of the settings and of these services."""
        config = self.config
        return DeviceSettings(
            model=config.model,
            tokenizer=config.tokenizer,
            model_kwargs=config.model_kwargs or {},
            train_dataset=config.train_dataset,
            eval_dataset=config.eval_dataset,
            num_chunks=config.num_chunks,
            seed=config.seed,
            eval_rows=config.eval_rows,
            max_concurrent_trials=config.max_concurrent_trials,
            schedule=config.policy,
            engine=config.engine,
            compile=config.compile,
            output_dir=str(config.output_dir),
            reward_funcs=tuple(config.reward_funcs or ()),
            memory_budget=config.memory_budget,
            extras=self.extras,
            check_metrics=self.check_metrics,
        )

    def check_metrics(self, evaluate: Callable[[], dict[str, float]]) -> None:
        """The evaluations' metrics must hold the metric (raises ``SetupError``, which ends the study): ``eval_loss``
        and the trainer's own default metric (GRPO's ``eval_reward``) always are, any other metric is looked for in a
        one-batch evaluation of the first trial (``evaluate()``), before any training."""
        from optuna_rapidfire._runtime._worker import SetupError

        with self._lock:
            kind = self._kind
        if kind is not None and self.metric in ("eval_loss", kind.default_metric):
            return
        metrics = evaluate()
        if self.metric not in metrics:
            raise SetupError(
                f"metric={self.metric!r} is not among the evaluation's metrics {sorted(metrics)}. "
                "Pass one of those, or a compute_metrics that returns it."
            )

    def checkpoints(self, study: optuna.Study) -> Checkpoints:
        """The study's per-chunk states: in its artifact store (``"auto"``: when the storage records heartbeats,
        whose retries resume from them), else in this process's memory, for clones only."""
        with self._lock:
            if study.study_name not in self._checkpoint_stores:
                setting = self.config.artifact_store
                store: ArtifactStore = MEMORY
                if setting == "auto":
                    # Checkpoints in a store serve retries, which need heartbeats: without them they would only cost.
                    if _compat.heartbeats_enabled(_compat.storage(study)):
                        store = default_store(study, os.fspath(self.config.output_dir))
                elif setting is not None:
                    store = setting
                limit = self.config.chunk_states_limit(in_memory=store is MEMORY)
                self._checkpoint_stores[study.study_name] = Checkpoints(
                    store, keep=self.config.keep_checkpoints, budget=limit
                )
            return self._checkpoint_stores[study.study_name]

    def prepare_study(self, study: optuna.Study) -> None:
        """Once per study: name its objective after the metric (optuna-dashboard shows ``eval_loss``, not
        "Objective 0"), and add the control form to its trials in optuna-dashboard (``dashboard_controls``)."""
        with self._lock:
            if study.study_name in self._prepared:
                return
            self._prepared.add(study.study_name)
        if study.metric_names != [self.metric]:
            with warnings.catch_warnings():  # experimental since Optuna 3.2; nothing to act on
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                study.set_metric_names([self.metric])
        if self.config.dashboard_controls:
            register_dashboard_form(study)


def check_direction(metric: str, direction: StudyDirection) -> None:
    """A loss must be minimized, a reward or an accuracy maximized; say so before any training."""
    name = metric.removeprefix("eval_").lower()
    if name.endswith("loss") and direction == StudyDirection.MAXIMIZE:
        raise ValueError(f"metric={metric!r} is a loss but the study maximizes: create it with direction='minimize'.")
    if ("reward" in name or "accurac" in name) and direction == StudyDirection.MINIMIZE:
        raise ValueError(
            f"metric={metric!r} is higher-is-better but the study minimizes: create it with direction='maximize'."
        )
