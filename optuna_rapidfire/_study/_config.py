"""The executor's settings: one frozen, validated object.

``RapidFireExecutor(**kwargs)`` validates its keywords here, before any work, and keeps the result. The
same object is what a worker process receives (with the device and a few per-process fields replaced)
and what the ``optuna-rapidfire worker`` command builds its executors from, so every path checks the
same things once.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Concatenate, Literal, ParamSpec, TypeVar

import optuna

from optuna_rapidfire._budget import MemoryBudget
from optuna_rapidfire._runtime._schedules import schedule_from

if TYPE_CHECKING:
    import torch
    from datasets import Dataset
    from mlflow.tracking import MlflowClient
    from peft import PeftConfig
    from transformers import PreTrainedTokenizerBase, TrainingArguments

    from optuna_rapidfire._compat import ArtifactStore
    from optuna_rapidfire._resident._model import ModelSource
    from optuna_rapidfire._runtime._schedule import BaseSchedule

EngineName = Literal["auto", "fused", "time_sliced"]
"""``"fused"``: gangs of trials share passes; ``"time_sliced"``: one trial at a time; ``"auto"``: fused on a
GPU, time-sliced on the CPU."""

Configure = Callable[[optuna.Trial], "tuple[PeftConfig, TrainingArguments]"]
"""The user's function: suggest hyperparameters on the trial, return ``(peft_config, training_args)``."""


