"""The declared search: what one file (YAML, or the same as a dict) says, validated before any work.

:func:`load_search` reads a search file or takes a dict and returns a frozen :class:`Search`, or raises a
``ValueError`` whose message starts with the key's path (``budget.n_trials``, ``space.training.learning_rate.low``)
and names the allowed values. The checks run in two passes: the file's structure first, by the schema's pydantic
models (:mod:`optuna_rapidfire._tune._schema`, no heavy import), then the ``training`` and ``lora`` fields against
TRL's and PEFT's own config classes (which import torch). Nothing here loads a model, a data set or opens a
storage: :mod:`optuna_rapidfire._tune._inputs` turns a valid search into those.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from optuna_rapidfire._tune._schema import (
    BUILTIN_REWARDS,
    DATA_FILE_TYPES,
    DEFAULT_METRIC,
    DEMO_FORMATS,
    DEMO_SETS,
    TRAINERS,
    CategoricalSpace,
    DataSourceModel,
    FloatSpace,
    TrainerName,
    shown,
    validate,
)

if TYPE_CHECKING:
    from optuna.distributions import BaseDistribution

__all__ = [
    "BUILTIN_REWARDS",
    "DATA_FILE_TYPES",
    "DEFAULT_METRIC",
    "DEMO_FORMATS",
    "DEMO_SETS",
    "TRAINERS",
    "DataSource",
    "Named",
    "Search",
    "TrainerName",
    "load_search",
]


@dataclass(frozen=True)
class DataSource:
    """Where one split of the data comes from: exactly one of ``demo``, ``path`` or ``dataset``.

    Attributes:
        demo: A bundled data set (``gsm8k``), in ``format`` (by default the trainer kind's).
        path: A local file (``.json``, ``.jsonl``, ``.csv``, ``.parquet``) or a folder written by
            ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``.
        dataset: Anything ``datasets.load_dataset`` takes (a hub id, or a local folder of data files),
            with ``name`` its configuration.
        split: The split to take (``dataset``, a saved ``DatasetDict`` and ``demo``).
        rows: Keep the first ``rows`` rows.
        columns: Renames, ``{old: new}`` (AutoTrain's column mapping), applied after loading.
    """

    demo: str | None = None
    path: str | None = None
    dataset: str | None = None
    name: str | None = None
    split: str | None = None
    rows: int | None = None
    format: str | None = None
    columns: Mapping[str, str] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class Named:
    """A sampler or pruner given by its class name, with keyword arguments (nested ones are ``Named`` too)."""

    name: str
    kwargs: Mapping[str, Any]


@dataclass(frozen=True)
class Search:
    """A validated search (see the README's "Tuning step for pipelines" for each key).

    Attributes:
        raw: The search as written (JSON-serialisable), recorded with the study.
        sha256: Hash of the search file's bytes (of the dict's canonical JSON for a dict).
        source: The search file, or ``None`` for a dict.
        space: Optuna distributions by parameter name (``training.learning_rate``, ``lora.r``).
    """

    study_name: str
    model: str
    model_kwargs: Mapping[str, Any]
    trainer: TrainerName
    train: DataSource
    eval: DataSource
    rewards: tuple[str, ...]
    metric: str
    direction: Literal["minimize", "maximize"]
    n_trials: int | None
    timeout: float | None
    space: Mapping[str, BaseDistribution]
    lora: Mapping[str, Any]
    training: Mapping[str, Any]
    executor: Mapping[str, Any]
    sampler: Named | None
    pruner: Named | None
    schedule: str
    storage: str
    output: str
    mlflow_tracking_uri: str | None
    heartbeat_interval: int
    merge: bool
    raw: Mapping[str, Any]
    sha256: str
    source: str | None

    @property
    def config_class(self) -> str:
        """Name of the TRL config class the trials' ``training`` values go into."""
        return TRAINERS[self.trainer]


# -- reading -----------------------------------------------------------------------------------------


def load_search(search: str | os.PathLike[str] | Mapping[str, Any], *, check_fields: bool = True) -> Search:
    """Read and validate a search file (YAML) or a search dict.

    Args:
        search: A path to a YAML file, or the same content as a dict.
        check_fields: Also check the ``training`` and ``lora`` fields against TRL's and PEFT's config
            classes (imports them); off only for tests of the structure.

    Returns:
        The validated :class:`Search`.

    Raises:
        ValueError: A missing file, bad YAML, an unknown key, a value of the wrong type or out of range; the
            message starts with the key's path.
        TypeError: ``search`` is neither a path nor a dict, or a dict holds objects a file cannot (a function).
    """
    if isinstance(search, Mapping):
        raw: Any = _plain(search, "search")
        digest = hashlib.sha256(json.dumps(raw, sort_keys=True, default=str).encode()).hexdigest()
        source = None
        default_name = None
    elif isinstance(search, (str, os.PathLike)):
        path = Path(search)
        if not path.is_file():
            raise ValueError(f"search file {os.fspath(search)!r} does not exist (looked in {Path.cwd()}).")
        data = path.read_bytes()
        raw = _parse_yaml(data, path)
        digest = hashlib.sha256(data).hexdigest()
        source = str(path.resolve())
        default_name = path.stem
    else:
        raise TypeError(f"search must be a path to a YAML file or a dict, but got {type(search).__name__}.")
    parsed = _parse(raw, digest, source, default_name)
    if check_fields:
        check_config_fields(parsed)
    return parsed


def _yaml_loader() -> Any:
    """PyYAML's safe loader that also reads ``1e-5`` as a float (YAML 1.1 wants ``1.0e-5``; users write both)."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(
            r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
            |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
            |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
            |[-+]?\.(?:inf|Inf|INF)
            |\.(?:nan|NaN|NAN))$""",
            re.X,
        ),
        list("-+0123456789."),
    )
    return Loader


