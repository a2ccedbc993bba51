"""The tuning step end to end: the example searches (shrunk to the tiny local model), what a run writes, running
it again, exit codes, --merge, MLflow and a real Metaflow pipeline around it.

Each example search is the file as written with only sizes changed (the model id becomes the tiny model's
path, rows, chunks and trials shrink, the output goes to a temporary folder), written back to a YAML file and
run through that file, so the tests read the searches as users do.
"""

from __future__ import annotations

import _thread
import contextlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from _numerics import assert_within_rounding, forward_terms
from _servers import mlflow_server
from helpers import run_python
from optuna.trial import TrialState

import optuna_rapidfire
from optuna_rapidfire import cli

ROOT = Path(__file__).resolve().parents[2]
DEVICE = os.environ.get("RAPIDFIRE_TEST_DEVICE", "cpu")


def shrunk(name: str, tiny_model: str, output: Path, n_trials: int = 2) -> dict[str, Any]:
    """``examples/search_<name>.yaml`` sized for a test (every key it changes must be in the file)."""
    search = yaml.safe_load((ROOT / "examples" / f"search_{name}.yaml").read_text())
    assert search["model"] == "tiny", "update this test with the example's model"
    search["model"] = tiny_model  # the suite's own tiny model (the built-in is built in a test below)
    for split, rows in (("train", 32), ("eval", 8)):
        assert "rows" in search["data"][split]
        search["data"][split]["rows"] = rows
    search["budget"] = {"n_trials": n_trials}
    assert {"num_chunks", "max_concurrent_trials"} <= set(search["executor"])
    search["executor"].update(num_chunks=2, max_concurrent_trials=2, devices=DEVICE, show_progress_bar=False)
    training = search["training"]
    if name == "grpo":
        for key, value in {
            "num_generations": 2,
            "per_device_train_batch_size": 4,
            "per_device_eval_batch_size": 4,
        }.items():
            assert key in training
            training[key] = value
        training.update(num_generations_eval=2, max_completion_length=8)
    else:
        assert "max_length" in training
        training.update(max_length=128, per_device_train_batch_size=4)
    search["output"] = str(output)
    search["schedule"] = "promote_all"  # every trial trains to the end (the default stops what ASHA would not promote)
    return search


def write(search: dict[str, Any], path: Path) -> Path:
    path.write_text(yaml.safe_dump(search))
    return path


@pytest.fixture(scope="module")
def sft_run(
    tiny_model: str, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, optuna_rapidfire._tune.TuneResult]:
    """The SFT example, run once with --merge (the tests below read it; the last one runs it again)."""
    folder = tmp_path_factory.mktemp("sft")
    path = write(shrunk("sft", tiny_model, folder / "out"), folder / "search_sft.yaml")
    return path, optuna_rapidfire.tune(path, merge=True)


