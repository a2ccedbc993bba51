"""Every use of another library's private internals, in one place.

Each function says what it reaches into, the versions it was checked against, and the public way to do
it where one exists. When a library changes one of these, this file is the only one to mend; when a
public way appears, the function becomes a one-line call to it.

Checked against: optuna 5.0.0, optuna-dashboard 0.21.0, trl 1.16.0, transformers 5.24.0, peft 0.21.2,
accelerate 1.15.0, torch 2.13.
"""

from __future__ import annotations

import copy
import functools
import threading
from typing import TYPE_CHECKING, Any

# The mixin of storages with heartbeats: a proxy of such a storage subclasses it, so that Optuna runs
# heartbeats through the proxy. Not exported by Optuna.
from optuna.storages._heartbeat import BaseHeartbeat as BaseHeartbeat

if TYPE_CHECKING:
    from collections.abc import Callable, Container

    import optuna

    # The Protocol every Optuna artifact store implements; Optuna does not export it (only the stores).
    from optuna.artifacts._protocol import ArtifactStore as ArtifactStore
    from optuna.storages import BaseStorage
    from optuna.trial import TrialState


def storage(study: optuna.Study) -> BaseStorage:
    """``study._storage``: the study's storage object. Optuna has no public accessor (only the URL a study
    was created with); samplers and pruners in Optuna itself read the attribute the same way."""
    return study._storage


def with_storage(study: optuna.Study, storage: Any) -> optuna.Study:
    """A shallow copy of ``study`` that reads and writes through ``storage`` (a proxy of its own storage:
    retrying, or a pruner's view). Sets ``_storage`` on the copy; Optuna has no public way to wrap it."""
    view = copy.copy(study)
    view._storage = storage
    return view


def study_id(study: optuna.Study) -> int:
    """``study._study_id``: the study's id in its storage (public only through the storage's name lookup)."""
    return study._study_id


def trial_id(trial: optuna.Trial | optuna.trial.FrozenTrial) -> int:
    """``trial._trial_id``: the trial's id in its storage, which every storage call about a trial takes."""
    return trial._trial_id


def heartbeats_enabled(storage: Any) -> bool:
    """``optuna.storages._heartbeat.is_heartbeat_enabled``: whether the storage records heartbeats (RDB
    storages with ``heartbeat_interval``). No public function; ``RDBStorage.heartbeat_interval`` is the
    public attribute behind it, but the storage may be wrapped (cached, retrying)."""
    from optuna.storages._heartbeat import is_heartbeat_enabled

    return bool(is_heartbeat_enabled(storage))


def stale_trial_ids(storage: Any, study_id: int) -> list[int]:
    """The running trials whose heartbeat is older than the grace period: ``BaseHeartbeat._get_stale_trial_ids``
    (what ``optuna.storages.fail_stale_trials`` fails; no public accessor). ``[]`` without heartbeats."""
    if not heartbeats_enabled(storage):
        return []
    return list(storage._get_stale_trial_ids(study_id))


def heartbeat_timing(storage: Any) -> tuple[float, float] | None:
    """``(interval, grace)``: seconds between a trial's heartbeats, and how long one may be missed before
    Optuna's stale check fails the trial (``None``: no heartbeats). ``get_heartbeat_interval`` is public;
    ``RDBStorage.grace_period`` is a public attribute (``None`` means twice the interval) reached through
    Optuna's cache (``_CachedStorage._backend``, no public accessor) and through wrappers that forward it."""
    if not heartbeats_enabled(storage):
        return None
    interval = float(storage.get_heartbeat_interval())
    grace = getattr(getattr(storage, "_backend", storage), "grace_period", None)
    return interval, float(grace if grace is not None else 2 * interval)


def retries_stale_trial(storage: Any, trial: optuna.trial.FrozenTrial) -> bool:
    """Whether the storage's heartbeat-stale callback re-enqueues ``trial`` (failed as stale) as a new trial:
    ``RetryFailedTrialCallback._max_retry`` against the trial's ``retry_history`` (no public accessor for the
    limit). Another callback, or none: ``False`` (nothing is known to come back)."""
    if not heartbeats_enabled(storage):
        return False
    callback = storage.get_heartbeat_stale_trial_callback()
    from optuna.storages import RetryFailedTrialCallback

    if not isinstance(callback, RetryFailedTrialCallback):
        return False
    limit = callback._max_retry
    return limit is None or len(trial.system_attrs.get("retry_history", [])) + 1 <= limit


