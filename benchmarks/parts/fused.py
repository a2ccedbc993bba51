"""The fused part: the fused engine against time slicing, against one adapter at saturation (issue 7), with
mixed gangs, over a whole study and against plain-TRL processes sharing the GPU (issue 14), compiled once per
gang layout, on three model shapes, with its GPU busy share (issue 19).

Every executor configuration is a real study through the executor (chunks, per-chunk eval and reports);
tokens/s count training only, over each trial's chunks after its first (the first holds the compilation). The
``processes_*`` runs are one plain-TRL process per trial (:mod:`benchmarks.parts.processes`), eager or with
TRL's ``torch_compile=True`` (compilation inside their wall). Ratios and the report: :mod:`.fused_summary`;
the profiled runs: :mod:`.fused_profile`.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import optuna
from peft import LoraConfig
from trl import SFTConfig

from benchmarks.harness.bench import Bench
from benchmarks.harness.hooks import PASS_TOKENS, Recorder
from benchmarks.harness.measure import drop, peak_memory_gb, reset_peak
from benchmarks.harness.models import configure_dpo, configure_from_params, configure_mixed, mixed_params
from benchmarks.parts.fused_profile import profile_busy, profile_operators
from benchmarks.parts.fused_summary import ratios
from benchmarks.parts.processes import run_processes


class FusedRun(NamedTuple):
    """One run of the fused part."""

    label: str
    engine: str  # "time_sliced", "fused", or "processes": one plain-TRL process per trial
    trials: int
    batch: int  # per trial
    examples: int  # GSM8K examples per trial
    kind: str = "sft"  # "sft" (LoRA r16 on q, k, v, o), "mixed" (mixed_params), "dpo"
    chunks: int = 4
    shape: str | None = None  # the part's shape unless given
    compiled: bool = False  # processes: TRL's torch_compile=True (executor runs compile on a GPU by default)
    busy: bool = False  # fused: then profile two chunks of the same trials for the GPU busy share


def planned_runs(shape: str, smoke: bool) -> list[FusedRun]:
    """Every run of the part, in the order they run (``--smoke``: 32 examples, gangs of 3)."""
    k = 8 if not smoke else 3
    small, large = ("search-82m", "llama-3.1-8b") if not smoke else ("tiny", "tiny")
    fit = 4 if not smoke else 2  # plain-TRL processes of the 8B shape that fit on one H200 (8 do not)
    configs = [
        FusedRun("ceiling_bs32", "time_sliced", 1, 32, 2048),
        FusedRun("ceiling_bs32_compiled", "fused", 1, 32, 2048),
        FusedRun(f"fused_k{k}_bs2", "fused", k, 2, 192),
        # A whole study of 8 mixed trials x 8 chunks (about 18 steps each): its steady rate is the mixed
        # gang's, its whole wall (compilation, builds, 64 evaluations, reports) the study's.
        # Then two of its chunks again under torch's profiler (the layout compiled): the GPU busy share.
        FusedRun(f"fused_mixed_k{k}_bs2", "fused", k, 2, 768, "mixed", chunks=8, busy=True),
        FusedRun(f"processes_mixed_k{k}_bs2", "processes", k, 2, 192, "mixed"),
        FusedRun(f"processes_compiled_mixed_k{k}_bs2", "processes", k, 2, 192, "mixed", compiled=True),
        FusedRun(f"processes_k{k}_bs2", "processes", k, 2, 192),
        FusedRun(f"processes_compiled_k{k}_bs2", "processes", k, 2, 192, compiled=True),
        FusedRun(f"fused_mixed_k{k}_bs2_82m", "fused", k, 2, 192, "mixed", shape=small),
        FusedRun(f"processes_mixed_k{k}_bs2_82m", "processes", k, 2, 192, "mixed", shape=small),
        FusedRun(f"processes_compiled_mixed_k{k}_bs2_82m", "processes", k, 2, 192, "mixed", shape=small, compiled=True),
        FusedRun(f"fused_k{k}_bs2_8b", "fused", k, 2, 192, shape=large),
        FusedRun(f"fused_mixed_k{k}_bs2_8b", "fused", k, 2, 192, "mixed", shape=large),
        FusedRun(f"processes_mixed_k{fit}_bs2_8b", "processes", fit, 2, 192, "mixed", shape=large),
        FusedRun(f"time_sliced_k{k}_bs2", "time_sliced", k, 2, 192),
        FusedRun(f"time_sliced_mixed_k{k}_bs2", "time_sliced", k, 2, 192, "mixed"),
        FusedRun(f"same_rows_bs{2 * k}", "time_sliced", 1, 2 * k, 1024),
        FusedRun("time_sliced_k4_bs16", "time_sliced", 4, 16, 1024),
        FusedRun("fused_k4_bs16", "fused", 4, 16, 1024),
        FusedRun("time_sliced_k2_bs32", "time_sliced", 2, 32, 1024),
        FusedRun("fused_k2_bs32", "fused", 2, 32, 1024),
        FusedRun(f"dpo_time_sliced_k{k}_bs2", "time_sliced", k, 2, 96, "dpo"),
        FusedRun(f"dpo_fused_k{k}_bs2", "fused", k, 2, 96, "dpo"),
    ]
    if smoke:
        configs = [c._replace(examples=32) for c in configs]
    return configs


def run(bench: Bench, shapes: list[str], save: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """The runs asked for (``--fused-runs``, default all) on the first shape unless a run names its own,
    merged into ``--out/fused.json`` when some are asked for; saved after each run."""
    shape = shapes[0]
    k = 8 if not bench.smoke else 3
    configs = planned_runs(shape, bench.smoke)
    options = bench.options
    if options.fused_runs:  # measure only these, keeping the other runs of --out/fused.json
        wanted = options.fused_runs.split(",")
        unknown = sorted(set(wanted) - {c.label for c in configs})
        if unknown:
            raise SystemExit(f"unknown fused runs {unknown}: choose among {', '.join(c.label for c in configs)}")
        configs = [c for c in configs if c.label in wanted]
    result: dict[str, Any] = {"model": shape, "pass_tokens": PASS_TOKENS, "num_chunks": 4, "runs": {}}
    reported: dict[str, list[dict[int, float]]] = {}
    earlier = Path(options.out) / "fused.json"
    if options.fused_runs and earlier.exists():
        kept = json.loads(earlier.read_text())
        result["runs"] = kept.get("runs", {})
        reported = kept.get("reported", {})
        for key in ("per_chunk_values_max_relative_difference", "profiles"):
            result[key] = kept.get(key, {})
    for spec in configs:
        run_shape = spec.shape or shape
        params = [_trial_params(spec.kind, i) for i in range(spec.trials)]
        if spec.engine == "processes":
            measured = run_processes(
                run_shape, bench.tokenizer_dir, params, spec.batch, spec.examples, compiled=spec.compiled
            )
            result["runs"][spec.label] = {
                **measured,
                "kind": spec.kind,
                "examples": spec.examples,
                "model": run_shape,
                "compiled": spec.compiled,
            }
            print(f"fused part, {spec.label}: {measured['tokens_per_second']:.0f} tokens/s", flush=True)
            save(result)
            continue
        configure = {"sft": configure_from_params, "mixed": configure_mixed, "dpo": configure_dpo}[spec.kind]
        executor = bench.executor(
            run_shape,
            spec.examples,
            spec.chunks,
            spec.trials,
            engine=spec.engine,
            data="preference" if spec.kind == "dpo" else "text",
            # Every trial trains every chunk, as the processes it is compared with do: under "promote" trials
            # wait at rungs and the gangs shrink, which would measure the schedule, not the shared pass.
            schedule="lockstep",
        )
        study = optuna.create_study(pruner=optuna.pruners.NopPruner())
        for trial_params in params:
            study.enqueue_trial(trial_params)
        executor.objective(configure(spec.batch))  # loads the model
        reset_peak()
        with Recorder() as recorder:
            start = time.perf_counter()
            executor.optimize(study, configure(spec.batch), n_trials=spec.trials)
            wall = time.perf_counter() - start
        if options.profile and spec.engine == "fused" and spec.batch == 2 and spec.kind == "sft":
            profile_operators(executor, spec.trials, spec.batch, Path(options.out) / f"{spec.label}_profile.txt")
        stats = executor.stats()
        if spec.busy:  # its first two chunks again, the layout compiled, under the profiler
            partial = functools.partial(_configure_partial, configure=configure(spec.batch), epochs=2 / spec.chunks)
            found = profile_busy(executor, partial, params, f"{spec.label}_busy", bench)
            result.setdefault("profiles", {})[spec.label] = found
            print(f"fused part, {spec.label}: GPU busy {found['busy_share']}", flush=True)
        result["runs"][spec.label] = {
            "engine": spec.engine,
            "kind": spec.kind,
            "model": run_shape,
            "trials": spec.trials,
            "batch": spec.batch,
            "examples": spec.examples,
            "num_chunks": spec.chunks,
            "tokens": recorder.tokens,
            "tokens_per_second": recorder.steady_tokens_per_second(),
            "wall_seconds": wall,
            "wall_tokens_per_second": recorder.tokens / wall,
            "eval_seconds": recorder.eval_seconds,
            "fused_steps": stats.fused_steps if spec.engine == "fused" else None,
            "launched_steps": stats.launched_steps if spec.engine == "fused" else None,
            "compiles": stats.compiles,
            "compile_failures": stats.compile_failures,
            "peak_memory_gb": peak_memory_gb(),
            "failed": sum(t.state != optuna.trial.TrialState.COMPLETE for t in study.trials),
        }
        reported[spec.label] = [
            {int(step): v for step, v in t.intermediate_values.items()}
            for t in sorted(study.trials, key=lambda t: t.number)
        ]
        result["reported"] = reported
        print(f"fused part, {spec.label}: {result['runs'][spec.label]['tokens_per_second']:.0f} tokens/s", flush=True)
        drop(executor)
        save(result)
    ratios(result, k)
    return result


def _trial_params(kind: str, index: int) -> dict[str, Any]:
    """The params trial ``index`` of a fused-part run is enqueued with (and a process trains with)."""
    if kind == "mixed":
        return mixed_params(index)
    return {"learning_rate": 1e-4 * (1 + index), "r": 16}


def _configure_partial(trial: optuna.Trial, configure: Any, epochs: float) -> tuple[LoraConfig, SFTConfig]:
    """``configure``'s trial, trained for ``epochs`` of the data only (the first chunks)."""
    peft_config, args = configure(trial)
    args.num_train_epochs = epochs
    return peft_config, args
