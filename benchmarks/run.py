"""optuna-rapidfire benchmarks: sequential TRL against the executor, on one machine, in one run.

    CUDA_VISIBLE_DEVICES=0 python -m benchmarks.run --parts throughput,scale --out benchmarks/results
    CUDA_VISIBLE_DEVICES=0 python -m benchmarks.run --parts search --out benchmarks/results  # benchmarks/search.py
    CUDA_VISIBLE_DEVICES=0 python -m benchmarks.run --parts fused,grpo --out benchmarks/results  # benchmarks/grpo.py
    python -m benchmarks.run --parts multi_gpu --out benchmarks/results            # two GPUs
    python -m benchmarks.run --smoke --parts all --out /tmp/bench                  # CPU, tiny model, minutes

Models are random-weight models of real shapes (Llama-3.2-1B, TinyLlama-1.1B) built on the device in
bf16; speed does not depend on the weights. Data: the bundled GSM8K train set, packed into 512-token rows.
Every part writes ``<part>.json`` (numbers, machine, versions, command); ``summary.json``, ``results.md``
and the plots gather them. See benchmarks/README.md for what each number means.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import optuna
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
from trl import SFTConfig, SFTTrainer

from optuna_rapidfire import RapidFireExecutor
from optuna_rapidfire._engines._fused_engine import PASS_TOKENS, FusedEngine
from optuna_rapidfire._engines._time_sliced import TimeSlicedEngine
from optuna_rapidfire._engines._trials import DeviceTrials
from optuna_rapidfire._study import _attrs
from optuna_rapidfire.demo import build_tiny_model, load_gsm8k

SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": {
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "tie_word_embeddings": True,
    },
    "tinyllama-1.1b": {
        "vocab_size": 32000,
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 22,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "tie_word_embeddings": False,
    },
    "search-82m": {  # the search part's base (benchmarks/search.py BASE_MODEL), random weights
        "vocab_size": 8192,
        "hidden_size": 768,
        "intermediate_size": 2048,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "tie_word_embeddings": True,
    },
    "llama-3.1-8b": {
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "tie_word_embeddings": False,
    },
    "tiny": {  # --smoke: CPU dry runs of the whole harness
        "vocab_size": 2048,
        "hidden_size": 64,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "tie_word_embeddings": False,
    },
}


# -- models and configs ----------------------------------------------------------------------------


def build_model(shape: str, tokenizer_dir: str) -> tuple[LlamaForCausalLM, Any]:
    """A random-weight model of ``shape`` (bf16 on the GPU, fp32 on the CPU) and the local tokenizer.

    Module level, so it reaches worker processes by pickling (``functools.partial`` of it).
    """
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(
        **SHAPES[shape],
        max_position_embeddings=2048,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    if torch.cuda.is_available():
        with torch.device("cuda"):
            model = LlamaForCausalLM(config).to(torch.bfloat16)
    else:
        model = LlamaForCausalLM(config)
    return model, tokenizer


TARGETS = {
    "attn": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "all": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}


def lora(rank: int = 16) -> LoraConfig:
    return LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS["attn"])


def trial_lora(params: dict[str, Any]) -> LoraConfig:
    """A trial's LoRA from its params: rank ``r`` (alpha 2r), ``targets`` (attention unless given),
    ``lora_dropout`` (0 unless given). ``{"r": 16}`` is :func:`lora`'s config."""
    rank = int(params["r"])
    return LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        target_modules=TARGETS[params.get("targets", "attn")],
        lora_dropout=float(params.get("lora_dropout", 0.0)),
    )


def sft_args(learning_rate: float, batch: int, **overrides: Any) -> SFTConfig:
    gpu = torch.cuda.is_available()
    settings: dict[str, Any] = {
        "learning_rate": learning_rate,
        "per_device_train_batch_size": batch,
        "per_device_eval_batch_size": 16,
        "num_train_epochs": 1,
        "max_length": 512,
        "packing": True,
        "packing_strategy": "wrapped",
        "bf16": gpu,
        "use_cpu": not gpu,
        "gradient_checkpointing": False,
        "report_to": "none",
        "save_strategy": "no",
        "logging_strategy": "no",
        "disable_tqdm": True,
        "seed": 0,
    }
    settings.update(overrides)
    return SFTConfig(**settings)


def configure_from_params(batch: int) -> Callable[[optuna.Trial], tuple[LoraConfig, SFTConfig]]:
    return functools.partial(_configure, batch=batch)


def _configure(trial: optuna.Trial, batch: int) -> tuple[LoraConfig, SFTConfig]:
    lr = trial.suggest_float("learning_rate", 1e-5, 1e-2, log=True)
    rank = trial.suggest_categorical("r", [8, 16])
    return lora(rank), sft_args(lr, batch)