def stop_requested(study: optuna.Study) -> bool:
    """``study._stop_flag``: whether ``study.stop()`` was called during this ``optimize``. Public
    alternative: none (``study.stop()`` only sets it)."""
    return bool(getattr(study, "_stop_flag", False))


def max_trials_callback_target(callback: optuna.study.MaxTrialsCallback) -> tuple[int, Container[TrialState] | None]:
    """``MaxTrialsCallback._n_trials`` and ``._states``: the count it stops the study at, and the states it
    counts (``None``: all). No public accessor."""
    return callback._n_trials, callback._states


def dashboard_form_json(study_system_attrs: dict[str, Any]) -> Any:
    """``optuna_dashboard._form_widget.get_form_widgets_json``: the form widgets a study has registered
    (``None``: none). optuna-dashboard exports only the registering function."""
    from optuna_dashboard._form_widget import get_form_widgets_json

    return get_form_widgets_json(study_system_attrs)


def backend_storage(study: optuna.Study) -> Any:
    """The storage behind Optuna's cache: ``optuna.storages._CachedStorage._backend`` for RDB storages (which
    ``optuna.load_study``/``create_study`` wrap in it), else the storage itself. No public accessor."""
    wrapped = storage(study)
    return getattr(wrapped, "_backend", wrapped)


def artifact_folder(store: Any) -> str | None:
    """The folder of a ``FileSystemArtifactStore`` (Optuna 4-5 keep it as ``_base_path``); ``None`` for others."""
    from optuna.artifacts import FileSystemArtifactStore

    if isinstance(store, FileSystemArtifactStore):
        return str(store._base_path)
    return None


def journal_file(storage: Any) -> str | None:
    """The file of a ``JournalStorage`` on a ``JournalFileBackend``: ``storage._backend._file_path``
    (``None`` for any other storage). Optuna keeps both private."""
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    backend = getattr(storage, "_backend", None) if isinstance(storage, JournalStorage) else None
    return str(backend._file_path) if isinstance(backend, JournalFileBackend) else None


def pruner_chain(pruner: Any) -> list[Any]:
    """``pruner`` and the pruners it wraps (``PatientPruner._wrapped_pruner``), outermost first."""
    chain, seen = [], set()
    while pruner is not None and id(pruner) not in seen:
        seen.add(id(pruner))
        chain.append(pruner)
        pruner = getattr(pruner, "_wrapped_pruner", None)
    return chain


def auto_resources(pruner: Any) -> tuple[Any, Any]:
    """``(HyperbandPruner._max_resource, SuccessiveHalvingPruner._min_resource)`` of ``pruner`` (``None``
    where it has no such field): Optuna fills ``"auto"``/``None`` in from the first COMPLETE trial."""
    return getattr(pruner, "_max_resource", None), getattr(pruner, "_min_resource", None)


def set_auto_resources(pruner: Any, *, max_resource: int | None = None, min_resource: int | None = None) -> None:
    """Fill in what :func:`auto_resources` reads (the constructor's arguments, had they been known)."""
    if max_resource is not None:
        pruner._max_resource = max_resource
    if min_resource is not None:
        pruner._min_resource = min_resource


# -- TRL and transformers' Trainer ---------------------------------------------------------------------


def sft_prepare(trainer: Any, dataset: Any, processing: Any, args: Any, packing: bool, split: str) -> Any:
    """``SFTTrainer._prepare_dataset``: turn raw rows into the trainer's examples, exactly as its ``train()``
    does (tokenize, add EOS, pack, truncate, drop fully masked rows). TRL has no public entry point for
    preparing data apart from building a trainer with the whole data set."""
    return trainer._prepare_dataset(dataset, processing, args, packing, trainer._formatting_func, split)


