"""The search part's section of results.md, its summary keys, and search.png."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.parts.search.aggregate import quantile
from benchmarks.parts.search.settings import say
from benchmarks.parts.search.space import METHODS, TARGET_SLACK


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown(data: dict[str, Any]) -> list[str]:
    """The search section of results.md."""
    settings = data.get("settings", {}).get("values", {})
    seeds = data.get("seeds", [])
    pretrain = data.get("pretrain", {})
    lines = [
        "",
        f"## Search: time to the best config ({len(seeds)} seeds x {settings.get('configs')} configs, "
        f"{settings.get('trial_rows')} GSM8K rows per trial in {settings.get('num_chunks')} chunks)",
        "",
        "Target: within 1% of the best final eval loss of the seed's exhaustive sweep. (a)-(c) replayed from "
        "recorded values and calibrated TRL times; (d)-(f) real. Regret = (best held - best) / best.",
        "",
        "| method | seeds | time to target s, median [IQR] | never reached | wall s, median "
        "| regret when (b) ends, median | chunks trained, median |",
        "|---|---|---|---|---|---|---|",
    ]
    for method, row in data.get("aggregate", {}).get("methods", {}).items():
        regret = row["regret_at_b_end_median"]
        held = "none complete" if regret is None else f"{100 * regret:.2f}%"
        lines.append(
            f"| {METHODS[method]} | {row['seeds']} | {_fmt(row['time_to_target_median'])} "
            f"[{_fmt(row['time_to_target_q25'])}, {_fmt(row['time_to_target_q75'])}] | {row['never_reached']} | "
            f"{_fmt(row['wall_median'])} | {held} | "
            f"{_fmt(row['chunks_median'], 0)} |"
        )
    ratios = data.get("aggregate", {}).get("ratios", {})
    said = [f"{key} {value:.2f}" for key, value in ratios.items() if value is not None]
    if said:
        lines += ["", "Median time to target, ratios: " + ", ".join(said) + "."]
    check = data.get("replay_check", {})
    for name, result in check.items():
        if isinstance(result, str):
            lines.append(f"Replay check {name}: {result}.")
        elif name == "exhaustive":
            lines.append(
                f"Replay check (a), one config trained fully with TRL: value {result['value_real']:.4f} vs recorded "
                f"{result['value_recorded']:.4f} ({100 * result['value_relative_difference']:.2f}%), time "
                f"{100 * result['total_relative_difference']:.1f}% off the replay's."
            )
        else:
            lines.append(
                f"Replay check {name} ({result['configs']} configs, {result['workers']} worker(s), "
                f"{result['chunks']} chunks): decisions agree {result['decisions_agree']}, values within "
                f"{100 * (result['values_max_relative_difference'] or 0):.2f}%, wall {result['wall_real']:.1f} s real "
                f"vs {result['wall_replay']:.1f} s replayed."
            )
    if pretrain:
        lines.append(
            f"Base: {pretrain['parameters'] / 1e6:.3g}M-parameter Llama pretrained "
            f"{pretrain['train_seconds']:.0f} s on {pretrain['corpus_tokens'] / 1e6:.1f}M corpus tokens, "
            f"{pretrain['tokens_per_second'] / 1e3:.0f}k tokens/s, final train loss {pretrain['final_train_loss']:.2f}."
        )
    return lines


def plot(data: dict[str, Any], path: Path) -> None:
    """search.png: per method, the median regret of the best COMPLETE value against seconds, IQR band."""
    seeds = data.get("seeds", [])
    if not seeds:
        return
    try:
        import matplotlib
    except ImportError:
        say("matplotlib is not installed: no search.png")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    floor = 1e-4
    times = [t for seed in seeds for m in seed["methods"].values() for t, _ in m["curve"]]
    if not times:
        return
    grid = np.logspace(math.log10(max(min(times), 1e-2)), math.log10(max(times)), 300)
    figure, axis = plt.subplots(figsize=(9, 5))
    for color, method in enumerate(METHODS):
        rows = []
        for seed in seeds:
            if method not in seed["methods"]:
                continue
            curve = seed["methods"][method]["curve"]
            best = seed["best_exhaustive"]
            row = np.full(len(grid), np.inf)
            for t, v in curve:
                row[grid >= t] = max((v - best) / best, floor)
            rows.append(row)
        if not rows:
            continue
        table = np.array(rows)
        middle, low, high = (np.array([quantile(list(col), q) for col in table.T]) for q in (0.5, 0.25, 0.75))
        shown = np.isfinite(middle)
        axis.plot(grid[shown], middle[shown], color=f"C{color}", label=f"{METHODS[method]} ({len(rows)} seeds)")
        band = np.isfinite(high)
        axis.fill_between(grid[band], low[band], high[band], color=f"C{color}", alpha=0.15)
    axis.axhline(TARGET_SLACK, color="gray", linestyle="--", linewidth=1, label="target (1%)")
    axis.set_xscale("log")
    axis.set_yscale("log")
    axis.set_xlabel("seconds since the method started")
    axis.set_ylabel("regret of the best complete trial (median, IQR; floor 1e-4)")
    axis.legend(fontsize=8)
    axis.set_title("Time to the best fine-tuning config")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def summary(data: dict[str, Any]) -> dict[str, Any]:
    """The part's keys of summary.json: the ratios of the medians of time to target."""
    return dict(data.get("aggregate", {}).get("ratios", {}))