def test_a_run_writes_the_summary_the_report_the_plot_and_the_best_adapter(sft_run) -> None:
    path, result = sft_run
    output = path.parent / "out"
    summary = json.loads((output / "summary.json").read_text())
    assert summary == result.summary
    assert summary["status"] == "ok" and summary["error"] is None and summary["format"] == 1
    assert (summary["study_name"], summary["trainer"], summary["metric"]) == ("gsm8k-sft", "sft", "eval_loss")
    study = result.study
    assert [t["number"] for t in summary["trials"]] == [t.number for t in study.trials] == [0, 1]
    for entry, trial in zip(summary["trials"], study.trials, strict=True):
        assert entry["state"] == trial.state.name == "COMPLETE"
        assert (entry["chunks_done"], entry["total_chunks"]) == (2, 2)
        assert entry["curve"] == [trial.intermediate_values[0], trial.intermediate_values[1]]
        assert entry["value"] == trial.value and entry["params"] == trial.params and entry["seconds"] > 0
        assert set(entry["params"]) == {"training.learning_rate", "training.weight_decay", "lora.r"}
    best = summary["best"]
    assert best["number"] == study.best_trial.number and best["value"] == study.best_value
    assert best["params"] == result.best_params == study.best_params
    assert best["adapter_path"] == str(output / "best_adapter") == str(result.best_adapter)
    assert (output / "best_adapter" / "adapter_model.safetensors").is_file()
    assert best["merged_path"] == str(output / "best_merged")
    import hashlib

    assert summary["search"] == {"path": str(path.resolve()), "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    assert {"python", "torch", "transformers", "peft", "trl", "optuna", "optuna-rapidfire"} <= set(summary["versions"])
    assert summary["times"]["seconds"] > 0 and summary["trials_run_now"] == 2
    report = (output / "report.md").read_text()
    assert "# Tuning step: gsm8k-sft" in report and f"best trial {best['number']}" in report
    assert "![eval_loss after each chunk](curves.png)" in report and "| 1 | COMPLETE | 2/2 |" in report
    assert (output / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_merged_model_computes_what_base_and_adapter_compute(sft_run, tiny_model: str) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, result = sft_run
    assert result.merged is not None
    merged = AutoModelForCausalLM.from_pretrained(result.merged).eval()
    with_adapter = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_model), result.best_adapter
    ).eval()
    assert not any("lora" in name for name, _ in merged.named_parameters())
    tokenizer = AutoTokenizer.from_pretrained(result.merged)
    batch = tokenizer(["Question: 3 apples and 2 more?\nAnswer: 5"], return_tensors="pt")
    with torch.no_grad():
        expected, actual = with_adapter(**batch).logits, merged(**batch).logits
        with with_adapter.disable_adapter():
            base = with_adapter(**batch).logits
    assert not torch.equal(expected, base)  # the adapter does something
    # Merging folds scale * B @ A into each adapted weight: one more sum over the rank and the width per layer.
    config = merged.config
    rank = result.best_params["lora.r"]
    extra = config.num_hidden_layers * (config.hidden_size + rank)
    length = batch["input_ids"].shape[1]
    assert_within_rounding(actual, expected, terms=forward_terms(config, length=length) + extra, what="logits")


