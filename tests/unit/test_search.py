"""The declared search's schema: every mistake is refused before any work, and the error names the key."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

from optuna_rapidfire._tune import load_search
from optuna_rapidfire._tune._inputs import build_named, make_configure, trials_in_study
from optuna_rapidfire._tune._run import trials_left

ROOT = Path(__file__).resolve().parents[2]

BASE: dict[str, Any] = {
    "study_name": "s",
    "model": "some/model",
    "data": {"train": {"demo": "gsm8k", "rows": 8}, "eval": {"demo": "gsm8k", "split": "test", "rows": 4}},
    "budget": {"n_trials": 2},
    "space": {
        "training.learning_rate": {"type": "float", "low": 1e-5, "high": 1e-3, "log": True},
        "lora.r": {"type": "categorical", "choices": [4, 8]},
        "training.per_device_train_batch_size": {"type": "int", "low": 2, "high": 8, "step": 2},
    },
    "lora": {"target_modules": ["q_proj", "v_proj"]},
    "training": {"num_train_epochs": 1, "bf16": False},
}


def search(**changes: Any) -> dict[str, Any]:
    """BASE with ``changes`` at dotted paths (``None`` removes the key)."""
    result = copy.deepcopy(BASE)
    for path, value in changes.items():
        *parents, last = path.split("__")
        node = result
        for part in parents:
            node = node.setdefault(part, {})
        if value is None:
            node.pop(last, None)
        else:
            node[last] = value
    return result


def test_a_valid_search_becomes_optuna_distributions_and_defaults(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    parsed = load_search(BASE)
    assert parsed.space == {
        "training.learning_rate": FloatDistribution(1e-5, 1e-3, log=True),
        "lora.r": CategoricalDistribution([4, 8]),
        "training.per_device_train_batch_size": IntDistribution(2, 8, step=2),
    }
    assert (parsed.trainer, parsed.metric, parsed.direction) == ("sft", "eval_loss", "minimize")
    assert parsed.output == str(tmp_path / "s") and parsed.storage == f"sqlite:///{tmp_path / 's' / 'study.db'}"
    assert parsed.train.split == "train" and parsed.eval.split == "test"
    grpo = load_search(
        search(trainer="grpo", rewards=["gsm8k"], lora__r=4, space={"training.beta": BASE["space"]["lora.r"]})
    )
    assert (grpo.metric, grpo.direction) == ("eval_reward", "maximize")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"budjet": {"n_trials": 2}}, r"^budjet: unknown key \(did you mean 'budget'\?\); allowed: .*budget"),
        ({"model": None}, r"^model is required"),
        ({"trainer": "ppo"}, r"^trainer must be one of sft, dpo, grpo, but got 'ppo'"),
        ({"budget": {}}, r"^budget needs n_trials .* and/or timeout"),
        ({"budget__n_trials": 0}, r"^budget.n_trials must be at least 1, but got 0"),
        ({"budget__n_trials": "2"}, r"^budget.n_trials must be an integer, but got '2' \(str\)"),
        ({"budget__timeout": -1}, r"^budget.timeout must be a positive number"),
        ({"data__train": {"demo": "mnist"}}, r"^data.train.demo must be one of gsm8k, but got 'mnist'"),
        (
            {"data__train": {"demo": "gsm8k", "path": "x.jsonl"}},
            r"^data.train needs exactly one of demo .* but got demo, path",
        ),
        ({"data__eval": {"path": "missing.jsonl"}}, r"^data.eval.path: no file or folder at .*missing.jsonl"),
        ({"data__eval": {"demo": "gsm8k", "split": "dev"}}, r"^data.eval.split must be one of train, test"),
        ({"data__train__rows": 0}, r"^data.train.rows must be at least 1"),
        ({"data__train__format": "chat"}, r"^data.train.format must be one of prompt_completion, text, preference"),
        ({"space": {}}, r"^space must map parameter names to distributions"),
        (
            {"space": {"learning_rate": {"type": "float", "low": 1, "high": 2}}},
            r"^space.learning_rate: a parameter name is <section>.<field> with section training or lora",
        ),
        (
            {"space": {"training.lr": {"type": "normal"}}},
            r"^space.training.lr.type must be one of float, int, categorical, but got 'normal'",
        ),
        (
            {"space": {"training.learning_rate": {"type": "float", "low": 1e-3, "high": 1e-5}}},
            r"^space.training.learning_rate: .*low",
        ),
        (
            {"space": {"training.learning_rate": {"type": "float", "low": 0.0, "high": 1.0, "log": True}}},
            r"^space.training.learning_rate: .*",
        ),
        (
            {"space": {"training.learning_rate": {"type": "float", "low": 1e-5, "high": 1e-3, "steps": 1e-5}}},
            r"^space.training.learning_rate.steps: unknown key \(did you mean 'step'\?\); allowed: high, log, low",
        ),
        (
            {"space": {"lora.r": {"type": "int", "low": 4.5, "high": 8}}},
            r"^space.lora.r.low must be an integer, but got 4.5",
        ),
        (
            {"space": {"lora.r": {"type": "categorical", "choices": []}}},
            r"^space.lora.r.choices must be a non-empty list",
        ),
        (
            {"lora": {}, "space": {"lora.target_modules": {"type": "categorical", "choices": [["q_proj"]]}}},
            r"^space.lora.target_modules.choices\[0\] must be a number, string, bool or null",
        ),
        ({"space": {"lora.r": 8}}, r"^space.lora.r must be a distribution .* fixed values go under lora:"),
        (
            {"lora__r": 8, "space": {"lora.r": {"type": "int", "low": 4, "high": 8}}},
            r"^space.lora.r: lora.r is also a fixed value under lora",
        ),
        ({"objective": {"metric": "eval_bleu"}}, r"^objective.direction is required for metric 'eval_bleu'"),
        (
            {"objective": {"direction": "down"}},
            r"^objective.direction must be one of minimize, maximize, but got 'down'",
        ),
        ({"sampler": "TPE"}, r"^sampler.name must be one of .*TPESampler"),
        ({"sampler": {"name": "TPESampler", "sed": 0}}, r"^sampler: TPESampler does not take sed; it takes .*seed"),
        (
            {"pruner": {"name": "PatientPruner", "wrapped_pruner": {"name": "Median"}, "patience": 1}},
            r"^pruner.wrapped_pruner.name must be one of .*MedianPruner",
        ),
        ({"schedule": "fifo"}, r"^schedule must be one of default, lockstep, promote, promote_all, but got 'fifo'"),
        ({"storage": "journal.log"}, r"^storage must be an RDB URL"),
        ({"executor": {"num_chunk": 4}}, r"^executor.num_chunk: unknown key \(did you mean 'num_chunks'\?\)"),
        ({"executor": {"reward_funcs": []}}, r"^executor.reward_funcs: unknown key"),
        ({"rewards": ["gsm8k"]}, r"^rewards apply to trainer: grpo only"),
        ({"trainer": "grpo"}, r"^rewards is required for trainer: grpo"),
        ({"merge": "yes"}, r"^merge must be true or false"),
        ({"study_name": None}, r"^study_name is required when the search is a dict"),
    ],
)
def test_a_bad_search_is_refused_and_the_error_names_the_key(changes: dict[str, Any], message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        load_search(search(**changes), check_fields=False)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"training__learnin_rate": 1e-3},
            r"^training.learnin_rate: SFTConfig has no field 'learnin_rate' \(did you mean learning_rate",
        ),
        (
            {"space": {"lora.rank": {"type": "int", "low": 4, "high": 8}}},
            r"^space.lora.rank: LoraConfig has no field 'rank'",
        ),
        (
            {"trainer": "dpo", "space": {"training.temperature": {"type": "float", "low": 0.5, "high": 1}}},
            r"^space.training.temperature: DPOConfig has no field",
        ),
        ({"training__lr_scheduler_type": "sawtooth"}, r"^training: SFTConfig refuses these values: .*sawtooth"),
    ],
)
def test_training_and_lora_names_are_checked_against_trl_and_peft(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_search(search(**changes))


def test_a_yaml_file_reads_like_the_dict_and_its_name_and_hash_are_kept(tmp_path: Path) -> None:
    path = tmp_path / "my-search.yaml"
    path.write_text(
        "model: some/model\n"
        "data: {train: {demo: gsm8k}, eval: {demo: gsm8k, split: test}}\n"
        "budget: {n_trials: 3, timeout: 60}\n"
        "space:\n"
        "  training.learning_rate: {type: float, low: 1e-5, high: 1.0e-3, log: true}\n"
        "training: {bf16: false}\n"
        "lora:\n"  # a section left empty (its lines commented out) is null in YAML: its default
        "  # r: 8\n"
    )
    parsed = load_search(path)
    assert parsed.lora == {}
    assert parsed.study_name == "my-search" and parsed.source == str(path.resolve())
    assert parsed.space["training.learning_rate"] == FloatDistribution(1e-5, 1e-3, log=True)  # 1e-5 is a float
    assert (parsed.n_trials, parsed.timeout) == (3, 60.0)
    import hashlib

    assert parsed.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    path.write_text("model: [unclosed\n")
    with pytest.raises(ValueError, match="is not valid YAML"):
        load_search(path)
    with pytest.raises(ValueError, match="does not exist"):
        load_search(tmp_path / "nope.yaml")


def test_every_example_search_and_the_readmes_are_valid(tmp_path: Path) -> None:
    paths = sorted((ROOT / "examples").glob("search_*.yaml"))
    assert [p.name for p in paths] == ["search_dpo.yaml", "search_grpo.yaml", "search_sft.yaml"]
    for path in paths:
        load_search(path)
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Tuning step for pipelines") :]
    block = re.findall(r"```yaml\n(.*?)```", section, flags=re.S)[0]
    (tmp_path / "search.yaml").write_text(block)
    assert load_search(tmp_path / "search.yaml").study_name == "gsm8k-sft"


def test_readme_s_search_reference_is_the_schema_s() -> None:
    """The key table is written once, as the schema's field descriptions: README holds what they render."""
    from optuna_rapidfire._tune._schema import reference_table

    readme = (ROOT / "README.md").read_text()
    start = readme.index("<!-- search reference:")
    table = readme[readme.index("\n", start) + 1 : readme.index("<!-- end of search reference -->")]
    assert table.strip() == reference_table(), "README's search reference is stale: paste reference_table()"


