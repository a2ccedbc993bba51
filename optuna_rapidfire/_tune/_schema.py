"""The search file's schema as pydantic models, and its errors as one line naming the key.

Each section of a search is a model here (:class:`SearchFile` at the top): the types, bounds, allowed values and
defaults are the models' fields, their ``description`` is the reference README's table is held to
(:func:`reference_table`), and what depends on several keys (exactly one data source, rewards for GRPO only,
a direction for a metric without a default, a sampled name that is also fixed) is a validator of the model
that holds them. :func:`validate` runs them and turns pydantic's first error into a ``ValueError`` whose
message starts with the key's path (``budget.n_trials``, ``space.training.learning_rate.low``) and names the
allowed values, with a "did you mean" for a misspelt key. Why pydantic and not a JSON Schema validator: the
names a search may use come from the package's registries and from TRL's, PEFT's and Optuna's classes at run
time (schedules, executor options, samplers and their keywords), which validators read directly.

Nothing here imports torch, TRL or PEFT: :mod:`optuna_rapidfire._tune._search` checks the ``training`` and
``lora`` fields against their config classes in a second pass.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from optuna_rapidfire._runtime._schedules import SCHEDULES
from optuna_rapidfire._study._storages import RDB_BACKENDS

TrainerName = Literal["sft", "dpo", "grpo"]
"""The trainer kinds a search names (held to the registry ``TRAINER_KINDS`` by a test)."""
TRAINERS: dict[str, str] = {"sft": "SFTConfig", "dpo": "DPOConfig", "grpo": "GRPOConfig"}
"""Trainer kinds and the TRL config class each takes its ``training`` values (fixed and sampled) into."""
DEFAULT_METRIC: dict[str, str] = {"sft": "eval_loss", "dpo": "eval_loss", "grpo": "eval_reward"}
DEMO_SETS = ("gsm8k",)
"""Data sets bundled with the package (``data.train: {demo: gsm8k}``)."""
DEMO_FORMATS: dict[str, str] = {"sft": "prompt_completion", "dpo": "preference", "grpo": "prompt_only"}
"""The bundled GSM8K's format for each trainer kind (``load_gsm8k(format=...)``), unless the source names one."""
BUILTIN_REWARDS = ("gsm8k",)
"""Reward names that need no import: ``gsm8k`` is :func:`optuna_rapidfire.demo.gsm8k_reward`."""
DATA_FILE_TYPES: dict[str, str] = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
"""Local data files by extension, and the ``datasets`` builder that reads each."""
SCHEDULE_NAMES = ("default", *SCHEDULES)
SPACE_SECTIONS = ("training", "lora")
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

Text = Annotated[str, Field(min_length=1)]
Number = Annotated[float, Field(allow_inf_nan=False)]


def fail(key: str, text: str) -> PydanticCustomError:
    """An error about ``key`` (a path below the model that raises it; ``""``: the model itself) whose message
    is the key's full path followed by ``text`` (``": ..."`` or ``" must ..."``)."""
    return PydanticCustomError("search", "{text}", {"key": key, "text": text})


class _Section(BaseModel):
    """A mapping of known keys: strict types (``"2"`` is not a number), no unknown key."""

    model_config = ConfigDict(strict=True, frozen=True)
    _empty_is_default: ClassVar[frozenset[str]] = frozenset()  # mapping keys whose null means their default

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, value: Any) -> Any:
        if isinstance(value, Mapping):
            # A key left empty in YAML (``lora:`` with its lines commented out) is null: the section's default.
            value = {k: v for k, v in value.items() if not (v is None and k in cls._empty_is_default)}
            allowed = sorted(cls.model_fields)
            for key in value:
                if key not in cls.model_fields:
                    close = difflib.get_close_matches(str(key), allowed, n=1)
                    hint = f" (did you mean {close[0]!r}?)" if close else ""
                    raise fail(str(key), f": unknown key{hint}; allowed: {', '.join(allowed)}.")
        return value