def mixed_params(index: int) -> dict[str, Any]:
    """Trial ``index`` of a mixed gang: ranks 8, 16, 32, 64 in turn (alpha 2r), attention-only or
    all-linear targets (each rank gets both in a gang of 8), dropout 0, 0.05, 0.1 in turn."""
    return {
        "learning_rate": 1e-4 * (1 + index),
        "r": (8, 16, 32, 64)[index % 4],
        "targets": ("attn", "all")[(index + index // 4) % 2],
        "lora_dropout": (0.0, 0.05, 0.1)[index % 3],
    }


def configure_mixed(batch: int) -> Callable[[optuna.Trial], tuple[LoraConfig, SFTConfig]]:
    return functools.partial(_configure_mixed, batch=batch)


def _configure_mixed(trial: optuna.Trial, batch: int) -> tuple[LoraConfig, SFTConfig]:
    params: dict[str, Any] = {
        "learning_rate": trial.suggest_float("learning_rate", 1e-5, 1e-2, log=True),
        "r": trial.suggest_categorical("r", [8, 16, 32, 64]),
        "targets": trial.suggest_categorical("targets", list(TARGETS)),
        "lora_dropout": trial.suggest_categorical("lora_dropout", [0.0, 0.05, 0.1]),
    }
    return trial_lora(params), sft_args(params["learning_rate"], batch)


def configure_dpo(batch: int) -> Callable[[optuna.Trial], tuple[LoraConfig, Any]]:
    return functools.partial(_configure_dpo, batch=batch)


def _configure_dpo(trial: optuna.Trial, batch: int) -> tuple[LoraConfig, Any]:
    from trl import DPOConfig

    lr = trial.suggest_float("learning_rate", 1e-5, 1e-2, log=True)
    trial.suggest_categorical("r", [8, 16])
    gpu = torch.cuda.is_available()
    args = DPOConfig(
        learning_rate=lr,
        per_device_train_batch_size=batch,
        per_device_eval_batch_size=8,
        max_length=512,
        bf16=gpu,
        use_cpu=not gpu,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    return lora(16), args


def grid(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` configs spread over the search space (a fixed, seeded list shared by every method)."""
    sampler = optuna.samplers.QMCSampler(seed=seed, scramble=True)
    study = optuna.create_study(sampler=sampler)
    params = []
    for _ in range(n):
        trial = study.ask()
        params.append(
            {
                "learning_rate": trial.suggest_float("learning_rate", 1e-5, 1e-2, log=True),
                "r": trial.suggest_categorical("r", [8, 16]),
            }
        )
        study.tell(trial, 0.0)
    return params


# -- measurement helpers ---------------------------------------------------------------------------


class Recorder:
    """Hooks into the engine: chunk timings, tokens, evaluation time, switch latency (synchronized)."""

    def __init__(self) -> None:
        self.first_report: dict[int, float] = {}
        self.eval_seconds = 0.0
        self.train_seconds = 0.0
        self.tokens = 0
        self.switches: list[float] = []
        self.chunks: list[dict[str, float]] = []  # per chunk: step, tokens, train seconds
        self._originals: dict[str, Any] = {}
        self._in_gang = False  # a fused engine's run: it records its members' chunks itself

    def __enter__(self) -> Recorder:
        recorder = self
        run_chunk, switch_to = TimeSlicedEngine.run_chunk, DeviceTrials.switch_to
        run_gang = FusedEngine.run
        self._originals = {"run_chunk": run_chunk, "switch_to": switch_to, "run_gang": run_gang}

        def tokens(runtime: Any) -> int:
            return int(getattr(runtime.trainer, "_total_train_tokens", 0))

        def record(runtime: Any, before: int, result: Any) -> None:
            recorder.tokens += tokens(runtime) - before
            recorder.eval_seconds += result.eval_seconds
            recorder.train_seconds += result.train_seconds
            recorder.chunks.append(
                {"step": result.step, "tokens": tokens(runtime) - before, "train_seconds": result.train_seconds}
            )
            if result.step == 0:
                recorder.first_report.setdefault(runtime.spec.number, time.perf_counter())

        def timed_run_chunk(engine: TimeSlicedEngine, runtime: Any) -> Any:
            before = tokens(runtime)
            result = run_chunk(engine, runtime)
            if not recorder._in_gang:
                record(runtime, before, result)
            return result

        def timed_run_gang(engine: FusedEngine, runtimes: Any) -> Any:
            before = [tokens(runtime) for runtime in runtimes]
            recorder._in_gang = True
            try:
                results = run_gang(engine, runtimes)
            finally:
                recorder._in_gang = False
            for runtime, count, result in zip(runtimes, before, results, strict=True):
                record(runtime, count, result)
            return results

        def timed_switch(trials: DeviceTrials, runtime: Any) -> None:
            changes = trials.current is not runtime
            _sync()
            start = time.perf_counter()
            switch_to(trials, runtime)
            _sync()
            if changes:
                recorder.switches.append(time.perf_counter() - start)

        TimeSlicedEngine.run_chunk = timed_run_chunk  # type: ignore[method-assign]
        DeviceTrials.switch_to = timed_switch  # type: ignore[method-assign]
        FusedEngine.run = timed_run_gang  # type: ignore[method-assign]
        return self

    def steady_tokens_per_second(self) -> float:
        """Training tokens/s over every trial's chunks after its first (warm kernels, allocator, caches)."""
        later = [c for c in self.chunks if c["step"] > 0] or self.chunks
        return sum(c["tokens"] for c in later) / max(sum(c["train_seconds"] for c in later), 1e-9)

    def __exit__(self, *exc: object) -> None:
        TimeSlicedEngine.run_chunk = self._originals["run_chunk"]  # type: ignore[method-assign]
        DeviceTrials.switch_to = self._originals["switch_to"]  # type: ignore[method-assign]
        FusedEngine.run = self._originals["run_gang"]  # type: ignore[method-assign]


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _peak_memory_gb() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")


def _drop(executor: RapidFireExecutor) -> None:
    """Close the executor and free its model now, so the next run's peak memory is its own."""
    executor.close()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def machine() -> dict[str, Any]:
    import peft
    import transformers
    import trl

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": trl.__version__,
        "peft": peft.__version__,
        "optuna": optuna.__version__,
        "cpu_count": os.cpu_count(),
    }
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        info["cuda"] = torch.version.cuda
    return info


# -- the parts -------------------------------------------------------------------------------------


class Bench:
    def __init__(self, options: argparse.Namespace) -> None:
        self.options = options
        self.smoke = options.smoke
        self.workdir = Path(tempfile.mkdtemp(prefix="rapidfire-bench-"))
        self.tokenizer_dir = str(build_tiny_model(self.workdir / "tokenizer", vocab_size=2048))
        self.device = "cuda:0" if torch.cuda.is_available() else "cpu"
        self.batch = options.batch
        self.command = " ".join([sys.executable, "-m", "benchmarks.run", *sys.argv[1:]])

    def save(self, part: str, data: dict[str, Any]) -> None:
        """Write what a part has so far: a call cut short by a time limit keeps what finished."""
        write_reports(Path(self.options.out), {part: data}, self.command)

    def rows(self, n: int, format: str = "text") -> Any:
        return load_gsm8k("train", num_rows=n, format=format)

    def eval_rows(self, format: str = "text") -> Any:
        return load_gsm8k("test", num_rows=64 if not self.smoke else 8, format=format)

    def factory(self, shape: str) -> Callable[[], tuple[Any, Any]]:
        return functools.partial(build_model, shape, self.tokenizer_dir)

    def executor(self, shape: str, rows: int, num_chunks: int, concurrent: int, **kwargs: Any) -> RapidFireExecutor:
        """An executor over ``rows`` GSM8K examples; time-sliced unless ``engine`` says otherwise."""
        kwargs.setdefault("engine", "time_sliced")
        data = kwargs.pop("data", "text")
        return RapidFireExecutor(
            model=self.factory(shape),
            train_dataset=self.rows(rows, data),
            eval_dataset=self.eval_rows(data),
            num_chunks=num_chunks,
            max_concurrent_trials=concurrent,
            output_dir=self.workdir / "out",
            show_progress_bar=False,
            dashboard_controls=False,
            **kwargs,
        )

    # (a) + (b)
    def throughput(self, shape: str) -> dict[str, Any]:
        # 128 rows (32 steps of 4 x 512 tokens) per chunk; eval_samples="auto" then evaluates 32 rows.
        rows, chunks = (512, 4) if not self.smoke else (32, 4)
        learning_rates = [1e-4, 2e-4, 5e-4, 1e-3]
        model, tokenizer = build_model(shape, self.tokenizer_dir)
        # Warm-up (not timed): CUDA context, kernels and allocator, which every later run of the process
        # shares, so the first timed config does not pay them.
        warm = get_peft_model(model, lora())
        SFTTrainer(
            model=warm,
            args=sft_args(1e-4, self.batch, output_dir=str(self.workdir / "trl"), max_steps=8),
            train_dataset=self.rows(64),
            processing_class=tokenizer,
        ).train()
        base = warm.unload()
        del warm
        sequential = []
        for lr in learning_rates:
            peft_model = get_peft_model(base, lora())
            trainer = SFTTrainer(
                model=peft_model,
                args=sft_args(lr, self.batch, output_dir=str(self.workdir / "trl")),
                train_dataset=self.rows(rows),
                processing_class=tokenizer,
            )
            _sync()
            start = time.perf_counter()
            trainer.train()
            _sync()
            seconds = time.perf_counter() - start
            sequential.append({"learning_rate": lr, "seconds": seconds, "tokens": trainer._total_train_tokens})
            base = peft_model.unload()
            del trainer, peft_model
        del model, base
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
        seq_tokens = sum(r["tokens"] for r in sequential)
        seq_seconds = sum(r["seconds"] for r in sequential)

        executor = self.executor(shape, rows, chunks, len(learning_rates))
        study = optuna.create_study(pruner=optuna.pruners.NopPruner())
        for lr in learning_rates:
            study.enqueue_trial({"learning_rate": lr, "r": 16})
        objective_ready = executor.objective(configure_from_params(self.batch))  # loads the model
        del objective_ready
        _reset_peak()
        with Recorder() as recorder:
            start = time.perf_counter()
            executor.optimize(study, configure_from_params(self.batch), n_trials=len(learning_rates))
            wall = time.perf_counter() - start
        peak = _peak_memory_gb()
        _drop(executor)
        first_decision = max(recorder.first_report.values()) - start
        # Sequentially, the last config's first chunk ends after every other config has trained fully.
        seq_first_decision = sum(r["seconds"] for r in sequential[:-1]) + sequential[-1]["seconds"] / chunks
        train_tps = recorder.tokens / max(recorder.train_seconds + sum(recorder.switches), 1e-9)
        return {
            "model": shape,
            "configs": len(learning_rates),
            "rows": rows,
            "num_chunks": chunks,
            "batch": self.batch,
            "sequential": {
                "runs": sequential,
                "tokens": seq_tokens,
                "seconds": seq_seconds,
                "tokens_per_second": seq_tokens / seq_seconds,
            },
            "executor": {
                "tokens": recorder.tokens,
                "wall_seconds": wall,
                "train_seconds": recorder.train_seconds,
                "eval_seconds": recorder.eval_seconds,
                "eval_share": recorder.eval_seconds / max(recorder.train_seconds + recorder.eval_seconds, 1e-9),
                "training_tokens_per_second": train_tps,
                "wall_tokens_per_second": recorder.tokens / wall,
                "switch_ms_median": statistics.median(recorder.switches) * 1e3 if recorder.switches else None,
                "switch_ms_p95": _percentile(recorder.switches, 0.95) * 1e3,
                "switches": len(recorder.switches),
                "time_to_first_decision_seconds": first_decision,
                "peak_memory_gb": peak,
            },
            "interleaved_over_sequential_throughput": train_tps / (seq_tokens / seq_seconds),
            "interleaved_over_sequential_throughput_with_eval": (recorder.tokens / wall) / (seq_tokens / seq_seconds),
            "sequential_time_to_first_decision_seconds": seq_first_decision,
            "time_to_first_decision_speedup": seq_first_decision / first_decision,
        }

    def search(self, shape: str) -> dict[str, Any]:
        """How soon each method reaches the best config (benchmarks/search.py; its own model, not ``shape``)."""
        from benchmarks import search

        return search.run(self.options, lambda data: self.save("search", data))

    def grpo(self, shape: str) -> dict[str, Any]:
        """GRPO trials fused against time-sliced, and against the decode ceiling (benchmarks/grpo.py)."""
        from benchmarks import grpo

        return grpo.run(self, shape, lambda data: self.save("grpo", data))

    # (e)
    def fused(self, shape: str) -> dict[str, Any]:
        """The fused engine against time slicing, against one adapter at saturation (issue 7), with mixed gangs,
        over a whole study and against plain-TRL processes sharing the GPU (issue 14), compiled once per gang
        layout, on three model shapes, with its GPU busy share (issue 19).

        Every executor configuration is a real study through the executor (chunks, per-chunk eval and
        reports); tokens/s count training only, over each trial's chunks after its first (the first holds
        the compilation). The ``processes_*`` runs are one plain-TRL process per trial
        (benchmarks/processes.py), eager or with TRL's ``torch_compile=True`` (compilation inside their wall).
        """
        k = 8 if not self.smoke else 3
        small, large = ("search-82m", "llama-3.1-8b") if not self.smoke else ("tiny", "tiny")
        fit = 4 if not self.smoke else 2  # plain-TRL processes of the 8B shape that fit on one H200 (8 do not)
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
            FusedRun(
                f"processes_compiled_mixed_k{k}_bs2_82m", "processes", k, 2, 192, "mixed", shape=small, compiled=True
            ),
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
        if self.smoke:
            configs = [c._replace(examples=32) for c in configs]
        if self.options.fused_runs:  # measure only these, keeping the other runs of --out/fused.json
            wanted = self.options.fused_runs.split(",")
            unknown = sorted(set(wanted) - {c.label for c in configs})
            if unknown:
                raise SystemExit(f"unknown fused runs {unknown}: choose among {', '.join(c.label for c in configs)}")
            configs = [c for c in configs if c.label in wanted]
        result: dict[str, Any] = {"model": shape, "pass_tokens": PASS_TOKENS, "num_chunks": 4, "runs": {}}
        reported: dict[str, list[dict[int, float]]] = {}
        earlier = Path(self.options.out) / "fused.json"
        if self.options.fused_runs and earlier.exists():
            kept = json.loads(earlier.read_text())
            result["runs"] = kept.get("runs", {})
            reported = kept.get("reported", {})
            for key in ("per_chunk_values_max_relative_difference", "profiles"):
                result[key] = kept.get(key, {})
        for run in configs:
            run_shape = run.shape or shape
            params = [_trial_params(run.kind, i) for i in range(run.trials)]
            if run.engine == "processes":
                from benchmarks.processes import run_processes

                measured = run_processes(
                    run_shape, self.tokenizer_dir, params, run.batch, run.examples, compiled=run.compiled
                )
                result["runs"][run.label] = {
                    **measured,
                    "kind": run.kind,
                    "examples": run.examples,
                    "model": run_shape,
                    "compiled": run.compiled,
                }
                print(f"fused part, {run.label}: {measured['tokens_per_second']:.0f} tokens/s", flush=True)
                self.save("fused", result)
                continue
            configure = {"sft": configure_from_params, "mixed": configure_mixed, "dpo": configure_dpo}[run.kind]
            executor = self.executor(
                run_shape,
                run.examples,
                run.chunks,
                run.trials,
                engine=run.engine,
                data="preference" if run.kind == "dpo" else "text",
            )
            study = optuna.create_study(pruner=optuna.pruners.NopPruner())
            for trial_params in params:
                study.enqueue_trial(trial_params)
            executor.objective(configure(run.batch))  # loads the model
            _reset_peak()
            with Recorder() as recorder:
                start = time.perf_counter()
                executor.optimize(study, configure(run.batch), n_trials=run.trials)
                wall = time.perf_counter() - start
            if self.options.profile and run.engine == "fused" and run.batch == 2 and run.kind == "sft":
                self._profile(executor, run.trials, run.batch, f"{run.label}_profile.txt")
            stats = executor.stats()
            if run.busy:  # its first two chunks again, the layout compiled, under the profiler
                partial = functools.partial(_configure_partial, configure=configure(run.batch), epochs=2 / run.chunks)
                profile = self._profile_busy(executor, partial, params, f"{run.label}_busy")
                result.setdefault("profiles", {})[run.label] = profile
                print(f"fused part, {run.label}: GPU busy {profile['busy_share']}", flush=True)
            result["runs"][run.label] = {
                "engine": run.engine,
                "kind": run.kind,
                "model": run_shape,
                "trials": run.trials,
                "batch": run.batch,
                "examples": run.examples,
                "num_chunks": run.chunks,
                "tokens": recorder.tokens,
                "tokens_per_second": recorder.steady_tokens_per_second(),
                "wall_seconds": wall,
                "wall_tokens_per_second": recorder.tokens / wall,
                "eval_seconds": recorder.eval_seconds,
                "fused_steps": stats.fused_steps if run.engine == "fused" else None,
                "launched_steps": stats.launched_steps if run.engine == "fused" else None,
                "compiles": stats.compiles,
                "compile_failures": stats.compile_failures,
                "peak_memory_gb": _peak_memory_gb(),
                "failed": sum(t.state != optuna.trial.TrialState.COMPLETE for t in study.trials),
            }
            reported[run.label] = [
                {int(step): v for step, v in t.intermediate_values.items()}
                for t in sorted(study.trials, key=lambda t: t.number)
            ]
            result["reported"] = reported
            print(f"fused part, {run.label}: {result['runs'][run.label]['tokens_per_second']:.0f} tokens/s", flush=True)
            _drop(executor)
            self.save("fused", result)
        _fused_ratios(result, k)
        return result

    def _profile_busy(
        self, executor: RapidFireExecutor, configure: Any, params: list[dict[str, Any]], label: str
    ) -> dict[str, Any]:
        """How busy the GPU is while a fused gang trains: a study of ``params`` on ``executor`` (whose layout is
        compiled already) under torch's profiler; the share of the training phase's wall time (the engine's gang
        chunks, synchronised at both ends) during which a kernel, copy or memset ran."""
        from torch.profiler import ProfilerActivity, profile

        def study() -> optuna.Study:
            fresh = optuna.create_study(pruner=optuna.pruners.NopPruner())
            for trial_params in params:
                fresh.enqueue_trial(trial_params)
            return fresh

        original = FusedEngine._train_gang
        windows: list[tuple[int, int]] = []  # wall-clock ns of each gang chunk's training (the worker thread's)

        def timed(engine: FusedEngine, runtimes: Any) -> Any:
            _sync()
            begin = time.time_ns()
            try:
                return original(engine, runtimes)
            finally:
                _sync()
                windows.append((begin, time.time_ns()))

        FusedEngine._train_gang = timed  # type: ignore[method-assign]
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        try:
            with profile(activities=activities) as prof, Recorder() as recorder:
                executor.optimize(study(), configure, n_trials=len(params))
        finally:
            FusedEngine._train_gang = original  # type: ignore[method-assign]
        trace = self.workdir / f"{label}.trace.json"
        prof.export_chrome_trace(str(trace))
        exported = json.loads(trace.read_text())
        base = int(exported.get("baseTimeNanoseconds", 0))
        sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
        Path(self.options.out).mkdir(parents=True, exist_ok=True)
        (Path(self.options.out) / f"{label}.txt").write_text(prof.key_averages().table(sort_by=sort, row_limit=30))
        # The trace's timestamps are microseconds after its base time (wall clock, ns).
        ranges = [((a - base) / 1e3, (b - base) / 1e3) for a, b in windows]
        found = busy_share(exported.get("traceEvents", []), ranges)
        # The training rate of these chunks (the layout compiled, no compilation in them), under the profiler.
        found["tokens"] = recorder.tokens
        found["tokens_per_second"] = recorder.tokens / found["training_wall_seconds"] if ranges else None
        return found

    def _profile(self, executor: RapidFireExecutor, trials: int, batch: int, name: str) -> None:
        """One more study on ``executor`` under torch's profiler; its top operators go to ``name`` in --out."""
        from torch.profiler import ProfilerActivity, profile

        study = optuna.create_study(pruner=optuna.pruners.NopPruner())
        for i in range(trials):
            study.enqueue_trial({"learning_rate": 1e-4 * (1 + i), "r": 16})
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with profile(activities=activities) as prof:
            executor.optimize(study, configure_from_params(batch), n_trials=trials)
        sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
        tables = [prof.key_averages().table(sort_by=key, row_limit=40) for key in (sort, "cpu_time_total")]
        Path(self.options.out).mkdir(parents=True, exist_ok=True)
        (Path(self.options.out) / name).write_text("\n\n".join(tables))

    # (d)
    def scale(self, shape: str) -> dict[str, Any]:
        """Switch latency, offloads and memory against the number of live trials (time-sliced)."""
        sizes = [1, 4, 8, 16, 32] if not self.smoke else [1, 2, 4]
        rows_per_trial_chunk = 32 if not self.smoke else 8
        results = []
        for k in sizes:
            chunks = 16
            # Room for 8 trials' states on the device: beyond that, idle trials move to pinned CPU memory.
            budget = None if k <= 8 else 8 * _state_bytes(shape)
            # Lock-step rounds, as these numbers were measured: each round trains every live trial once, in
            # turn, so with K > 8 the switches keep bringing back states the budget moved off the device (the
            # offloads, and switch latency with that traffic in it). The default "promote" trains leaders first
            # and completes them early, so fewer states are live at once and the offloads mostly go (0 instead
            # of 10 at K = 10 in a CPU run): no longer the K live trials this part is about.
            executor = self.executor(
                shape,
                rows_per_trial_chunk * chunks,
                chunks,
                k,
                state_memory_budget=budget,
                schedule="lockstep",
            )
            executor.objective(configure_from_params(self.batch))  # loads the model
            study = optuna.create_study(pruner=optuna.pruners.NopPruner())
            for i in range(k):
                study.enqueue_trial({"learning_rate": 1e-4 * (1 + i % 4), "r": 16})
            configure = functools.partial(_configure_two_chunks, batch=self.batch, chunks=chunks)
            _reset_peak()
            with Recorder() as recorder:
                executor.optimize(study, configure, n_trials=k)
            stats = executor.stats()
            results.append(
                {
                    "live_trials": k,
                    "switch_ms_median": statistics.median(recorder.switches) * 1e3 if recorder.switches else None,
                    "switch_ms_p95": _percentile(recorder.switches, 0.95) * 1e3 if recorder.switches else None,
                    "switches": len(recorder.switches),
                    "offloads": stats.offloads,
                    "peak_memory_gb": _peak_memory_gb(),
                    "base_memory_gb": stats.base_bytes / 2**30,
                }
            )
            print(
                f"scale part, {k} live trials: {len(recorder.switches)} switches, {stats.offloads} offloads",
                flush=True,
            )
            _drop(executor)
        return {"model": shape, "results": results}

    # multi-GPU
    def multi_gpu(self, shape: str) -> dict[str, Any]:
        """The same study on one GPU, then with one worker process per GPU sharing an SQLite study."""
        devices = _multi_gpu_devices(self.smoke)
        rows, chunks, configs = (256, 8, 16) if not self.smoke else (32, 2, 4)
        result: dict[str, Any] = {"model": shape, "configs": configs, "rows": rows, "devices": devices}
        for label, chosen in (("one_gpu", devices[:1]), ("all_gpus", devices)):
            url = f"sqlite:///{self.workdir / f'{label}.db'}"
            study = optuna.create_study(storage=url, study_name=label, pruner=optuna.pruners.NopPruner())
            for i in range(configs):
                study.enqueue_trial({"learning_rate": 1e-4 * (1 + i % 4), "r": 16})
            # Lock-step, the only schedule when results/multi_gpu.json was measured: the ratio compares devices,
            # so both runs keep the schedule those numbers ran under (waves of 8 trials, every chunk a switch),
            # not the default "promote", which changes the order of switches and when trials start and end.
            executor = self.executor(
                shape, rows, chunks, 8, devices=chosen if len(chosen) > 1 else chosen[0], schedule="lockstep"
            )
            start = time.perf_counter()
            executor.optimize(study, configure_from_params(self.batch), n_trials=configs)
            wall = time.perf_counter() - start
            _drop(executor)
            trials = study.get_trials()
            window = max(t.datetime_complete for t in trials) - min(t.datetime_start for t in trials)
            tokens = configs * _tokens_per_trial(self, rows)
            result[label] = {
                "wall_seconds": wall,
                "trial_window_seconds": window.total_seconds(),
                "tokens": tokens,
                "tokens_per_second": tokens / window.total_seconds(),
                "workers": sorted({t.user_attrs.get(_attrs.WORKER, "") for t in trials}),
            }
        result["two_gpu_over_one_gpu_throughput"] = (
            result["all_gpus"]["tokens_per_second"] / result["one_gpu"]["tokens_per_second"]
        )
        return result


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


def _trial_params(kind: str, index: int) -> dict[str, Any]:
    """The params trial ``index`` of a fused-part run is enqueued with (and a process trains with)."""
    if kind == "mixed":
        return mixed_params(index)
    return {"learning_rate": 1e-4 * (1 + index), "r": 16}


def busy_share(events: list[dict[str, Any]], ranges: list[tuple[float, float]]) -> dict[str, Any]:
    """From a chrome trace's events: the share of the wall time of ``ranges`` (trace microseconds) during which
    the GPU ran a kernel, a copy or a memset (the union of their intervals, clipped to the ranges)."""
    device = sorted(
        (e["ts"], e["ts"] + e["dur"])
        for e in events
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and e.get("ph") == "X"
    )
    wall = sum(end - begin for begin, end in ranges)
    busy, kernels = 0.0, 0
    for begin, end in ranges:
        inside = [(max(a, begin), min(b, end)) for a, b in device if b > begin and a < end]
        busy += _union(inside)
        kernels += len(inside)
    return {
        "busy_share": busy / wall if wall and device else None,
        # A check of the time base: every device event of the whole profiled study, and its span.
        "study_gpu_busy_seconds": _union(device) / 1e6,
        "study_span_seconds": (device[-1][1] - device[0][0]) / 1e6 if device else 0.0,
        "training_wall_seconds": wall / 1e6,
        "gpu_busy_seconds": busy / 1e6,
        "device_events": kernels,
        "gang_chunks": len(ranges),
    }


def _union(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by ``intervals``."""
    total, reach = 0.0, float("-inf")
    for begin, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(begin, reach)
        reach = end
    return total


def _best(tps: dict[str, float], *labels: str) -> float | None:
    """The best tokens/s among the runs ``labels`` that were measured (``None``: none was)."""
    found = [tps[label] for label in labels if label in tps]
    return max(found) if found else None


def _fused_ratios(result: dict[str, Any], k: int) -> None:
    """The fused part's ratios, from whichever of its runs ``result`` holds.

    The ceiling is the better of one adapter at batch 32 eager (TRL's loss, time-sliced engine) and compiled
    (the launched pass); a baseline of plain-TRL processes is the better of eager and ``torch_compile=True``.
    """
    # A run whose trials failed measures nothing.
    tps = {label: run["tokens_per_second"] for label, run in result["runs"].items() if not run.get("failed")}
    reported = {
        label: [{int(s): v for s, v in t.items()} for t in runs] for label, runs in result.get("reported", {}).items()
    }
    fit = 4 if k == 8 else 2
    bests = {
        "ceiling": _best(tps, "ceiling_bs32", "ceiling_bs32_compiled"),
        "processes": _best(tps, f"processes_k{k}_bs2", f"processes_compiled_k{k}_bs2"),
        "processes_mixed": _best(tps, f"processes_mixed_k{k}_bs2", f"processes_compiled_mixed_k{k}_bs2"),
        "processes_mixed_82m": _best(tps, f"processes_mixed_k{k}_bs2_82m", f"processes_compiled_mixed_k{k}_bs2_82m"),
        "processes_mixed_8b": _best(tps, f"processes_mixed_k{fit}_bs2_8b", f"processes_compiled_mixed_k{fit}_bs2_8b"),
    }
    tps.update({f"best:{name}": value for name, value in bests.items() if value is not None})
    ratios = {
        "fused_k8_bs2_over_ceiling": (f"fused_k{k}_bs2", "best:ceiling"),
        "fused_over_time_sliced_throughput_k8": (f"fused_k{k}_bs2", f"time_sliced_k{k}_bs2"),
        "fused_over_time_sliced_at_saturation": ("fused_k4_bs16", "time_sliced_k4_bs16"),
        "fused_over_time_sliced_k2_bs32": ("fused_k2_bs32", "time_sliced_k2_bs32"),
        "dpo_fused_over_time_sliced_k8": (f"dpo_fused_k{k}_bs2", f"dpo_time_sliced_k{k}_bs2"),
        "fused_mixed_k8_bs2_over_ceiling": (f"fused_mixed_k{k}_bs2", "best:ceiling"),
        "fused_mixed_over_time_sliced_k8": (f"fused_mixed_k{k}_bs2", f"time_sliced_mixed_k{k}_bs2"),
        "fused_over_parallel_processes": (f"fused_k{k}_bs2", "best:processes"),
        "fused_mixed_over_parallel_processes": (f"fused_mixed_k{k}_bs2", "best:processes_mixed"),
        "fused_mixed_over_parallel_processes_82m": (f"fused_mixed_k{k}_bs2_82m", "best:processes_mixed_82m"),
        "fused_mixed_over_parallel_processes_8b": (f"fused_mixed_k{k}_bs2_8b", "best:processes_mixed_8b"),
        "compiled_ceiling_over_eager_ceiling": ("ceiling_bs32_compiled", "ceiling_bs32"),
    }
    for key, (ours, theirs) in ratios.items():
        if ours in tps and theirs in tps:
            result[key] = tps[ours] / tps[theirs]
    # Peak memory: a gang against one adapter at the gang's total rows, against the processes' sum, and a mixed
    # gang against an equal one at the same rows (8B shape).
    peaks = {label: run["peak_memory_gb"] for label, run in result["runs"].items() if not run.get("failed")}
    memory = {
        "fused_memory_over_same_rows": (f"fused_k{k}_bs2", f"same_rows_bs{2 * k}"),
        "fused_memory_over_parallel_processes": (f"fused_k{k}_bs2", f"processes_k{k}_bs2"),
        "fused_memory_mixed_over_equal": (f"fused_mixed_k{k}_bs2_8b", f"fused_k{k}_bs2_8b"),
    }
    for key, (ours, theirs) in memory.items():
        if ours in peaks and theirs in peaks:
            result[key] = peaks[ours] / peaks[theirs]
    study = result["runs"].get(f"fused_mixed_k{k}_bs2")
    if study and study.get("num_chunks", 4) >= 8:
        # Tokens over the study's whole wall time (compilation, building, evaluation, reports) against steady.
        result["fused_study_wall_over_steady"] = study["tokens"] / study["wall_seconds"] / study["tokens_per_second"]
    profile = result.get("profiles", {}).get(f"fused_mixed_k{k}_bs2")
    if profile and profile.get("busy_share") is not None:
        result["fused_gpu_busy_share"] = profile["busy_share"]
    # The same trials on both engines report per-chunk eval losses that differ by bf16 rounding only.
    diffs = result.setdefault("per_chunk_values_max_relative_difference", {})
    for name in (f"k{k}_bs2", "k4_bs16", "k2_bs32", f"dpo_k{k}_bs2"):
        sliced, fused = f"time_sliced_{name}", f"fused_{name}"
        if name.startswith("dpo"):
            sliced, fused = f"dpo_time_sliced_{name[4:]}", f"dpo_fused_{name[4:]}"
        if sliced in reported and fused in reported:
            diffs[name] = _max_relative_difference(reported[sliced], reported[fused])


FUSED_ISSUE_14_KEYS = (
    "fused_mixed_k8_bs2_over_ceiling",
    "fused_mixed_over_time_sliced_k8",
    "fused_study_wall_over_steady",
    "fused_over_parallel_processes",
    "fused_mixed_over_parallel_processes",
    "fused_memory_over_same_rows",
    "fused_memory_over_parallel_processes",
)
"""The fused part's summary keys of issue 14 (mixed gangs, whole study, plain-TRL processes, memory)."""

FUSED_ISSUE_19_KEYS = (
    "fused_gpu_busy_share",
    "fused_mixed_over_parallel_processes_82m",
    "fused_mixed_over_parallel_processes_8b",
    "fused_memory_mixed_over_equal",
    "compiled_ceiling_over_eager_ceiling",
)
"""The fused part's summary keys added by issue 19 (compiled passes: busy share, shapes, memory)."""


def _max_relative_difference(a: list[dict[int, float]], b: list[dict[int, float]]) -> float | None:
    """The largest relative difference between two studies' per-chunk values, trial by trial, step by step."""
    pairs = [(x[step], y[step]) for x, y in zip(a, b, strict=True) for step in x if step in y]
    return max((abs(x - y) / max(abs(x), 1e-12) for x, y in pairs), default=None)


def _configure_partial(trial: optuna.Trial, configure: Any, epochs: float) -> tuple[LoraConfig, SFTConfig]:
    """``configure``'s trial, trained for ``epochs`` of the data only (the first chunks)."""
    peft_config, args = configure(trial)
    args.num_train_epochs = epochs
    return peft_config, args


def _configure_two_chunks(trial: optuna.Trial, batch: int, chunks: int) -> tuple[LoraConfig, SFTConfig]:
    lr = trial.suggest_float("learning_rate", 1e-5, 1e-2, log=True)
    rank = trial.suggest_categorical("r", [8, 16])
    return lora(rank), sft_args(lr, batch, num_train_epochs=2 / chunks)


def _state_bytes(shape: str) -> int:
    """Adapter + Adam moments of LoRA r16 on q, k, v, o (fp32), for the budget of the scale part."""
    s = SHAPES[shape]
    head = s["hidden_size"] // s["num_attention_heads"]
    kv = s["num_key_value_heads"] * head
    per_layer = 16 * (4 * s["hidden_size"] + 2 * s["hidden_size"] + 2 * kv + 2 * s["hidden_size"])
    return per_layer * s["num_hidden_layers"] * 4 * 3


def _multi_gpu_devices(smoke: bool) -> list[str]:
    """The multi_gpu part's devices: every visible GPU, at least 2; on a machine without one, two CPU
    workers for a --smoke dry run of the harness. Exits with the reason otherwise."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count >= 2:
        return [f"cuda:{i}" for i in range(count)]
    if count == 0 and smoke:
        return ["cpu", "cpu"]
    raise SystemExit(
        f"multi_gpu compares one GPU with several: it needs at least 2 visible GPUs, but torch sees {count}"
        + (" (without a GPU, --smoke dry-runs it with two CPU workers)." if count == 0 else ".")
    )


def _tokens_per_trial(bench: Bench, rows: int) -> int:
    """Training tokens of one trial: packed 512-token rows, as many as the data fills."""
    tokenizer = AutoTokenizer.from_pretrained(bench.tokenizer_dir)
    text = bench.rows(rows)["text"]
    return sum(len(tokenizer(t + tokenizer.eos_token)["input_ids"]) for t in text)


def _time_to(completions: list[tuple[float, float]], target: float) -> float | None:
    best = math.inf
    for seconds, value in sorted(completions):
        best = min(best, value)
        if best <= target:
            return seconds
    return None


# -- reports ---------------------------------------------------------------------------------------


def write_reports(out: Path, results: dict[str, Any], command: str) -> None:
    """Write ``<part>.json`` for each part in ``results``, then rebuild the summary, table and plot."""
    out.mkdir(parents=True, exist_ok=True)
    info = machine()
    for name, data in results.items():
        (out / f"{name}.json").write_text(json.dumps({"command": command, "machine": info, **data}, indent=1))
    rebuild(out)


def rebuild(out: Path) -> None:
    """``summary.json``, ``results.md`` and ``performance.png`` from the part JSONs in ``out``.

    Parts may come from separate runs (one GPU, then two): each keeps its own command and machine.
    """

    def load(name: str) -> dict[str, Any] | None:
        path = out / f"{name}.json"
        return json.loads(path.read_text()) if path.exists() else None

    summary: dict[str, Any] = {}
    parts = {name: load(name) for name in ("throughput", "scale", "search", "fused", "grpo", "multi_gpu")}
    first = next((data for data in parts.values() if data), None)
    summary["device"] = ((first or {}).get("machine", {}).get("gpus") or ["cpu"])[0]
    throughput = parts["throughput"]
    if throughput:
        main = throughput["runs"][0]
        summary["switch_latency_ms_median"] = main["executor"]["switch_ms_median"]
        summary["switch_latency_ms_p95"] = main["executor"]["switch_ms_p95"]
        summary["interleaved_over_sequential_throughput"] = main["interleaved_over_sequential_throughput"]
        summary["interleaved_over_sequential_throughput_with_eval"] = main[
            "interleaved_over_sequential_throughput_with_eval"
        ]
        summary["eval_share_of_chunk_time"] = main["executor"]["eval_share"]
        summary["time_to_first_decision_speedup"] = main["time_to_first_decision_speedup"]
    search = parts["search"]
    if search:
        summary.update(search.get("aggregate", {}).get("ratios", {}))
    fused = parts["fused"]
    if fused:
        k = 8 if "fused_k8_bs2" in fused["runs"] else 3  # --smoke runs gangs of 3
        _fused_ratios(fused, k)  # from the runs the part finished
        for key in (
            "fused_k8_bs2_over_ceiling",
            "fused_over_time_sliced_throughput_k8",
            "fused_over_time_sliced_at_saturation",
            "fused_over_time_sliced_k2_bs32",
            "dpo_fused_over_time_sliced_k8",
            *FUSED_ISSUE_14_KEYS,
            *FUSED_ISSUE_19_KEYS,
        ):
            if key in fused:
                summary[key] = fused[key]
    grpo = parts["grpo"]
    if grpo:
        from benchmarks import grpo as grpo_part

        grpo_part.ratios(grpo)
        summary.update({key: grpo[key] for key in grpo_part.KEYS if key in grpo})
    multi = parts["multi_gpu"]
    if multi:
        summary["two_gpu_over_one_gpu_throughput"] = multi["two_gpu_over_one_gpu_throughput"]
        summary["two_gpu_over_one_gpu_wall"] = multi["one_gpu"]["wall_seconds"] / multi["all_gpus"]["wall_seconds"]
    summary["machines"] = {name: data["machine"] for name, data in parts.items() if data}
    summary["commands"] = {name: data["command"] for name, data in parts.items() if data}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "results.md").write_text(_markdown(out))
    _plots(out)


def _markdown(out: Path) -> str:
    def load(name: str) -> dict[str, Any] | None:
        path = out / f"{name}.json"
        return json.loads(path.read_text()) if path.exists() else None

    lines = ["# Benchmark results", ""]
    summary = load("summary") or {}
    lines += [f"Device: {summary.get('device')}", "", "| summary | value |", "|---|---|"]
    for key, value in summary.items():
        if key not in ("machines", "commands"):
            lines.append(f"| {key} | {value:.3f} |" if isinstance(value, float) else f"| {key} | {value} |")
    data = load("throughput")
    if data:
        lines += [
            "",
            "## Throughput (4 configs, sequential TRL vs interleaved)",
            "",
            "| model | sequential tok/s | interleaved tok/s (training) | ratio | ratio incl. eval | "
            "switch ms median / p95 | first decision s (seq / ours) | peak GB |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in data["runs"]:
            e = r["executor"]
            seq_tps, ratio_eval = (
                r["sequential"]["tokens_per_second"],
                r["interleaved_over_sequential_throughput_with_eval"],
            )
            lines.append(
                f"| {r['model']} | {seq_tps:.0f} | {e['training_tokens_per_second']:.0f} | "
                f"{r['interleaved_over_sequential_throughput']:.3f} | {ratio_eval:.3f} | "
                f"{e['switch_ms_median']:.2f} / {e['switch_ms_p95']:.2f} | "
                f"{r['sequential_time_to_first_decision_seconds']:.1f} / {e['time_to_first_decision_seconds']:.1f} | "
                f"{e['peak_memory_gb']:.2f} |"
            )
    data = load("scale")
    if data:
        lines += [
            "",
            f"## Scale ({data['model']})",
            "",
            "| live trials | switch ms median | p95 | offloads | peak GB |",
            "|---|---|---|---|---|",
        ]
        for r in data["results"]:
            median = "-" if r["switch_ms_median"] is None else f"{r['switch_ms_median']:.2f}"
            p95 = "-" if r["switch_ms_p95"] is None else f"{r['switch_ms_p95']:.2f}"
            lines.append(f"| {r['live_trials']} | {median} | {p95} | {r['offloads']} | {r['peak_memory_gb']:.2f} |")
    data = load("search")
    if data:
        from benchmarks import search as search_part

        lines += search_part.markdown(data)
    data = load("fused")
    if data:
        _fused_ratios(data, 8 if "fused_k8_bs2" in data["runs"] else 3)
        lines += [
            "",
            f"## Fused engine ({data['model']}, LoRA r16, 512-token rows, real studies through the executor)",
            "",
            "mixed: ranks 8-64, attention-only or all-linear targets, dropout 0-0.1; processes: one plain-TRL "
            "process per trial sharing the GPU, tokens/s from the go to the last end, peak = the sum of the "
            "processes' peaks (CUDA contexts not included).",
            "",
            "| run | engine | trials x batch | training tok/s | wall s | peak GB |",
            "|---|---|---|---|---|---|",
        ]
        for label, run in data["runs"].items():
            lines.append(
                f"| {label} | {run['engine']} | {run['trials']} x {run['batch']} | {run['tokens_per_second']:.0f} | "
                f"{run['wall_seconds']:.1f} | {run['peak_memory_gb']:.2f} |"
            )
        ratios = {
            "fused K=8 batch 2 / ceiling": "fused_k8_bs2_over_ceiling",
            "fused / time-sliced at K=8 batch 2": "fused_over_time_sliced_throughput_k8",
            "at K=4 batch 16 (saturation)": "fused_over_time_sliced_at_saturation",
            "at K=2 batch 32": "fused_over_time_sliced_k2_bs32",
            "DPO fused / time-sliced at K=8 batch 2": "dpo_fused_over_time_sliced_k8",
            "mixed gang fused / ceiling": "fused_mixed_k8_bs2_over_ceiling",
            "mixed gang fused / time-sliced": "fused_mixed_over_time_sliced_k8",
            "fused study of 8 chunks, tokens over its whole wall time / steady": "fused_study_wall_over_steady",
            "fused / plain-TRL processes sharing the GPU": "fused_over_parallel_processes",
            "mixed, fused / processes": "fused_mixed_over_parallel_processes",
            "peak memory, fused gang / one adapter at the gang's rows": "fused_memory_over_same_rows",
            "peak memory, fused gang / the processes' summed peaks": "fused_memory_over_parallel_processes",
        }
        said = [f"{text}: {data[key]:.3f}" for text, key in ratios.items() if key in data]
        diffs = data.get("per_chunk_values_max_relative_difference", {})
        lines += ["", "; ".join(said) + "."] if said else []
        if diffs:
            lines.append(
                "Largest relative difference of the per-chunk eval losses the same trials reported on the two "
                "engines (bf16): " + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items() if v is not None) + "."
            )
    data = load("grpo")
    if data:
        from benchmarks import grpo as grpo_part

        lines += grpo_part.markdown(data)
    data = load("fused_bf16")
    if data:
        lines += [
            "",
            f"## Fused pass in bf16 against each trial alone ({data['model']}, 5 mixed adapters)",
            "",
            "| gang | loss: gang vs alone | gradients: gang vs alone | gradients: gang vs float32 "
            "| gradients: alone vs float32 |",
            "|---|---|---|---|---|",
        ]
        for k, r in data["results"].items():
            lines.append(
                f"| {k} | {r['loss_max_relative_difference']:.1e} | {r['grad_max_relative_difference']:.1e} | "
                f"{r.get('gang_vs_float32_grad_max_relative_error', float('nan')):.1e} | "
                f"{r.get('alone_vs_float32_grad_max_relative_error', float('nan')):.1e} |"
            )
        lines.append("\nLargest relative differences over the trials; gradients per LoRA tensor, in Frobenius norm.")
    data = load("fused_probe")
    if data:
        tps = data["tokens_per_second"]
        lines += [
            "",
            "## Fused pass probe (llama-3.2-1b, 8 adapters r16, batch 2 x 512 each; the pass alone, no engine)",
            "",
            "| time-sliced tok/s | fused tok/s | one adapter at batch 32 (ceiling) tok/s "
            "| fused / time-sliced | fused / ceiling |",
            "|---|---|---|---|---|",
            f"| {tps['time_sliced_k8_bs2']:.0f} | {tps['fused_k8_bs2']:.0f} | {tps['ceiling_bs32']:.0f} | "
            f"{data['fused_over_time_sliced']:.2f} | {data['fused_over_ceiling']:.2f} |",
        ]
    data = load("multi_gpu")
    if data:
        lines += [
            "",
            f"## Several GPUs ({data['model']}, {data['configs']} configs)",
            "",
            "| | tokens/s (first trial start to last trial end) | trial window s | wall s (incl. process start) |",
            "|---|---|---|---|",
        ]
        for label in ("one_gpu", "all_gpus"):
            run = data[label]
            lines.append(
                f"| {label} | {run['tokens_per_second']:.0f} | {run['trial_window_seconds']:.1f} | "
                f"{run['wall_seconds']:.1f} |"
            )
        lines.append(f"\nRatio: {data['two_gpu_over_one_gpu_throughput']:.2f}")
    return "\n".join(lines) + "\n"


def _plots(out: Path) -> None:
    search_path = out / "search.json"
    if search_path.exists():
        from benchmarks import search as search_part

        search_part.plot(json.loads(search_path.read_text()), out / "search.png")
    try:
        import matplotlib
    except ImportError:  # a bare GPU image: the JSONs and results.md are written, the plots are not
        print("matplotlib is not installed: no performance.png", flush=True)
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grpo_path = out / "grpo.json"
    if grpo_path.exists():
        from benchmarks import grpo as grpo_part

        grpo_part.plot(json.loads(grpo_path.read_text()), out / "grpo.png")

    scale_path = out / "scale.json"
    throughput_path = out / "throughput.json"
    fused_path = out / "fused.json"
    if not (scale_path.exists() or throughput_path.exists() or fused_path.exists()):
        return
    figure, axes = plt.subplots(1, 3, figsize=(16, 4))
    if throughput_path.exists():
        runs = json.loads(throughput_path.read_text())["runs"]
        names = [r["model"] for r in runs]
        seq = [r["sequential"]["tokens_per_second"] for r in runs]
        ours = [r["executor"]["training_tokens_per_second"] for r in runs]
        x = range(len(names))
        axes[0].bar([i - 0.2 for i in x], seq, width=0.4, label="sequential TRL")
        axes[0].bar([i + 0.2 for i in x], ours, width=0.4, label="optuna-rapidfire (interleaved)")
        axes[0].set_xticks(list(x), names)
        axes[0].set_ylabel("training tokens / s")
        axes[0].legend()
        axes[0].set_title("Throughput, 4 configs")
    if scale_path.exists():
        results = json.loads(scale_path.read_text())["results"]
        ks = [r["live_trials"] for r in results if r["switch_ms_median"] is not None]
        axes[1].plot(
            ks,
            [r["switch_ms_median"] for r in results if r["switch_ms_median"] is not None],
            "o-",
            label="switch median (ms)",
        )
        axes[1].plot(
            ks, [r["switch_ms_p95"] for r in results if r["switch_ms_p95"] is not None], "s--", label="switch p95 (ms)"
        )
        axes[1].set_xlabel("live trials")
        axes[1].set_ylabel("ms")
        twin = axes[1].twinx()
        twin.plot(
            [r["live_trials"] for r in results],
            [r["peak_memory_gb"] for r in results],
            "^:",
            color="gray",
            label="peak GB",
        )
        twin.set_ylabel("peak GPU memory (GB)")
        axes[1].legend(loc="upper left")
        axes[1].set_title("Switch latency and memory vs live trials")
    if fused_path.exists():
        fused_runs = json.loads(fused_path.read_text())["runs"]
        labels = list(fused_runs)
        colors = ["gray" if r["engine"] == "time_sliced" and r["trials"] == 1 else "C0" for r in fused_runs.values()]
        engines = {"fused": "C1", "processes": "C2"}
        colors = [engines.get(r["engine"], c) for c, r in zip(colors, fused_runs.values(), strict=True)]
        axes[2].bar(labels, [r["tokens_per_second"] for r in fused_runs.values()], color=colors)
        axes[2].set_ylabel("training tokens / s")
        axes[2].tick_params(axis="x", labelrotation=60, labelsize=7)
        plt.setp(axes[2].get_xticklabels(), ha="right", rotation_mode="anchor")
        axes[2].set_title("Fused (orange), time-sliced (blue),\none adapter (gray), TRL processes (green)", fontsize=10)
    figure.tight_layout()
    figure.savefig(out / "performance.png", dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--parts", default="throughput,scale", help="throughput, scale, search, fused, grpo, multi_gpu or all"
    )
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--batch", type=int, default=4, help="per-trial batch of 512-token rows")
    search = parser.add_argument_group("search part (benchmarks/search.py); unset sizes take the defaults or --smoke's")
    search.add_argument(
        "--search-steps", default="all", help="pretrain, record, calibrate, validate, executor, replay, or all"
    )
    search.add_argument("--seeds", default=None, help="seeds of record and executor (default 0,1,2,3,4)")
    search.add_argument("--search-methods", default="lockstep,promote,clone", help="executor runs (d), (e), (f)")
    search.add_argument("--search-configs", type=int, default=None, help="configs per seed (default 32)")
    search.add_argument("--trial-rows", type=int, default=None, help="GSM8K rows each trial trains on (default 4096)")
    search.add_argument("--search-chunks", type=int, default=None, help="chunks per trial (default 8)")
    search.add_argument("--record-concurrency", type=int, default=None, help="live trials when recording (16)")
    search.add_argument("--search-concurrency", type=int, default=None, help="live trials of the executor runs (8)")
    search.add_argument("--processes", type=int, default=None, help="TRL processes sharing the GPU in (c) (8)")
    search.add_argument("--pretrain-seconds", type=float, default=None, help="pretraining time of the base (150)")
    search.add_argument("--corpus", default=None, help="folder of the pretraining corpus (.bench/corpus)")
    search.add_argument("--search-base", default=None, help="where the base model is cached (.bench/search-base)")
    parser.add_argument(
        "--rebuild", action="store_true", help="only rebuild summary, table and plot from the JSONs in --out"
    )
    parser.add_argument("--smoke", action="store_true", help="tiny model and sizes: a CPU dry run of the harness")
    parser.add_argument("--profile", action="store_true", help="fused part: also profile one fused study")
    parser.add_argument(
        "--fused-runs", default="", help="fused part: only these runs (comma-separated), merged into --out/fused.json"
    )
    parser.add_argument(
        "--grpo-runs", default="", help="grpo part: only these runs (comma-separated), merged into --out/grpo.json"
    )
    options = parser.parse_args(argv)
    if options.rebuild:
        rebuild(Path(options.out))
        return
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    known = ["throughput", "scale", "search", "fused", "grpo", "multi_gpu"]
    parts = known if options.parts == "all" else options.parts.split(",")
    unknown = sorted(set(parts) - set(known))
    if unknown:
        raise SystemExit(f"unknown parts {unknown}: choose among {', '.join(known)}, all")
    one_gpu_parts = [p for p in parts if p != "multi_gpu"]
    if one_gpu_parts and torch.cuda.device_count() > 1:
        raise SystemExit(
            f"{', '.join(one_gpu_parts)} measure one GPU (TRL's trainer would use DataParallel over "
            f"{torch.cuda.device_count()}): run them with CUDA_VISIBLE_DEVICES=0, and multi_gpu separately."
        )
    if "multi_gpu" in parts:
        _multi_gpu_devices(options.smoke)  # too few GPUs: say so before the other parts run
    bench = Bench(options)
    shapes = ["tiny"] if options.smoke else ["llama-3.2-1b", "tinyllama-1.1b"]
    results: dict[str, Any] = {}
    for part in parts:
        start = time.perf_counter()
        if part == "throughput":
            results[part] = {"runs": []}
            for shape in shapes:
                results[part]["runs"].append(bench.throughput(shape))
                bench.save(part, results[part])
        elif part in ("scale", "search", "fused", "grpo", "multi_gpu"):
            results[part] = getattr(bench, part)(shapes[0])
        else:
            raise SystemExit(f"unknown part {part!r}")
        results[part]["seconds"] = time.perf_counter() - start
        print(f"{part}: {results[part]['seconds']:.1f} s", flush=True)
        write_reports(
            Path(options.out),
            {part: results[part]},
            " ".join([sys.executable, "-m", "benchmarks.run", *(argv or sys.argv[1:])]),
        )


if __name__ == "__main__":
    main()