def _parse_yaml(data: bytes, path: Path) -> Any:
    import yaml

    try:
        return yaml.load(data, Loader=_yaml_loader())  # a SafeLoader subclass
    except yaml.YAMLError as error:
        raise ValueError(f"search file {str(path)!r} is not valid YAML: {error}") from None


def _plain(value: Any, where: str) -> Any:
    """A copy of a dict's content as JSON would hold it (tuples become lists); other objects are refused."""
    if isinstance(value, Mapping):
        for key in value:
            if not isinstance(key, str):
                raise TypeError(f"{where}: keys must be strings, but got {key!r}.")
        return {key: _plain(item, f"{where}.{key}") for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item, f"{where}[{i}]") for i, item in enumerate(value)]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(
        f"{where}: a search holds plain values (numbers, strings, lists, dicts), but got {type(value).__name__}."
    )


# -- from the validated file to a Search ----------------------------------------------------------------


def _parse(raw: Any, digest: str, source: str | None, default_name: str | None) -> Search:
    file = validate({"study_name": default_name, **raw} if default_name and isinstance(raw, Mapping) else raw)
    if file.study_name is None:
        raise ValueError("study_name is required when the search is a dict (a file's default is its name).")
    output = str(Path(file.output or file.study_name).resolve())
    return Search(
        study_name=file.study_name,
        model=file.model,
        model_kwargs=dict(file.model_kwargs),
        trainer=file.trainer,
        train=_data_source(file.data.train, "train"),
        eval=_data_source(file.data.eval, "test"),
        rewards=tuple(file.rewards or ()),
        metric=file.metric,
        direction=file.direction,
        n_trials=file.budget.n_trials,
        timeout=None if file.budget.timeout is None else float(file.budget.timeout),
        space={name: _distribution(entry, f"space.{name}") for name, entry in file.space.items()},
        lora=dict(file.lora),
        training=dict(file.training),
        executor=dict(file.executor),
        sampler=_named(file.sampler, "sampler"),
        pruner=_named(file.pruner, "pruner"),
        schedule=file.schedule,
        storage=file.storage or f"sqlite:///{Path(output) / 'study.db'}",
        output=output,
        mlflow_tracking_uri=file.mlflow_tracking_uri,
        heartbeat_interval=file.heartbeat_interval,
        merge=file.merge,
        raw=raw,
        sha256=digest,
        source=source,
    )


def _data_source(model: DataSourceModel, default_split: str) -> DataSource:
    """The source ``model`` names; the bundled set and a ``datasets`` path take ``default_split`` when none is
    given (a saved ``DatasetDict`` must name its split)."""
    split = model.split if model.split is not None or model.path is not None else default_split
    return DataSource(
        demo=model.demo,
        path=model.path,
        dataset=model.dataset,
        name=model.name,
        split=split,
        rows=model.rows,
        format=model.format,
        columns=dict(model.columns),
    )


def _distribution(entry: FloatSpace | Any, where: str) -> BaseDistribution:
    """The Optuna distribution of a space entry; Optuna's own checks (low > high, log with step, log of 0...) say
    the entry's key."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    try:
        if isinstance(entry, CategoricalSpace):
            return CategoricalDistribution(entry.choices)
        if isinstance(entry, FloatSpace):
            return FloatDistribution(entry.low, entry.high, log=entry.log, step=entry.step)
        return IntDistribution(entry.low, entry.high, log=entry.log, step=entry.step)
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None


def sampler_names() -> dict[str, Any]:
    """Sampler classes a search may name: Optuna's and :class:`~optuna_rapidfire.samplers.CloneSampler`."""
    import optuna

    from optuna_rapidfire.samplers import CloneSampler

    found = {name: getattr(optuna.samplers, name) for name in optuna.samplers.__all__}
    found = {n: c for n, c in found.items() if isinstance(c, type) and not n.startswith("Base")}
    return {**found, "CloneSampler": CloneSampler}


