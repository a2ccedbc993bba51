"""Two workers on one study, as two nodes: ``optuna-rapidfire worker`` processes, one per GPU.

    python -m benchmarks.multinode --out benchmarks/results        # needs 2 GPUs
    RF_BENCH_SMOKE=1 python -m benchmarks.multinode --out /tmp/nodes   # CPU dry run

Each worker sees one GPU (``CUDA_VISIBLE_DEVICES``), shares the study's storage (SQLite here;
PostgreSQL across machines) and an artifact folder (a shared filesystem or S3 across machines), and
records heartbeats. Two runs of 16 configs (Llama-3.2-1B shape, bf16, LoRA r16, 8 chunks of 32 packed
512-token rows): ``clean`` (both workers to the end) and ``fault`` (worker 1 is SIGKILLed mid-chunk once
its trials have trained half their chunks; they are retried on worker 0 from their last per-chunk
checkpoints). Writes ``multinode.json`` and ``multinode.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import optuna
from optuna.artifacts import FileSystemArtifactStore

SMOKE = os.environ.get("RF_BENCH_SMOKE") == "1"  # CPU dry run: tiny model, 4 configs
CONFIGS = 4 if SMOKE else 16
ROWS, CHUNKS, BATCH = (32, 4, 2) if SMOKE else (256, 8, 4)
SHAPE, DEVICE = ("tiny", "cpu") if SMOKE else ("llama-3.2-1b", "cuda:0")


def app(devices: str) -> tuple[Any, Any, dict[str, Any]]:
    """What each worker runs (``--app benchmarks.multinode:app``)."""
    import functools

    from benchmarks.harness.models import build_model, configure_from_params
    from optuna_rapidfire import RapidFireExecutor
    from optuna_rapidfire.demo import load_gsm8k

    executor = RapidFireExecutor(
        model=functools.partial(build_model, SHAPE, os.environ["RF_BENCH_TOKENIZER"]),
        train_dataset=load_gsm8k("train", num_rows=ROWS, format="text"),
        eval_dataset=load_gsm8k("test", num_rows=64, format="text"),
        num_chunks=CHUNKS,
        max_concurrent_trials=2 if SMOKE else 8,
        output_dir=os.environ["RF_BENCH_OUTPUT"],
        artifact_store=FileSystemArtifactStore(os.environ["RF_BENCH_ARTIFACTS"]),
        show_progress_bar=False,
        dashboard_controls=False,
        devices=devices,
    )
    return executor, configure_from_params(BATCH), {"pruner": optuna.pruners.NopPruner()}


def _run(workdir: Path, name: str, kill_after_chunks: int | None) -> dict[str, Any]:
    folder = workdir / name
    (folder / "artifacts").mkdir(parents=True)
    url = f"sqlite:///{folder / 'study.db'}"
    study = optuna.create_study(storage=url, study_name=name, pruner=optuna.pruners.NopPruner())
    for i in range(CONFIGS):
        study.enqueue_trial({"learning_rate": 1e-4 * (1 + i % 4), "r": 16 if i % 2 == 0 else 8})
    env = {
        **os.environ,
        "RF_BENCH_ARTIFACTS": str(folder / "artifacts"),
        "RF_BENCH_OUTPUT": str(folder / "out"),
        "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]),
    }
    command = [sys.executable, "-m", "optuna_rapidfire", "worker", "--storage", url, "--study-name", name]
    command += ["--app", "benchmarks.multinode:app", "--devices", DEVICE, "--study-trials", str(CONFIGS)]
    command += ["--heartbeat-interval", "2", "--grace-period", "6"]
    start = time.perf_counter()
    workers = []
    for gpu in (0, 1):
        log = open(folder / f"worker{gpu}.log", "wb")  # noqa: SIM115 - closed below
        workers.append(
            (
                subprocess.Popen(
                    command, env={**env, "CUDA_VISIBLE_DEVICES": str(gpu)}, stdout=log, stderr=subprocess.STDOUT
                ),
                log,
            )
        )
    killed_at = None
    if kill_after_chunks is not None:
        while killed_at is None:
            running = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
            victim = str(workers[1][0].pid)
            busy = [t for t in running if victim in t.user_attrs.get("rapidfire:worker", "")]
            if any(len(t.intermediate_values) >= kill_after_chunks for t in busy):
                workers[1][0].send_signal(signal.SIGKILL)
                killed_at = time.perf_counter() - start
            if workers[0][0].poll() is not None:
                break
            time.sleep(0.2)
    codes = [process.wait(timeout=540) for process, _ in workers]
    wall = time.perf_counter() - start
    for _, log in workers:
        log.close()
    trials = study.get_trials()
    complete = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    retries = [t for t in trials if "failed_trial" in t.system_attrs]
    window = max(t.datetime_complete for t in complete) - min(t.datetime_start for t in trials)
    links = [t.system_attrs.get("rapidfire:checkpoint") for t in complete]
    return {
        "exit_codes": codes,
        "wall_seconds": wall,
        "trial_window_seconds": window.total_seconds(),
        "killed_worker_1_at_seconds": killed_at,
        "complete": len(complete),
        "distinct_configs_complete": len({(t.params["learning_rate"], t.params["r"]) for t in complete}),
        "failed_by_heartbeat": sum(t.state == optuna.trial.TrialState.FAIL for t in trials),
        "retries": [
            {
                "trial": t.number,
                "retry_of": t.user_attrs.get("rapidfire:retry_of"),
                "resumed_from_step": t.user_attrs.get("rapidfire:resumed_from_step"),
                "resume_failed": t.user_attrs.get("rapidfire:resume_failed"),
                "state": t.state.name,
            }
            for t in retries
        ],
        "chunks_retrained": sum(
            (
                len(next(x for x in trials if x.number == t.system_attrs["failed_trial"]).intermediate_values)
                - (t.user_attrs.get("rapidfire:resumed_from_step") or 0)
            )
            for t in retries
        ),
        "checkpoint_mb": (links[0] or {}).get("bytes", 0) / 2**20 if links else 0,
        "workers": sorted({t.user_attrs.get("rapidfire:worker", "").split(":")[1] for t in complete}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--rebuild", action="store_true", help="only rewrite multinode.md from multinode.json")
    options = parser.parse_args()
    if options.rebuild:
        out = Path(options.out)
        (out / "multinode.md").write_text(markdown(json.loads((out / "multinode.json").read_text())))
        return
    from benchmarks.harness.environment import machine
    from optuna_rapidfire.demo import build_tiny_model

    workdir = Path(tempfile.mkdtemp(prefix="rapidfire-nodes-"))
    os.environ["RF_BENCH_TOKENIZER"] = str(build_tiny_model(workdir / "tokenizer", vocab_size=2048))
    results = {
        "command": " ".join([sys.executable, "-m", "benchmarks.multinode", *sys.argv[1:]]),
        "machine": machine(),
        "configs": CONFIGS,
        "clean": _run(workdir, "clean", None),
        "fault": _run(workdir, "fault", kill_after_chunks=CHUNKS // 2),
    }
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "multinode.json").write_text(json.dumps(results, indent=1))
    (out / "multinode.md").write_text(markdown(results))
    print(markdown(results))


def markdown(results: dict[str, Any]) -> str:
    lines = [
        "# Two workers, one study (one per GPU, as two nodes)",
        "",
        "| run | wall s | trial window s | trials complete | failed by heartbeat | retried as (resumed from chunk) "
        "| chunks retrained | checkpoint MB per trial and chunk |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in ("clean", "fault"):
        r = results[name]
        resumed = ", ".join(f"{x['retry_of']}→{x['trial']} ({x['resumed_from_step']})" for x in r["retries"]) or "-"
        lines.append(
            f"| {name} | {r['wall_seconds']:.1f} | {r['trial_window_seconds']:.1f} | "
            f"{r['complete']}/{results['configs']} "
            f"| {r['failed_by_heartbeat']} | {resumed} | {r['chunks_retrained']} | {r['checkpoint_mb']:.1f} |"
        )
    killed = results["fault"]["killed_worker_1_at_seconds"]
    if killed is not None:
        lines.append(f"\nIn `fault`, worker 1 was killed (SIGKILL) {killed:.0f} s in.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
