"""What a valid search becomes for a run: data sets, reward functions, the sampler and pruner, the storage
and the ``configure(trial)`` that turns a trial's sampled values into ``(LoraConfig, <TRL config>)``.

Every function here reads a :class:`~optuna_rapidfire._tune._search.Search` and returns objects; none of them
runs a trial. Errors name the search key they come from, as the schema's do.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

from optuna_rapidfire._logging import quiet_library_noise
from optuna_rapidfire._tune._search import (
    BUILTIN_REWARDS,
    DATA_FILE_TYPES,
    DEMO_FORMATS,
    Named,
    config_classes,
    pruner_names,
    sampler_names,
    training_values,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    import optuna
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainingArguments

    from optuna_rapidfire._tune._search import DataSource, Search
    from optuna_rapidfire.demo._data import DemoFormat

MAX_RETRY = 3
"""Retries of a trial whose step was killed, before it stays FAIL."""


def load_data(source: DataSource, trainer: str, where: str) -> Dataset:
    """The ``datasets.Dataset`` ``source`` names (``where``: its key in the search, for errors)."""
    import datasets

    if source.demo is not None:
        from optuna_rapidfire.demo import load_gsm8k

        # The search's validation allows only the demo's own splits and formats here.
        dataset = load_gsm8k(
            cast("Literal['train', 'test']", source.split),
            num_rows=source.rows,
            format=cast("DemoFormat", source.format or DEMO_FORMATS[trainer]),
        )
    elif source.path is not None:
        path = Path(source.path)
        if path.is_dir():
            loaded = datasets.load_from_disk(str(path))
        else:
            loaded = datasets.load_dataset(DATA_FILE_TYPES[path.suffix.lower()], data_files=str(path), split="train")
        dataset = _split(loaded, source.split, where)
    else:
        assert source.dataset is not None
        try:
            loaded = datasets.load_dataset(source.dataset, source.name, split=source.split)
        except (FileNotFoundError, ValueError, OSError) as error:
            raise ValueError(f"{where}.dataset: datasets cannot load {source.dataset!r}: {error}") from None
        dataset = _split(loaded, None, where)
    if source.rows is not None and source.demo is None:
        dataset = dataset.select(range(min(source.rows, len(dataset))))
    missing = sorted(set(source.columns) - set(dataset.column_names))
    if missing:
        raise ValueError(f"{where}.columns: no column {', '.join(missing)}; the data has {dataset.column_names}.")
    if source.columns:
        dataset = dataset.rename_columns(dict(source.columns))
    if len(dataset) == 0:
        raise ValueError(f"{where}: the data is empty.")
    return dataset


def _split(loaded: Any, split: str | None, where: str) -> Dataset:
    from datasets import Dataset, DatasetDict

    if isinstance(loaded, Dataset):
        return loaded
    if isinstance(loaded, DatasetDict):
        if split is None or split not in loaded:
            raise ValueError(
                f"{where}.split must be one of {', '.join(loaded)} (the folder holds splits), got {split!r}."
            )
        return loaded[split]
    raise TypeError(f"{where}: expected a datasets.Dataset, but loading gave {type(loaded).__name__}.")


def reward_funcs(search: Search) -> list[Callable[..., list[float]] | str]:
    """The GRPO rewards: built-in ones by name, ``module:function`` imported, anything else a reward model's
    path or hub id (the executor loads those once)."""
    found: list[Callable[..., list[float]] | str] = []
    for i, name in enumerate(search.rewards):
        where = f"rewards[{i}]"
        if name in BUILTIN_REWARDS:
            from optuna_rapidfire.demo import gsm8k_reward

            found.append(gsm8k_reward)
            continue
        module_name, sep, attr = name.partition(":")
        if not sep or os.path.exists(name):
            found.append(name)
            continue
        if os.getcwd() not in sys.path:  # a module of the pipeline's own, as `python -m` would find it
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            raise ValueError(f"{where}: cannot import {module_name!r} ({error}).") from None
        function = getattr(module, attr, None)
        if not callable(function):
            raise ValueError(f"{where}: {module_name!r} has no function {attr!r}.")
        found.append(function)
    return found


def build_named(spec: Named | None, kind: str, *, seed_offset: int = 0) -> Any:
    """The sampler or pruner ``spec`` names (nested ones built first); ``None`` for Optuna's default.

    ``seed_offset`` is added to every ``seed``: a step run again passes the number of trials its study holds,
    so that a seeded sampler does not draw its first configs again (it would, from the same seed), while the
    same history still gives the same draws.
    """
    if spec is None:
        return None
    classes = sampler_names() if kind == "sampler" else pruner_names()
    kwargs = {}
    for key, value in spec.kwargs.items():
        if isinstance(value, Named):
            value = build_named(value, "sampler" if key.endswith("sampler") else "pruner", seed_offset=seed_offset)
        elif key == "seed" and isinstance(value, int) and not isinstance(value, bool):
            value += seed_offset
        kwargs[key] = value
    return classes[spec.name](**kwargs)


def trials_in_study(storage: optuna.storages.BaseStorage, study_name: str) -> int:
    """How many trials the study ``study_name`` holds in ``storage`` (0 when it does not exist yet)."""
    try:
        study_id = storage.get_study_id_from_name(study_name)
    except KeyError:
        return 0
    return len(storage.get_all_trials(study_id, deepcopy=False))


def open_storage(search: Search) -> optuna.storages.RDBStorage:
    """The study's storage, with heartbeats: a killed step's trials are retried from their checkpoints."""
    import warnings

    import optuna
    from optuna.exceptions import ExperimentalWarning

    if search.storage.startswith("sqlite:///"):
        Path(search.storage.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():  # heartbeats have been "experimental" since Optuna 2.8; nothing to act on
        warnings.simplefilter("ignore", ExperimentalWarning)
        return optuna.storages.RDBStorage(
            search.storage,
            heartbeat_interval=search.heartbeat_interval,
            heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=MAX_RETRY),
        )


def make_configure(search: Search) -> Callable[[optuna.trial.BaseTrial], tuple[LoraConfig, TrainingArguments]]:
    """``configure(trial)``: suggest every parameter of the space under its name, then build the configs from
    the fixed values and the sampled ones (a sampled value goes where its name says: ``lora.r`` into
    ``LoraConfig.r``, ``training.learning_rate`` into the TRL config's ``learning_rate``)."""
    lora_class, args_class = config_classes(search.trainer)
    fixed_lora, fixed_training = dict(search.lora), training_values(search)
    space: Mapping[str, Any] = search.space

    def configure(trial: optuna.trial.BaseTrial) -> tuple[LoraConfig, TrainingArguments]:
        from optuna.distributions import CategoricalDistribution, IntDistribution

        sampled: dict[str, dict[str, Any]] = {"lora": {}, "training": {}}
        for name, distribution in space.items():
            section, _, field = name.partition(".")
            if isinstance(distribution, CategoricalDistribution):
                value: Any = trial.suggest_categorical(name, distribution.choices)
            elif isinstance(distribution, IntDistribution):
                value = trial.suggest_int(
                    name, distribution.low, distribution.high, step=distribution.step, log=distribution.log
                )
            else:
                value = trial.suggest_float(
                    name, distribution.low, distribution.high, step=distribution.step, log=distribution.log
                )
            sampled[section][field] = value
        return (
            lora_class(**{**fixed_lora, **sampled["lora"]}),
            args_class(**{**fixed_training, **sampled["training"]}),
        )

    return configure


TINY_MODEL = "tiny"
"""``model: tiny`` in a search: a small random-weight Llama-shape model and tokenizer built on this machine (once,
in the user's cache), so that a search runs on a CPU without the hub; the examples ship with it."""


def model_path(model: str) -> str:
    """What the executor loads for the search's ``model``: :data:`TINY_MODEL` built (or found) in
    ``$XDG_CACHE_HOME/optuna-rapidfire/tiny-model`` (``~/.cache`` by default), anything else as written."""
    if model != TINY_MODEL:
        return model
    from optuna_rapidfire.demo import build_tiny_model

    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return str(build_tiny_model(cache / "optuna-rapidfire" / "tiny-model", hidden_size=64, vocab_size=2048))


def check_model(model: str) -> Any:
    """The base model's config (``transformers.PretrainedConfig``), found before anything is created: a local
    folder with a ``config.json``, or a hub id in the local hub cache or on the hub. Raises ``ValueError`` with
    one line saying which it is not (and, for the hub, how to reach it), never after a minute of retries."""
    from transformers import AutoConfig

    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model: the folder {path.resolve()} has no config.json (it is not a model folder).")
        return AutoConfig.from_pretrained(str(path))
    if path.exists():
        raise ValueError(f"model: {path.resolve()} is a file; give the model's folder, or a hub id.")
    import huggingface_hub
    from huggingface_hub.errors import HFValidationError

    try:
        huggingface_hub.utils.validate_repo_id(model)
    except HFValidationError:
        raise ValueError(f"model: there is no folder {path.resolve()} (and {model!r} is not a hub id).") from None
    if isinstance(huggingface_hub.try_to_load_from_cache(model, "config.json"), str):
        return AutoConfig.from_pretrained(model, local_files_only=True)
    where = f"there is no folder {path.resolve()}, and hub model {model!r}"
    if huggingface_hub.constants.HF_HUB_OFFLINE:
        raise ValueError(f"model: {where} is not in the hub cache (HF_HUB_OFFLINE is set, so the hub is not asked).")
    try:
        huggingface_hub.model_info(model, timeout=10)
    except huggingface_hub.errors.GatedRepoError:
        raise ValueError(f"model: {where} is gated: accept its terms on the hub, then `hf auth login`.") from None
    except huggingface_hub.errors.RepositoryNotFoundError:
        raise ValueError(f"model: {where} does not exist (or is private: `hf auth login`).") from None
    except Exception as error:  # no network, a proxy, a timeout
        raise ValueError(
            f"model: {where} is not in the hub cache and the hub could not be reached ({type(error).__name__}); "
            "download it where the hub is reachable and give its folder, or set HF_HOME to a cache that holds it."
        ) from None
    return AutoConfig.from_pretrained(model)


def check_trials(
    search: Search,
    model_config: Any,
    train: Dataset,
    evaluation: Dataset,
    rewards: Sequence[Callable[..., list[float]] | str] = (),
) -> None:
    """Build what the trials will build, dry, before any work: the TRL config of each value of the space (the
    first of every other parameter), checked as the executor checks a trial's (settings it cannot honour, the
    data's columns against what the trainer needs), and its LoRA adapter on the model's shape (no weights: the
    meta device). A config no trial could use is refused here with one line, rather than failing every trial
    after the model has loaded."""
    import optuna
    import torch
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from optuna_rapidfire._trainers import TrainerExtras, kind_for

    ends = {  # every choice, or the two ends of a range
        name: list(d.choices) if isinstance(d, CategoricalDistribution) else [d.low, d.high]
        for name, d in search.space.items()
        if isinstance(d, (CategoricalDistribution, IntDistribution, FloatDistribution))
    }
    quiet_library_noise()  # PEFT's deprecation warning on every adapter it adds, which nobody can act on
    first = {name: values[0] for name, values in ends.items()}
    variants = [first] + [{**first, name: value} for name, values in ends.items() for value in values[1:]]
    configure = make_configure(search)
    extras = TrainerExtras(reward_funcs=tuple(rewards))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
    adapters: set[str] = set()
    for params in variants:
        shown = ", ".join(f"{k}={v}" for k, v in params.items())
        try:
            lora, args = configure(optuna.trial.FixedTrial(params))
        except (TypeError, ValueError) as error:
            raise ValueError(f"training/lora: no trial could be configured with {shown}: {error}") from None
        kind = kind_for(args)
        try:
            kind.check_args(args)
        except ValueError as error:
            raise ValueError(f"training: no trial could run with {shown}: {error}") from None
        try:
            kind.check_columns(train, evaluation, args, extras)
        except ValueError as error:
            raise ValueError(f"data: {error}") from None
        key = repr(lora)
        if key in adapters:
            continue
        adapters.add(key)
        try:
            peft_model = get_peft_model(model, lora)
        except (TypeError, ValueError) as error:
            raise ValueError(f"lora: the adapter of {shown} cannot be built on {search.model!r}: {error}") from None
        model = peft_model.unload()  # the bare model again, for the next adapter
