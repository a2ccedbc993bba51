"""The fused part's ratios, summary keys and report section, from whichever of its runs a result holds."""

from __future__ import annotations

from typing import Any

ISSUE_14_KEYS = (
    "fused_mixed_k8_bs2_over_ceiling",
    "fused_mixed_over_time_sliced_k8",
    "fused_study_wall_over_steady",
    "fused_over_parallel_processes",
    "fused_mixed_over_parallel_processes",
    "fused_memory_over_same_rows",
    "fused_memory_over_parallel_processes",
)
"""The fused part's summary keys of issue 14 (mixed gangs, whole study, plain-TRL processes, memory)."""

ISSUE_19_KEYS = (
    "fused_gpu_busy_share",
    "fused_mixed_over_parallel_processes_82m",
    "fused_mixed_over_parallel_processes_8b",
    "fused_memory_mixed_over_equal",
    "compiled_ceiling_over_eager_ceiling",
)
"""The fused part's summary keys added by issue 19 (compiled passes: busy share, shapes, memory)."""

SUMMARY_KEYS = (
    "fused_k8_bs2_over_ceiling",
    "fused_over_time_sliced_throughput_k8",
    "fused_over_time_sliced_at_saturation",
    "fused_over_time_sliced_k2_bs32",
    "dpo_fused_over_time_sliced_k8",
    *ISSUE_14_KEYS,
    *ISSUE_19_KEYS,
)
"""The fused part's keys of summary.json, in their order there."""


def gang_size(data: dict[str, Any]) -> int:
    """The part's K: 8, or 3 for a --smoke run."""
    return 8 if "fused_k8_bs2" in data["runs"] else 3


def _best(tps: dict[str, float], *labels: str) -> float | None:
    """The best tokens/s among the runs ``labels`` that were measured (``None``: none was)."""
    found = [tps[label] for label in labels if label in tps]
    return max(found) if found else None


def ratios(result: dict[str, Any], k: int) -> None:
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
    throughput = {
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
    for key, (ours, theirs) in throughput.items():
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
            diffs[name] = max_relative_difference(reported[sliced], reported[fused])


def max_relative_difference(a: list[dict[int, float]], b: list[dict[int, float]]) -> float | None:
    """The largest relative difference between two studies' per-chunk values, trial by trial, step by step."""
    pairs = [(x[step], y[step]) for x, y in zip(a, b, strict=True) for step in x if step in y]
    return max((abs(x - y) / max(abs(x), 1e-12) for x, y in pairs), default=None)


def summary(data: dict[str, Any]) -> dict[str, Any]:
    """The part's keys of summary.json, from the runs the part finished (the ratios are recomputed)."""
    ratios(data, gang_size(data))
    return {key: data[key] for key in SUMMARY_KEYS if key in data}


def markdown(data: dict[str, Any]) -> list[str]:
    """The part's section of results.md."""
    ratios(data, gang_size(data))
    lines = [
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
    said_keys = {
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
    said = [f"{text}: {data[key]:.3f}" for text, key in said_keys.items() if key in data]
    diffs = data.get("per_chunk_values_max_relative_difference", {})
    lines += ["", "; ".join(said) + "."] if said else []
    if diffs:
        lines.append(
            "Largest relative difference of the per-chunk eval losses the same trials reported on the two "
            "engines (bf16): " + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items() if v is not None) + "."
        )
    return lines
