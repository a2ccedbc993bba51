"""The executor's settings, validated without a model: one frozen object, errors that name the bad value."""

from __future__ import annotations

import dataclasses
import pickle

import optuna
import pytest
from optuna.trial import TrialState

from optuna_rapidfire._executor import study_target
from optuna_rapidfire._study._config import ExecutorConfig, MemoryBudget
from optuna_rapidfire.demo import load_gsm8k


@pytest.fixture(scope="module")
def data():
    return load_gsm8k("train", num_rows=40), load_gsm8k("test", num_rows=8)


def test_defaults_are_resolved_and_the_config_is_frozen_and_picklable(data) -> None:
    train, evaluation = data
    config = ExecutorConfig(model="some/model", train_dataset=train, eval_dataset=evaluation, metric="loss")
    assert config.metric == "eval_loss"
    assert config.eval_rows == 32  # "auto": a quarter of a chunk's rows, at least 32
    assert config.memory_budget is None  # "auto": the device decides
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.num_chunks = 3  # type: ignore[misc]
    copy = pickle.loads(pickle.dumps(config.replace(show_progress_bar=False)))  # the worker processes' payload
    assert copy.show_progress_bar is False and copy.num_chunks == config.num_chunks
    assert repr(copy.policy) == repr(config.policy) and copy.eval_rows == 32


def test_the_executor_takes_the_config_s_fields_as_its_keywords_and_names_a_wrong_one() -> None:
    """One option list: the executor's signature (as help() and IDEs show it) is the config's, every option
    is documented, and a misspelt or missing keyword is refused before any work, named."""
    import inspect

    from optuna_rapidfire import RapidFireExecutor

    parameters = inspect.signature(RapidFireExecutor).parameters
    assert list(parameters) == ExecutorConfig.options()
    assert all(p.kind == inspect.Parameter.KEYWORD_ONLY for p in parameters.values())
    assert parameters["num_chunks"].default == 8 and parameters["model"].default is inspect.Parameter.empty
    for name in parameters:  # each one documented in the executor's docstring
        assert f"        {name}: " in (RapidFireExecutor.__doc__ or ""), name
    with pytest.raises(TypeError, match="unexpected keyword argument 'num_chunk'; did you mean 'num_chunks'"):
        RapidFireExecutor(model="m", train_dataset=None, eval_dataset=None, num_chunk=3)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="missing the keyword arguments 'train_dataset', 'eval_dataset'"):
        RapidFireExecutor(model="m")  # type: ignore[call-arg]


@pytest.mark.parametrize(
    ("setting", "expected"),
    [
        (None, MemoryBudget()),
        (0, MemoryBudget(bytes=0)),
        (1, MemoryBudget(bytes=1)),
        (8_000_000, MemoryBudget(bytes=8_000_000)),
        ("40%", MemoryBudget(fraction=0.4)),
        ("100%", MemoryBudget(fraction=1.0)),
        ("8GiB", MemoryBudget(bytes=8 * 2**30)),
        ("512 MB", MemoryBudget(bytes=512 * 10**6)),
    ],
)
def test_a_memory_budget_means_the_same_whatever_the_number_type(setting, expected) -> None:
    assert MemoryBudget.parse(setting) == expected
    assert MemoryBudget.parse("auto") is None
    assert MemoryBudget(fraction=0.25).resolve(1000) == 250 and MemoryBudget(bytes=7).resolve(1000) == 7


@pytest.mark.parametrize(
    ("setting", "error", "message"),
    [
        (1.0, TypeError, "A float is ambiguous"),
        (0.5, TypeError, "A float is ambiguous"),
        (True, TypeError, "state_memory_budget"),
        (-1, ValueError, "must not be negative"),
        ("lots", ValueError, "'lots'"),
        ("150%", ValueError, "'150%'"),
    ],
)
def test_a_bad_memory_budget_is_refused_by_name(setting, error, message) -> None:
    with pytest.raises(error, match=message):
        MemoryBudget.parse(setting)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"num_chunks": 0}, ValueError, "num_chunks=0"),
        ({"max_concurrent_trials": 0}, ValueError, "max_concurrent_trials=0"),
        ({"eval_samples": 0}, ValueError, "eval_samples=0"),
        ({"metric": 3}, TypeError, "metric must be a metric name"),
        ({"reward_funcs": [3]}, TypeError, "reward_funcs"),
        ({"poll_seconds": 0}, ValueError, "poll_seconds=0"),
        ({"pause_grace_seconds": -1}, ValueError, "pause_grace_seconds=-1"),
        ({"engine": "warp"}, ValueError, "engine='warp'"),
        ({"storage_retry_seconds": -1}, ValueError, "storage_retry_seconds=-1"),
        ({"artifact_store": "s3"}, ValueError, "artifact_store='s3'"),
        ({"artifact_store": object()}, TypeError, "has no write, open_reader, remove"),
    ],
)
def test_each_bad_setting_is_refused_by_name(data, kwargs, error, message) -> None:
    train, evaluation = data
    with pytest.raises(error, match=message):
        ExecutorConfig(model="m", train_dataset=train, eval_dataset=evaluation, **kwargs)