def dpo_prepare(trainer: Any, dataset: Any, processing: Any, args: Any, split: str) -> Any:
    """``DPOTrainer._prepare_dataset``: as :func:`sft_prepare`, for preference pairs."""
    return trainer._prepare_dataset(dataset, processing, args, split)


def signature_columns(trainer: Any) -> list[str]:
    """``Trainer._set_signature_columns_if_needed`` / ``._signature_columns``: the columns the trainer's
    collator keeps (``remove_unused_columns``)."""
    trainer._set_signature_columns_if_needed()
    return list(trainer._signature_columns or [])


def trainer_metrics(trainer: Any, split: str) -> dict[str, list[float]]:
    """``trainer._metrics[split]``: what TRL's trainers accumulate for ``log()`` (token accuracy, rewards,
    ...); the caller averages and clears it. Public alternative: only through ``log()`` callbacks."""
    metrics: dict[str, list[float]] = trainer._metrics[split]
    return metrics


def num_items_in_batch(trainer: Any, batches: list[Any], device: Any) -> Any:
    """``Trainer._get_num_items_in_batch``: the tokens (or rows) a loss is normalised over across the
    accumulated micro-batches, as ``Trainer.training_step`` counts them."""
    return trainer._get_num_items_in_batch(batches, device)


def count_train_tokens(trainer: Any, tokens: int) -> None:
    """``Trainer._total_train_tokens``: the token count TRL's trainers report as ``num_tokens``."""
    trainer._total_train_tokens = getattr(trainer, "_total_train_tokens", 0) + tokens


def grpo_generation(trainer: Any) -> Any:
    """``GRPOTrainer._generate_single_turn``: generates completions for tokenized prompts (TRL 1.16). The
    public hook, ``rollout_func``, takes the prompts before TRL tokenizes them (chat template included)."""
    return trainer._generate_single_turn


def set_grpo_generation(trainer: Any, generate: Any) -> None:
    """Replace ``GRPOTrainer._generate_single_turn`` on this trainer (see :func:`grpo_generation`)."""
    trainer._generate_single_turn = generate


def grpo_tokenization(trainer: Any) -> Any:
    """``GRPOTrainer._tokenize_prompts``: a batch's prompts rendered with the chat template and encoded, as
    ``(token ids per prompt, images, multimodal fields)`` (TRL 1.16); ``None`` where TRL has none. No public hook."""
    return getattr(trainer, "_tokenize_prompts", None)


def grpo_vision(trainer: Any) -> bool:
    """``GRPOTrainer._is_vlm``: whether the trainer's processing class handles images (TRL 1.16). No public
    attribute."""
    return bool(getattr(trainer, "_is_vlm", False))


def set_grpo_tokenization(trainer: Any, tokenize: Any) -> None:
    """Replace ``GRPOTrainer._tokenize_prompts`` on this trainer (see :func:`grpo_tokenization`)."""
    trainer._tokenize_prompts = tokenize


def grpo_logps(trainer: Any) -> Any:
    """``GRPOTrainer._get_per_token_logps_and_entropies``: the per-token log-probabilities (and entropies) of
    completion tokens that TRL's GRPO loss is computed from (TRL 1.16). No public hook."""
    return trainer._get_per_token_logps_and_entropies


def set_grpo_logps(trainer: Any, logps: Any) -> None:
    """Replace ``GRPOTrainer._get_per_token_logps_and_entropies`` on this trainer (see :func:`grpo_logps`)."""
    trainer._get_per_token_logps_and_entropies = logps


def grpo_rewards(trainer: Any) -> Any:
    """``GRPOTrainer._calculate_rewards``: a step's rewards, one column per reward function (TRL 1.16). The
    reward functions are public; the call that gives them their arguments is not."""
    return trainer._calculate_rewards


def set_grpo_rewards(trainer: Any, calculate: Any) -> None:
    """Replace ``GRPOTrainer._calculate_rewards`` on this trainer (see :func:`grpo_rewards`)."""
    trainer._calculate_rewards = calculate


def set_backward(trainer: Any, backward: Any) -> None:
    """Replace ``trainer.accelerator.backward`` (what ``Trainer.training_step`` backpropagates its loss with) on
    this trainer's own accelerator. Public alternative: overriding ``training_step`` in a subclass."""
    trainer.accelerator.backward = backward