def test_configure_puts_each_sampled_value_where_its_name_says() -> None:
    import optuna

    configure = make_configure(load_search(BASE))
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    trial = study.ask()
    lora, args = configure(trial)
    assert lora.r == trial.params["lora.r"] and lora.target_modules == {"q_proj", "v_proj"}
    assert args.learning_rate == trial.params["training.learning_rate"]
    assert args.per_device_train_batch_size == trial.params["training.per_device_train_batch_size"]
    assert args.num_train_epochs == 1 and args.bf16 is False


def test_samplers_and_pruners_are_built_by_name_and_a_rerun_shifts_the_seed() -> None:
    import optuna

    from optuna_rapidfire.samplers import CloneSampler

    spec = load_search(search(sampler={"name": "CloneSampler", "base_sampler": {"name": "RandomSampler", "seed": 3}}))
    sampler = build_named(spec.sampler, "sampler")
    assert isinstance(sampler, CloneSampler)
    first = [build_named(spec.sampler, "sampler", seed_offset=k) for k in (0, 0, 2)]
    draws = []
    for made in first:
        study = optuna.create_study(sampler=made)
        draws.append(study.ask({"x": FloatDistribution(0, 1)}).params["x"])
    assert draws[0] == draws[1] != draws[2]
    patient = load_search(search(pruner={"name": "PatientPruner", "wrapped_pruner": "MedianPruner", "patience": 1}))
    assert isinstance(build_named(patient.pruner, "pruner"), optuna.pruners.PatientPruner)


