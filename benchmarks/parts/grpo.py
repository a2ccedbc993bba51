"""The grpo part (issue 15): GRPO trials fused against time-sliced, and the gang's decodes against the ceiling.

    CUDA_VISIBLE_DEVICES=0 python -m benchmarks.run --parts grpo --out benchmarks/results
    python -m benchmarks.run --parts grpo --smoke --out /tmp/bench      # CPU dry run, tiny sizes

Runs, in this order (``--grpo-runs`` measures some of them and merges them into ``--out/grpo.json``):

- ``grpo_fused_k8`` and ``grpo_time_sliced_k8``: one real study each through the executor, 8 GRPO trials
  (see :data:`GPU` for the sizes), schedule ``"lockstep"`` on both engines, so that the fused engine's gang
  holds every trial. Wall time is the whole study (trainer builds, generation, rewards, policy steps,
  per-chunk evaluation, which generates too); the model is loaded before the clock starts. Every decode
  the engine runs (``Generation.decode``: a trial alone, or the members of a gang together) is timed with
  the device synchronized before and after, and its generated tokens are counted from the completions
  (:class:`benchmarks.harness.hooks.DecodeLog`).
- ``decode_ceiling``: a fresh model of the same shape with one LoRA adapter (r16), and one call of
  :func:`~optuna_rapidfire._fused._fused_decode.decode` with ONE request holding the rows of one of the
  gang's decodes (trials x completions per step: GSM8K train prompts, tokenized as TRL does, each
  repeated per generation), with the trials' sampling settings (TRL's defaults: temperature 1, no top-k or
  top-p) and precision: once to warm up, then timed :data:`CEILING_REPEATS` times (median).

The model has random weights, so it almost never samples EOS: completions run to ``max_completion_length``
(a trained model's would often stop sooner) and the rewards, hence the advantages, are about 0; a step's
work does not depend on the rewards. The ceiling's prompts are the first train prompts; the gang's are
each trial's own shuffled ones: both record the widest prompt of their decodes (``prompt_width``).

The two studies then run again, in turns (fused, time-sliced), until each has run ``--grpo-repeats`` times
(default :data:`REPEATS`; 1 with ``--smoke``): the lent hosts and their moments differ by about a second in a
study's wall, so one pair's ratio moves by about 0.3 between calls. ``runs`` keeps each study's first run whole,
``repeats`` every run's wall, decode and gang seconds.

Ratios: ``grpo_fused_over_time_sliced_k8`` = time-sliced wall / fused wall, each the median of its repeats;
``grpo_generation_over_ceiling`` = generated tokens / seconds inside the fused study's decodes that served the
whole gang (its first run), over the ceiling's generated tokens / second.
"""

from __future__ import annotations

import contextlib
import functools
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import optuna
import torch
from peft import LoraConfig, get_peft_model
from trl import GRPOConfig

from benchmarks.harness.bench import Bench
from benchmarks.harness.hooks import DecodeLog, DecodeRequest, decode
from benchmarks.harness.measure import drop, peak_memory_gb, release, reset_peak, sync
from benchmarks.harness.models import build_model, lora, quiet_training
from benchmarks.parts.grpo_processes import run_processes
from optuna_rapidfire import RapidFireExecutor
from optuna_rapidfire.demo import gsm8k_reward, load_gsm8k


@dataclass(frozen=True)
class Sizes:
    """Sizes of the GRPO studies (the same for both engines)."""

    trials: int
    prompts: int  # GSM8K train prompts every trial trains on, once
    num_chunks: int
    eval_prompts: int  # GSM8K test prompts of every evaluation (after each chunk)
    generations: int  # completions per prompt (num_generations, for evaluation too)
    batch: int  # completions per step and per decode (per_device_train_batch_size, eval batch too)
    completion: int  # max_completion_length


GPU = Sizes(trials=8, prompts=64, num_chunks=2, eval_prompts=16, generations=4, batch=16, completion=32)
"""8 trials, each 64 prompts in 2 chunks: 16 decodes of 16 rows (4 prompts x 4 completions) for training
and 4 per evaluation (16 test prompts), up to 32 tokens each; a fused gang's decode holds 128 rows."""
SMOKE = Sizes(trials=3, prompts=8, num_chunks=2, eval_prompts=4, generations=4, batch=8, completion=4)


