"""``RapidFireExecutor``: many Optuna trials trained chunk by chunk on one resident base model."""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import optuna
import torch
from optuna.storages._heartbeat import is_heartbeat_enabled
from optuna.study import StudyDirection

from optuna_rapidfire import _attrs
from optuna_rapidfire._checkpoints import Checkpoints, default_store
from optuna_rapidfire._commands import register_dashboard_form
from optuna_rapidfire._data import ChunkPlan, PreparedData
from optuna_rapidfire._engines._fused_engine import FusedEngine
from optuna_rapidfire._engines._time_sliced import TimeSlicedEngine
from optuna_rapidfire._logging import get_logger, quiet_library_noise
from optuna_rapidfire._model import ModelSource, ResidentModel, load_model, resolve_devices
from optuna_rapidfire._pool import Slots, TrialPool
from optuna_rapidfire._progress import Progress
from optuna_rapidfire._scheduler import Entry, Scheduler
from optuna_rapidfire._trainers import TrainerExtras, TrainerKind, kind_for
from optuna_rapidfire._trial_driver import EndPaused, TrialDriver
from optuna_rapidfire._worker import DeviceWorker, SetupError

if TYPE_CHECKING:
    from datasets import Dataset
    from peft import PeftConfig
    from transformers import PreTrainedTokenizerBase, TrainingArguments

    from optuna_rapidfire._mlflow import MlflowTracker

_logger = get_logger(__name__)

Configure = Callable[[optuna.Trial], "tuple[PeftConfig, TrainingArguments]"]
"""The user's function: suggest hyperparameters on the trial, return ``(peft_config, training_args)``."""