def test_bad_input_exits_2_with_one_line_before_anything_is_written(
    tmp_path: Path, tiny_model: str, capsys, monkeypatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    search = shrunk("sft", tiny_model, tmp_path / "out", n_trials=1)

    def refused(change: dict[str, Any], message: str) -> None:
        bad = {**search, **change}
        assert cli.main(["tune", str(write(bad, tmp_path / "bad.yaml"))]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
        assert not (tmp_path / "out").exists()  # refused before any work: no study, no summary

    refused({"space": {**search["space"], "lora.r": {"type": "choice", "choices": [4]}}}, "space.lora.r.type must be")
    empty = tmp_path / "empty_model"
    empty.mkdir()
    refused({"model": str(empty)}, f"model: the folder {empty} has no config.json")
    # A relative path that looks like a hub id: not a folder here, not in the cache, and the hub is not asked.
    refused({"model": "models/tiny"}, "there is no folder")
    refused({"model": "/no/such/model/folder"}, "model: there is no folder /no/such/model/folder")
    # Every trial would fail when its adapter is built: said once, before the model is loaded for real.
    refused(
        {"lora": {**search["lora"], "target_modules": ["query", "value"]}},
        "lora: the adapter of ",
    )
    # What the executor refuses of a trial's TRL config and data, refused before the study exists.
    refused({"training": {**search["training"], "per_device_train_batch_size": 0}}, "training: no trial could run")
    foo = tmp_path / "foo.jsonl"
    foo.write_text("".join(f'{{"foo": "row {i}"}}\n' for i in range(8)))
    refused(
        {"data": {**search["data"], "train": {"path": str(foo)}}},
        "data: train_dataset has the columns ['foo'], but SFTConfig trials need",
    )
    assert cli.main(["tune", str(tmp_path / "missing.yaml")]) == 2


def test_a_study_whose_first_run_failed_runs_again_after_the_fix(
    tmp_path: Path, tiny_model: str, capsys, rapidfire_logs
) -> None:
    """A first run whose every trial fails (a learning rate that diverges) exits 1, and its failed trial is not
    replaced in that run (no trial has a result); the fixed search runs on the same study: its space and model
    changed, which a study without results takes (one line says so), and the failed trials do not count toward
    the budget."""
    search = shrunk("sft", tiny_model, tmp_path / "out", n_trials=1)
    search["space"] = {"training.learning_rate": {"type": "float", "low": 1.0e4, "high": 1.0e4}}
    assert cli.main(["tune", str(write(search, tmp_path / "search.yaml"))]) == 1
    assert "has no COMPLETE trial" in capsys.readouterr().err
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["status"] == "failed" and [t["state"] for t in summary["trials"]] == ["FAIL"]

    # Optuna keeps a parameter's scale within a study: a log scale now is refused by name, at once.
    search["space"] = {"training.learning_rate": {"type": "float", "low": 1.0e-4, "high": 1.0e-3, "log": True}}
    assert cli.main(["tune", str(write(search, tmp_path / "search.yaml"))]) == 2
    assert "space.training.learning_rate: " in capsys.readouterr().err
    search["space"] = {"training.learning_rate": {"type": "float", "low": 1.0e-4, "high": 1.0e-3}}
    search["model"] = str(shutil.copytree(tiny_model, tmp_path / "other_model"))  # a fixed model path, too
    assert cli.main(["tune", str(write(search, tmp_path / "search.yaml"))]) == 0
    assert "has no COMPLETE or PRUNED trial: its model, space (training.learning_rate) changed" in rapidfire_logs.text
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert [t["state"] for t in summary["trials"]] == ["FAIL", "COMPLETE"]


def test_a_trial_that_fails_is_replaced_within_the_run(tmp_path: Path, tiny_model: str, rapidfire_logs) -> None:
    """Failed trials do not count toward ``n_trials``: a config that diverges (enqueued first) FAILs, and the run
    starts a new config in its place, so the step ends with its two results."""
    import optuna

    search = shrunk("sft", tiny_model, tmp_path / "out", n_trials=2)
    search["space"] = {"training.learning_rate": {"type": "float", "low": 1.0e-4, "high": 1.0e-3}}
    (tmp_path / "out").mkdir()
    study = optuna.create_study(
        storage=f"sqlite:///{tmp_path / 'out' / 'study.db'}", study_name=search["study_name"], direction="minimize"
    )
    study.enqueue_trial({"training.learning_rate": 1.0e4})  # outside the space: Optuna warns and takes it
    assert cli.main(["tune", str(write(search, tmp_path / "search.yaml"))]) == 0
    assert "1 trial(s) failed; running 1 new config(s) in their place" in rapidfire_logs.text
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert [t["state"] for t in summary["trials"]] == ["FAIL", "COMPLETE", "COMPLETE"]


@pytest.fixture(scope="module")
def user_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache folder for ``model: tiny`` (built there once for the module, as in a user's ~/.cache)."""
    return tmp_path_factory.mktemp("cache")


@pytest.mark.parametrize("name", ["sft", "dpo", "grpo"])
def test_every_example_search_runs_offline_on_a_cpu_as_shipped(
    name: str, tmp_path: Path, user_cache: Path, monkeypatch, capsys
) -> None:
    """The example as a user runs it (`optuna-rapidfire tune examples/search_<name>.yaml`), from a folder of its
    own: the built-in tiny model, no hub, the CPU, the shipped sizes."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(user_cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["tune", str(ROOT / "examples" / f"search_{name}.yaml")]) == 0
    assert "best adapter: " in capsys.readouterr().out
    summary = json.loads((tmp_path / f"tune-gsm8k-{name}" / "summary.json").read_text())
    shipped = yaml.safe_load((ROOT / "examples" / f"search_{name}.yaml").read_text())
    assert summary["trainer"] == name and summary["status"] == "ok"
    assert len(summary["trials"]) == shipped["budget"]["n_trials"] and "COMPLETE" in summary["counts"]
    assert summary["metric"] == ("eval_reward" if name == "grpo" else "eval_loss")
    assert (user_cache / "optuna-rapidfire" / "tiny-model" / "config.json").is_file()


def test_a_budget_of_time_alone_runs_the_first_wave_then_finishes(tiny_model: str, tmp_path: Path) -> None:
    search = shrunk("dpo", tiny_model, tmp_path / "out")
    search["budget"] = {"timeout": 1}  # trials start for 1 s (the first wave at once), then finish
    result = optuna_rapidfire.tune(write(search, tmp_path / "search_dpo.yaml"))
    summary = result.summary
    assert summary["trainer"] == "dpo" and summary["status"] == "ok"
    # every trial started has ended: COMPLETE, or PRUNED where the example's MedianPruner saw a peer do better at
    # the same chunk (which trial that is depends on timing; CI once pruned one)
    assert "COMPLETE" in summary["counts"] and set(summary["counts"]) <= {"COMPLETE", "PRUNED"}
    assert summary["trials_run_now"] == len(summary["trials"]) >= 2
    assert summary["direction"] == "minimize" and (result.best_adapter / "adapter_config.json").is_file()


def test_the_best_adapter_is_an_artifact_of_the_studys_mlflow_run(tiny_model: str, tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    with mlflow_server(tmp_path / "mlflow") as url:
        search = shrunk("sft", tiny_model, tmp_path / "out", n_trials=1)
        search["mlflow_tracking_uri"] = url
        result = optuna_rapidfire.tune(search)
        client = MlflowClient(tracking_uri=url)
        experiment = client.get_experiment_by_name("gsm8k-sft")
        assert experiment is not None
        parents = [
            r for r in client.search_runs([experiment.experiment_id]) if r.data.tags.get("rapidfire.role") == "study"
        ]
        assert len(parents) == 1
        run = parents[0]
        assert result.summary["mlflow"] == {"run_id": run.info.run_id, "artifact_path": "best_adapter"}
        assert run.data.tags["rapidfire.best_trial"] == str(result.summary["best"]["number"])
        artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "best_adapter")}
        assert {"best_adapter/adapter_config.json", "best_adapter/adapter_model.safetensors"} <= artifacts
        assert "tune/summary.json" in {a.path for a in client.list_artifacts(run.info.run_id, "tune")}


def test_an_interrupted_step_run_again_continues_its_trials(
    tiny_model: str, tmp_path: Path, slow_chunks, sigint_handled
) -> None:
    database = tmp_path / "out" / "study.db"
    sent = threading.Event()
    # Once a chunk is reported, the next ones wait for the interrupt: a busy machine's test thread is never
    # overtaken by the trials.
    slow_chunks(0.1, hold=lambda: not sent.is_set() and _reported(database))
    search = shrunk("sft", tiny_model, tmp_path / "out")
    search["schedule"] = "lockstep"

    def interrupt_after_the_first_chunk() -> None:
        _first_chunk_reported(database)
        _thread.interrupt_main()  # as Ctrl-C (the CLI turns SIGTERM into the same)
        sent.set()

    threading.Thread(target=interrupt_after_the_first_chunk, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        optuna_rapidfire.tune(search)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["status"] == "interrupted"
    interrupted = [t for t in summary["trials"] if t["status"] == "interrupted"]
    assert interrupted and all(t["state"] == "PRUNED" and t["chunks_done"] == 1 for t in interrupted)

    result = optuna_rapidfire.tune(search)
    trials = {t.number: t for t in result.study.trials}
    continued = result.study.user_attrs["rapidfire:tune:continued"]
    assert sorted(int(n) for n in continued) == [t["number"] for t in interrupted]
    for parent, child in continued.items():
        clone = trials[child]
        assert clone.state == TrialState.COMPLETE and clone.user_attrs["rapidfire:parent"] == int(parent)
        assert clone.intermediate_values[0] == trials[int(parent)].intermediate_values[0]  # its curve goes on
        assert result.summary["trials"][int(parent)]["continued_by"] == child
    finished = [t for t in trials.values() if t.state.is_finished() and str(t.number) not in continued]
    assert len(finished) == 2 and result.summary["status"] == "ok"


def test_a_sigterm_ends_the_step_as_ctrl_c_does_and_says_sigterm(tiny_model: str, tmp_path: Path) -> None:
    search = shrunk("sft", tiny_model, tmp_path / "out")
    search["schedule"] = "lockstep"
    search["training"]["num_train_epochs"] = 20  # it runs until the signal comes
    path = write(search, tmp_path / "search.yaml")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "optuna_rapidfire", "tune", str(path)]
    step = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        _first_chunk_reported(tmp_path / "out" / "study.db")
        step.terminate()  # SIGTERM, as a pipeline's cancel sends
        _, err = step.communicate(timeout=300)
    finally:
        step.kill()
    assert step.returncode == 130, err
    assert "Interrupted (SIGTERM): no new trial or chunk starts" in err and "Ctrl-C" not in err.split("SIGTERM", 1)[0]
    assert "the tuning step was interrupted (SIGTERM); run it again to go on." in err
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    reasons = [t["reason"] for t in summary["trials"] if t["status"] == "interrupted"]
    assert reasons and all(reason.startswith("Interrupted (SIGTERM)") for reason in reasons), reasons


def _reported(database: Path) -> bool:
    """Whether the study in ``database`` holds a reported chunk (read with sqlite3: opening the study through
    Optuna would race the step at creating its tables)."""
    try:
        with contextlib.closing(sqlite3.connect(database)) as connection:
            return bool(connection.execute("SELECT COUNT(*) FROM trial_intermediate_values").fetchone()[0])
    except sqlite3.Error:  # no database or no tables yet
        return False


def _first_chunk_reported(database: Path, timeout: float = 300) -> None:
    """Wait until the study in ``database`` holds a reported chunk."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _reported(database):
            return
        time.sleep(0.05)
    raise AssertionError("no chunk was reported")


def test_a_killed_step_run_again_retries_its_trials_from_their_checkpoints(tiny_model: str, tmp_path: Path) -> None:
    script = "import sys, optuna_rapidfire\noptuna_rapidfire.tune(sys.argv[1])\n"
    search = shrunk("sft", tiny_model, tmp_path / "out")
    search["schedule"] = "lockstep"
    search["heartbeat_interval"] = 1  # a 2 s grace period instead of 20 s, in the killed run and the next
    path = write(search, tmp_path / "search.yaml")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    process = subprocess.Popen([sys.executable, "-c", script, str(path)], cwd=tmp_path, env=env)
    try:
        _first_chunk_reported(tmp_path / "out" / "study.db")
    finally:
        process.kill()  # as a lost node or an out-of-memory kill: nothing is cleaned up
        process.wait()

    result = optuna_rapidfire.tune(path)
    trials = {t.number: t for t in result.study.trials}
    killed = [n for n, t in trials.items() if t.state == TrialState.FAIL]
    assert killed and all("HeartbeatStale" in trials[n].user_attrs["rapidfire:fail_reason"] for n in killed)
    for number in killed:
        retry = trials[result.summary["trials"][number]["continued_by"]]
        assert retry.state == TrialState.COMPLETE
        if trials[number].intermediate_values:  # it had reported a chunk: the retry went on from its checkpoint
            assert retry.user_attrs["rapidfire:retry_of"] == number
            assert retry.user_attrs["rapidfire:resumed_from_step"] == 1
            assert retry.intermediate_values[0] == trials[number].intermediate_values[0]
    assert any(trials[n].intermediate_values for n in killed)
    assert result.summary["counts"].get("COMPLETE") == 2 and result.summary["status"] == "ok"


def test_running_the_step_again_continues_the_study(sft_run, capsys) -> None:
    """After the tests above: the same budget runs nothing (here through the command), a larger one only the
    missing trials, and a changed space is refused."""
    path, first = sft_run
    search = yaml.safe_load(path.read_text())
    assert cli.main(["tune", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"best adapter: {first.best_adapter}" in out and f"summary: {first.summary_path}" in out
    again = json.loads(first.summary_path.read_text())
    assert len(again["trials"]) == 2 and again["trials_run_now"] == 0
    assert again["best"]["number"] == first.summary["best"]["number"]

    search["budget"]["n_trials"] = 3
    more = optuna_rapidfire.tune(write(search, path))
    # One more trial runs (the example's MedianPruner may prune it against the first two).
    assert len(more.study.trials) == 3 and more.summary["trials_run_now"] == 1
    assert more.study.trials[2].state in (TrialState.COMPLETE, TrialState.PRUNED)
    assert more.study.trials[2].params != more.study.trials[0].params  # the seeded sampler did not start over
    assert more.summary["search"]["sha256"] != first.summary["search"]["sha256"]

    search["space"]["training.learning_rate"]["high"] *= 2
    with pytest.raises(ValueError, match=r"was run with another space \(training.learning_rate\)"):
        optuna_rapidfire.tune(write(search, path))


def test_a_metaflow_pipeline_tunes_then_loads_the_best_adapter(tiny_model: str, tmp_path: Path, monkeypatch) -> None:
    search = write(shrunk("sft", tiny_model, tmp_path / "out"), tmp_path / "search.yaml")
    monkeypatch.setenv("METAFLOW_USER", "ci")  # Metaflow names a run's user; CI's environment may have none
    flow = str(ROOT / "examples" / "pipeline_metaflow.py")
    out = run_python([flow, "--no-pylint", "run", "--search", str(search)], tmp_path, timeout=600).stdout
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert f"best trial {summary['best']['number']}: value {summary['best']['value']}" in out
    assert f"loaded the best adapter from {tmp_path / 'out' / 'best_adapter'} (default)" in out