def train_tokens(trainer: Any) -> int:
    """``Trainer._total_train_tokens``: the tokens the trial has trained, which TRL reports as ``num_tokens``."""
    return int(getattr(trainer, "_total_train_tokens", 0))


def pin_device(args: Any, device: Any) -> None:
    """``TrainingArguments._setup_devices`` (a cached property) and ``._n_gpu``: make ``args.device`` the
    executor's device and keep the trainer from wrapping the model in DataParallel. Public alternative:
    ``use_cpu`` / ``CUDA_VISIBLE_DEVICES``, which would move every trial of the process."""
    args.__dict__["_setup_devices"] = device
    args._n_gpu = 1


def private_accelerate_state(trainer: Any, autocast: Callable[[], Any]) -> None:
    """Give ``trainer.accelerator.state`` (and ``args.distributed_state``) a private copy of accelerate's
    process-wide state (``AcceleratorState._shared_state``, a class-level dict that every new
    ``TrainingArguments`` clears), and make ``trainer.accelerator.autocast()`` (which TRL's GRPO and DPO steps
    enter) return ``autocast()``: accelerate's reads the process-wide state afresh, and after a clear it
    raises and leaves the state half made, so that every later trainer build fails too (an ``AutocastKwargs``
    handler passed to it is not applied). Public alternative: none (the state is accelerate's singleton)."""
    state = trainer.accelerator.state
    state.__dict__ = dict(state.__dict__)
    distributed = getattr(trainer.args, "distributed_state", None)
    if distributed is not None:
        distributed.__dict__ = dict(distributed.__dict__)
    trainer.accelerator.autocast = lambda autocast_handler=None: autocast()


def unwrap_without_walks(trainer: Any) -> None:
    """Make ``trainer.accelerator.unwrap_model(trainer.model)`` return the model without accelerate's walks.

    TRL unwraps its model several times a step; accelerate's ``extract_model_from_parallel`` walks every module
    (looking for compiled regions) and looks its optional packages up each time: with several trials' adapters
    resident, a few milliseconds a call. The trainer's model here is the resident ``PeftModel``, which nothing
    wraps (no DDP, DeepSpeed, FSDP or compiled top level, accelerate never prepared it): accelerate would return
    it as it is. Any other model, or one carrying accelerate's mixed-precision hook, is unwrapped by accelerate.
    Public alternative: none."""
    from peft import PeftModel

    accelerator = trainer.accelerator
    unwrap = accelerator.unwrap_model
    own = trainer.model
    if not isinstance(own, PeftModel) or hasattr(own, "_orig_mod"):  # not the plain resident model
        return

    def unwrap_model(model: Any, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True) -> Any:
        if model is own and "_original_forward" not in model.__dict__:
            return model
        return unwrap(model, keep_fp32_wrapper=keep_fp32_wrapper, keep_torch_compile=keep_torch_compile)

    accelerator.unwrap_model = unwrap_model


def reset_accelerate_state() -> None:
    """Clear accelerate's process-wide state (``AcceleratorState._reset_state``), as every new
    ``TrainingArguments`` does, so that the next ``Accelerator`` (a trainer being built) sets it up whole
    whatever was left in it.

    Setting it up on a GPU asks ``nvidia-smi`` whether the GPUs are consumer cards without peer-to-peer support
    (``accelerate.state.check_cuda_p2p_ib_support``, a subprocess every time: about 20 ms a trial's build on an
    H200 host, the first thing a study's builds wait for). The answer depends on the machine's GPUs and driver
    alone, so it is asked once per process here (``functools.cache``). Public alternative: none."""
    from accelerate import state

    if not hasattr(state.check_cuda_p2p_ib_support, "cache_info"):
        state.check_cuda_p2p_ib_support = functools.cache(state.check_cuda_p2p_ib_support)
    keep_accelerate_environment()
    state.AcceleratorState._reset_state(reset_partial_state=True)


