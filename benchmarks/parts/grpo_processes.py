"""What users run today instead of a GRPO gang: one plain-TRL ``GRPOTrainer`` process per trial, all on one GPU.

The grpo part's ``processes_k8`` run (issue 35). Each trial is an OS process that builds its own copy of the
model (the same random-weight shape as the executor's), wraps it in the trial's LoRA (r16 on q, k, v, o) and
trains TRL's ``GRPOTrainer`` with the trial's ``GRPOConfig`` (:func:`benchmarks.parts.grpo.grpo_args`: the
same prompts, completions per prompt, batch, completion length, learning rate, KL beta and seed as the
executor's trial), generating with TRL's own ``model.generate``, and evaluating on the same test prompts
after each chunk's worth of steps (``eval_strategy="steps"``), as the executor evaluates after each chunk.
The processes start together through :func:`benchmarks.harness.workers.spawn_workers`: model and trainer are
built before the go (outside the clock, as the executor's model is loaded before its clock); the window is
from the go to the last process's end, the GPU synchronized.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

from peft import get_peft_model
from trl import GRPOTrainer

from benchmarks.harness.measure import sync
from benchmarks.harness.models import build_model, lora
from benchmarks.harness.workers import spawn_workers, wait_for_go, worker_main, write_result
from optuna_rapidfire.demo import gsm8k_reward, load_gsm8k


def run_processes(
    shape: str, tokenizer_dir: str, params: list[dict[str, Any]], sizes: dict[str, Any]
) -> dict[str, Any]:
    """One plain-TRL GRPO process per entry of ``params`` (a trial's params), started together on one device."""
    specs = [{"shape": shape, "tokenizer": tokenizer_dir, "params": p, "sizes": sizes} for p in params]
    results = sorted(spawn_workers(specs, module="benchmarks.parts.grpo_processes"), key=lambda r: int(r["index"]))
    return {
        "engine": "processes",
        "trials": len(params),
        "wall_seconds": max(r["end"] for r in results),
        "processes": results,
        "failed": 0,  # a process that fails stops the run (spawn_workers raises with its log)
    }


def _worker_main(spec_path: str) -> None:
    """``python -m benchmarks.parts.grpo_processes --worker SPEC``: one trial's plain-TRL GRPO process."""
    from benchmarks.parts.grpo import Sizes, grpo_args

    spec = json.loads(Path(spec_path).read_text())
    folder, index, params = Path(spec["dir"]), spec["index"], spec["params"]
    sizes = Sizes(**spec["sizes"])
    model, tokenizer = build_model(spec["shape"], spec["tokenizer"])
    train = load_gsm8k("train", num_rows=sizes.prompts, format="prompt_only")
    evaluation = load_gsm8k("test", num_rows=sizes.eval_prompts, format="prompt_only")
    steps = sizes.prompts * sizes.generations // sizes.batch  # one epoch
    with tempfile.TemporaryDirectory(prefix="bench-grpo-process-") as scratch:
        args = grpo_args(float(params["learning_rate"]), float(params["beta"]), int(params["seed"]), sizes)
        args.output_dir = scratch
        args.eval_strategy = "steps"
        args.eval_steps = max(1, steps // sizes.num_chunks)
        trainer = GRPOTrainer(
            model=get_peft_model(model, lora(16)),
            args=args,
            reward_funcs=[gsm8k_reward],
            train_dataset=train,
            eval_dataset=evaluation,
            processing_class=tokenizer,
        )
        sync()
        go = wait_for_go(folder, index)
        begun = time.time()
        trainer.train()
        sync()
        end = time.time()
        result = {
            "index": index,
            "params": params,
            "start": begun - go,
            "end": end - go,
            "train_seconds": end - begun,
            "steps": int(trainer.state.global_step),
            "evaluations": sum("eval_reward" in entry for entry in trainer.state.log_history),
        }
    write_result(folder, index, result)


if __name__ == "__main__":
    worker_main(_worker_main, "run the GRPO process baseline with: python -m benchmarks.run --parts grpo --out DIR")
