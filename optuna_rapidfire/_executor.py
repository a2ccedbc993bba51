"""``RapidFireExecutor``: many Optuna trials trained chunk by chunk on one resident base model.

The executor is a front, as ``Study.optimize`` is in Optuna: it validates its settings into an
:class:`~optuna_rapidfire._study._config.ExecutorConfig`, builds a device runtime (model, engine, scheduler,
worker thread, slots) and the study services, and hands them to the functions of
:mod:`optuna_rapidfire._study._optimize` (or, with several devices, to one worker process per device).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from optuna.trial import TrialState

from optuna_rapidfire import _compat
from optuna_rapidfire._engines._types import EngineStats
from optuna_rapidfire._logging import get_logger, quiet_library_noise
from optuna_rapidfire._processes import run_workers
from optuna_rapidfire._resident._model import resolve_devices
from optuna_rapidfire._runtime._device import DeviceRuntime
from optuna_rapidfire._study import _attrs
from optuna_rapidfire._study._config import Configure, ExecutorConfig, takes_options_of
from optuna_rapidfire._study._optimize import end_paused, make_objective, optimize
from optuna_rapidfire._study._progress import Progress
from optuna_rapidfire._study._run import Run
from optuna_rapidfire._study._services import StudyServices

if TYPE_CHECKING:
    import optuna
    import torch

    from optuna_rapidfire._runtime._schedule import BaseSchedule

_logger = get_logger(__name__)

__all__ = ["Configure", "RapidFireExecutor", "best_adapter_path"]


class RapidFireExecutor:
    """Train many Optuna trials together on one resident base model, chunk by chunk.

    The train set is shuffled once with ``seed`` and cut into ``num_chunks`` chunks. Up to
    ``max_concurrent_trials`` trials are live on the device, and the ``schedule`` picks who trains next
    (by default ASHA's promotion rule). After each chunk a trial is evaluated, reports its metric at
    ``step`` = its global chunk count, and asks the study's pruner whether to stop, with its running peers
    visible to the pruner. Switching trials swaps only the small per-trial state: the base model is
    loaded once.

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
            the final state and the final adapter. Needs MLflow (``pip install mlflow``, or the project's
            ``mlflow`` extra). Or the ``MlflowClient`` to log through (made with settings of your own; with
            several devices each worker process logs through a copy of it).
        output_dir: Where final adapters go: ``output_dir/<study name>/trial-<number>``.
        devices: ``"auto"`` (every visible GPU, else the CPU), a device such as ``"cuda:1"``, or a list of
            devices. With several, :meth:`optimize` runs one worker process per device, each with its own
            copy of the base model, all pulling trials from the study's storage (which must be an RDB URL
            or a JournalStorage on a file); a trial lives on one device.
        state_memory_budget: How much per-trial state (adapters and optimizer moments) stays on the
            device; idle trials beyond it move to pinned CPU memory. Bytes as an int, a size such as
            ``"8GiB"``, or a share of the device memory left after loading the base model such as
            ``"40%"`` (on a GPU). ``"auto"``: half of what is left on a GPU, no limit on the CPU.
            ``None``: no limit.
        show_progress_bar: Show per-trial progress on a terminal.
        dashboard_controls: Add a stop/resume/delete/clone form to running trials in optuna-dashboard
            (unless the study has a form of its own).
        poll_seconds: How often a trial that is not training (queued, paused, or waiting at a rung or for the
            device) checks the storage for a command, which then applies at once.
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
            other machines use them. ``None``: never (a retry then starts from scratch). Without a store,
            the chunk states clones branch from are kept in this process's memory.
        keep_checkpoints: Chunk states kept per trial for warm clones to branch from (``control.clone(...,
            from_chunk=k)``): ``None`` (default) keeps every chunk's state of a live trial and the last of
            a finished one; an integer keeps the last that many of every trial; a state a waiting clone
            branches from is kept until the clone has it.
        checkpoint_budget: Bytes of chunk states this process keeps (an int, ``"8GiB"``, or ``"25%"`` of the
            host memory); over it, the oldest that are neither a trial's latest nor awaited by a clone are
            dropped, each with a log line. ``"auto"``: a quarter of the host memory for states kept in
            memory, no limit in an artifact store. ``None``: no limit.
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
            (float32 and bf16: within rounding, see benchmarks/README.md).
        schedule: Which live trials train next, by name or as an instance of
            :mod:`optuna_rapidfire.schedules` (like a pruner). ``"promote"`` (``"default"``): ASHA's
            promotion rule: a trial that reports at a rung (after chunks 1, 3, 9, ...) waits there and
            goes on only when it ranks in the top third of the trials that reported there; new configs
            train their first chunk before anyone waiting; when nothing else may train, the best waiting
            trial goes on (:class:`~optuna_rapidfire.schedules.PromoteSchedule`). ``"lockstep"``: chunk k
            of every live trial before anyone's chunk k+1, pruning decisions at round barriers, all
            completing at the end of their wave. Per-chunk values do not depend on the schedule.
        compile: How the fused engine runs a gang's pass. ``"auto"`` (default): on a GPU, a stream's passes
            (SFT: training, optimizer steps, evaluation) are uncompiled kernels recorded as CUDA graphs, one per
            pass shape (rows padded to a few buckets, tokens to the stream's width), and replayed with one
            launch: a recording costs about one pass and nothing is compiled; the passes of fixed gangs (DPO,
            GRPO's policy passes) are compiled as with ``True``; uncompiled on the CPU. ``True``: compiled with
            ``torch.compile`` (Inductor) on any device, once per gang *layout* (the projections the members
            adapt, their rank bucket, precision, dropout) and reused by every gang of that layout (on a GPU in a
            background thread while the passes run uncompiled), nothing recorded; ``False``: neither; or the
            name of a ``torch.compile`` backend. A layout that fails to compile, or a shape that cannot be
            recorded, runs uncompiled, the log says why, and the results are the same.
            Llama-family models (Llama, Mistral, Qwen2, Qwen3) take this pass; other models train in the
            model's own modules, uncompiled.
    """

    @takes_options_of(ExecutorConfig)
    def __init__(self, **options: Any) -> None:
        quiet_library_noise()
        _compat.keep_accelerate_environment()  # before this executor's threads start
        self.config = ExecutorConfig.from_options(type(self).__name__, options)
        devices = self.config.devices
        self._devices = resolve_devices(devices)
        self._several_explicit = len(self._devices) > 1 and not (isinstance(devices, str) and devices == "auto")
        self._services = StudyServices(self.config)
        self._device = DeviceRuntime(self._services.device_settings(), self._devices[0], label=str(self._devices[0]))
        # The objective's trials (under a plain study.optimize) share one run with no pool and no display.
        self._objective_run = Run(self._device, self._services, Progress(False))

    @property
    def max_concurrent_trials(self) -> int:
        """Trials live on the device at once (the ``n_jobs`` of a plain ``study.optimize``)."""
        return self.config.max_concurrent_trials

    @property
    def num_chunks(self) -> int:
        """Chunks per pass over the train set."""
        return self.config.num_chunks

    @property
    def schedule(self) -> BaseSchedule:
        """Which live trials train next (see the ``schedule`` argument)."""
        return self.config.policy

    @property
    def engine(self) -> str:
        """The engine the trials train with on this executor's (first) device: ``fused`` or ``time_sliced``."""
        return self._device.engine_name

    @property
    def metric(self) -> str:
        """The metric reported after every chunk and returned as the trials' value."""
        return self._services.metric

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
            self._services.note_once(
                f"The objective runs on {self._device.device}; executor.optimize uses all {len(self._devices)} GPUs."
            )
        self._device.start()
        return make_objective(self._objective_run, configure)

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
    ) -> None:
        """Run ``n_trials`` trials of ``configure`` on ``study``, ``max_concurrent_trials`` at a time.

        Like ``study.optimize(self.objective(configure), n_jobs=self.max_concurrent_trials)``, with a
        per-trial progress display, and two differences that only matter with control commands: a
        paused trial gives its place to a new one, and a trial failed from optuna-dashboard ends
        cleanly while the study goes on. ``timeout`` stops new trials from starting, as in Optuna.
        Trials still paused ``pause_grace_seconds`` after nothing else is left to run are finished as
        PRUNED (their state is kept for clones). Ctrl-C ends the live trials after their chunk in flight
        (PRUNED, state kept), then raises ``KeyboardInterrupt``.

        Several workers (processes or machines) sharing one study: pass Optuna's
        ``MaxTrialsCallback(n, states=(TrialState.COMPLETE, TrialState.PRUNED))`` in ``callbacks`` (and
        no ``n_trials``). Each worker then runs until the study, all workers together, has ``n`` such
        trials, and stays while trials run elsewhere, so that the retries of a dead worker's trials
        (with heartbeats and ``RetryHeartbeatStaleTrialCallback``) find a live worker. Workers that start
        at the same moment may start a few trials more than needed.
        """
        if n_trials is not None and (not isinstance(n_trials, int) or n_trials < 1):
            raise ValueError(f"n_trials must be None or a positive integer, but got {n_trials=}.")
        catch = tuple(catch) if isinstance(catch, Iterable) else (catch,)
        callbacks = list(callbacks or [])
        target = study_target(callbacks)
        if not callable(configure):
            raise TypeError(f"configure must be callable, but got {type(configure).__name__}.")
        self._services.check_study(study)
        if len(self._devices) > 1:
            options: dict[str, Any] = {"configure": configure, "n_trials": n_trials, "timeout": timeout}
            options |= {"callbacks": callbacks, "catch": catch, "gc_after_trial": gc_after_trial, "target": target}
            run_workers(self.config, self._devices, study, options)
            return
        optimize(
            self._device,
            self._services,
            study,
            configure,
            n_trials=n_trials,
            timeout=timeout,
            callbacks=callbacks,
            catch=catch,
            gc_after_trial=gc_after_trial,
            target=target,
        )

    def close(self) -> None:
        """End paused trials (as PRUNED), stop the device worker and drop the model.

        The executor cannot be used afterwards.
        """
        end_paused(self._device)
        self._device.paused.wait_until_empty()
        self._device.close()
        if self._services.tracker is not None:
            self._services.tracker.close()

    def __enter__(self) -> RapidFireExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def devices(self) -> list[torch.device]:
        """The devices trials train on (one worker process each when there are several)."""
        return list(self._devices)

    def stats(self) -> EngineStats:
        """Counters of the (first) device's engine, for benchmarks and tests.

        Returns:
            Switches, offloads, fused steps, live trials and the like; all zeros before the model is loaded
            (by the first ``optimize`` or ``objective``) and after :meth:`close`.
        """
        engine = self._device.engine
        return EngineStats() if engine is None else engine.stats()


def study_target(
    callbacks: list[Callable[[optuna.Study, optuna.trial.FrozenTrial], None]],
) -> tuple[int, tuple[TrialState, ...]] | None:
    """The study-wide count of a ``MaxTrialsCallback`` among ``callbacks``: ``(n, finished states counted)``.

    Such a callback calls ``study.stop()`` once the study holds ``n`` trials in its states; the executor
    reads the same ``n`` to keep a worker available for other workers' retries until then.
    """
    from optuna.study import MaxTrialsCallback

    finished = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
    targets = []
    for callback in callbacks:
        if isinstance(callback, MaxTrialsCallback):
            n, states = _compat.max_trials_callback_target(callback)
            counted = tuple(s for s in finished if states is None or s in states)
            if not counted:
                raise ValueError(
                    "A MaxTrialsCallback in executor.optimize must count finished trials, e.g. "
                    "states=(TrialState.COMPLETE, TrialState.PRUNED)."
                )
            targets.append((n, counted))
    return min(targets, key=lambda t: t[0]) if targets else None


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