def pruner_names() -> dict[str, Any]:
    """Pruner classes a search may name: Optuna's."""
    import optuna

    found = {name: getattr(optuna.pruners, name) for name in optuna.pruners.__all__}
    return {n: c for n, c in found.items() if isinstance(c, type) and not n.startswith("Base")}


def _named(value: Any, where: str) -> Named | None:
    """``TPESampler`` or ``{name: TPESampler, seed: 0}``; a keyword ending in sampler/pruner may nest one."""
    if value is None:
        return None
    if isinstance(value, str):
        value = {"name": value}
    if not isinstance(value, Mapping):
        raise ValueError(f"{where} must be a class name or {{name: ..., <keyword>: ...}}, but got {shown(value)}.")
    kind = "sampler" if where.rsplit(".", 1)[-1].endswith("sampler") else "pruner"
    classes = sampler_names() if kind == "sampler" else pruner_names()
    name = value.get("name")
    if name not in classes:
        raise ValueError(f"{where}.name must be one of {', '.join(sorted(classes))}, but got {name!r}.")
    kwargs = {k: v for k, v in value.items() if k != "name"}
    import inspect

    try:
        inspect.signature(classes[name]).bind(**kwargs)
    except TypeError:
        accepted = [p for p in inspect.signature(classes[name]).parameters if p not in ("self", "args", "kwargs")]
        unknown = sorted(set(kwargs) - set(accepted)) or sorted(kwargs)
        raise ValueError(
            f"{where}: {name} does not take {', '.join(unknown)}; it takes {', '.join(accepted) or 'no keyword'}."
        ) from None
    nested = {
        k: _named(v, f"{where}.{k}") if isinstance(v, Mapping) and k.endswith(("sampler", "pruner")) else v
        for k, v in kwargs.items()
    }
    return Named(name=name, kwargs=nested)


# -- the config classes' fields (imports TRL and PEFT) ---------------------------------------------------


def config_classes(trainer: str) -> tuple[type, type]:
    """``(LoraConfig, the trainer kind's TRL config class)``."""
    import trl
    from peft import LoraConfig

    return LoraConfig, getattr(trl, TRAINERS[trainer])


def check_config_fields(search: Search) -> None:
    """Check every ``lora``/``training`` name (fixed and sampled) against ``LoraConfig`` and the trainer's TRL
    config, then build both from the fixed values and each distribution's first value, so a value either
    class refuses is an error now rather than a failed trial later."""
    lora_class, args_class = config_classes(search.trainer)
    classes = {"lora": lora_class, "training": args_class}
    names = {section: {f.name for f in dataclasses.fields(cls) if f.init} for section, cls in classes.items()}
    sampled: dict[str, dict[str, Any]] = {"lora": {}, "training": {}}
    for name, distribution in search.space.items():
        section, _, field = name.partition(".")
        sampled[section][field] = first_value(distribution)
    for section, fixed in (("lora", search.lora), ("training", search.training)):
        for field in [*fixed, *sampled[section]]:
            if field not in names[section]:
                where = f"space.{section}.{field}" if field in sampled[section] else f"{section}.{field}"
                close = difflib.get_close_matches(field, sorted(names[section]), n=3)
                hint = f" (did you mean {', '.join(close)}?)" if close else ""
                raise ValueError(f"{where}: {classes[section].__name__} has no field {field!r}{hint}.")
    for section in ("lora", "training"):
        values = {**(search.lora if section == "lora" else training_values(search)), **sampled[section]}
        try:
            classes[section](**values)
        except (ValueError, TypeError) as error:
            raise ValueError(f"{section}: {classes[section].__name__} refuses these values: {error}") from None


def first_value(distribution: BaseDistribution) -> Any:
    """A value of ``distribution`` (its low, or its first choice), to try the config classes with."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    if isinstance(distribution, CategoricalDistribution):
        return distribution.choices[0]
    assert isinstance(distribution, (FloatDistribution, IntDistribution)), distribution
    return distribution.low


def training_values(search: Search) -> dict[str, Any]:
    """The fixed ``training`` values, with mixed precision chosen for the machine unless the file sets it.

    TRL's configs default to ``bf16=True``, which a machine without a bf16 GPU refuses; as AutoTrain's
    ``mixed_precision`` defaults do, bf16 is used where the GPU supports it, else full precision.
    """
    values = dict(search.training)
    if "bf16" not in values and "fp16" not in values:
        import torch

        values["bf16"] = bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    return values
