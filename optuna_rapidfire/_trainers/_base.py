"""What a TRL trainer type must provide for the executor to drive it chunk by chunk.

The executor never calls a TRL trainer's ``train()``: that loop owns the whole run. It builds one
trainer per trial over the shared ``PeftModel`` and uses its pieces (data preparation, collator, loss,
optimizer and LR scheduler factories), so a trial trains exactly as TRL would train it, one chunk at a
time. A :class:`TrainerKind` holds what differs between SFT, DPO and GRPO, in every engine: the fused
engine's shared passes call its :class:`~optuna_rapidfire._trainers._fused_loss.FusedLoss`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

from optuna_rapidfire import _compat
from optuna_rapidfire._trainers._gangs import ALONE, GangStrategy

if TYPE_CHECKING:
    from collections.abc import Callable, Collection, Hashable, Iterator

    import numpy as np
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    from optuna_rapidfire._resident._model import ResidentModel
    from optuna_rapidfire._trainers._fused_loss import FusedLoss


ACCELERATE_STATE = threading.RLock()
"""Held while ``TrainingArguments`` are made (``configure(trial)`` in a trial thread, a trial's effective
args) and while a trainer is built, until :meth:`TrainerKind.isolate` has given it its own copy of
accelerate's state: every new ``TrainingArguments`` clears accelerate's process-wide state, which a trainer
under construction reads (``SFTTrainer`` reads ``accelerator.parallelism_config``)."""


@dataclass(frozen=True)
class TrainerExtras:
    """Executor-wide arguments forwarded to every trial's TRL trainer."""

    compute_metrics: Callable[..., dict[str, float]] | None = None
    preprocess_logits_for_metrics: Callable[..., Any] | None = None
    formatting_func: Callable[[dict[str, Any]], str] | None = None
    reward_funcs: tuple[Any, ...] = ()
    reward_processing_classes: tuple[Any, ...] = ()


# Fields the executor owns: it evaluates after every chunk, saves the final adapter itself and cuts
# the run into chunks. A value other than the field's default is reported once, then ignored.
_OWNED_FIELDS: dict[str, str] = {
    "eval_strategy": "the executor evaluates after every chunk",
    "eval_steps": "the executor evaluates after every chunk",
    "save_strategy": "the executor saves each COMPLETE trial's final adapter",
    "save_steps": "the executor saves each COMPLETE trial's final adapter",
    "save_total_limit": "the executor saves each COMPLETE trial's final adapter",
    "logging_strategy": "the executor records per-chunk metrics in the study",
    "logging_steps": "the executor records per-chunk metrics in the study",
    "report_to": "the executor reports to Optuna (and MLflow when configured)",
    "data_seed": "the executor's seed fixes the chunks and their order",
    "shuffle_dataset": "the executor shuffles the train set once with its seed",
    "eval_on_start": "the executor evaluates after every chunk",
}

# Fields whose feature the executor does not drive; a non-default value is an error.
_UNSUPPORTED_FIELDS: dict[str, str] = {
    "deepspeed": "DeepSpeed shards the model; the executor keeps one base model per device",
    "fsdp": "FSDP shards the model; the executor keeps one base model per device",
    "torch_compile": "compiling the shared model per trial defeats hot-swapping adapters",
    "auto_find_batch_size": "it restarts training with new batch sizes; set the batch size per trial",
    "neftune_noise_alpha": "NEFTune hooks the shared embedding layer",
    "use_liger_kernel": "Liger patches the shared model",
    "activation_offloading": "it wraps the shared model's activations",
    "load_best_model_at_end": "the trial's value and adapter are those of its final chunk",
    "push_to_hub": "adapters are saved locally; push the best one yourself",
}


def _field_default(args: TrainingArguments, name: str) -> Any:
    for f in dataclasses.fields(args):
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                return f.default
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
    return None


def _is_default(args: TrainingArguments, name: str) -> bool:
    value = getattr(args, name, None)
    value = getattr(value, "value", value)  # enum members compare by value
    default = _field_default(args, name)
    if not value and not default:  # None, False, "", [] and {} all mean "off"
        return True
    if value in ("no", "none") and name in _OWNED_FIELDS:  # turned off: nothing to ignore
        return True
    if name == "report_to" and value in ("none", ["none"], []):
        return True
    return bool(value == default)


