"""The declared search: what one file (YAML, or the same as a dict) says, validated before any work.

:func:`load_search` reads a search file or takes a dict and returns a frozen :class:`Search`, or raises a
``ValueError`` (a ``TypeError`` for a value of the wrong type) whose message starts with the key's path
(``budget.n_trials``, ``space.training.learning_rate.low``) and names the allowed values. The checks run in
two passes: the file's structure first, with no heavy import, then the ``training`` and ``lora`` fields
against TRL's and PEFT's own config classes (which import torch). Nothing here loads a model, a data set or
opens a storage: :mod:`optuna_rapidfire._tune._inputs` turns a valid search into those.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

from optuna_rapidfire._runtime._schedules import SCHEDULES
from optuna_rapidfire._study._storages import RDB_BACKENDS

if TYPE_CHECKING:
    from optuna.distributions import BaseDistribution

TrainerName = Literal["sft", "dpo", "grpo"]

TOP_KEYS = (
    "study_name",
    "model",
    "model_kwargs",
    "trainer",
    "data",
    "rewards",
    "objective",
    "budget",
    "space",
    "lora",
    "training",
    "executor",
    "sampler",
    "pruner",
    "schedule",
    "storage",
    "output",
    "mlflow_tracking_uri",
    "merge",
)
"""Every key a search may have at its top level."""

TRAINERS: dict[str, str] = {"sft": "SFTConfig", "dpo": "DPOConfig", "grpo": "GRPOConfig"}
"""Trainer kinds and the TRL config class each takes its ``training`` values (fixed and sampled) into."""

DEFAULT_METRIC: dict[str, str] = {"sft": "eval_loss", "dpo": "eval_loss", "grpo": "eval_reward"}

DEMO_SETS = ("gsm8k",)
"""Data sets bundled with the package (``data.train: {demo: gsm8k}``)."""
DEMO_FORMATS: dict[str, str] = {"sft": "prompt_completion", "dpo": "preference", "grpo": "prompt_only"}
"""The bundled GSM8K's format for each trainer kind (``load_gsm8k(format=...)``), unless the source names one."""
_ALL_DEMO_FORMATS = ("prompt_completion", "text", "preference", "prompt_only")

BUILTIN_REWARDS = ("gsm8k",)
"""Reward names that need no import: ``gsm8k`` is :func:`optuna_rapidfire.demo.gsm8k_reward`."""

DATA_FILE_TYPES: dict[str, str] = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
"""Local data files by extension, and the ``datasets`` builder that reads each."""

# Executor keywords a search sets elsewhere (model, data, objective, rewards, output, schedule) or that take
# Python objects (functions, artifact stores), which a file cannot hold.
_EXECUTOR_ELSEWHERE = frozenset(
    {
        "model",
        "train_dataset",
        "eval_dataset",
        "tokenizer",
        "model_kwargs",
        "metric",
        "compute_metrics",
        "preprocess_logits_for_metrics",
        "formatting_func",
        "reward_funcs",
        "mlflow_tracking_uri",
        "output_dir",
        "schedule",
        "artifact_store",
    }
)
_SCHEDULES = ("default", *SCHEDULES)
_SPACE_SECTIONS = ("training", "lora")
_DISTRIBUTION_KEYS: dict[str, tuple[str, ...]] = {
    "float": ("type", "low", "high", "log", "step"),
    "int": ("type", "low", "high", "log", "step"),
    "categorical": ("type", "choices"),
}


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
        ValueError: A missing file, bad YAML, an unknown key or value; the message starts with the key's path.
        TypeError: A value of the wrong type; the message starts with the key's path.
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


# -- checks --------------------------------------------------------------------------------------------


def _keys(value: Any, where: str, allowed: tuple[str, ...] | frozenset[str], required: tuple[str, ...] = ()) -> None:
    if not isinstance(value, Mapping):
        raise TypeError(f"{where} must be a mapping, but got {_shown(value)}.")
    for key in value:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), list(allowed), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"{_join(where, key)}: unknown key{hint}; allowed: {', '.join(sorted(allowed))}.")
    for key in required:
        if value.get(key) is None:
            raise ValueError(f"{_join(where, key)} is required.")


