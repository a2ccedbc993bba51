"""What users run today instead of the executor: one plain-TRL process per trial, all sharing one GPU.

The fused part's ``processes_*`` runs (issue 14). Each trial is an OS process that builds its own copy of
the model (the same random-weight shape and weights as the executor's), wraps it in the trial's LoRA and
trains TRL's ``SFTTrainer`` on the same GSM8K rows, batch and ``max_length`` as the executor's trial, with
no evaluation. The processes start together through :func:`benchmarks.harness.workers.spawn_workers`:

- before it says it is ready, each process imports, builds its model, trains 3 untimed steps of its own
  LoRA config (CUDA context, kernels, allocator) and builds its timed trainer (TRL tokenizes and packs
  the rows then); model loading and all that is outside the clock;
- once all are ready they get one go time; each trains, synchronizes the GPU and notes its end;
- tokens/s = the tokens all processes trained (TRL's own count) / (the last end - go);
- ``compiled``: each timed trainer has TRL's ``torch_compile=True`` and compiles inside the window, as a user's
  process compiles for each trial; the rate after every process's second step is reported beside it.

Memory: each process reports ``torch.cuda.max_memory_allocated()`` over its timed training (model,
adapter, optimizer, activations; the peak statistic is reset once the trainer is built), and the run sums
them. Each process's CUDA context (several hundred MB, outside PyTorch's allocator) and allocator cache
come on top of that sum; so do they for the executor, whose one context is not in its peak either.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from peft import get_peft_model
from transformers import TrainerCallback
from trl import SFTTrainer

from benchmarks.harness.measure import sync
from benchmarks.harness.models import build_model, sft_args, trial_lora
from benchmarks.harness.workers import spawn_workers, wait_for_go, worker_main, write_result
from optuna_rapidfire.demo import load_gsm8k


def run_processes(
    shape: str, tokenizer_dir: str, params: list[dict[str, Any]], batch: int, examples: int, compiled: bool = False
) -> dict[str, Any]:
    """One plain-TRL process per entry of ``params`` (a trial's params), started together on one device;
    ``compiled``: each trains with TRL's ``torch_compile=True`` (each compiles inside the timed window)."""
    specs = [
        {
            "shape": shape,
            "tokenizer": tokenizer_dir,
            "params": p,
            "batch": batch,
            "examples": examples,
            "compiled": compiled,
        }
        for p in params
    ]
    results = sorted(spawn_workers(specs, module="benchmarks.parts.processes"), key=_index)
    tokens = sum(r["tokens"] for r in results)
    window = max(r["end"] for r in results)  # seconds since the go
    peaks = [r["peak_memory_gb"] for r in results]
    # After each process's second step (compilation done), up to the last end: the rate they reach once warm.
    warm = [r for r in results if r.get("warm_tokens")]
    warm_window = max(r["end"] for r in warm) - max(r["warm_start"] for r in warm) if warm else 0.0
    return {
        "engine": "processes",
        "trials": len(params),
        "batch": batch,
        "tokens": tokens,
        "tokens_per_second": tokens / window,
        "tokens_per_second_after_second_step": (
            sum(r["warm_tokens"] for r in warm) / warm_window if warm_window > 0 else None
        ),
        "wall_seconds": window,
        "peak_memory_gb": sum(peaks),
        "peak_memory_gb_per_process": peaks,
        "reserved_memory_gb_per_process": [r["reserved_memory_gb"] for r in results],
        "processes": results,
        "failed": 0,  # a process that fails stops the run (spawn_workers raises with its log)
    }


class _StepTimes(TrainerCallback):
    """Notes when each optimizer step ends (the GPU synchronized), to tell compilation from steady training."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if len(self.times) < 3:
            sync()
        self.times.append(time.time())


def _index(result: dict[str, Any]) -> int:
    return int(result["index"])


def _memory_gb(statistic: Any) -> float:
    """A ``torch.cuda`` memory statistic (a function) in GiB; NaN without a GPU."""
    return statistic() / 2**30 if torch.cuda.is_available() else float("nan")


def _worker_main(spec_path: str) -> None:
    """``python -m benchmarks.parts.processes --worker SPEC``: one trial's plain-TRL process (see the module)."""
    spec = json.loads(Path(spec_path).read_text())
    folder, index, batch = Path(spec["dir"]), spec["index"], spec["batch"]
    params = spec["params"]
    started = time.time() - spec["spawned"]  # interpreter and imports
    model, tokenizer = build_model(spec["shape"], spec["tokenizer"])
    loaded = time.time() - spec["spawned"]
    rows = load_gsm8k("train", num_rows=spec["examples"], format="text")
    with tempfile.TemporaryDirectory(prefix="bench-process-") as scratch:
        warm = get_peft_model(model, trial_lora(params))
        SFTTrainer(
            model=warm,
            args=sft_args(float(params["learning_rate"]), batch, output_dir=scratch, max_steps=3),
            train_dataset=rows.select(range(min(16, len(rows)))),
            processing_class=tokenizer,
        ).train()
        base = warm.unload()
        del warm
        stamps = _StepTimes()
        trainer = SFTTrainer(
            model=get_peft_model(base, trial_lora(params)),
            args=sft_args(
                float(params["learning_rate"]), batch, output_dir=scratch, torch_compile=bool(spec.get("compiled"))
            ),
            train_dataset=rows,
            processing_class=tokenizer,
            callbacks=[stamps],
        )
        sync()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        ready = time.time() - spec["spawned"]
        go = wait_for_go(folder, index)
        begun = time.time()
        trainer.train()
        sync()
        end = time.time()
        steps = int(trainer.state.global_step)
        tokens = int(trainer._total_train_tokens)
        # Steps are equal (packed rows): the tokens after the second step, from its end to the last.
        warm_start = stamps.times[1] - go if len(stamps.times) > 2 else None
        warm_tokens = tokens * (steps - 2) // steps if warm_start is not None else 0
        result = {
            "index": index,
            "params": params,
            "imported_seconds": started,
            "loaded_seconds": loaded,
            "ready_seconds": ready,  # from spawn to ready: imports, model, warm-up steps, trainer
            "start": begun - go,
            "end": end - go,
            "train_seconds": end - begun,
            "tokens": tokens,
            "steps": steps,
            "warm_start": warm_start,
            "warm_tokens": warm_tokens,
            "first_step_seconds": stamps.times[0] - begun if stamps.times else None,
            "peak_memory_gb": _memory_gb(torch.cuda.max_memory_allocated),
            "reserved_memory_gb": _memory_gb(torch.cuda.max_memory_reserved),
        }
    write_result(folder, index, result)


if __name__ == "__main__":
    worker_main(_worker_main, "run the process baseline with: python -m benchmarks.run --parts fused --out DIR")
