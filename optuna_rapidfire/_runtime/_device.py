"""One device and what lives on it: the base model, the engine, the scheduler, the worker thread, the slots.

Built lazily (the model loads on the first ``start``) and shut down by ``close``. Trial drivers reach the
device only through the scheduler (tasks and events) and the slots; only the worker thread touches the
model.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from typing import TYPE_CHECKING, Any

import torch

from optuna_rapidfire._engines import ENGINES
from optuna_rapidfire._engines._trials import DeviceTrials
from optuna_rapidfire._logging import get_logger
from optuna_rapidfire._resident._data import ChunkPlan, PreparedData
from optuna_rapidfire._resident._model import ResidentModel, load_model
from optuna_rapidfire._runtime._scheduler import Scheduler
from optuna_rapidfire._runtime._slots import PausedTrials, Slots
from optuna_rapidfire._runtime._worker import DeviceWorker

if TYPE_CHECKING:
    from optuna_rapidfire._config import ExecutorConfig
    from optuna_rapidfire._engines._base import Engine
    from optuna_rapidfire._study._services import StudyServices
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
    """Whether the fused engine replays its streamed passes from CUDA graphs: with ``compile="auto"`` on a GPU.

    Recording a pass costs about one uncompiled pass, where compiling the launched pass cost 20-50 s on an
    H200 (and stalled the passes beside it), and a replay launches the pass's thousands of small kernels at
    once: the 82M search's passes are launch-bound, so this is what makes them fast."""
    return setting == "auto" and device_type == "cuda"


def engine_for(config: ExecutorConfig, device: torch.device) -> str:
    """The engine ``config.engine`` means on ``device``: ``"auto"`` is fused on a GPU, time-sliced elsewhere."""
    if config.engine != "auto":
        return config.engine
    return "fused" if device.type == "cuda" else "time_sliced"


class DeviceRuntime:
    """The per-device half of an executor.

    Args:
        config: The executor's settings.
        device: The device (``cuda:0``, ``cpu``...).
        services: The executor's study services (metric check, trainer extras).
        label: How the trial attributes name this device (a worker process sees its GPU as ``cuda:0``).
    """

    def __init__(self, config: ExecutorConfig, device: torch.device, services: StudyServices, label: str) -> None:
        self.config = config
        self.device = device
        self.services = services
        self.label = label
        self.plan = ChunkPlan(num_rows=len(config.train_dataset), num_chunks=config.num_chunks, seed=config.seed)
        self.engine_name = engine_for(config, device)
        if config.engine == "auto" and self.engine_name == "time_sliced":
            _logger.info(
                "engine='auto' on %s: time-sliced (a shared pass pays where one small trial leaves a GPU idle).",
                device,
            )
        self.slots = Slots(config.max_concurrent_trials)
        self.scheduler = Scheduler(schedule=config.policy)
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
            model, tokenizer = load_model(
                config.model, tokenizer=config.tokenizer, model_kwargs=config.model_kwargs or {}
            )
            resident = ResidentModel(model, tokenizer, self.device)
            data = PreparedData(config.train_dataset, config.eval_dataset, self.plan, config.eval_rows)
            trials = DeviceTrials(
                resident=resident,
                data=data,
                extras=self._with_reward_models(self.services.extras),
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
                check_metrics=self.services.check_metrics,
            )
            self._worker.start()

    def close(self) -> None:
        """Stop the worker thread and drop the model (paused trials must have ended first)."""
        self.scheduler.close()
        if self._worker is not None:
            self._worker.join()
        self._worker = None
        if self.engine is not None:
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