def _join(where: str, key: object) -> str:
    return str(key) if where == "search" else f"{where}.{key}"


def _shown(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def _string(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise TypeError(f"{where} must be a non-empty string, but got {_shown(value)}.")
    return value


def _choice(value: Any, where: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{where} must be one of {', '.join(choices)}, but got {value!r}.")
    return cast("str", value)


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"{where} must be a finite number, but got {_shown(value)}.")
    return value


def _integer(value: Any, where: str, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{where} must be an integer, but got {_shown(value)}.")
    if minimum is not None and value < minimum:
        raise ValueError(f"{where} must be at least {minimum}, but got {value}.")
    return value


def _mapping(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(f"{where} must be a mapping, but got {_shown(value)}.")
    return dict(value)


def _parse(raw: Any, digest: str, source: str | None, default_name: str | None) -> Search:
    _keys(raw, "search", TOP_KEYS, required=("model", "data", "budget", "space"))
    study_name = raw.get("study_name", default_name)
    if study_name is None:
        raise ValueError("study_name is required when the search is a dict (a file's default is its name).")
    study_name = _string(study_name, "study_name")
    trainer = _choice(raw.get("trainer", "sft"), "trainer", tuple(TRAINERS))
    model = _string(raw["model"], "model")
    data = raw["data"]
    _keys(data, "data", ("train", "eval"), required=("train", "eval"))
    train = _data_source(data["train"], "data.train", "train")
    evaluation = _data_source(data["eval"], "data.eval", "test")
    rewards = _rewards(raw.get("rewards"), trainer)
    metric, direction = _objective(raw.get("objective"), trainer)
    n_trials, timeout = _budget(raw["budget"])
    lora = _mapping(raw.get("lora"), "lora")
    training = _mapping(raw.get("training"), "training")
    space = _space(raw["space"], {"lora": lora, "training": training})
    executor = _executor(raw.get("executor"))
    output = str(Path(_string(raw.get("output", study_name), "output")).resolve())
    storage = raw.get("storage")
    storage = _storage(storage) if storage is not None else f"sqlite:///{Path(output) / 'study.db'}"
    mlflow = raw.get("mlflow_tracking_uri")
    merge = raw.get("merge", False)
    if not isinstance(merge, bool):
        raise TypeError(f"merge must be true or false, but got {_shown(merge)}.")
    return Search(
        study_name=study_name,
        model=model,
        model_kwargs=_mapping(raw.get("model_kwargs"), "model_kwargs"),
        trainer=cast("TrainerName", trainer),
        train=train,
        eval=evaluation,
        rewards=rewards,
        metric=metric,
        direction=cast("Literal['minimize', 'maximize']", direction),
        n_trials=n_trials,
        timeout=timeout,
        space=space,
        lora=lora,
        training=training,
        executor=executor,
        sampler=_named(raw.get("sampler"), "sampler"),
        pruner=_named(raw.get("pruner"), "pruner"),
        schedule=_choice(raw.get("schedule", "default"), "schedule", _SCHEDULES),
        storage=storage,
        output=output,
        mlflow_tracking_uri=None if mlflow is None else _string(mlflow, "mlflow_tracking_uri"),
        merge=merge,
        raw=raw,
        sha256=digest,
        source=source,
    )


def _data_source(value: Any, where: str, default_split: str) -> DataSource:
    kinds = ("demo", "path", "dataset")
    _keys(value, where, (*kinds, "name", "split", "rows", "format", "columns"))
    given = [k for k in kinds if value.get(k) is not None]
    if len(given) != 1:
        raise ValueError(
            f"{where} needs exactly one of demo (bundled: {', '.join(DEMO_SETS)}), path (a local .json/.jsonl/.csv/"
            f".parquet file or a save_to_disk folder) or dataset (a datasets.load_dataset path), but got "
            f"{', '.join(given) or 'none'}."
        )
    kind = given[0]
    rows = value.get("rows")
    if rows is not None:
        _integer(rows, f"{where}.rows", minimum=1)
    split = value.get("split")
    if split is not None:
        _string(split, f"{where}.split")
    columns = _mapping(value.get("columns"), f"{where}.columns")
    for old, new in columns.items():
        _string(new, f"{where}.columns.{old}")
    if value.get("format") is not None and kind != "demo":
        raise ValueError(f"{where}.format applies to demo data only; rename columns with {where}.columns.")
    if value.get("name") is not None and kind != "dataset":
        raise ValueError(f"{where}.name (a configuration of a datasets.load_dataset path) applies to dataset only.")
    if kind == "demo":
        _choice(value["demo"], f"{where}.demo", DEMO_SETS)
        _choice(split or default_split, f"{where}.split", ("train", "test"))
        if value.get("format") is not None:
            _choice(value["format"], f"{where}.format", _ALL_DEMO_FORMATS)
        return DataSource(
            demo=value["demo"], split=split or default_split, rows=rows, format=value.get("format"), columns=columns
        )
    if kind == "path":
        path = _string(value["path"], f"{where}.path")
        if not os.path.exists(path):
            raise ValueError(f"{where}.path: no file or folder at {os.path.abspath(path)}.")
        if os.path.isfile(path) and Path(path).suffix.lower() not in DATA_FILE_TYPES:
            raise ValueError(
                f"{where}.path: {path!r} is not a data file this reads ({', '.join(DATA_FILE_TYPES)}) nor a "
                "save_to_disk folder."
            )
        return DataSource(path=path, split=split, rows=rows, columns=columns)
    name = value.get("name")
    return DataSource(
        dataset=_string(value["dataset"], f"{where}.dataset"),
        name=None if name is None else _string(name, f"{where}.name"),
        split=split or default_split,
        rows=rows,
        columns=columns,
    )


def _rewards(value: Any, trainer: str) -> tuple[str, ...]:
    if trainer != "grpo":
        if value:
            raise ValueError(f"rewards apply to trainer: grpo only, but the trainer is {trainer}.")
        return ()
    if not isinstance(value, list) or not value:
        raise ValueError(
            f"rewards is required for trainer: grpo: a list of built-in rewards ({', '.join(BUILTIN_REWARDS)}), "
            "module:function names, or reward model paths / hub ids."
        )
    return tuple(_string(item, f"rewards[{i}]") for i, item in enumerate(value))


def _objective(value: Any, trainer: str) -> tuple[str, str]:
    settings = _mapping(value, "objective")
    _keys(settings, "objective", ("metric", "direction"))
    metric = _string(settings.get("metric", DEFAULT_METRIC[trainer]), "objective.metric")
    metric = metric if metric.startswith("eval_") else f"eval_{metric}"
    direction = settings.get("direction")
    name = metric.removeprefix("eval_").lower()
    if direction is None:
        if name.endswith("loss"):
            direction = "minimize"
        elif "reward" in name or "accurac" in name:
            direction = "maximize"
        else:
            raise ValueError(
                f"objective.direction is required for metric {metric!r}: minimize or maximize (only a loss, a "
                "reward or an accuracy has a default)."
            )
    return metric, _choice(direction, "objective.direction", ("minimize", "maximize"))


def _budget(value: Any) -> tuple[int | None, float | None]:
    _keys(value, "budget", ("n_trials", "timeout"))
    n_trials, timeout = value.get("n_trials"), value.get("timeout")
    if n_trials is None and timeout is None:
        raise ValueError("budget needs n_trials (trials in the study) and/or timeout (seconds per run of the step).")
    if n_trials is not None:
        _integer(n_trials, "budget.n_trials", minimum=1)
    if timeout is not None and not _number(timeout, "budget.timeout") > 0:
        raise ValueError(f"budget.timeout must be a positive number of seconds, but got {timeout}.")
    return n_trials, None if timeout is None else float(timeout)


def _space(value: Any, fixed: dict[str, dict[str, Any]]) -> dict[str, BaseDistribution]:
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    if not isinstance(value, Mapping) or not value:
        raise ValueError(
            "space must map parameter names to distributions, e.g. "
            "training.learning_rate: {type: float, low: 1.0e-5, high: 1.0e-3, log: true}."
        )
    space: dict[str, BaseDistribution] = {}
    for name, entry in value.items():
        where = f"space.{name}"
        section, _, field = str(name).partition(".")
        if section not in _SPACE_SECTIONS or not field or "." in field:
            raise ValueError(
                f"{where}: a parameter name is <section>.<field> with section {' or '.join(_SPACE_SECTIONS)} "
                "(training.learning_rate, lora.r)."
            )
        if field in fixed[section]:
            raise ValueError(f"{where}: {section}.{field} is also a fixed value under {section}: keep one of them.")
        if not isinstance(entry, Mapping):
            raise TypeError(
                f"{where} must be a distribution such as {{type: float, low: ..., high: ...}}, but got "
                f"{_shown(entry)}; fixed values go under {section}:."
            )
        kind = _choice(entry.get("type"), f"{where}.type", tuple(_DISTRIBUTION_KEYS))
        _keys(entry, where, _DISTRIBUTION_KEYS[kind])
        try:
            if kind == "categorical":
                choices = entry.get("choices")
                if not isinstance(choices, list) or not choices:
                    raise ValueError(f"{where}.choices must be a non-empty list, but got {choices!r}.")
                for i, choice in enumerate(choices):
                    if choice is not None and not isinstance(choice, (bool, int, float, str)):
                        raise TypeError(
                            f"{where}.choices[{i}] must be a number, string, bool or null (as Optuna's "
                            f"suggest_categorical takes), but got {_shown(choice)}."
                        )
                space[name] = CategoricalDistribution(choices)
                continue
            if "low" not in entry or "high" not in entry:
                raise ValueError(f"{where} needs low and high.")
            log = entry.get("log", False)
            if not isinstance(log, bool):
                raise TypeError(f"{where}.log must be true or false, but got {_shown(log)}.")
            if kind == "int":
                step = entry.get("step", 1)
                space[name] = IntDistribution(
                    _integer(entry["low"], f"{where}.low"),
                    _integer(entry["high"], f"{where}.high"),
                    log=log,
                    step=_integer(step, f"{where}.step"),
                )
            else:
                step = entry.get("step")
                space[name] = FloatDistribution(
                    _number(entry["low"], f"{where}.low"),
                    _number(entry["high"], f"{where}.high"),
                    log=log,
                    step=None if step is None else _number(step, f"{where}.step"),
                )
        except ValueError as error:  # Optuna's own checks (low > high, log with step, log of 0...)
            message = str(error)
            raise ValueError(message if message.startswith(where) else f"{where}: {message}") from None
    return space


def _executor(value: Any) -> dict[str, Any]:
    from optuna_rapidfire._study._config import ExecutorConfig

    settings = _mapping(value, "executor")
    allowed = tuple(name for name in ExecutorConfig.options() if name not in _EXECUTOR_ELSEWHERE)
    _keys(settings, "executor", allowed)
    return settings


def _storage(value: Any) -> str:
    url = _string(value, "storage")
    backend = url.split(":", 1)[0].split("+", 1)[0]
    if "://" not in url or backend not in RDB_BACKENDS:
        raise ValueError(
            f"storage must be an RDB URL ({', '.join(b + '://...' for b in RDB_BACKENDS)}), but got {url!r}."
        )
    return url


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
        raise TypeError(f"{where} must be a class name or {{name: ..., <keyword>: ...}}, but got {_shown(value)}.")
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