def warm_up_sizes(sizes: Sizes) -> Sizes:
    """The sizes of the warm-up study each engine runs before the timed ones: the timed studies' trials, one step
    per chunk and a one-decode evaluation, with their rows per decode and completion length, so that each engine's
    warm-up meets the shapes its timed study meets (a trial's alone, time-sliced; the whole gang's, fused: its
    decode steps' attention plans, its members' page-locked snapshot buffers)."""
    prompts = sizes.batch // sizes.generations
    return Sizes(sizes.trials, prompts, 1, prompts, sizes.generations, sizes.batch, sizes.completion)


CEILING_REPEATS = 3
REPEATS = 3
"""Runs of each engine's timed study (the first, then in turns); the ratios take each one's median wall."""
ANCHORS = {
    "decode_ceiling": "one request, one adapter, this project's decode",
    "generate_eager": "stock generate(), no adapter, dynamic cache",
    "generate_static": "stock generate(), no adapter, static cache compiled",
}
KEYS = (
    "grpo_fused_over_time_sliced_k8",
    "grpo_fused_over_parallel_processes",
    "grpo_decode_over_generate",
    "grpo_single_decode_over_generate",
    "grpo_generation_over_ceiling",
)


def params(index: int) -> dict[str, Any]:
    """Trial ``index``'s params: learning rates 1e-5 to 8e-5, KL beta 0 and 0.04 in turn, its own seed."""
    return {"learning_rate": 1e-5 * (1 + index), "beta": (0.0, 0.04)[index % 2], "seed": index}


def grpo_args(learning_rate: float, beta: float, seed: int, sizes: Sizes) -> GRPOConfig:
    return GRPOConfig(
        learning_rate=learning_rate,
        beta=beta,
        num_generations=sizes.generations,
        per_device_train_batch_size=sizes.batch,
        per_device_eval_batch_size=sizes.batch,
        max_completion_length=sizes.completion,
        num_train_epochs=1,
        seed=seed,
        **quiet_training(),
    )


def _configure(trial: optuna.Trial, sizes: Sizes) -> tuple[LoraConfig, GRPOConfig]:
    lr = trial.suggest_float("learning_rate", 1e-6, 1e-3, log=True)
    beta = trial.suggest_categorical("beta", [0.0, 0.04])
    seed = trial.suggest_int("seed", 0, 1000)
    return lora(16), grpo_args(lr, beta, seed, sizes)


def _totals(decodes: list[dict[str, Any]]) -> dict[str, Any]:
    tokens, seconds = sum(d["tokens"] for d in decodes), sum(d["seconds"] for d in decodes)
    return {
        "decodes": len(decodes),
        "rows": sum(d["rows"] for d in decodes),
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_second": tokens / seconds if seconds else None,
    }