class DataSourceModel(_Section):
    """One split of the data: exactly one of ``demo``, ``path`` or ``dataset``."""

    _empty_is_default = frozenset({"columns"})

    demo: Literal["gsm8k"] | None = Field(
        None, description="a bundled data set, in the trainer kind's format (`split`: train or test)"
    )
    path: Text | None = Field(
        None,
        description="a local `.json`/`.jsonl`/`.csv`/`.parquet` file, or a folder written by `save_to_disk` (with "
        "`split` for a `DatasetDict`)",
    )
    dataset: Text | None = Field(
        None, description="anything `datasets.load_dataset` takes (a hub id, a local folder of data files)"
    )
    name: Text | None = Field(None, description="the configuration of a `dataset`")
    split: Text | None = Field(None, description="the split (default: train for data.train, test for data.eval)")
    rows: Annotated[int, Field(ge=1)] | None = Field(None, description="keep the first rows")
    format: Literal["prompt_completion", "text", "preference", "prompt_only"] | None = Field(
        None, description="the bundled set's format (default: the trainer's)"
    )
    columns: dict[str, Text] = Field(
        default_factory=dict, description="renames `{old: new}` after loading (AutoTrain's column mapping)"
    )

    @model_validator(mode="after")
    def _one_source(self) -> DataSourceModel:
        given = [k for k in ("demo", "path", "dataset") if getattr(self, k) is not None]
        if len(given) != 1:
            raise fail(
                "",
                f" needs exactly one of demo (bundled: {', '.join(DEMO_SETS)}), path (a local .json/.jsonl/.csv/"
                ".parquet file or a save_to_disk folder) or dataset (a datasets.load_dataset path), but got "
                f"{', '.join(given) or 'none'}.",
            )
        if self.format is not None and self.demo is None:
            raise fail("format", " applies to demo data only; rename columns with columns.")
        if self.name is not None and self.dataset is None:
            raise fail("name", " (a configuration of a datasets.load_dataset path) applies to dataset only.")
        if self.demo is not None and self.split is not None and self.split not in ("train", "test"):
            raise fail("split", f" must be one of train, test, but got {self.split!r}.")
        if self.path is not None:
            if not os.path.exists(self.path):
                raise fail("path", f": no file or folder at {os.path.abspath(self.path)}.")
            if os.path.isfile(self.path) and Path(self.path).suffix.lower() not in DATA_FILE_TYPES:
                raise fail(
                    "path",
                    f": {self.path!r} is not a data file this reads ({', '.join(DATA_FILE_TYPES)}) nor a "
                    "save_to_disk folder.",
                )
        return self


class DataModel(_Section):
    train: DataSourceModel = Field(description="the train set: exactly one of `demo`, `path` or `dataset` (keys below)")
    eval: DataSourceModel = Field(description="the eval set (evaluated after every chunk), as `data.train`")


class ObjectiveModel(_Section):
    metric: Text | None = Field(
        None, description="`eval_loss` (GRPO: `eval_reward`) unless given; `eval_` is added when missing"
    )
    direction: Literal["minimize", "maximize"] | None = Field(
        None,
        description="a loss is minimized and a reward or accuracy maximized unless given; any other metric needs it",
    )


class BudgetModel(_Section):
    n_trials: Annotated[int, Field(ge=1)] | None = Field(
        None, description="COMPLETE and PRUNED trials in the study, all runs together (a FAIL trial is replaced)"
    )
    timeout: Annotated[Number, Field(gt=0)] | None = Field(
        None, description="seconds per run of the step: no new trial starts after it"
    )

    @model_validator(mode="after")
    def _some_budget(self) -> BudgetModel:
        if self.n_trials is None and self.timeout is None:
            raise fail("", " needs n_trials (trials in the study) and/or timeout (seconds per run of the step).")
        return self


class FloatSpace(_Section):
    type: Literal["float"]
    low: Number
    high: Number
    log: bool = False
    step: Number | None = None


class IntSpace(_Section):
    type: Literal["int"]
    low: int
    high: int
    log: bool = False
    step: int = 1


class CategoricalSpace(_Section):
    type: Literal["categorical"]
    choices: list[Any]

    @model_validator(mode="after")
    def _plain_choices(self) -> CategoricalSpace:
        if not self.choices:
            raise fail("choices", f" must be a non-empty list, but got {self.choices!r}.")
        for i, choice in enumerate(self.choices):
            if choice is not None and not isinstance(choice, (bool, int, float, str)):
                raise fail(
                    f"choices[{i}]",
                    " must be a number, string, bool or null (as Optuna's suggest_categorical takes), but got "
                    f"{shown(choice)}.",
                )
        return self


Distribution = Annotated[FloatSpace | IntSpace | CategoricalSpace, Field(discriminator="type")]
_KINDS = ("float", "int", "categorical")