def keep_accelerate_environment() -> None:
    """Make accelerate's ``KwargsHandler.to_kwargs`` (which an ``Accelerator`` runs for its handlers: every trainer
    build) compute each handler class's defaults once per process instead of at every call. To compute them it
    empties ``os.environ`` for the whole process (``clear_environment``) and fills it again: a thread reading the
    environment meanwhile (the MLflow tracker's HTTP client, iterating it for proxies) found variables gone and
    failed (``KeyError``), dropping a trial's logged params. The defaults are computed without the environment by
    construction, so the cached ones are the same; the handler classes that take no arguments are computed here at
    once (called from the executor's construction, before its threads start). Public alternative: none."""
    from accelerate.utils import dataclasses as handlers
    from accelerate.utils.environment import clear_environment

    if getattr(handlers.KwargsHandler.to_kwargs, "_rapidfire", False):
        return
    defaults: dict[type, dict[str, Any]] = {}
    lock = threading.Lock()

    def default_of(cls: type) -> dict[str, Any]:
        with lock:
            found = defaults.get(cls)
            if found is None:
                with clear_environment():
                    found = defaults[cls] = cls().to_dict()
            return found

    def to_kwargs(self: Any) -> dict[str, Any]:
        default = default_of(type(self))
        return {k: v for k, v in self.to_dict().items() if default[k] != v}

    to_kwargs._rapidfire = True  # type: ignore[attr-defined]
    handlers.KwargsHandler.to_kwargs = to_kwargs
    pending = list(handlers.KwargsHandler.__subclasses__())
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        try:
            default_of(cls)
        except Exception:  # a handler that needs arguments: computed at its first call
            continue


# -- PEFT and torch ------------------------------------------------------------------------------------


def point_peft_at(peft: Any, layers: list[Any], name: str) -> None:
    """Set the active adapter of every LoRA layer (``BaseTunerLayer._active_adapter``) and of the models
    (``active_adapter``) without PEFT's ``set_adapter``, which walks every module and parameter of every
    adapter and changes ``requires_grad``: the hot swap's microseconds depend on it."""
    for layer in layers:
        layer.__dict__["_active_adapter"] = [name]
    peft.base_model.__dict__["active_adapter"] = name
    peft.__dict__["active_adapter"] = name


def inject_lora_on(peft: Any, name: str, config: Any, wrapped: list[tuple[str, Any, str]]) -> None:
    """What ``PeftModel.add_adapter`` does for a LoRA adapter ``name`` (its ``config`` stored already) once it has found
    the modules to wrap, on ``wrapped`` (``(name, parent, attribute)`` each, in the model's order): the tuner's
    ``_check_new_adapter_config``, ``_create_and_replace`` on each module, the targeted names, and the adapter's dtype
    cast over those modules (``cast_adapter_dtype``, PEFT 0.18 and later; before, ``_cast_adapter_dtype``'s walk of
    the model). Checked against PEFT 0.21; the public way, ``add_adapter``, searches the whole model first."""
    import torch
    from peft.tuners import tuners_utils

    tuner = peft.base_model
    tuner._check_new_adapter_config(config)
    for key, parent, attribute in wrapped:
        tuner._create_and_replace(config, name, getattr(parent, attribute), attribute, parent, current_key=key)
    targeted = set(tuner.targeted_module_names)
    tuner.targeted_module_names.extend(key for key, _, _ in wrapped if key not in targeted)
    cast = getattr(tuners_utils, "cast_adapter_dtype", None)
    if cast is None:
        tuner._cast_adapter_dtype(adapter_name=name, autocast_adapter_dtype=True)
    else:
        layers = torch.nn.ModuleList(getattr(parent, attribute) for _, parent, attribute in wrapped)
        cast(layers, adapter_name=name, autocast_adapter_dtype=True)


def lr_at(scheduler: Any, steps: int) -> float:
    """The learning rate an LR schedule gives the first parameter group after ``steps`` optimizer steps, without
    moving it: ``base_lrs`` times ``lr_lambdas`` for ``LambdaLR`` (every schedule of transformers), else the
    closed form (``_get_closed_form_lr``) at ``last_epoch = steps``. Public alternative: stepping a copy."""
    if hasattr(scheduler, "lr_lambdas"):
        return float(scheduler.base_lrs[0] * scheduler.lr_lambdas[0](steps))
    current = scheduler.last_epoch
    try:
        scheduler.last_epoch = steps
        return float(scheduler._get_closed_form_lr()[0])
    finally:
        scheduler.last_epoch = current


