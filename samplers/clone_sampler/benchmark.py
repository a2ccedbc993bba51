"""CloneSampler against its base sampler at equal budget, over several seeds (CPU, a few minutes a seed).

    python samplers/clone_sampler/benchmark.py --seeds 5 --out samplers/clone_sampler/benchmark.json

Task: LoRA SFT of the tiny local model on the bundled GSM8K slice, tuned with RapidFireExecutor (4 trials
at a time, MedianPruner). Budget: the same number of trials for both samplers. Reported per run: the
best final eval loss, and the chunks actually trained (a warm clone trains only from its branch on).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import optuna
import torch
from peft import LoraConfig
from trl import SFTConfig

from optuna_rapidfire import RapidFireExecutor
from optuna_rapidfire.demo import build_tiny_model, load_gsm8k
from optuna_rapidfire.samplers import CloneSampler


def configure(trial: optuna.Trial) -> tuple[LoraConfig, SFTConfig]:
    lora = LoraConfig(
        r=trial.suggest_categorical("r", [4, 8, 16]),
        lora_alpha=16,
        lora_dropout=trial.suggest_float("lora_dropout", 0.0, 0.3),
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
    )
    args = SFTConfig(
        learning_rate=trial.suggest_float("learning_rate", 1e-4, 1e-1, log=True),
        per_device_train_batch_size=8,
        num_train_epochs=1,
        max_length=256,
        bf16=False,
        gradient_checkpointing=False,
    )
    return lora, args


def run(sampler_name: str, seed: int, model: str, folder: Path, n_trials: int) -> dict:
    sampler: optuna.samplers.BaseSampler = optuna.samplers.TPESampler(seed=seed)
    if sampler_name == "clone":
        sampler = CloneSampler(sampler, seed=seed)
    executor = RapidFireExecutor(
        model=model,
        train_dataset=load_gsm8k("train", num_rows=256),
        eval_dataset=load_gsm8k("test", num_rows=32),
        num_chunks=8,
        max_concurrent_trials=4,
        seed=seed,
        output_dir=folder / f"{sampler_name}-{seed}",
        show_progress_bar=False,
        devices="cpu",
    )
    study = optuna.create_study(
        sampler=sampler, pruner=optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=1)
    )
    start = time.perf_counter()
    with executor:
        executor.optimize(study, configure, n_trials=n_trials)
    trained = sum(
        t.user_attrs.get("rapidfire:chunks_done", 0) - t.user_attrs.get("rapidfire:branch_step", 0)
        for t in study.trials
    )
    return {
        "sampler": sampler_name,
        "seed": seed,
        "best_eval_loss": study.best_value,
        "chunks_trained": trained,
        "warm_clones": sum(t.user_attrs.get("rapidfire:clone") == "warm" for t in study.trials),
        "cold_clones": sum(t.user_attrs.get("rapidfire:clone") == "cold" for t in study.trials),
        "pruned": sum(t.state == optuna.trial.TrialState.PRUNED for t in study.trials),
        "seconds": time.perf_counter() - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--n-trials", type=int, default=16)
    parser.add_argument("--out", default="benchmark.json")
    options = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model = str(build_tiny_model(folder / "model", vocab_size=2048))
        runs = [
            run(name, seed, model, folder, options.n_trials)
            for seed in range(options.seeds)
            for name in ("tpe", "clone")
        ]
    summary = {}
    for name in ("tpe", "clone"):
        mine = [r for r in runs if r["sampler"] == name]
        losses = [r["best_eval_loss"] for r in mine]
        summary[name] = {
            "best_eval_loss_mean": statistics.mean(losses),
            "best_eval_loss_stdev": statistics.stdev(losses) if len(losses) > 1 else 0.0,
            "chunks_trained_mean": statistics.mean(r["chunks_trained"] for r in mine),
            "warm_clones_mean": statistics.mean(r["warm_clones"] for r in mine),
        }
    wins = sum(c["best_eval_loss"] < t["best_eval_loss"] for t, c in zip(runs[0::2], runs[1::2], strict=True))
    report = {
        "command": f"python samplers/clone_sampler/benchmark.py --seeds {options.seeds} --n-trials {options.n_trials}",
        "machine": f"{platform.machine()} {platform.processor() or ''} {torch.get_num_threads()} threads, CPU".strip(),
        "versions": {"optuna": optuna.__version__, "torch": torch.__version__, "python": platform.python_version()},
        "runs": runs,
        "summary": summary,
        "clone_better_in": f"{wins}/{options.seeds}",
    }
    Path(options.out).write_text(json.dumps(report, indent=1))
    print("| sampler | best eval loss (mean ± sd) | chunks trained | warm clones |")
    print("|---|---|---|---|")
    for name, label in (("tpe", "TPE"), ("clone", "CloneSampler(TPE)")):
        s = summary[name]
        print(
            f"| {label} | {s['best_eval_loss_mean']:.4f} ± {s['best_eval_loss_stdev']:.4f} | "
            f"{s['chunks_trained_mean']:.1f} | {s['warm_clones_mean']:.1f} |"
        )
    print(f"CloneSampler better in {wins}/{options.seeds} seeds")


if __name__ == "__main__":
    main()