def test_a_max_trials_callback_sets_the_study_wide_target() -> None:
    finished = (TrialState.COMPLETE, TrialState.PRUNED)
    assert study_target([]) is None
    assert study_target([optuna.study.MaxTrialsCallback(8, states=finished)]) == (8, finished)
    assert study_target([optuna.study.MaxTrialsCallback(8)]) == (8, (TrialState.COMPLETE,))
    both = [optuna.study.MaxTrialsCallback(8, states=finished), optuna.study.MaxTrialsCallback(5, states=None)]
    assert study_target(both) == (5, (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL))
    with pytest.raises(ValueError, match="must count finished trials"):
        study_target([optuna.study.MaxTrialsCallback(8, states=(TrialState.RUNNING,))])


def test_each_list_of_names_is_its_registry_s() -> None:
    """The names the config, tune, the CLI and errors accept are their registries' (one place each); the
    tuning step's light first pass keeps copies of two, checked here."""
    import typing

    from optuna_rapidfire._engines import ENGINES
    from optuna_rapidfire._runtime._schedules import SCHEDULES
    from optuna_rapidfire._study._config import EngineName
    from optuna_rapidfire._trainers import TRAINER_KINDS
    from optuna_rapidfire._tune import _schema

    assert set(typing.get_args(EngineName)) == {"auto", *ENGINES}
    assert typing.get_args(_schema.TrainerName) == tuple(TRAINER_KINDS)
    assert {name: kind.args_type().__name__ for name, kind in TRAINER_KINDS.items()} == _schema.TRAINERS
    assert {name: kind.default_metric for name, kind in TRAINER_KINDS.items()} == _schema.DEFAULT_METRIC
    assert set(_schema.DEMO_FORMATS) == set(TRAINER_KINDS)
    from optuna_rapidfire import cli, control
    from optuna_rapidfire._study import _commands

    assert tuple(control.TRIAL_COMMANDS) == _commands.TRIAL_OPS
    assert set(_commands.OPS) <= set(cli.COMMANDS) and set(_commands._FORM_VALUES.values()) == set(_commands.OPS)
    assert ("default", *SCHEDULES) == _schema.SCHEDULE_NAMES


def _readme_options() -> dict[str, str]:
    """README's API table: each option named in its first column, with its default cell."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    table = text[text.index("| option | default | meaning |") : text.index("- `executor.optimize(")]
    options: dict[str, str] = {}
    for row in table.splitlines()[2:]:
        cells = [cell.strip() for cell in row.strip().strip("|").split("|")]
        for name in re.findall(r"`(\w+)`", cells[0]):
            options[name] = cells[1].strip("`")
    return options


# Defaults README writes as what they resolve to, not as the field's value.
_RESOLVED_IN_README = {
    "model_kwargs": "{}",  # None becomes {}
    "metric": '"eval_loss"',  # None: the trainer kind's default metric (eval_loss for SFT and DPO)
    "output_dir": "rapidfire-output",  # a folder name, unquoted
}


def test_readme_and_the_executor_docstring_document_every_option_with_its_default() -> None:
    """The options are written once, as ExecutorConfig's fields: README's table and RapidFireExecutor's
    docstring name each of them (and nothing else), README with the field's default."""
    import dataclasses

    from optuna_rapidfire import RapidFireExecutor

    fields = {f.name: f for f in dataclasses.fields(ExecutorConfig) if f.init}
    readme = _readme_options()
    assert set(readme) == set(fields)
    for name, cell in readme.items():
        field = fields[name]
        if name in _RESOLVED_IN_README:
            assert cell == _RESOLVED_IN_README[name], name
        elif field.default is dataclasses.MISSING or field.default is None:
            assert cell in ("", "`None`", "None"), (name, cell)
        elif isinstance(field.default, str):
            assert cell == f'"{field.default}"', (name, cell)
        else:
            assert cell == str(field.default) or float(cell) == field.default, (name, cell)
    doc = RapidFireExecutor.__doc__ or ""
    documented = {
        line.strip().split(":")[0] for line in doc.splitlines() if line.startswith("        ") and ":" in line
    }
    assert set(fields) <= documented, sorted(set(fields) - documented)
