"""The report of ``python -m benchmarks.run``: each part's JSON, then ``summary.json``, ``results.md`` and the
plots, rebuilt from whatever part JSONs are in ``--out``.

Parts may come from separate runs (one GPU, then two): each keeps its own command and machine. The parts own
their summary keys and sections (``summary(data)``, ``markdown(data)``); this module orders them, and adds the
sections of the standalone probes' results (``fused_bf16.json``, ``fused_probe.json``) and ``performance.png``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.harness.environment import machine
from benchmarks.parts import fused_summary, grpo, multi_gpu, scale, search, throughput

PARTS = ("throughput", "scale", "search", "fused", "grpo", "multi_gpu")


def write_reports(out: Path, results: dict[str, Any], command: str) -> None:
    """Write ``<part>.json`` for each part in ``results``, then rebuild the summary, table and plot."""
    out.mkdir(parents=True, exist_ok=True)
    info = machine()
    for name, data in results.items():
        (out / f"{name}.json").write_text(json.dumps({"command": command, "machine": info, **data}, indent=1))
    rebuild(out)


def _load(out: Path, name: str) -> dict[str, Any] | None:
    path = out / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def rebuild(out: Path) -> None:
    """``summary.json``, ``results.md`` and ``performance.png`` from the part JSONs in ``out`` (the search part's
    targets, comparisons and medians recomputed from its runs first)."""
    search_path = out / "search.json"
    if search_path.exists():
        found = json.loads(search_path.read_text())
        search.finalize(found)
        search_path.write_text(json.dumps(found, indent=1))
    summary: dict[str, Any] = {}
    parts = {name: _load(out, name) for name in PARTS}
    first = next((data for data in parts.values() if data), None)
    summary["device"] = ((first or {}).get("machine", {}).get("gpus") or ["cpu"])[0]
    summaries = {
        "throughput": throughput.summary,
        "search": search.summary,
        "fused": fused_summary.summary,  # from the runs the part finished
        "grpo": grpo.summary,
        "multi_gpu": multi_gpu.summary,
    }
    for name, part_summary in summaries.items():
        data = parts[name]
        if data:
            summary.update(part_summary(data))
    summary["machines"] = {name: data["machine"] for name, data in parts.items() if data}
    summary["commands"] = {name: data["command"] for name, data in parts.items() if data}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "results.md").write_text(_markdown(out))
    _plots(out)


def _markdown(out: Path) -> str:
    lines = ["# Benchmark results", ""]
    summary = _load(out, "summary") or {}
    lines += [f"Device: {summary.get('device')}", "", "| summary | value |", "|---|---|"]
    for key, value in summary.items():
        if key not in ("machines", "commands"):
            lines.append(f"| {key} | {value:.3f} |" if isinstance(value, float) else f"| {key} | {value} |")
    sections = {
        "throughput": throughput.markdown,
        "scale": scale.markdown,
        "search": search.markdown,
        "fused": fused_summary.markdown,
        "grpo": grpo.markdown,
        "fused_bf16": _fused_bf16_markdown,
        "fused_probe": _fused_probe_markdown,
        "multi_gpu": multi_gpu.markdown,
    }
    for name, section in sections.items():
        data = _load(out, name)
        if data:
            lines += section(data)
    return "\n".join(lines) + "\n"


def _fused_bf16_markdown(data: dict[str, Any]) -> list[str]:
    """``python -m benchmarks.fused_bf16``'s results."""
    lines = [
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
    return lines


def _fused_probe_markdown(data: dict[str, Any]) -> list[str]:
    """``python -m benchmarks.fused_probe``'s results."""
    tps = data["tokens_per_second"]
    return [
        "",
        "## Fused pass probe (llama-3.2-1b, 8 adapters r16, batch 2 x 512 each; the pass alone, no engine)",
        "",
        "| time-sliced tok/s | fused tok/s | one adapter at batch 32 (ceiling) tok/s "
        "| fused / time-sliced | fused / ceiling |",
        "|---|---|---|---|---|",
        f"| {tps['time_sliced_k8_bs2']:.0f} | {tps['fused_k8_bs2']:.0f} | {tps['ceiling_bs32']:.0f} | "
        f"{data['fused_over_time_sliced']:.2f} | {data['fused_over_ceiling']:.2f} |",
    ]


def _plots(out: Path) -> None:
    search_path = out / "search.json"
    if search_path.exists():
        data = json.loads(search_path.read_text())
        (out / "search.md").write_text("# Search benchmark\n" + "\n".join(search.markdown(data)) + "\n")
        search.plot(data, out / "search.png")
    try:
        import matplotlib
    except ImportError:  # a bare GPU image: the JSONs and results.md are written, the plots are not
        print("matplotlib is not installed: no performance.png", flush=True)
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grpo_path = out / "grpo.json"
    if grpo_path.exists():
        grpo.plot(json.loads(grpo_path.read_text()), out / "grpo.png")

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