@dataclass(frozen=True, kw_only=True)
class ExecutorConfig:
    """Every setting of a :class:`~optuna_rapidfire.RapidFireExecutor`: the one list of its keywords.

    Its fields *are* the executor's keyword arguments: the executor's ``__init__`` takes ``**options`` and
    borrows this class's signature (:func:`takes_options_of`), so a setting is added here once, with its
    type and default (and documented in the executor's docstring). The executor passes its keywords here
    unchanged; making the object validates every setting before any work,
    names the bad value, and resolves a few in place: ``metric`` gets its ``eval_`` prefix, ``model_kwargs``
    becomes a dict, ``reward_funcs`` a tuple, ``output_dir`` a string. Derived: :attr:`policy` (the schedule
    object ``schedule`` names), :attr:`eval_rows` (``eval_samples`` resolved) and :attr:`memory_budget`
    (``state_memory_budget`` parsed; ``None`` for ``"auto"``: half the free GPU memory, no limit on the CPU).
    The same object is what a worker process receives (with a few per-process fields replaced) and what the
    ``optuna-rapidfire worker`` command builds its executors from, so every path checks the same things once.
    """

    model: ModelSource
    train_dataset: Dataset
    eval_dataset: Dataset
    tokenizer: PreTrainedTokenizerBase | None = None
    model_kwargs: dict[str, Any] | None = None
    num_chunks: int = 8
    max_concurrent_trials: int = 8
    seed: int = 0
    metric: str | None = None
    eval_samples: int | Literal["auto"] | None = "auto"
    compute_metrics: Callable[..., dict[str, float]] | None = None
    preprocess_logits_for_metrics: Callable[..., Any] | None = None
    formatting_func: Callable[[dict[str, Any]], str] | None = None
    reward_funcs: Sequence[Callable[..., list[float]] | str] | None = None
    mlflow_tracking_uri: str | MlflowClient | None = None
    output_dir: str | os.PathLike[str] = "rapidfire-output"
    devices: str | torch.device | list[str | torch.device] = "auto"
    state_memory_budget: int | str | None = "auto"
    show_progress_bar: bool = True
    dashboard_controls: bool = True
    poll_seconds: float = 1.0
    pause_grace_seconds: float = 120.0
    artifact_store: ArtifactStore | Literal["auto"] | None = "auto"
    keep_checkpoints: int | None = None
    checkpoint_budget: int | str | None = "auto"
    storage_retry_seconds: float = 60.0
    engine: EngineName = "auto"
    schedule: str | BaseSchedule = "default"
    compile: bool | str = "auto"
    policy: BaseSchedule = field(init=False)
    """The schedule object ``schedule`` names (or is)."""
    memory_budget: MemoryBudget | None = field(init=False)
    """``state_memory_budget`` parsed (``None``: "auto")."""
    chunk_states_budget: MemoryBudget | None = field(init=False)
    """``checkpoint_budget`` parsed (``None``: "auto": a quarter of the host memory for states kept in memory, no
    limit in an artifact store); a percentage is of the host memory."""
    eval_rows: int | None = field(init=False)
    """``eval_samples`` resolved: rows of the eval subsample (``None``: the whole eval set)."""

    def __post_init__(self) -> None:
        from datasets import Dataset

        for name, dataset in (("train_dataset", self.train_dataset), ("eval_dataset", self.eval_dataset)):
            if not isinstance(dataset, Dataset):
                raise TypeError(f"{name} must be a datasets.Dataset, but got {type(dataset).__name__}.")
            if len(dataset) == 0:
                raise ValueError(f"{name} is empty.")
        num_chunks, max_concurrent_trials = self.num_chunks, self.max_concurrent_trials
        if not isinstance(num_chunks, int) or num_chunks < 1:
            raise ValueError(f"num_chunks must be an integer of at least 1, but got {num_chunks=}.")
        if not isinstance(max_concurrent_trials, int) or max_concurrent_trials < 1:
            raise ValueError(
                f"max_concurrent_trials must be an integer of at least 1, but got {max_concurrent_trials=}."
            )
        eval_samples = self.eval_samples
        if eval_samples == "auto":
            eval_samples = max(32, len(self.train_dataset) // num_chunks // 4)
        elif eval_samples is not None and (not isinstance(eval_samples, int) or eval_samples < 1):
            raise ValueError(f"eval_samples must be 'auto', None or an integer of at least 1, but got {eval_samples=}.")
        budget = MemoryBudget.parse(self.state_memory_budget)
        metric = self.metric
        if metric is not None and not isinstance(metric, str):
            raise TypeError(f"metric must be a metric name, but got {metric!r}.")
        for source in self.reward_funcs or []:
            if not (callable(source) or isinstance(source, str)):
                raise TypeError(f"reward_funcs must hold functions or reward model paths, but got {source!r}.")
        poll_seconds, pause_grace_seconds = self.poll_seconds, self.pause_grace_seconds
        if not poll_seconds > 0:
            raise ValueError(f"poll_seconds must be positive, but got {poll_seconds=}.")
        if not pause_grace_seconds >= 0:
            raise ValueError(f"pause_grace_seconds must not be negative, but got {pause_grace_seconds=}.")
        from optuna_rapidfire._engines import ENGINES  # torch and the engines: only once an executor is made

        engine = self.engine
        if engine != "auto" and engine not in ENGINES:
            names = ", ".join(repr(name) for name in ENGINES)
            raise ValueError(f"engine must be one of {names} or 'auto', but got {engine=}.")
        storage_retry_seconds = self.storage_retry_seconds
        if not (isinstance(storage_retry_seconds, (int, float)) and storage_retry_seconds >= 0):
            raise ValueError(f"storage_retry_seconds must be a number of at least 0, but got {storage_retry_seconds=}.")
        _check_artifact_store(self.artifact_store)
        tracking = self.mlflow_tracking_uri
        if not (tracking is None or isinstance(tracking, str) or callable(getattr(tracking, "create_run", None))):
            raise TypeError(
                f"mlflow_tracking_uri must be a tracking URI or an mlflow.tracking.MlflowClient, but got {tracking!r}."
            )
        keep = self.keep_checkpoints
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise ValueError(
                f"keep_checkpoints must be None (every chunk's state of a live trial) or an integer of at least 1, "
                f"but got keep_checkpoints={keep!r}."
            )
        _check_compile(self.compile)
        policy = schedule_from(self.schedule)
        resolved = {
            "model_kwargs": dict(self.model_kwargs or {}),
            "metric": None if metric is None else metric_key(metric),
            "eval_rows": eval_samples,
            "reward_funcs": tuple(self.reward_funcs or ()),
            "output_dir": os.fspath(self.output_dir),
            "storage_retry_seconds": float(storage_retry_seconds),
            "policy": policy,
            "memory_budget": budget,
            "chunk_states_budget": MemoryBudget.parse(self.checkpoint_budget, "checkpoint_budget"),
        }
        for name, value in resolved.items():
            object.__setattr__(self, name, value)  # frozen: set once, while the object is made

    def chunk_states_limit(self, *, in_memory: bool) -> int | None:
        """``checkpoint_budget`` in bytes for chunk states kept in this process's memory (``in_memory``) or in an
        artifact store (``None``: no limit); a percentage is of the host memory."""
        budget = self.chunk_states_budget
        if budget is None:  # "auto"
            budget = MemoryBudget(fraction=0.25) if in_memory else MemoryBudget()
        return budget.resolve(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))

    @classmethod
    def options(cls) -> list[str]:
        """The executor's keyword arguments (the fields a config is made from), in order."""
        return [f.name for f in dataclasses.fields(cls) if f.init]

    @classmethod
    def from_options(cls, caller: str, options: dict[str, Any]) -> ExecutorConfig:
        """The config of ``caller``'s keyword ``options``; an unknown or missing keyword is a ``TypeError``
        that names it (and the option it was probably meant to be)."""
        known = cls.options()
        for name in options:
            if name not in known:
                close = difflib.get_close_matches(name, known, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else f". Its options: {', '.join(known)}."
                raise TypeError(f"{caller}() got an unexpected keyword argument {name!r}{hint}")
        required = [
            f.name
            for f in dataclasses.fields(cls)
            if f.init and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]
        missing = [name for name in required if name not in options]
        if missing:
            raise TypeError(f"{caller}() is missing the keyword arguments {', '.join(map(repr, missing))}.")
        return cls(**options)

    def replace(self, **changes: Any) -> ExecutorConfig:
        """A copy with ``changes`` (for a worker process: no progress bar of its own)."""
        settings = {name: getattr(self, name) for name in self.options()}
        settings["schedule"] = self.policy
        return ExecutorConfig(**{**settings, **changes})


_P = ParamSpec("_P")
_S = TypeVar("_S")


def takes_options_of(
    config: Callable[_P, Any],
) -> Callable[[Callable[Concatenate[_S, ...], None]], Callable[Concatenate[_S, _P], None]]:
    """Give ``def __init__(self, **options)`` the keyword signature of ``config``, so the options are written
    once, as the config's fields: type checkers check each keyword's name and type (PEP 612), and
    ``inspect.signature``/``help()`` list them with their defaults."""

    def decorate(init: Callable[Concatenate[_S, ...], None]) -> Callable[Concatenate[_S, _P], None]:
        self = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
        signature = inspect.Signature([self, *inspect.signature(config).parameters.values()])
        vars(init)["__signature__"] = signature  # what inspect.signature reads
        return init

    return decorate


def metric_key(metric: str) -> str:
    """The metric as evaluation reports it: ``"loss"`` → ``"eval_loss"``."""
    return metric if metric.startswith("eval_") else f"eval_{metric}"


def _check_compile(setting: Any) -> None:
    if isinstance(setting, bool) or setting == "auto":
        return
    import torch

    known = torch.compiler.list_backends(exclude_tags=())
    if not isinstance(setting, str) or setting not in known:
        raise ValueError(
            f"compile must be 'auto', True, False or the name of a torch.compile backend ({', '.join(known)}), "
            f"but got compile={setting!r}."
        )


def _check_artifact_store(store: Any) -> None:
    if isinstance(store, str) and store != "auto":
        raise ValueError(
            f"artifact_store must be 'auto', None or an Optuna artifact store, but got artifact_store={store!r}."
        )
    if not isinstance(store, str) and store is not None:
        missing = [m for m in ("write", "open_reader", "remove") if not callable(getattr(store, m, None))]
        if missing:
            raise TypeError(
                f"artifact_store must be an Optuna artifact store (FileSystemArtifactStore, Boto3ArtifactStore, "
                f"...), but {type(store).__name__} has no {', '.join(missing)}."
            )