class SearchFile(_Section):
    """A search, as a file holds it (``load_search`` turns it into a ``Search``)."""

    _empty_is_default = frozenset({"model_kwargs", "objective", "lora", "training", "executor"})

    study_name: Text | None = Field(None, description="the Optuna study (default: the file's name)")
    model: Text = Field(
        description="a local folder or a hub id, loaded as `RapidFireExecutor(model=...)` loads it; `tiny`: a "
        "small model built here"
    )
    model_kwargs: dict[str, Any] = Field(default_factory=dict, description="the model's `from_pretrained` keywords")
    trainer: TrainerName = Field(
        "sft",
        description="`sft`, `dpo` or `grpo`: the TRL config (`SFTConfig`, `DPOConfig`, `GRPOConfig`) the "
        "`training` values go into",
    )
    data: DataModel = Field(description="`train` and `eval`")
    rewards: list[Text] | None = Field(
        None,
        description="GRPO only, required there: `gsm8k` (built in), `module:function`, or a reward model's path "
        "or hub id",
    )
    objective: ObjectiveModel = Field(default_factory=lambda: ObjectiveModel(), description="`metric` and `direction`")
    budget: BudgetModel = Field(description="`n_trials` and/or `timeout`")
    space: dict[str, Distribution] = Field(
        description="`<section>.<field>` (section `training` or `lora`) -> `{type: float, low, high, log, "
        "step}`, `{type: int, "
        "low, high, log, step}` or `{type: categorical, choices: [...]}`: Optuna's distributions, suggested under that "
        "name"
    )
    lora: dict[str, Any] = Field(default_factory=dict, description="fixed `LoraConfig` values")
    training: dict[str, Any] = Field(
        default_factory=dict,
        description="fixed values of the trainer's TRL config; without `bf16`/`fp16`, bf16 where the GPU has "
        "it, else full precision",
    )
    executor: dict[str, Any] = Field(
        default_factory=dict,
        description="`RapidFireExecutor` keywords that are plain values (`num_chunks`, `max_concurrent_trials`, "
        "`seed`, `eval_samples`, `engine`, `devices`...)",
    )
    sampler: Any = Field(
        None,
        description="a class of `optuna.samplers` (or `CloneSampler`), by name or `{name: ..., <keyword>: "
        "...}`; a keyword ending in `sampler` takes one the same way; default: Optuna's (TPE)",
    )
    pruner: Any = Field(None, description="a class of `optuna.pruners`, as `sampler`; default: Optuna's (median)")
    schedule: str = Field("default", description=f"one of {', '.join(f'`{n}`' for n in SCHEDULE_NAMES)}")
    storage: Text | None = Field(
        None, description="an RDB URL (PostgreSQL for several machines); default `sqlite:///<output>/study.db`"
    )
    output: Text | None = Field(None, description="the step's folder; default `./<study_name>`")
    mlflow_tracking_uri: Text | None = Field(
        None, description="log trials to MLflow, and the best adapter to the study's run"
    )
    heartbeat_interval: Annotated[int, Field(ge=1)] = Field(
        10,
        description="seconds between a running trial's heartbeats in the storage: a killed step's trials are "
        "retried from their checkpoints once theirs is twice as old",
    )
    merge: bool = Field(False, description="also write the base model with the best adapter merged in (as `--merge`)")

    @model_validator(mode="before")
    @classmethod
    def _space_names(cls, value: Any) -> Any:
        """Sampled names are ``<section>.<field>`` and each is a distribution (checked before its fields, which
        would otherwise only say a mapping was expected)."""
        if not isinstance(value, Mapping):
            return value
        space = value.get("space")
        if not isinstance(space, Mapping) or not space:
            raise fail(
                "space",
                " must map parameter names to distributions, e.g. "
                "training.learning_rate: {type: float, low: 1.0e-5, high: 1.0e-3, log: true}.",
            )
        for name, entry in space.items():
            section, _, field = str(name).partition(".")
            if section not in SPACE_SECTIONS or not field or "." in field:
                raise fail(
                    f"space.{name}",
                    f": a parameter name is <section>.<field> with section {' or '.join(SPACE_SECTIONS)} "
                    "(training.learning_rate, lora.r).",
                )
            if not isinstance(entry, Mapping):
                raise fail(
                    f"space.{name}",
                    f" must be a distribution such as {{type: float, low: ..., high: ...}}, but got "
                    f"{shown(entry)}; fixed values go under {section}:.",
                )
            if entry.get("type") not in _KINDS:
                raise fail(f"space.{name}.type", f" must be one of {', '.join(_KINDS)}, but got {entry.get('type')!r}.")
        return value

    @model_validator(mode="after")
    def _across_keys(self) -> SearchFile:
        if self.schedule not in SCHEDULE_NAMES:
            raise fail("schedule", f" must be one of {', '.join(SCHEDULE_NAMES)}, but got {self.schedule!r}.")
        for name in self.space:
            section, _, field = name.partition(".")
            if field in (self.lora if section == "lora" else self.training):
                raise fail(f"space.{name}", f": {name} is also a fixed value under {section}: keep one of them.")
        if self.trainer != "grpo" and self.rewards:
            raise fail("rewards", f" apply to trainer: grpo only, but the trainer is {self.trainer}.")
        if self.trainer == "grpo" and not self.rewards:
            raise fail(
                "rewards",
                f" is required for trainer: grpo: a list of built-in rewards ({', '.join(BUILTIN_REWARDS)}), "
                "module:function names, or reward model paths / hub ids.",
            )
        metric = self.metric
        if self.objective.direction is None and direction_of(metric) is None:
            raise fail(
                "objective.direction",
                f" is required for metric {metric!r}: minimize or maximize (only a loss, a reward or an "
                "accuracy has a default).",
            )
        if self.storage is not None:
            backend = self.storage.split(":", 1)[0].split("+", 1)[0]
            if "://" not in self.storage or backend not in RDB_BACKENDS:
                raise fail(
                    "storage",
                    f" must be an RDB URL ({', '.join(b + '://...' for b in RDB_BACKENDS)}), but got {self.storage!r}.",
                )
        from optuna_rapidfire._study._config import ExecutorConfig

        allowed = sorted(name for name in ExecutorConfig.options() if name not in _EXECUTOR_ELSEWHERE)
        for key in self.executor:
            if key not in allowed:
                close = difflib.get_close_matches(key, allowed, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise fail(f"executor.{key}", f": unknown key{hint}; allowed: {', '.join(allowed)}.")
        return self

    @property
    def metric(self) -> str:
        """The objective's metric, ``eval_``-prefixed as the trainers report it."""
        metric = self.objective.metric or DEFAULT_METRIC[self.trainer]
        return metric if metric.startswith("eval_") else f"eval_{metric}"

    @property
    def direction(self) -> Literal["minimize", "maximize"]:
        found = self.objective.direction or direction_of(self.metric)
        assert found is not None  # checked by the model
        return found


def direction_of(metric: str) -> Literal["minimize", "maximize"] | None:
    """The direction a metric's name implies: a loss goes down, a reward or an accuracy up; ``None`` otherwise."""
    name = metric.removeprefix("eval_").lower()
    if name.endswith("loss"):
        return "minimize"
    if "reward" in name or "accurac" in name:
        return "maximize"
    return None


def shown(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def validate(raw: Any) -> SearchFile:
    """``raw`` (a search's plain content) as a :class:`SearchFile`, or a ``ValueError`` whose one line starts with
    the path of the first key that is wrong."""
    if not isinstance(raw, Mapping):
        raise ValueError(f"a search must be a mapping of keys, but got {shown(raw)}.")
    try:
        return SearchFile.model_validate(raw)
    except ValidationError as error:
        raise ValueError(_message(error.errors(include_url=False)[0])) from None


# What pydantic's error types say, as the rest of the package says it.
_SAYS = {
    "missing": " is required.",
    "int_type": " must be an integer, but got {shown}.",
    "float_type": " must be a finite number, but got {shown}.",
    "finite_number": " must be a finite number, but got {shown}.",
    "bool_type": " must be true or false, but got {shown}.",
    "string_type": " must be a non-empty string, but got {shown}.",
    "string_too_short": " must be a non-empty string, but got {shown}.",
    "dict_type": " must be a mapping, but got {shown}.",
    "model_type": " must be a mapping, but got {shown}.",
    "model_attributes_type": " must be a mapping, but got {shown}.",
    "list_type": " must be a list, but got {shown}.",
    "greater_than_equal": " must be at least {ge}, but got {input!r}.",
    "greater_than": " must be a positive number, but got {input!r}.",
}


def _message(error: Any) -> str:
    loc = [str(part) for part in error["loc"]]
    if len(loc) >= 3 and loc[0] == "space" and loc[2] in _KINDS:
        del loc[2]  # the discriminated union's tag, not a key
    ctx = error.get("ctx") or {}
    kind = error["type"]
    if kind == "search":
        where = ".".join(part for part in (*loc, ctx["key"]) if part)
        return f"{where}{ctx['text']}"
    where = ".".join(loc) or "search"
    if kind == "literal_error":
        allowed = re.findall(r"'([^']*)'", str(ctx.get("expected", "")))
        return f"{where} must be one of {', '.join(allowed)}, but got {error['input']!r}."
    template = _SAYS.get(kind)
    if template is None:
        return f"{where}: {error['msg']}."
    return where + template.format(shown=shown(error.get("input")), input=error.get("input"), **ctx)


def reference_table() -> str:
    """The search's keys as a Markdown table (README's "Search file reference"), from the models' fields."""
    rows = ["| key | default | what it is |", "|---|---|---|"]

    def add(model: type[BaseModel], prefix: str) -> None:
        for name, info in model.model_fields.items():
            nested = _section_of(info.annotation)
            if info.is_required():
                default = "required"
            elif info.default_factory is not None or info.default is None:
                default = "-"
            else:
                default = f"`{str(info.default).lower() if isinstance(info.default, bool) else info.default}`"
            rows.append(f"| `{prefix}{name}` | {default} | {info.description or ''} |")
            if nested is not None and nested is not DataSourceModel:
                add(nested, f"{prefix}{name}.")

    add(SearchFile, "")
    add(DataSourceModel, "data.<split>.")
    return "\n".join(rows)


def _section_of(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, _Section):
        return annotation
    return None
