"""The search part's entry: the steps asked for, merged into ``--out/search.json`` and saved after each."""

from __future__ import annotations

import dataclasses
import json
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
from benchmarks.parts.search.calibrate import calibrate_alone, calibrate_processes
from benchmarks.parts.search.executor_runs import executor_run, record
from benchmarks.parts.search.settings import Settings, say
from benchmarks.parts.search.space import BATCHES, TARGETS, sample_configs
from benchmarks.parts.search.trl_runs import warm_up
from benchmarks.parts.search.validate import validate_exhaustive, validate_processes, validate_sequential

STEPS = ("pretrain", "record", "calibrate", "validate", "executor", "replay")
SCHEDULED = {"lockstep": "executor_lockstep", "promote": "executor_promote", "clone": "executor_promote_clone"}


def _settings_record(settings: Settings) -> dict[str, Any]:
    return {
        "comparable": settings.comparable(),
        "values": dataclasses.asdict(settings),
        "pruner": "MedianPruner(n_startup_trials=5, n_warmup_steps=1)",
        "target": "best COMPLETE value <= best final value of the seed's exhaustive sweep x 1.01",
        "search_space": {
            "learning_rate": "log-uniform [1e-5, 3e-3]",
            "r": [8, 16, 32, 64],
            "lora_alpha": "alpha_multiple x r, alpha_multiple in {0.5, 1, 2}",
            "target_modules": TARGETS,
            "lora_dropout": "uniform [0, 0.1]",
            "per_device_train_batch_size": list(BATCHES),
            "warmup_ratio": "uniform [0, 0.1]",
        },
        "data": "bundled GSM8K, prompt-completion; train: the first trial_rows rows (shuffled by the executor's "
        "seed into chunks; plain TRL gets the same order); eval: the first eval_rows test rows",
    }


def _use_base(data: dict[str, Any], base: Path) -> str:
    """The base's fingerprint, refusing a base other than the one the results in ``data`` were measured on."""
    if not (base / "config.json").exists():
        raise SystemExit(f"no base model in {base}: run --search-steps pretrain first (same --out)")
    mark = fingerprint(base)
    known = data.get("pretrain", {}).get("fingerprint")
    if known is not None and known != mark:
        raise SystemExit(
            f"the base model in {base} ({mark}) is not the one the results in --out were measured on ({known}): "
            "a new base means a new benchmark; use another --out"
        )
    return mark


def _has_results(data: dict[str, Any]) -> bool:
    return any(data.get(key) for key in ("records", "calibration", "validation", "executor_runs"))


def run(bench: Bench, shapes: list[str], save: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """The search part: the steps asked for, merged into ``--out/search.json`` (``save`` writes it). Its own
    model (``--search-base``), not ``shapes``."""
    options = bench.options
    settings = Settings.from_options(options)
    datasets.disable_progress_bars()
    path = Path(options.out) / "search.json"
    data: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    if "settings" not in data:
        data = {}  # nothing of this part's yet (or the earlier search part's format, which this replaces)
    if data.get("settings") and data["settings"]["comparable"] != settings.comparable():
        raise SystemExit(
            f"{path} holds results for other settings ({data['settings']['comparable']}): use another --out"
        )
    data["settings"] = _settings_record(settings)
    steps = list(STEPS) if options.search_steps == "all" else options.search_steps.split(",")
    unknown = sorted(set(steps) - set(STEPS))
    methods = options.search_methods.split(",")
    if unknown or set(methods) - set(SCHEDULED):
        raise SystemExit(f"--search-steps: choose among {', '.join(STEPS)}; --search-methods: {', '.join(SCHEDULED)}")
    seeds = [int(s) for s in (options.seeds or ("0,1" if settings.smoke else "0,1,2,3,4")).split(",")]
    default_base = ".bench/search-base-smoke" if settings.smoke else ".bench/search-base"
    base = Path(options.search_base or default_base)
    if set(steps) - {"replay"} or "machine" not in data:
        data["machine"] = machine()
    call = {"command": " ".join([sys.executable, *sys.argv]), "steps": steps, "seeds": seeds, "methods": methods}
    data.setdefault("calls", []).append(call)
    began = time.perf_counter()

    def done(what: str, since: float) -> None:
        finalize(data, settings)
        call["seconds"] = time.perf_counter() - began
        save(data)
        say(f"{what}: {time.perf_counter() - since:.1f} s")

    for step in (s for s in STEPS if s in steps):
        start = time.perf_counter()
        if step == "pretrain":
            reuse = (base / "pretrain.json").exists() and (base / "config.json").exists()
            if not reuse and _has_results(data):
                raise SystemExit(
                    f"no base model in {base}, and {path} holds results measured on another one: a new base means "
                    "a new benchmark; use another --out"
                )
            info = (
                json.loads((base / "pretrain.json").read_text())
                if reuse
                else pretrain(settings, Path(options.corpus or ".bench/corpus"), base)
            )
            data["pretrain"] = {**info, "fingerprint": _use_base(data, base), "reused": reuse}
            done(f"pretrain ({'reused ' + str(base) if reuse else 'trained'})", start)
            continue
        if step == "replay":
            done("replay", start)
            continue
        _use_base(data, base)
        if step == "record":
            for seed in seeds:
                begun = time.perf_counter()
                data.setdefault("records", {})[str(seed)] = record(settings, base, seed)
                done(f"record seed {seed}", begun)
        elif step == "calibrate":
            calibration: dict[str, Any] = {"alone": calibrate_alone(settings, base)}
            data["calibration"] = calibration
            done("calibrate alone", start)
            begun = time.perf_counter()
            calibration["processes"] = calibrate_processes(settings, base)
            done(f"calibrate {settings.processes} processes", begun)
        elif step == "validate":
            validation = data.setdefault("validation", {})
            configs = sample_configs(0, settings.configs)
            record0 = data.get("records", {}).get("0")
            best = configs[0]
            if record0 is not None:
                best = min(zip(configs, record0["trials"], strict=True), key=lambda p: p[1]["values"][-1])[0]
            begun = time.perf_counter()
            validation["exhaustive"] = validate_exhaustive(settings, base, best, 0)
            done("validate (a), one config to the end", begun)
            begun = time.perf_counter()
            validation["sequential"] = validate_sequential(
                settings, base, configs[: settings.validate_sequential_configs], 0
            )
            done(f"validate (b), {settings.validate_sequential_configs} configs", begun)
            begun = time.perf_counter()
            validation["processes"] = validate_processes(settings, base, configs[: settings.processes], 0)
            done(f"validate (c), {settings.processes} processes", begun)
        elif step == "executor":
            warm_up(settings, base)
            for seed in seeds:
                configs = sample_configs(seed, settings.configs)
                for method in methods:
                    begun = time.perf_counter()
                    result = executor_run(settings, base, seed, method, configs)
                    data.setdefault("executor_runs", {}).setdefault(str(seed), {})[SCHEDULED[method]] = result
                    done(f"executor seed {seed} {method}", begun)
    finalize(data, settings)
    call["seconds"] = time.perf_counter() - began
    return data
