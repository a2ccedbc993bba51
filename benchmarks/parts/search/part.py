"""The search part's entry: the base (pretrained, or reused and checked), then per replicate each method asked
for, run for real and merged into ``--out/search.json``, saved as each method ends."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import datasets

from benchmarks.harness.bench import Bench
from benchmarks.harness.environment import machine
from benchmarks.parts.search.aggregate import finalize
from benchmarks.parts.search.base import fingerprint, pretrain
from benchmarks.parts.search.methods import run_method
from benchmarks.parts.search.settings import Settings, say
from benchmarks.parts.search.space import BATCHES, TARGETS, Method, method, sample_configs

DEFAULT_METHODS = "processes_8,executor,processes_4,sequential"
SMOKE_METHODS = "processes_2,executor,sequential,executor_lockstep"


def _settings_record(settings: Settings) -> dict[str, Any]:
    return {
        "comparable": settings.comparable(),
        "values": dataclasses.asdict(settings),
        "pruner": "MedianPruner(n_startup_trials=5, n_warmup_steps=1), asked after every chunk",
        "search_space": {
            "learning_rate": "log-uniform [1e-5, 3e-3]",
            "r": [8, 16, 32, 64],
            "lora_alpha": "alpha_multiple x r, alpha_multiple in {0.5, 1, 2}",
            "target_modules": TARGETS,
            "lora_dropout": "uniform [0, 0.1]",
            "per_device_train_batch_size": list(BATCHES),
            "warmup_ratio": "uniform [0, 0.1]",
        },
        "data": "bundled GSM8K, prompt-completion; train: the first trial_rows rows, shuffled by the replicate's "
        "seed into the executor's chunks (plain TRL visits them in the same order); eval: the first eval_rows test "
        "rows after every chunk",
    }


def _code_label() -> str:
    """The checkout's HEAD (short), with ``+changes`` when its tracked files differ; ``unrecorded`` without git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        changed = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
        )
    except (OSError, subprocess.CalledProcessError):
        return "unrecorded"
    return head.stdout.strip() + ("+changes" if changed.stdout.strip() else "")


def _base(settings: Settings, base: Path, corpus: Path) -> dict[str, Any]:
    """The base model: reused when ``base`` holds one of this recipe, else pretrained (by a fixed recipe, so that
    a rebuild on the same kind of machine gives the same weights: their fingerprint tells)."""
    saved = base / "pretrain.json"
    reuse = saved.exists() and json.loads(saved.read_text()).get("recipe") == settings.pretrain_recipe()
    if reuse:
        info = json.loads(saved.read_text())
        info["fingerprint"] = fingerprint(base)
    else:
        say(f"pretraining the base in {base} ({settings.pretrain_steps} steps)")
        info = pretrain(settings, corpus, base)
        say(f"pretrained: {info['train_seconds']:.1f} s, final train loss {info['final_train_loss']:.2f}")
    return {**info, "reused": reuse}


def _check_bases(replicates: dict[str, Any], seeds: list[int], mark: str) -> None:
    """Refuse, before any work, a replicate measured on other weights: its methods must share one base."""
    for seed in seeds:
        known = replicates.get(str(seed), {}).get("base", mark)
        if known != mark:
            raise SystemExit(
                f"replicate {seed} was measured on a base with weights {known}, but this base has {mark}: the "
                "rebuild was not bit-identical (another GPU kind or library versions?). Run it on its own base "
                "with another --out, or measure other seeds."
            )


def _estimate(replicates: dict[str, Any], chosen: Method, code: str) -> float:
    """Seconds ``chosen`` will likely take with its warm-up: the longest of its runs at this ``code`` in other
    replicates, else of its runs at any code, else the longest of its family measured so far, else 0 (it starts,
    and is stopped at the deadline if it has not ended)."""
    runs = [
        (name, run)
        for r in replicates.values()
        for name, run in r["methods"].items()
        if "seconds_in_call" in run and "error" not in run
    ]
    for pick in (
        lambda name, run: name == chosen.name and run.get("code") == code,
        lambda name, run: name == chosen.name,
        lambda name, run: method(name).family == chosen.family,
    ):
        found = [run["seconds_in_call"] for name, run in runs if pick(name, run)]
        if found:
            return float(max(found))
    return 0.0


def run(bench: Bench, shapes: list[str], save: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """The search part (its own model, ``--search-base``, not ``shapes``); ``save`` writes ``search.json``."""
    options = bench.options
    settings = Settings.from_options(options)
    methods = [
        method(name)
        for name in (options.search_methods or (SMOKE_METHODS if settings.smoke else DEFAULT_METHODS)).split(",")
    ]
    seeds = [int(s) for s in (options.seeds or ("0" if settings.smoke else "0,1")).split(",")]
    datasets.disable_progress_bars()
    path = Path(options.out) / "search.json"
    data: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    if "replicates" not in data:
        data = {}  # nothing of this part's yet (or an earlier search part's format, which this replaces)
    if data and data["settings"]["comparable"] != settings.comparable():
        raise SystemExit(
            f"{path} holds results for other settings ({data['settings']['comparable']}): use another --out"
        )
    base = Path(options.search_base or (".bench/search-base-smoke" if settings.smoke else ".bench/search-base"))
    data["settings"] = _settings_record(settings)
    data["machine"] = machine()
    call: dict[str, Any] = {"command": " ".join([sys.executable, *sys.argv]), "seeds": seeds}
    call["code"] = code = options.code or _code_label()
    call |= {"methods": [m.name for m in methods], "machine": data["machine"]}
    data.setdefault("calls", []).append(call)
    began = time.perf_counter()
    deadline = options.search_deadline or math.inf
    info = _base(settings, base, Path(options.corpus or ".bench/corpus"))
    mark = info["fingerprint"]
    replicates = data.setdefault("replicates", {})
    _check_bases(replicates, seeds, mark)
    data.setdefault("bases", {})[mark] = info
    call["base"], call["base_seconds"] = mark, time.perf_counter() - began
    for seed in seeds:
        configs = sample_configs(seed, settings.configs)
        replicate = replicates.setdefault(str(seed), {"configs": configs, "base": mark, "methods": {}})
        for chosen in methods:
            start = time.perf_counter()
            left = deadline - (start - began)
            if left < _estimate(replicates, chosen, code):
                say(f"replicate {seed}: {chosen.name} skipped: {left:.0f} s left before --search-deadline")
                call.setdefault("skipped", []).append([seed, chosen.name])
                continue
            say(f"replicate {seed}: {chosen.label} ...")
            try:
                run = run_method(chosen, settings, base, seed, replicate["configs"], timeout=left)
            except RuntimeError as error:  # one method's failure (its log in the message) costs that method only
                run = {"error": str(error)[-4000:]}
                say(f"replicate {seed}: {chosen.name} failed: {str(error)[-2000:]}")
            run["seconds_in_call"] = time.perf_counter() - start
            run["code"] = code
            replicate["methods"][chosen.name] = run
            finalize(data)
            call["seconds"] = time.perf_counter() - began
            save(data)
            if "error" not in run:
                result = replicate["results"][chosen.name]
                say(
                    f"replicate {seed}: {chosen.name}: wall {run['wall']:.1f} s, time to target "
                    f"{result['time_to_target']}, chunks {run['chunks']}, states {run['states']} "
                    f"({run['seconds_in_call']:.0f} s with warm-up)"
                )
    finalize(data)
    call["seconds"] = time.perf_counter() - began
    return data