def compile_backend(name: str) -> Any:
    """``torch._dynamo.lookup_backend``: the ``torch.compile`` backend callable registered as ``name``, so a
    backend of our own can count compilations and hand each graph on. Public alternative: none (only
    ``torch.compiler.list_backends`` lists the names)."""
    import torch

    return torch._dynamo.lookup_backend(name)


def allow_recompiles(limit: int) -> None:
    """Raise ``torch._dynamo.config.recompile_limit`` (``cache_size_limit`` before torch 2.6) to ``limit``: how
    many variants of one function ``torch.compile`` keeps before it stops compiling new ones (8 by default).
    Dynamo's config is set per thread. Public alternative: none."""
    import torch

    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    if getattr(config, name) < limit:
        setattr(config, name, limit)


def is_compile_error(error: BaseException) -> bool:
    """Whether ``error`` came from ``torch.compile`` compiling (tracing, lowering, code generation) rather than
    from running: ``torch._dynamo.exc.TorchDynamoException`` (backend failures, unsupported code, recompile
    limits) or an error raised in dynamo, inductor or functorch. Public alternative: none."""
    import torch

    module = type(error).__module__ or ""
    return isinstance(error, torch._dynamo.exc.TorchDynamoException) or module.startswith(
        ("torch._dynamo", "torch._inductor", "torch._functorch")
    )


def seek_lr_scheduler(scheduler: Any, steps: int) -> None:
    """Move an LR schedule to ``steps`` optimizer steps and set the rates it gives there: ``last_epoch``,
    the closed form (``_get_closed_form_lr``) where the schedule has one, and ``_last_lr``. Public
    alternative: calling ``step()`` ``steps`` times, which is slow and warns."""
    scheduler.last_epoch = steps
    rates = scheduler.get_lr() if hasattr(scheduler, "lr_lambdas") else scheduler._get_closed_form_lr()
    for group, rate in zip(scheduler.optimizer.param_groups, rates, strict=True):
        group["lr"] = rate
    scheduler._last_lr = list(rates)


def compile_backward_ahead() -> None:
    """Have AOTAutograd compile a graph's backward together with its forward, instead of at the first backward
    pass (``torch._functorch.config.force_non_lazy_backward_lowering``): a graph compiled in a background thread
    is then whole before the device's thread first runs it, and no backward pass compiles. Public alternative:
    none."""
    import torch._functorch.config

    torch._functorch.config.force_non_lazy_backward_lowering = True


def run_beside_compiler() -> None:
    """Let the device's thread call a compiled function while another thread traces one with FX (the background
    compiler): ``torch._dynamo.config.error_on_nested_fx_trace = False`` makes such a call run the function
    eagerly instead of raising (FX's tracing flag is process-wide, not per thread). Public alternative: none."""
    import torch._dynamo.config

    torch._dynamo.config.error_on_nested_fx_trace = False


def flatten_dense_tensors(tensors: list[Any]) -> Any:
    """``tensors`` (one dtype) flattened and concatenated into one 1-D tensor by a single operator
    (``torch._utils._flatten_dense_tensors``, what DDP buckets use): one release of Python's global lock where
    a ``torch.cat`` of flattened views takes one per tensor. Public alternative: ``torch.cat([t.reshape(-1)
    ...])``, one operator per tensor."""
    from torch._utils import _flatten_dense_tensors

    return _flatten_dense_tensors(tensors)


def unflatten_dense_tensors(flat: Any, tensors: list[Any]) -> list[Any]:
    """Views of ``flat`` (what :func:`flatten_dense_tensors` made of ``tensors``) shaped as ``tensors``, made by
    a single operator (``torch._utils._unflatten_dense_tensors``). Public alternative: ``flat.split([t.numel()
    ...])`` and one ``view`` per tensor."""
    from torch._utils import _unflatten_dense_tensors

    return list(_unflatten_dense_tensors(flat, tensors))