def run_study(bench: Bench, shape: str, engine: Literal["fused", "time_sliced"], sizes: Sizes) -> dict[str, Any]:
    """One study of ``sizes.trials`` GRPO trials on ``engine`` (lock-step); whole wall time and every decode."""
    executor = RapidFireExecutor(
        model=bench.factory(shape),
        train_dataset=load_gsm8k("train", num_rows=sizes.prompts, format="prompt_only"),
        eval_dataset=load_gsm8k("test", num_rows=sizes.eval_prompts, format="prompt_only"),
        eval_samples=None,
        reward_funcs=[gsm8k_reward],
        num_chunks=sizes.num_chunks,
        max_concurrent_trials=sizes.trials,
        engine=engine,
        schedule="lockstep",
        output_dir=bench.workdir / "out",
        show_progress_bar=False,
        dashboard_controls=False,
    )
    configure = functools.partial(_configure, sizes=sizes)
    study = optuna.create_study(direction="maximize", pruner=optuna.pruners.NopPruner())
    for index in range(sizes.trials):
        study.enqueue_trial(params(index))
    executor.objective(configure)  # loads the model
    reset_peak()
    with DecodeLog() as log:
        start = time.perf_counter()
        executor.optimize(study, configure, n_trials=sizes.trials)
        wall = time.perf_counter() - start
    stats = executor.stats()
    peak = peak_memory_gb()
    drop(executor)
    decoded = _totals(log.decodes)
    gang = [d for d in log.decodes if d["requests"] == sizes.trials]
    return {
        "engine": engine,
        "trials": sizes.trials,
        "wall_seconds": wall,
        "generated_tokens": decoded["tokens"],
        "generated_tokens_per_second": decoded["tokens"] / wall,  # over the whole study
        "decode_seconds": decoded["seconds"],
        "rest_seconds": wall - decoded["seconds"],  # policy steps, rewards, builds, evaluation's other work
        "decode": decoded,
        "decode_by_phase": {
            phase: _totals([d for d in log.decodes if d["phase"] == phase])
            for phase in sorted({d["phase"] for d in log.decodes})
        },
        "whole_gang_decodes": _totals(gang),  # the decodes that served every trial (fused: the shared ones)
        "engine_decodes": stats.decodes,
        "engine_decoded_requests": stats.decoded_requests,
        "gang_seconds": stats.gang_seconds,  # fused: host time of the members' own code and the shared steps
        # fused: the gangs' policy passes, their scoring passes, those that shared prompts, those that read stacked
        # adapters
        "shared_passes": {
            "policy": stats.fused_steps,
            "scoring": stats.scoring_passes,
            "prefix_shared": stats.prefix_passes,
            "stacked": stats.stacked_passes,
        },
        "decode_settings": log.settings,
        "decodes": log.decodes,
        "peak_memory_gb": peak,
        "failed": sum(t.state != optuna.trial.TrialState.COMPLETE for t in study.trials),
        "values": [dict(t.intermediate_values) for t in sorted(study.trials, key=lambda t: t.number)],
    }


def anchor_rows(tokenizer: Any, sizes: Sizes) -> tuple[list[list[int]], dict[str, Any], tuple[int]]:
    """The rows of one gang decode (trials x completions per step: the first train prompts, tokenized as
    TRL does, each repeated per generation), the trials' sampling settings (TRL's defaults) and the EOS."""
    per_decode = sizes.batch // sizes.generations  # prompts of one trial's decode
    texts = list(load_gsm8k("train", num_rows=sizes.trials * per_decode, format="prompt_only")["prompt"])
    rows = [ids for ids in tokenizer(text=texts)["input_ids"] for _ in range(sizes.generations)]
    args = grpo_args(1e-5, 0.0, 0, sizes)
    settings: dict[str, Any] = {
        "max_new_tokens": args.max_completion_length,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "min_p": args.min_p,
        "repetition_penalty": args.repetition_penalty,
        "do_sample": True,
    }
    return rows, settings, (int(tokenizer.eos_token_id),)


def _timed(call: Callable[[], int], warm_ups: int = 1) -> dict[str, Any]:
    """``call`` (which returns the tokens it generated) run ``warm_ups`` times, then timed CEILING_REPEATS
    times, the device synchronized around each: the median's seconds and tokens/s."""
    timed: list[tuple[float, int]] = []
    for _ in range(warm_ups + CEILING_REPEATS):
        sync()
        start = time.perf_counter()
        tokens = call()
        sync()
        timed.append((time.perf_counter() - start, tokens))
    seconds = statistics.median(s for s, _ in timed[warm_ups:])
    tokens = timed[warm_ups][1]
    return {
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_second": tokens / seconds,
        "warm_up_seconds": [s for s, _ in timed[:warm_ups]],
        "repeats": [{"seconds": s, "tokens": t} for s, t in timed[warm_ups:]],
    }


