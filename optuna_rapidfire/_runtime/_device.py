"""One device and what lives on it: the base model, the engine, the scheduler, the worker thread, the slots.

Built lazily (the model loads on the first ``start``) and shut down by ``close``. Trial drivers reach the
device only through the scheduler (tasks and events) and the slots; only the worker thread touches the
model.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from optuna_rapidfire import events
from optuna_rapidfire._engines import ENGINES, _environment
from optuna_rapidfire._engines._trials import DeviceTrials
from optuna_rapidfire._logging import get_logger
from optuna_rapidfire._resident._data import ChunkPlan, PreparedData
from optuna_rapidfire._resident._model import ResidentModel, load_model
from optuna_rapidfire._runtime._scheduler import Scheduler
from optuna_rapidfire._runtime._slots import PausedTrials, Slots
from optuna_rapidfire._runtime._worker import DeviceWorker

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from datasets import Dataset
    from transformers import PreTrainedTokenizerBase

    from optuna_rapidfire._budget import MemoryBudget
    from optuna_rapidfire._engines._base import Engine
    from optuna_rapidfire._resident._model import ModelSource
    from optuna_rapidfire._runtime._schedule import BaseSchedule
    from optuna_rapidfire._trainers import TrainerExtras

_logger = get_logger(__name__)


def compile_backend(setting: bool | str, device_type: str) -> str | bool:
    """The ``torch.compile`` backend the fused engine's launched pass uses on a device of ``device_type``
    (``False``: none): ``"auto"`` compiles with Inductor on a GPU only (the passes it records as CUDA graphs
    run uncompiled kernels, see :func:`records_graphs`: a stream's, so Inductor compiles only what is not
    recorded, fixed gangs such as DPO's), ``True`` with Inductor anywhere."""
    if setting == "auto":
        return "inductor" if device_type == "cuda" else False
    if setting is True:
        return "inductor"
    return setting


def records_graphs(setting: bool | str, device_type: str) -> bool:
    """Whether the fused engine replays its streamed passes from CUDA graphs: with ``compile="auto"`` on a GPU,
    unless ``RAPIDFIRE_RECORD_PASSES`` says otherwise (:mod:`~optuna_rapidfire._engines._environment`).

    Recording a pass costs about one uncompiled pass, where compiling the launched pass cost 20-50 s on an
    H200 (and stalled the passes beside it), and a replay launches the pass's thousands of small kernels at
    once: the 82M search's passes are launch-bound, so this is what makes them fast."""
    forced = _environment.flag(_environment.RECORD_PASSES)
    return forced if forced is not None else setting == "auto" and device_type == "cuda"


def engine_for(engine: str, device: torch.device) -> str:
    """The engine ``engine`` means on ``device``: ``"auto"`` is fused on a GPU, time-sliced elsewhere."""
    if engine != "auto":
        return engine
    return "fused" if device.type == "cuda" else "time_sliced"


@dataclass(frozen=True, kw_only=True)
class DeviceSettings:
    """What a device's runtime needs of the executor's settings and study services, as values (the front
    builds it: ``ExecutorConfig.for_device``).

    Attributes:
        model: The base model (a path, a hub id, a model, or a function that returns model and tokenizer).
        tokenizer: The tokenizer (``None``: the model's).
        model_kwargs: Keywords for ``from_pretrained``.
        train_dataset: The training rows, chunked by ``num_chunks`` and ``seed``.
        eval_dataset: The evaluation rows, of which ``eval_rows`` are used (``None``: all).
        num_chunks: Chunks per epoch.
        seed: The chunk plan's seed.
        eval_rows: Evaluation rows used (``None``: all).
        max_concurrent_trials: Live trials at a time.
        schedule: Which ready trials train next.
        engine: ``"auto"``, ``"fused"`` or ``"time_sliced"``.
        compile: The fused engine's compile setting.
        output_dir: The executor's output folder.
        reward_funcs: GRPO reward functions, or paths of reward models to load once on the device.
        memory_budget: Per-trial state kept on the device (``None``: ``"auto"``).
        extras: Executor-wide arguments for the TRL trainers.
        check_metrics: Given a one-batch evaluation of the first trial (to call where the study's metric is not
            known to be reported), raises when the evaluations lack that metric.
    """

    model: ModelSource
    tokenizer: PreTrainedTokenizerBase | None
    model_kwargs: dict[str, Any]
    train_dataset: Dataset
    eval_dataset: Dataset
    num_chunks: int
    seed: int
    eval_rows: int | None
    max_concurrent_trials: int
    schedule: BaseSchedule
    engine: str
    compile: bool | str
    output_dir: str
    reward_funcs: Sequence[Callable[..., list[float]] | str]
    memory_budget: MemoryBudget | None
    extras: TrainerExtras
    check_metrics: Callable[[Callable[[], dict[str, float]]], None]


class DeviceRuntime:
    """The per-device half of an executor.

    Args:
        config: What the device needs of the executor's settings.
        device: The device (``cuda:0``, ``cpu``...).
        label: How the trial attributes name this device (a worker process sees its GPU as ``cuda:0``).
    """

    def __init__(self, config: DeviceSettings, device: torch.device, label: str) -> None:
        self.config = config
        self.device = device
        self.label = label
        self.plan = ChunkPlan(num_rows=len(config.train_dataset), num_chunks=config.num_chunks, seed=config.seed)
        self.engine_name = engine_for(config.engine, device)
        if config.engine == "auto" and self.engine_name == "time_sliced":
            _logger.info(
                "engine='auto' on %s: time-sliced (a shared pass pays where one small trial leaves a GPU idle).",
                device,
            )
        self.slots = Slots(config.max_concurrent_trials)
        self.scheduler = Scheduler(schedule=config.schedule)
        self.scheduler.lender = self.slots
        self.scheduler.expect(config.max_concurrent_trials)
        self.paused = PausedTrials(self.slots)
        self.fatal: BaseException | None = None
        self.engine: Engine | None = None
        self._worker: DeviceWorker | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        """Load the model and start the worker thread (once); raise the error that made the device unusable."""
        with self._lock:
            if self.fatal is not None:
                raise self.fatal
            if self._worker is not None:
                return
            config = self.config
            start = time.perf_counter()
            model, tokenizer = load_model(config.model, tokenizer=config.tokenizer, model_kwargs=config.model_kwargs)
            if events.listening(events.ModelLoaded):
                events.emit(events.ModelLoaded(str(self.device), time.perf_counter() - start, model))
            resident = ResidentModel(model, tokenizer, self.device)
            data = PreparedData(config.train_dataset, config.eval_dataset, self.plan, config.eval_rows)
            trials = DeviceTrials(
                resident=resident,
                data=data,
                extras=self._with_reward_models(config.extras),
                output_dir=os.path.join(config.output_dir, ".trainer"),
                state_budget=self._state_budget(),
            )
            self.engine = ENGINES[self.engine_name].create(
                trials,
                compile=compile_backend(config.compile, self.device.type),
                capacity=config.max_concurrent_trials,
                graphs=records_graphs(config.compile, self.device.type),
            )
            self._worker = DeviceWorker(
                self.engine,
                self.scheduler,
                adapter_dir=lambda entry: entry.spec.adapter_dir,
                check_metrics=config.check_metrics,
            )
            self._worker.start()

    def flush(self) -> None:
        """Wait until the trials that ended have left the device and their snapshot files, written in the
        background, are written."""
        worker = self._worker
        if worker is not None:
            self.scheduler.settle(worker.is_alive)
        if self.engine is not None:
            self.engine.flush()

    def close(self) -> None:
        """Stop the worker thread and drop the model (paused trials must have ended first)."""
        self.scheduler.close()
        if self._worker is not None:
            self._worker.join()
        self._worker = None
        if self.engine is not None:
            self.engine.flush()
            self.engine.close()
        self.engine = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _with_reward_models(self, extras: TrainerExtras) -> TrainerExtras:
        """Load reward models given by path once, on this device, for every GRPO trial to share."""
        if not self.config.reward_funcs:
            return extras
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        funcs: list[Any] = []
        processing: list[Any] = []
        for source in self.config.reward_funcs:
            if isinstance(source, str):
                model = AutoModelForSequenceClassification.from_pretrained(source, num_labels=1)
                model.to(self.device).eval().requires_grad_(False)
                tokenizer = AutoTokenizer.from_pretrained(source)
                if tokenizer.pad_token is None:
                    tokenizer.pad_token = tokenizer.eos_token
                funcs.append(model)
                processing.append(tokenizer)
            else:
                funcs.append(source)
                processing.append(None)
        return dataclasses.replace(extras, reward_funcs=tuple(funcs), reward_processing_classes=tuple(processing))

    def _state_budget(self) -> int | None:
        """Bytes of trial state kept on the device: ``"auto"`` is half the free GPU memory, no limit on the CPU."""
        budget = self.config.memory_budget
        free = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else 0
        if budget is None:
            return int(free * 0.5) if self.device.type == "cuda" else None
        if budget.fraction is not None and self.device.type != "cuda":
            return None  # the CPU's memory is not the budget's concern
        return budget.resolve(free)