class TrainerKind(ABC):
    """Glue between the executor and one TRL trainer type (SFT, DPO, GRPO)."""

    #: Short name used in logs and user attributes.
    name: str
    #: Metric reported after every chunk unless ``metric=`` says otherwise.
    default_metric: str = "eval_loss"
    #: Whether trials of this kind need the executor's ``reward_funcs``.
    needs_rewards: bool = False
    #: How the fused engine trains a gang of the kind's trials (:mod:`optuna_rapidfire._trainers._gangs`):
    #: :data:`~optuna_rapidfire._trainers._gangs.SHARED_PASSES`, one forward/backward pass per step for the gang,
    #: each member's loss through :attr:`fused_loss`; GRPO's own (:mod:`optuna_rapidfire._trainers.grpo._gang`);
    #: by default each member alone, in turn.
    gang: GangStrategy = ALONE
    #: What the kind's trials compute in the fused engine's shared passes (for :data:`SHARED_PASSES`).
    fused_loss: FusedLoss | None = None

    @classmethod
    @abstractmethod
    def args_type(cls) -> type[TrainingArguments]:
        """The TRL config class that selects this kind (imported lazily)."""

    def check_args(self, args: TrainingArguments) -> list[str]:
        """Raise ``ValueError`` for settings the executor cannot honour; return notes on ignored ones."""
        for name, why in _UNSUPPORTED_FIELDS.items():
            if hasattr(args, name) and not _is_default(args, name):
                raise ValueError(
                    f"{type(args).__name__}.{name}={getattr(args, name)!r} is not supported by "
                    f"RapidFireExecutor: {why}."
                )
        if args.max_steps is not None and args.max_steps > 0:
            raise ValueError(
                f"{type(args).__name__}.max_steps={args.max_steps} is not supported: a trial's length is "
                "num_train_epochs passes over the train set, num_chunks chunks each. Leave max_steps at -1."
            )
        if not args.num_train_epochs > 0:
            raise ValueError(f"num_train_epochs must be positive, but got num_train_epochs={args.num_train_epochs}.")
        scheduler = getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)
        if scheduler in ("reduce_lr_on_plateau", "greedy"):
            raise ValueError(
                f"lr_scheduler_type={scheduler!r} is not supported: its steps depend on evaluations inside "
                "the trainer's own loop. Use a schedule over steps (linear, cosine, constant...)."
            )
        if args.per_device_train_batch_size < 1 or args.gradient_accumulation_steps < 1:
            raise ValueError(
                "per_device_train_batch_size and gradient_accumulation_steps must be at least 1, but got "
                f"{args.per_device_train_batch_size} and {args.gradient_accumulation_steps}."
            )
        return [
            f"{type(args).__name__}.{name}={getattr(args, name)!r} is ignored: {why}."
            for name, why in _OWNED_FIELDS.items()
            if hasattr(args, name) and not _is_default(args, name)
        ]

    @abstractmethod
    def needed_columns(self, columns: Collection[str], args: TrainingArguments, extras: TrainerExtras) -> str | None:
        """``None`` when rows with ``columns`` can be prepared by this trainer, else what columns it needs."""

    def check_columns(self, train: Dataset, eval: Dataset, args: TrainingArguments, extras: TrainerExtras) -> None:
        """Raise ``ValueError`` naming the columns found and the ones needed, before any trial trains."""
        for name, dataset in (("train_dataset", train), ("eval_dataset", eval)):
            needed = self.needed_columns(dataset.column_names, args, extras)
            if needed is not None:
                raise ValueError(
                    f"{name} has the columns {dataset.column_names}, but {type(args).__name__} trials need "
                    f"{needed}. Rename or map the columns first (dataset.rename_column / dataset.map)."
                )

    def effective_args(self, args: TrainingArguments, output_dir: str, device: torch.device) -> TrainingArguments:
        """A copy of the user's args with the fields the executor owns set for the executor's loop."""
        from transformers.trainer_utils import IntervalStrategy, SaveStrategy

        overrides: dict[str, Any] = {
            "output_dir": output_dir,
            "report_to": [],
            "eval_strategy": IntervalStrategy.NO,
            "save_strategy": SaveStrategy.NO,
            "logging_strategy": IntervalStrategy.NO,
            "disable_tqdm": True,
            "eval_on_start": False,
            "shuffle_dataset": False,
            "data_seed": None,
            "dataset_kwargs": {**(getattr(args, "dataset_kwargs", None) or {}), "skip_prepare_dataset": True},
        }
        # A shallow copy with the owned fields set: re-running the config's validation (as
        # dataclasses.replace would) fails for configs whose __post_init__ fills fields in, like GRPO's.
        effective = copy.copy(args)
        for name, value in overrides.items():
            if hasattr(args, name):
                setattr(effective, name, value)
        # The trainer places tensors (and, at construction, the model) on ``args.device``: make that
        # the executor's device, and keep the trainer from wrapping the model in DataParallel.
        _compat.pin_device(effective, device)
        return effective

    def checkpointing(self, args: TrainingArguments) -> tuple[bool, dict[str, Any] | None]:
        """Whether the trial trains with activation (gradient) checkpointing, and its kwargs."""
        enabled = getattr(args, "activation_checkpointing", None)
        if enabled is None:
            enabled = getattr(args, "gradient_checkpointing", False)
        kwargs = getattr(args, "activation_checkpointing_kwargs", None) or getattr(
            args, "gradient_checkpointing_kwargs", None
        )
        return bool(enabled), kwargs

    def isolate(self, trainer: Trainer) -> None:
        """Give the trainer a private copy of accelerate's process-wide state, its accelerator's
        ``autocast()`` the trial's own (:meth:`autocast`), and an ``unwrap_model`` that returns the resident
        model without walking it (:func:`~optuna_rapidfire._compat.unwrap_without_walks`).

        accelerate keeps its state in class-level dicts shared by every object, and every new
        ``TrainingArguments`` clears them, for instance when another thread runs ``configure(trial)``
        while this trial trains. A private copy keeps this trainer's accelerator whole.
        """
        args, device = trainer.args, trainer.args.device
        _compat.private_accelerate_state(trainer, lambda: self.autocast(args, device))
        _compat.unwrap_without_walks(trainer)

    def autocast(self, args: TrainingArguments, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        """Mixed-precision context of the trial (``bf16``/``fp16``), as accelerate's autocast would set it.

        Built here rather than through the trainer's accelerator, whose ``autocast`` reads accelerate's
        process-wide state afresh (see :meth:`isolate`).
        """
        if getattr(args, "bf16", False):
            return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
        if getattr(args, "fp16", False):
            return torch.autocast(device_type=device.type, dtype=torch.float16)
        return contextlib.nullcontext()

    def fused_refusal(self, trainer: Trainer, args: TrainingArguments) -> str | None:
        """Why the trial cannot train in a shared pass of the fused engine (``None``: it can).

        The text completes "trial N ..." in the log line that says why a gang trains time-sliced.
        """
        if self.fused_loss is None:
            return f"is a {self.name.upper()} trial (SFT and DPO trials are fused)"
        return self.fused_loss.refusal(trainer, args)

    def base_dropout_off(self, args: TrainingArguments) -> bool:
        """Whether the trial trains with the base model's dropout layers off (``disable_dropout``)."""
        return bool(getattr(args, "disable_dropout", False))

    def total_chunks(self, args: TrainingArguments, num_chunks: int) -> int:
        """How many chunks a trial trains: ``num_train_epochs`` passes of ``num_chunks`` chunks."""
        return max(1, math.ceil(args.num_train_epochs * num_chunks - 1e-9))

    @abstractmethod
    def data_key(self, args: TrainingArguments) -> Hashable:
        """Settings that change how raw rows become examples; trials with equal keys share prepared data."""

    @abstractmethod
    def build_trainer(
        self,
        resident: ResidentModel,
        args: TrainingArguments,
        sample: Dataset,
        extras: TrainerExtras,
    ) -> Trainer:
        """Build the trial's TRL trainer over the shared model (``sample``: raw rows of the train set)."""

    @abstractmethod
    def prepare(self, trainer: Trainer, dataset: Dataset, split: str) -> Dataset:
        """Turn raw rows into the examples the trainer's collator takes, as TRL would."""

    def micro_batches(self, args: TrainingArguments, order: np.ndarray) -> list[list[int]]:
        """Row indices of each training micro-batch of a chunk, visited in ``order``."""
        size = args.per_device_train_batch_size
        batches = [[int(i) for i in order[start : start + size]] for start in range(0, len(order), size)]
        if batches and args.dataloader_drop_last and len(batches[-1]) < size:
            batches.pop()
        return batches

    def eval_batches(self, args: TrainingArguments, size: int) -> list[list[int]]:
        """Row indices of each evaluation micro-batch of an eval set of ``size`` rows."""
        step = args.per_device_eval_batch_size
        return [list(range(start, min(start + step, size))) for start in range(0, size, step)]

    @abstractmethod
    def accumulate(
        self,
        trainer: Trainer,
        model: torch.nn.Module,
        batches: list[list[dict[str, Any]]],
        device: torch.device,
        scaler: torch.amp.GradScaler | None,
    ) -> torch.Tensor:
        """Forward and backward over one optimizer step's micro-batches (rows); return the summed loss.

        Losses are scaled for gradient accumulation as TRL's training step scales them.
        """

    @abstractmethod
    def eval_batch(
        self,
        trainer: Trainer,
        model: torch.nn.Module,
        rows: list[dict[str, Any]],
        device: torch.device,
        with_outputs: bool,
    ) -> tuple[torch.Tensor, int, Any, Any]:
        """``(loss, examples, predictions, labels)`` of one eval micro-batch (predictions only ``with_outputs``)."""

    def drain_metrics(self, trainer: Trainer, split: str) -> dict[str, float]:
        """Metrics the trainer accumulated since the last call (token accuracy, rewards...), then forget them."""
        collected = _compat.trainer_metrics(trainer, split)
        metrics = {key: sum(values) / len(values) for key, values in collected.items() if values}
        collected.clear()
        return metrics


class CollatedKind(TrainerKind):
    """Trainers whose micro-batches are collated tensors and whose loss is ``compute_loss`` (SFT, DPO)."""

    def collate(self, trainer: Trainer, rows: list[dict[str, Any]]) -> dict[str, Any]:
        return cast("dict[str, Any]", trainer.data_collator(rows))

    def accumulate(
        self,
        trainer: Trainer,
        model: torch.nn.Module,
        batches: list[list[dict[str, Any]]],
        device: torch.device,
        scaler: torch.amp.GradScaler | None,
    ) -> torch.Tensor:
        collated = [self.collate(trainer, rows) for rows in batches]
        num_items = _compat.num_items_in_batch(trainer, collated, device)
        trainer.current_gradient_accumulation_steps = len(collated)
        total = torch.zeros((), device=device)
        for inputs in collated:
            with self.autocast(trainer.args, device):
                loss = trainer.compute_loss(model, _to_device(inputs, device), num_items_in_batch=num_items)
            assert isinstance(loss, torch.Tensor)
            loss = loss / accumulation_divisor(trainer, num_items, len(collated))
            (scaler.scale(loss) if scaler is not None else loss).backward()
            total += loss.detach()
        return total

    def eval_batch(
        self,
        trainer: Trainer,
        model: torch.nn.Module,
        rows: list[dict[str, Any]],
        device: torch.device,
        with_outputs: bool,
    ) -> tuple[torch.Tensor, int, Any, Any]:
        inputs = _to_device(self.collate(trainer, rows), device)
        with self.autocast(trainer.args, device):
            loss, logits, labels = trainer.prediction_step(model, inputs, prediction_loss_only=not with_outputs)
        assert loss is not None
        return loss, len(rows), logits, labels


@contextlib.contextmanager
def reference_is_the_base(resident: ResidentModel, args: TrainingArguments) -> Iterator[None]:
    """Build a DPO/GRPO trainer whose reference model is the shared base with adapters disabled.

    Given a ``PeftModel``, TRL's DPO and GRPO trainers look for an adapter named ``default`` and copy it
    into a frozen ``ref`` adapter. Here every trial has its own adapter and the reference is the base
    itself (a fresh LoRA adapter computes exactly the base), so ``default`` is shown only while the
    trainer is built, and the ``ref`` copy is never made (PEFT's injection of a whole adapter, then its
    removal: a third of a trial's build); TRL, finding no ``ref`` adapter, disables the adapters to compute
    reference log-probabilities. No second copy of the base exists at any time.
    """
    peft = resident.peft
    assert peft is not None and resident._active is not None
    configs = peft.peft_config
    configs["default"] = configs[resident._active]
    add_adapter = peft.add_adapter

    def add_all_but_ref(adapter_name: str, *others: Any, **kwargs: Any) -> Any:
        return None if adapter_name == "ref" else add_adapter(adapter_name, *others, **kwargs)

    peft.__dict__["add_adapter"] = add_all_but_ref
    try:
        yield
    finally:
        peft.__dict__.pop("add_adapter", None)
        configs.pop("default", None)
        if "ref" in configs:  # made some other way than TRL's add_adapter call
            peft.delete_adapter("ref")
        resident._active = None  # deleting an adapter may have moved PEFT's active one


def accumulation_divisor(trainer: Trainer, num_items: Any, steps: int) -> int:
    """What a micro-batch's loss is divided by under gradient accumulation, as in ``Trainer.training_step``:
    a per-batch mean by the accumulation steps, a loss already normalized over the accumulated tokens not."""
    scaled = getattr(trainer, "loss_is_scaled_for_ga", None)
    if scaled is None:
        scaled = (trainer.model_accepts_loss_kwargs and num_items is not None) or trainer.compute_loss_func is not None
    return 1 if scaled else steps


def _to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    non_blocking = device.type == "cuda"
    return {k: v.to(device, non_blocking=non_blocking) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