def ceiling(bench: Bench, shape: str, sizes: Sizes) -> dict[str, Any]:
    """The project's decode with ONE request holding one gang decode's rows, through one adapter."""
    model, tokenizer = build_model(shape, bench.tokenizer_dir)
    peft_model = get_peft_model(model, lora(16))
    rows, settings, eos = anchor_rows(tokenizer, sizes)
    device = torch.device(bench.device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    reset_peak()

    def call() -> int:
        generator = torch.Generator(device=device).manual_seed(0)
        request = DecodeRequest(adapter="default", prompts=rows, generator=generator, eos_token_ids=eos, **settings)
        with torch.no_grad(), autocast:
            out = decode(peft_model, [request], int(tokenizer.pad_token_id))
        return sum(len(c) for c in out[0])

    found = _timed(call)
    peak = peak_memory_gb()
    peft_model = model = None  # freed before the next run
    release()
    return {
        "rows": len(rows),
        "prompt_width": max(len(r) for r in rows),
        **found,
        "decode_settings": {**settings, "eos_token_ids": list(eos)},
        "peak_memory_gb": peak,
    }


def generate_anchor(bench: Bench, shape: str, sizes: Sizes, static: bool) -> dict[str, Any]:
    """Stock transformers ``generate()`` of one model without an adapter, on the rows and settings of
    :func:`ceiling`: eager with its dynamic cache, or ``static`` (a static cache, which ``generate``
    compiles on a GPU); completions cut after their first EOS, as TRL cuts them."""
    from transformers import GenerationConfig

    model, tokenizer = build_model(shape, bench.tokenizer_dir)
    model.eval()
    rows, settings, eos = anchor_rows(tokenizer, sizes)
    pad = int(tokenizer.pad_token_id)
    device = torch.device(bench.device)
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
    config = GenerationConfig(
        **settings, pad_token_id=pad, eos_token_id=list(eos), cache_implementation="static" if static else None
    )
    reset_peak()

    def call() -> int:
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)[:, width:]
        ended = torch.isin(out, torch.tensor(list(eos), device=device))
        first = torch.where(ended.any(-1), ended.int().argmax(-1) + 1, out.shape[1])
        return int(first.sum())

    found = _timed(call, warm_ups=2 if static else 1)  # the static cache's compile takes the first calls
    peak = peak_memory_gb()
    model = None  # freed before the next run
    release()
    return {"rows": len(rows), "prompt_width": width, "static_cache": static, **found, "peak_memory_gb": peak}