class RapidFireExecutor:
    """Train many Optuna trials together on one resident base model, chunk by chunk.

    The train set is shuffled once with ``seed`` and cut into ``num_chunks`` chunks. Up to
    ``max_concurrent_trials`` trials are live on the device; the device always goes to the live trial
    with the least progress, so live trials advance in lock-step rounds. After each chunk a trial is
    evaluated, reports its metric to Optuna at ``step`` = its global chunk count, and asks the study's
    pruner whether to stop, with its running peers visible to the pruner. Switching trials swaps only
    the small per-trial state (LoRA weights, optimizer, LR schedule, RNG, data position): the base
    model is loaded once.

    Example:

        .. code-block:: python

            import optuna
            from peft import LoraConfig
            from trl import SFTConfig
            from optuna_rapidfire import RapidFireExecutor
            from optuna_rapidfire.demo import build_tiny_model, load_gsm8k


            def configure(trial):
                lora = LoraConfig(r=trial.suggest_categorical("r", [4, 8]), target_modules=["q_proj", "v_proj"])
                args = SFTConfig(
                    learning_rate=trial.suggest_float("learning_rate", 1e-4, 1e-2, log=True),
                    per_device_train_batch_size=4, num_train_epochs=1, bf16=False, max_length=256,
                )
                return lora, args


            executor = RapidFireExecutor(
                model=str(build_tiny_model("tiny-model")),
                train_dataset=load_gsm8k("train", num_rows=64),
                eval_dataset=load_gsm8k("test", num_rows=16),
                num_chunks=4,
                max_concurrent_trials=4,
            )
            study = optuna.create_study()
            executor.optimize(study, configure, n_trials=8)

    Args:
        model: A path or hub id (loaded with ``AutoModelForCausalLM.from_pretrained``), a loaded
            ``PreTrainedModel`` (pass ``tokenizer`` too), or a zero-argument callable returning
            ``(model, tokenizer)``.
        train_dataset: A ``datasets.Dataset`` in any format TRL's trainer for the trials takes.
        eval_dataset: The ``datasets.Dataset`` every chunk's metric is computed on.
        tokenizer: The tokenizer, when ``model`` is not a path.
        model_kwargs: Keyword arguments for ``from_pretrained`` (``dtype``, ``attn_implementation``...).
        num_chunks: Chunks per pass over the train set; each trial reports once per chunk.
        max_concurrent_trials: Trials live on the device at once (also ``n_jobs`` in :meth:`optimize`).
        seed: Seed of the train-set shuffle and of the eval subsample. Each trial's own RNG comes from
            its training args' ``seed``, never from its number or its order.
        metric: Evaluation metric reported after every chunk and returned as the trial's value
            (``"eval_loss"`` by default; ``"eval_"`` is prefixed when missing). Metrics of a user
            ``compute_metrics`` are available under their ``eval_`` names.
        eval_samples: Evaluate on a fixed random subsample of this many eval rows (the same for every
            trial and chunk). ``"auto"`` (the default) takes a quarter of a chunk's rows, at least 32 (or the
            whole eval set when smaller): evaluating then costs about a tenth of a chunk's training (a
            forward pass per row against a forward and a backward). ``None`` evaluates the whole set.
        compute_metrics: Forwarded to the TRL trainer, as in ``SFTTrainer(compute_metrics=...)``.
        preprocess_logits_for_metrics: Forwarded to the TRL trainer.
        formatting_func: Forwarded to the TRL trainer.
        reward_funcs: For GRPO trials, as in ``GRPOTrainer(reward_funcs=...)``: functions, or paths / hub ids
            of reward models (loaded once, on the executor's device, and shared by all trials).
        mlflow_tracking_uri: Log each trial as an MLflow run (nested under a run for the study, in an
            experiment named after the study): params, per-chunk metrics at step = chunk index, tags,
            the final state and the final adapter. Needs ``pip install optuna-rapidfire[mlflow]``.
        output_dir: Where final adapters go: ``output_dir/<study name>/trial-<number>``.
        devices: ``"auto"`` (every visible GPU, else the CPU), a device such as ``"cuda:1"``, or a list of
            devices. With several, :meth:`optimize` runs one worker process per device, each with its own
            copy of the base model, all pulling trials from the study's storage (which must be an RDB URL
            or a JournalStorage on a file); a trial lives on one device.
        state_memory_budget: Bytes of per-trial state (adapters and optimizer moments) kept on the
            device, or a fraction of the device memory left after loading the base model; idle trials
            beyond it move to pinned CPU memory. ``"auto"``: half of what is left on a GPU, no limit on
            the CPU. ``None``: no limit.
        show_progress_bar: Show per-trial progress on a terminal.
        dashboard_controls: Add a stop/resume/delete/clone form to running trials in optuna-dashboard
            (unless the study has a form of its own).
        poll_seconds: How often a paused trial checks the storage for a resume or delete.
        pause_grace_seconds: When only paused trials are left in :meth:`optimize`, how long to wait for
            a resume before finishing them as PRUNED (their state is kept for clones).
        artifact_store: Where each trial's state is checkpointed after every chunk (adapter weights and
            optimizer moments as safetensors; schedule, RNG and data position as JSON), linked from the
            trial: any Optuna artifact store (``FileSystemArtifactStore``, ``Boto3ArtifactStore``, ...).
            Optuna's retry of a trial whose worker died (``RetryHeartbeatStaleTrialCallback``) resumes
            from it on any worker, and warm clones of trials that ran elsewhere start from it. ``"auto"``:
            on when the study's storage records heartbeats (``RDBStorage(heartbeat_interval=...)``, as
            ``optuna-rapidfire worker`` sets up), in a folder beside an SQLite or journal-file storage
            (``<file>.artifacts``), else ``output_dir/artifacts``; off otherwise, since only retries and
            other machines use them. ``None``: never (a retry then starts from scratch).
        storage_retry_seconds: In :meth:`optimize`, how long calls to the study's storage are retried
            (with exponential backoff) while it is unreachable, before the study stops with
            ``StorageUnavailableError``. 0 turns retries off.
        engine: ``"auto"`` (default): ``"fused"`` on a GPU, ``"time_sliced"`` on the CPU (said in the log).
            ``"time_sliced"``: one trial at a time on the device, adapter hot-swap.
            ``"fused"``: live trials at the same progress train their chunk together in shared
            forward/backward passes over the base, each with its own loss, optimizer, schedule and
            clipping (SFT and DPO trials); gangs that cannot share a pass (GRPO trials, fp16, DoRA,
            padding-free packing, non-default losses, differing precision or activation checkpointing)
            train time-sliced, and the log says why once. Per-chunk values equal the time-sliced ones
            (float32: within 1e-5; bf16: within rounding, see benchmarks/README.md).
    """

    def __init__(
        self,
        *,
        model: ModelSource,
        train_dataset: Dataset,
        eval_dataset: Dataset,
        tokenizer: PreTrainedTokenizerBase | None = None,
        model_kwargs: dict[str, Any] | None = None,
        num_chunks: int = 8,
        max_concurrent_trials: int = 8,
        seed: int = 0,
        metric: str | None = None,
        eval_samples: int | str | None = "auto",
        compute_metrics: Callable[..., dict[str, float]] | None = None,
        preprocess_logits_for_metrics: Callable[..., Any] | None = None,
        formatting_func: Callable[[dict[str, Any]], str] | None = None,
        reward_funcs: list[Callable[..., list[float]] | str] | None = None,
        mlflow_tracking_uri: str | None = None,
        output_dir: str | os.PathLike[str] = "rapidfire-output",
        devices: str | torch.device | list[str | torch.device] = "auto",
        state_memory_budget: int | float | str | None = "auto",
        show_progress_bar: bool = True,
        dashboard_controls: bool = True,
        poll_seconds: float = 1.0,
        pause_grace_seconds: float = 120.0,
        artifact_store: Any = "auto",
        storage_retry_seconds: float = 60.0,
        engine: str = "auto",
    ) -> None:
        # Everything but the devices, to build one executor per device in worker processes.
        self._init_kwargs = {k: v for k, v in locals().items() if k not in ("self", "devices")}
        quiet_library_noise()
        from datasets import Dataset

        for name, dataset in (("train_dataset", train_dataset), ("eval_dataset", eval_dataset)):
            if not isinstance(dataset, Dataset):
                raise TypeError(f"{name} must be a datasets.Dataset, but got {type(dataset).__name__}.")
            if len(dataset) == 0:
                raise ValueError(f"{name} is empty.")
        if not isinstance(num_chunks, int) or num_chunks < 1:
            raise ValueError(f"num_chunks must be an integer of at least 1, but got {num_chunks=}.")
        if not isinstance(max_concurrent_trials, int) or max_concurrent_trials < 1:
            raise ValueError(
                f"max_concurrent_trials must be an integer of at least 1, but got {max_concurrent_trials=}."
            )
        if eval_samples == "auto":
            eval_samples = max(32, len(train_dataset) // num_chunks // 4)
        elif eval_samples is not None and (not isinstance(eval_samples, int) or eval_samples < 1):
            raise ValueError(f"eval_samples must be 'auto', None or an integer of at least 1, but got {eval_samples=}.")
        if isinstance(state_memory_budget, str) and state_memory_budget != "auto":
            raise ValueError(f"state_memory_budget must be 'auto', None or a number, but got {state_memory_budget=}.")
        if isinstance(state_memory_budget, (int, float)) and state_memory_budget < 0:
            raise ValueError(f"state_memory_budget must not be negative, but got {state_memory_budget=}.")
        if metric is not None and not isinstance(metric, str):
            raise TypeError(f"metric must be a metric name, but got {metric!r}.")
        for source in reward_funcs or []:
            if not (callable(source) or isinstance(source, str)):
                raise TypeError(f"reward_funcs must hold functions or reward model paths, but got {source!r}.")
        if not poll_seconds > 0:
            raise ValueError(f"poll_seconds must be positive, but got {poll_seconds=}.")
        if not pause_grace_seconds >= 0:
            raise ValueError(f"pause_grace_seconds must not be negative, but got {pause_grace_seconds=}.")
        if engine not in ("time_sliced", "fused", "auto"):
            raise ValueError(f"engine must be 'time_sliced', 'fused' or 'auto', but got {engine=}.")
        if not (isinstance(storage_retry_seconds, (int, float)) and storage_retry_seconds >= 0):
            raise ValueError(f"storage_retry_seconds must be a number of at least 0, but got {storage_retry_seconds=}.")
        if isinstance(artifact_store, str) and artifact_store != "auto":
            raise ValueError(
                f"artifact_store must be 'auto', None or an Optuna artifact store, but got {artifact_store=}."
            )
        if not isinstance(artifact_store, str) and artifact_store is not None:
            missing = [m for m in ("write", "open_reader", "remove") if not callable(getattr(artifact_store, m, None))]
            if missing:
                raise TypeError(
                    f"artifact_store must be an Optuna artifact store (FileSystemArtifactStore, Boto3ArtifactStore, "
                    f"...), but {type(artifact_store).__name__} has no {', '.join(missing)}."
                )

        self._plan = ChunkPlan(num_rows=len(train_dataset), num_chunks=num_chunks, seed=seed)
        self._model_source = model
        self._tokenizer = tokenizer
        self._model_kwargs = dict(model_kwargs or {})
        self._train = train_dataset
        self._eval = eval_dataset
        self.num_chunks = num_chunks
        self.max_concurrent_trials = max_concurrent_trials
        self.seed = seed
        # Resolved by the first trial's trainer type when not given (eval_loss, or eval_reward for GRPO).
        self._metric_given = None if metric is None else _metric_key(metric)
        self._metric: str | None = self._metric_given
        self._kind: TrainerKind | None = None
        self._eval_samples = eval_samples
        self._reward_sources = list(reward_funcs or [])
        self._tracker: MlflowTracker | None = None
        if mlflow_tracking_uri is not None:
            from optuna_rapidfire._mlflow import MlflowTracker

            self._tracker = MlflowTracker(mlflow_tracking_uri)
        self._extras = TrainerExtras(compute_metrics, preprocess_logits_for_metrics, formatting_func)
        self.output_dir = os.fspath(output_dir)
        self._devices = resolve_devices(devices)
        self._device = self._devices[0]
        self._worker_label = str(self._device)
        self._trial_tickets: Any = None  # set in worker processes: the trials left to start, shared
        self._several_explicit = len(self._devices) > 1 and not (isinstance(devices, str) and devices == "auto")
        self._budget_setting = state_memory_budget
        self.show_progress_bar = show_progress_bar

        self._start_lock = threading.Lock()
        self._slots = Slots(max_concurrent_trials)
        self._pool: TrialPool | None = None
        self._paused: set[Entry] = set()
        self._externally_finished: set[int] = set()
        self._forms: set[str] = set()
        self._poll_seconds = poll_seconds
        self.dashboard_controls = dashboard_controls
        self.pause_grace_seconds = pause_grace_seconds
        self._artifact_setting = artifact_store
        self.storage_retry_seconds = float(storage_retry_seconds)
        # "auto": fused on a GPU, where one pass for several trials fills the device; on the CPU a
        # shared pass saves nothing, so trials are time-sliced there.
        self.engine = engine if engine != "auto" else ("fused" if self._device.type == "cuda" else "time_sliced")
        if engine == "auto" and self.engine == "time_sliced":
            _logger.info(
                "engine='auto' on %s: time-sliced (a shared pass pays where one small trial leaves a GPU idle).",
                self._device,
            )
        self._checkpoint_stores: dict[str, Checkpoints | None] = {}
        self._scheduler = Scheduler()
        self._scheduler.expect(max_concurrent_trials)
        self._worker: DeviceWorker | None = None
        self._engine: TimeSlicedEngine | None = None
        self._fatal: BaseException | None = None
        self._call_error: BaseException | None = None
        self._notes_lock = threading.Lock()
        self._notes: set[str] = set()
        self._progress = Progress(False)

    # -- public API -----------------------------------------------------------------------------

    def objective(self, configure: Configure) -> Callable[[optuna.Trial], float]:
        """Return an Optuna objective that trains ``configure(trial)``'s config on this executor.

        Use it with ``study.optimize(executor.objective(configure), n_jobs=executor.max_concurrent_trials)``:
        each of Optuna's threads holds one live trial while the device interleaves them. The base
        model is loaded here, so a bad model path fails before the study starts.
        """
        if not callable(configure):
            raise TypeError(f"configure must be callable, but got {type(configure).__name__}.")
        if self._several_explicit:
            raise ValueError(
                f"devices={[str(d) for d in self._devices]} runs one worker process per device: use "
                "executor.optimize(study, configure, ...); an objective for study.optimize runs on one device."
            )
        if len(self._devices) > 1:
            self._note_once(
                f"The objective runs on {self._device}; executor.optimize uses all {len(self._devices)} GPUs."
            )
        self._ensure_started()

        def objective(trial: optuna.Trial) -> float:
            return TrialDriver(self, trial, configure).run()

        return objective

    def optimize(
        self,
        study: optuna.Study,
        configure: Configure,
        n_trials: int | None = None,
        timeout: float | None = None,
        *,
        callbacks: Iterable[Callable[[optuna.Study, optuna.trial.FrozenTrial], None]] | None = None,
        catch: Iterable[type[Exception]] | type[Exception] = (),
        gc_after_trial: bool = False,
        study_trials: int | None = None,
    ) -> None:
        """Run ``n_trials`` trials of ``configure`` on ``study``, ``max_concurrent_trials`` at a time.

        Like ``study.optimize(self.objective(configure), n_jobs=self.max_concurrent_trials)``, with a
        per-trial progress display, and two differences that only matter with control commands: a
        paused trial gives its place to a new one, and a trial failed from optuna-dashboard ends
        cleanly while the study goes on. ``timeout`` stops new trials from starting, as in Optuna.
        Trials still paused ``pause_grace_seconds`` after nothing else is left to run are finished as
        PRUNED (their state is kept for clones).

        ``study_trials`` is for several workers (processes or machines) sharing one study: run until
        the study, all workers together, has that many COMPLETE or PRUNED trials, and stay while
        trials run elsewhere, so that the retries of a dead worker's trials (with heartbeats and
        ``RetryHeartbeatStaleTrialCallback``) find a live worker. Each worker may start a few trials
        more than needed when they start at the same moment.
        """
        if n_trials is not None and (not isinstance(n_trials, int) or n_trials < 1):
            raise ValueError(f"n_trials must be None or a positive integer, but got {n_trials=}.")
        if study_trials is not None and (not isinstance(study_trials, int) or study_trials < 1):
            raise ValueError(f"study_trials must be None or a positive integer, but got {study_trials=}.")
        catch = tuple(catch) if isinstance(catch, Iterable) else (catch,)
        self._check_study(study)
        if len(self._devices) > 1:
            from optuna_rapidfire._processes import run_workers

            run_workers(
                self._init_kwargs,
                self._devices,
                study,
                {
                    "configure": configure,
                    "n_trials": n_trials,
                    "timeout": timeout,
                    "callbacks": list(callbacks or []),
                    "catch": catch,
                    "gc_after_trial": gc_after_trial,
                    "study_trials": study_trials,
                },
                self.show_progress_bar,
            )
            return
        objective = self.objective(configure)
        budget = n_trials if n_trials is not None else study_trials
        first_wave = self.max_concurrent_trials if budget is None else min(budget, self.max_concurrent_trials)
        self._scheduler.expect(first_wave)
        tickets = self._trial_tickets  # several worker processes share one count of trials to start
        self._call_error = None
        self._progress = Progress(self.show_progress_bar, total_trials=n_trials)
        self._pool = TrialPool(
            study,
            objective,
            self._slots,
            n_trials=n_trials,
            timeout=timeout,
            callbacks=callbacks,
            catch=catch,
            gc_after_trial=gc_after_trial,
            paused=lambda: len(self._paused),
            end_paused=self._end_paused,
            pause_grace=self.pause_grace_seconds,
            externally_finished=lambda number: number in self._externally_finished,
            take_ticket=tickets.take if tickets is not None else None,
            target=study_trials,
            retry_seconds=self.storage_retry_seconds,
        )
        try:
            self._pool.run()
        finally:
            self._pool = None
            if self._tracker is not None:
                self._tracker.flush()
            self._progress.close()
            self._progress = Progress(False)
            self._scheduler.expect(self.max_concurrent_trials)
        error = self._fatal or self._call_error
        if error is not None:
            raise error

    def close(self) -> None:
        """End paused trials (as PRUNED), stop the device worker and drop the model.

        The executor cannot be used afterwards.
        """
        self._end_paused()
        while self._paused:
            self._slots.wait_for_change(0.1)
        self._scheduler.close()
        if self._worker is not None:
            self._worker.join()
        self._worker = None
        self._engine = None
        if self._device.type == "cuda":
            torch.cuda.empty_cache()

    def __enter__(self) -> RapidFireExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def switches(self) -> int:
        """How many times the device switched from one trial to another so far."""
        return 0 if self._engine is None else self._engine.switches

    # -- set-up ---------------------------------------------------------------------------------

    def _ensure_started(self) -> None:
        with self._start_lock:
            if self._fatal is not None:
                raise self._fatal
            if self._worker is not None:
                return
            model, tokenizer = load_model(
                self._model_source, tokenizer=self._tokenizer, model_kwargs=self._model_kwargs
            )
            resident = ResidentModel(model, tokenizer, self._device)
            self._extras = self._with_reward_models(self._extras)
            data = PreparedData(self._train, self._eval, self._plan, self._eval_samples)
            engine_class = FusedEngine if self.engine == "fused" else TimeSlicedEngine
            self._engine = engine_class(
                resident, data, self._extras, os.path.join(self.output_dir, ".trainer"), self._state_budget()
            )
            self._scheduler.fuse = self.engine == "fused"
            self._worker = DeviceWorker(
                self._engine,
                self._scheduler,
                adapter_dir=lambda entry: entry.spec.adapter_dir,
                check_metrics=self._check_metrics,
            )
            self._worker.start()

    def _with_reward_models(self, extras: TrainerExtras) -> TrainerExtras:
        """Load reward models given by path once, for every GRPO trial to share."""
        if not self._reward_sources:
            return extras
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        funcs: list[Any] = []
        processing: list[Any] = []
        for source in self._reward_sources:
            if isinstance(source, str):
                model = AutoModelForSequenceClassification.from_pretrained(source, num_labels=1)
                model.to(self._device).eval().requires_grad_(False)
                tokenizer = AutoTokenizer.from_pretrained(source)
                if tokenizer.pad_token is None:
                    tokenizer.pad_token = tokenizer.eos_token
                funcs.append(model)
                processing.append(tokenizer)
            else:
                funcs.append(source)
                processing.append(None)
        return dataclasses.replace(extras, reward_funcs=tuple(funcs), reward_processing_classes=tuple(processing))

    @property
    def metric(self) -> str:
        """The metric reported after every chunk and returned as the trials' value."""
        if self._metric is None:
            raise RuntimeError("The metric is known once the first trial's training args are known.")
        return self._metric

    def _state_budget(self) -> int | None:
        setting = self._budget_setting
        if setting is None or (setting == "auto" and self._device.type != "cuda"):
            return None
        free = 0
        if self._device.type == "cuda":
            free_bytes, _ = torch.cuda.mem_get_info(self._device)
            free = free_bytes
        if setting == "auto":
            return int(free * 0.5)
        if isinstance(setting, float) and setting <= 1.0:
            return int(free * setting)
        return int(setting)

    def _check_metrics(self, metrics: dict[str, float]) -> None:
        if self.metric not in metrics:
            raise SetupError(
                f"metric={self.metric!r} is not among the evaluation's metrics {sorted(metrics)}. "
                "Pass one of those, or a compute_metrics that returns it."
            )

    def _note_once(self, message: str) -> None:
        with self._notes_lock:
            if message in self._notes:
                return
            self._notes.add(message)
        _logger.warning(message)

    # -- what the trial drivers share ---------------------------------------------------------------

    def _checkpoints(self, study: optuna.Study) -> Checkpoints | None:
        """The study's per-chunk checkpoint store (``None``: checkpoints are off)."""
        with self._notes_lock:
            if study.study_name not in self._checkpoint_stores:
                setting = self._artifact_setting
                if setting is None:
                    store = None
                elif setting == "auto":
                    # Checkpoints serve retries, which need heartbeats: without them they would only cost.
                    heartbeats = is_heartbeat_enabled(study._storage)
                    store = Checkpoints(default_store(study, self.output_dir)) if heartbeats else None
                else:
                    store = Checkpoints(setting)
                self._checkpoint_stores[study.study_name] = store
            return self._checkpoint_stores[study.study_name]

    def _check_study(self, study: optuna.Study) -> None:
        if len(study.directions) > 1:
            raise ValueError("RapidFireExecutor optimizes one metric: create the study with one direction.")
        if self._metric is not None:
            _check_direction(self._metric, study.direction)

    def _checked_config(self, returned: Any, study: optuna.Study) -> tuple[PeftConfig, TrainingArguments, TrainerKind]:
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
            self._note_once(note)
        kind.check_columns(self._train, self._eval, args, self._extras)
        if kind.name == "grpo" and not self._reward_sources:
            raise ValueError("GRPOConfig trials need rewards: pass RapidFireExecutor(..., reward_funcs=[...]).")
        with self._notes_lock:
            if self._kind is None:
                self._kind = kind
                self._metric = self._metric or kind.default_metric
            elif kind is not self._kind and (self._metric_given is None or self._metric_given.endswith("loss")):
                raise ValueError(
                    f"This study mixes {self._kind.args_type().__name__} and {kind.args_type().__name__} trials, "
                    f"whose {self.metric} values mean different things. Use one trainer type per study, or pass "
                    "metric= a metric every trial type reports on the same scale (from compute_metrics)."
                )
        _check_direction(self.metric, study.direction)
        return peft_config, args, kind

    def _claim_slot(self, trial_number: int, *, resume: bool = False) -> None:
        """Take a live-trial slot (the pool may already have taken one for this thread)."""
        pool = self._pool
        if pool is not None:
            pool.asked()
        if not resume and pool is not None and getattr(pool.local, "slot_taken", False):
            pool.local.slot_taken = False
            pool.local.trial_number = trial_number
            return
        if pool is not None:
            pool.local.trial_number = trial_number
        self._slots.acquire(resume=resume)

    def _register_form(self, study: optuna.Study) -> None:
        if not self.dashboard_controls:
            return
        with self._notes_lock:
            if study.study_name in self._forms:
                return
            self._forms.add(study.study_name)
        register_dashboard_form(study)

    def _end_paused(self) -> None:
        for entry in list(self._paused):
            entry.events.put(EndPaused())


def _check_direction(metric: str, direction: StudyDirection) -> None:
    """A loss must be minimized, a reward or an accuracy maximized; say so before any training."""
    name = metric.removeprefix("eval_").lower()
    if name.endswith("loss") and direction == StudyDirection.MAXIMIZE:
        raise ValueError(f"metric={metric!r} is a loss but the study maximizes: create it with direction='minimize'.")
    if ("reward" in name or "accurac" in name) and direction == StudyDirection.MINIMIZE:
        raise ValueError(
            f"metric={metric!r} is higher-is-better but the study minimizes: create it with direction='maximize'."
        )


def _metric_key(metric: str) -> str:
    return metric if metric.startswith("eval_") else f"eval_{metric}"


def best_adapter_path(study: optuna.Study) -> str:
    """Path of the best trial's final adapter, loadable with ``PeftModel.from_pretrained(base, path)``.

    Raises:
        ValueError: If the study has no COMPLETE trial, or its best trial has no saved adapter.
    """
    best = study.best_trial
    path = best.user_attrs.get(_attrs.ADAPTER_PATH)
    if path is None:
        raise ValueError(f"Trial {best.number} has no saved adapter (user attr {_attrs.ADAPTER_PATH!r}).")
    return str(path)


__all__ = ["RapidFireExecutor", "best_adapter_path"]