def test_the_budget_counts_each_finished_trial_once() -> None:
    import optuna

    storage = optuna.storages.InMemoryStorage()
    study = optuna.create_study(storage=storage, study_name="count")
    assert trials_in_study(storage, "count") == 0 and trials_in_study(storage, "other") == 0
    for value in (1.0, 2.0):
        study.add_trial(optuna.trial.create_trial(value=value))
    assert trials_left(study, 5) == 3 and trials_left(study, 2) == 0 and trials_left(study, None) is None
    # A FAIL trial that Optuna retried counts through its retry; an interrupted trial through its continuation.
    study.add_trial(optuna.trial.create_trial(state=optuna.trial.TrialState.FAIL))
    study.add_trial(optuna.trial.create_trial(state=optuna.trial.TrialState.WAITING, system_attrs={"failed_trial": 2}))
    study.add_trial(optuna.trial.create_trial(state=optuna.trial.TrialState.PRUNED))
    study.set_user_attr("rapidfire:tune:continued", {"4": 5})
    assert trials_left(study, 5) == 3


def test_data_comes_from_local_files_saved_folders_and_the_bundled_set(tmp_path: Path) -> None:
    from datasets import Dataset, DatasetDict

    from optuna_rapidfire._tune._inputs import load_data

    rows = [{"question": f"q{i}", "answer": f"a{i}"} for i in range(5)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    Dataset.from_list(rows).to_csv(str(tmp_path / "train.csv"))
    DatasetDict({"train": Dataset.from_list(rows), "test": Dataset.from_list(rows[:2])}).save_to_disk(tmp_path / "dd")
    columns = {"question": "prompt", "answer": "completion"}
    for name in ("train.jsonl", "train.csv"):
        spec = load_search(search(data__train={"path": str(tmp_path / name), "rows": 3, "columns": columns}))
        loaded = load_data(spec.train, "sft", "data.train")
        assert loaded.column_names == ["prompt", "completion"] and loaded["prompt"] == ["q0", "q1", "q2"]
    spec = load_search(search(data__eval={"path": str(tmp_path / "dd"), "split": "test"}))
    assert len(load_data(spec.eval, "sft", "data.eval")) == 2
    with pytest.raises(ValueError, match=r"^data.eval.split must be one of train, test"):
        load_data(load_search(search(data__eval={"path": str(tmp_path / "dd")})).eval, "sft", "data.eval")
    with pytest.raises(ValueError, match=r"^data.train.columns: no column query"):
        bad = load_search(search(data__train={"path": str(tmp_path / "train.jsonl"), "columns": {"query": "prompt"}}))
        load_data(bad.train, "sft", "data.train")
    demo = load_search(search(trainer="dpo", space={"training.beta": {"type": "float", "low": 0.1, "high": 0.2}}))
    assert load_data(demo.train, "dpo", "data.train").column_names == ["prompt", "chosen", "rejected"]


def test_grpo_rewards_are_built_in_imported_from_the_working_directory_or_reward_models(tmp_path, monkeypatch) -> None:
    from optuna_rapidfire._tune._inputs import reward_funcs
    from optuna_rapidfire.demo import gsm8k_reward

    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "my_rewards.py").write_text("def short(completions, **kwargs):\n    return [0.0] * len(completions)\n")
    space = {"training.beta": {"type": "float", "low": 0.0, "high": 0.1}}
    spec = load_search(search(trainer="grpo", space=space, rewards=["gsm8k", "my_rewards:short", "org/reward-model"]))
    built = reward_funcs(spec)
    assert built[0] is gsm8k_reward and built[1].__name__ == "short" and built[2] == "org/reward-model"
    with pytest.raises(ValueError, match=r"^rewards\[0\]: 'my_rewards' has no function 'long'"):
        reward_funcs(load_search(search(trainer="grpo", space=space, rewards=["my_rewards:long"])))
    with pytest.raises(ValueError, match=r"^rewards\[0\]: cannot import 'no_such_module'"):
        reward_funcs(load_search(search(trainer="grpo", space=space, rewards=["no_such_module:f"])))