def run(bench: Bench, shapes: list[str], save: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """The grpo part: the runs asked for (``--grpo-runs``, default all), merged into ``--out/grpo.json``; on the
    first shape."""
    shape = shapes[0]
    sizes = SMOKE if bench.smoke else GPU
    k = sizes.trials
    # The time-sliced study is the longest: last, so that a call cut short keeps the other two (each run is
    # saved when it ends).
    labels = [
        f"grpo_fused_k{k}",
        "decode_ceiling",
        "generate_eager",
        "generate_static",
        f"grpo_time_sliced_k{k}",
        f"grpo_processes_k{k}",
    ]
    chosen = bench.options.grpo_runs.split(",") if bench.options.grpo_runs else labels
    unknown = sorted(set(chosen) - set(labels))
    if unknown:
        raise SystemExit(f"--grpo-runs: unknown runs {unknown}; choose among {', '.join(labels)}")
    data: dict[str, Any] = {"model": shape, "sizes": asdict(sizes), "runs": {}}
    if bench.options.grpo_runs:
        keep_earlier(data, Path(bench.options.out) / "grpo.json")
    studies = [label for label in chosen if label.startswith(("grpo_fused", "grpo_time_sliced"))]
    if studies:
        # What a process pays once (kernels' just-in-time compilation, cuDNN and cuBLAS start-up), paid
        # before either engine's timed study, by both engines, so that neither study carries it for the other.
        data["warm_up_seconds"] = {}
        for engine in ("fused", "time_sliced"):
            start = time.perf_counter()
            run_study(bench, shape, engine, warm_up_sizes(sizes))
            data["warm_up_seconds"][engine] = time.perf_counter() - start
        print(f"grpo part, warm-up: {data['warm_up_seconds']}", flush=True)
    for label in (label for label in labels if label in chosen):
        if label in ("decode_ceiling", "generate_eager", "generate_static"):
            anchor = (
                ceiling(bench, shape, sizes)
                if label == "decode_ceiling"
                else generate_anchor(bench, shape, sizes, static=label == "generate_static")
            )
            data["runs"][label] = anchor
            said = f"{anchor['tokens_per_second']:.0f} generated tokens/s"
        elif label.startswith("grpo_processes"):
            found = run_processes(shape, bench.tokenizer_dir, [params(i) for i in range(k)], asdict(sizes))
            data["runs"][label] = found
            said = f"{found['wall_seconds']:.1f} s"
        else:
            found = run_study(bench, shape, _engine(label), sizes)
            data["runs"][label] = found
            data.setdefault("repeats", {})[label] = [_repeat(found)]
            said = _said(found)
        print(f"grpo part, {label}: {said}", flush=True)
        ratios(data)
        save(data)
    repeats = bench.options.grpo_repeats or (1 if bench.smoke else REPEATS)
    for run_number in range(2, repeats + 1):  # the studies again, in turns, after every other run
        for label in (label for label in labels if label in studies):
            found = run_study(bench, shape, _engine(label), sizes)
            data["repeats"][label].append(_repeat(found))
            print(f"grpo part, {label} (run {run_number} of {repeats}): {_said(found)}", flush=True)
            ratios(data)
            save(data)
    return data


def keep_earlier(data: dict[str, Any], earlier: Path) -> None:
    """Put into ``data`` the runs of ``earlier`` (a grpo.json of the same sizes) with their repeated walls: a run
    that runs again replaces its own (and its repeats), the others stay, so that the ratios of a partial run still
    take the medians of the studies it does not repeat. Nothing when the file does not exist."""
    if not earlier.exists():
        return
    kept = json.loads(earlier.read_text())
    if kept.get("sizes") != data["sizes"]:
        raise SystemExit(f"{earlier} holds GRPO runs of other sizes ({kept.get('sizes')}): use another --out")
    data["runs"], data["repeats"] = kept.get("runs", {}), kept.get("repeats", {})


def _repeat(found: dict[str, Any]) -> dict[str, Any]:
    """What ``repeats`` keeps of one run of a study."""
    keys = ("wall_seconds", "decode_seconds", "gang_seconds", "failed")
    return {key: found[key] for key in keys}


def _engine(label: str) -> Literal["fused", "time_sliced"]:
    """The engine of study ``label`` (``grpo_fused_k8``, ``grpo_time_sliced_k8``)."""
    return "fused" if "fused" in label else "time_sliced"


def _said(found: dict[str, Any]) -> str:
    return f"{found['wall_seconds']:.1f} s" + (f", {found['failed']} trials failed" if found["failed"] else "")


def median_wall(data: dict[str, Any], label: str) -> float | None:
    """The median wall of study ``label``'s runs (its one run in files from before ``repeats``)."""
    runs = data.get("repeats", {}).get(label)
    if runs:
        return float(statistics.median(run["wall_seconds"] for run in runs))
    run = data["runs"].get(label)
    return None if run is None else float(run["wall_seconds"])


def ratios(data: dict[str, Any]) -> None:
    """The part's summary keys, from whichever runs ``data`` holds."""
    k = data["sizes"]["trials"]
    runs = data["runs"]
    fused, single = runs.get(f"grpo_fused_k{k}"), runs.get("decode_ceiling")
    stock, processes = runs.get("generate_static"), runs.get(f"grpo_processes_k{k}")
    fused_wall, sliced_wall = median_wall(data, f"grpo_fused_k{k}"), median_wall(data, f"grpo_time_sliced_k{k}")
    gang_rate = fused["whole_gang_decodes"]["tokens_per_second"] if fused else None
    if sliced_wall and fused_wall:
        data["grpo_fused_over_time_sliced_k8"] = sliced_wall / fused_wall
    if processes and fused_wall:
        data["grpo_fused_over_parallel_processes"] = processes["wall_seconds"] / fused_wall
    if gang_rate and single:
        data["grpo_generation_over_ceiling"] = gang_rate / single["tokens_per_second"]
    if stock:
        if gang_rate:
            data["grpo_decode_over_generate"] = gang_rate / stock["tokens_per_second"]
        if single:
            data["grpo_single_decode_over_generate"] = single["tokens_per_second"] / stock["tokens_per_second"]


def summary(data: dict[str, Any]) -> dict[str, Any]:
    """The part's keys of summary.json (the ratios are recomputed)."""
    ratios(data)
    return {key: data[key] for key in KEYS if key in data}


def markdown(data: dict[str, Any]) -> list[str]:
    """The part's section of results.md."""
    ratios(data)
    sizes = Sizes(**data["sizes"])
    lines = [
        "",
        f"## GRPO gangs ({data['model']}, {sizes.trials} trials, LoRA r16, {sizes.prompts} prompts in "
        f"{sizes.num_chunks} chunks, {sizes.generations} completions of up to {sizes.completion} tokens per "
        f"prompt, {sizes.batch} per decode per trial)",
        "",
        "| run | wall s | decodes (requests) | generated tokens | in decodes s | decode tok/s | rest s | peak GB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, run in data["runs"].items():
        if label in ANCHORS:
            lines.append(
                f"| {label} ({run['rows']} rows, {ANCHORS[label]}) | - | 1 (1) | {run['tokens']} | "
                f"{run['seconds']:.3f} | {run['tokens_per_second']:.0f} | - | {run['peak_memory_gb']:.2f} |"
            )
            continue
        if run["engine"] == "processes":
            wall = run["wall_seconds"]
            lines.append(f"| {label} (plain TRL, one process per trial) | {wall:.1f} | - | - | - | - | - | - |")
            continue
        lines.append(
            f"| {label} | {run['wall_seconds']:.1f} | {run['engine_decodes']} ({run['engine_decoded_requests']}) | "
            f"{run['generated_tokens']} | {run['decode_seconds']:.1f} | {run['decode']['tokens_per_second']:.0f} | "
            f"{run['rest_seconds']:.1f} | {run['peak_memory_gb']:.2f} |"
        )
    said = {
        "time-sliced wall / fused wall": "grpo_fused_over_time_sliced_k8",
        "plain-TRL processes' wall / fused wall": "grpo_fused_over_parallel_processes",
        "fused gang's decodes / static-cache generate() (generated tokens/s)": "grpo_decode_over_generate",
        "one request's decode / static-cache generate()": "grpo_single_decode_over_generate",
        "fused gang's decodes / one request's decode": "grpo_generation_over_ceiling",
    }
    shown = [f"{text}: {data[key]:.3f}" for text, key in said.items() if key in data]
    repeated = [
        f"{label} {', '.join(format(run['wall_seconds'], '.1f') for run in runs)} "
        f"(median {median_wall(data, label):.1f})"
        for label, runs in data.get("repeats", {}).items()
        if len(runs) > 1
    ]
    if repeated:
        shown.append("the studies' walls, in the order they ran (s): " + "; ".join(repeated))
    return lines + (["", "; ".join(shown) + "."] if shown else [])


def plot(data: dict[str, Any], path: Path) -> None:
    """``grpo.png``: each study's wall time split into decoding and the rest; generated tokens/s of the
    decodes against the ceiling."""
    import matplotlib.pyplot as plt

    runs = data["runs"]
    studies = {label: run for label, run in runs.items() if label not in ANCHORS and run["engine"] != "processes"}
    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    names = list(studies)
    axes[0].bar(names, [r["decode_seconds"] for r in studies.values()], label="decoding")
    axes[0].bar(
        names,
        [r["rest_seconds"] for r in studies.values()],
        bottom=[r["decode_seconds"] for r in studies.values()],
        label="the rest",
    )
    axes[0].set_ylabel("whole-study wall seconds")
    axes[0].legend()
    axes[0].set_title(f"{data['sizes']['trials']} GRPO trials")
    rates = {label: run["decode"]["tokens_per_second"] for label, run in studies.items()}
    for label in ANCHORS:
        if label in runs:
            rates[label] = runs[label]["tokens_per_second"]
    colors = ["gray" if label in ANCHORS else "C0" for label in rates]
    axes[1].bar(list(rates), [v or 0.0 for v in rates.values()], color=colors)
    axes[1].set_ylabel("generated tokens / s inside decodes")
    axes[1].set_title("Decoding: engines against one request of the gang's rows", fontsize=10)
    for axis in axes:
        axis.tick_params(axis="x", labelrotation=15)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
