"""The search part's section of results.md (also search.md), its summary keys, and search.png."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.parts.search.settings import say


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, str | int):
        return str(value)
    return f"{value:.{digits}f}"


def _reached(value: float | None) -> str:
    return "never" if value is None else f"{value:.0f}"


def markdown(data: dict[str, Any]) -> list[str]:
    """The search section: per replicate one row per method, then the medians over replicates."""
    settings = data.get("settings", {}).get("values", {})
    machine = data.get("machine", {})
    lines = [
        "",
        f"## Search: time to a good config, every method run for real ({settings.get('configs')} configs, "
        f"{settings.get('trial_rows')} GSM8K rows per trial in {settings.get('num_chunks')} chunks, "
        f"{settings.get('eval_rows')} eval rows after every chunk, MedianPruner(n_startup_trials=5, n_warmup_steps=1))",
        "",
        f"Machine: {', '.join(machine.get('gpus') or ['cpu'])}; torch {machine.get('torch')}, transformers "
        f"{machine.get('transformers')}, TRL {machine.get('trl')}, PEFT {machine.get('peft')}, Optuna "
        f"{machine.get('optuna')}.",
        "Targets per replicate: within 1% of the best COMPLETE value any method reached (best), and within 1% of the "
        "third-best config's (loose). Seconds from before each method's first model load (each process warmed up "
        "once, untimed).",
    ]
    for seed, replicate in sorted(data.get("replicates", {}).items(), key=lambda item: int(item[0])):
        goal = replicate.get("targets") or {}
        lines += [
            "",
            f"### Replicate {seed} (configs from RandomSampler(seed={seed}), base {replicate.get('base')}, code "
            f"{replicate.get('code') or 'of several versions'}; target "
            f"{_fmt(goal.get('best'), 4)}, loose {_fmt(goal.get('loose'), 4)})",
            "",
            "| method | time to target s | to loose target s | wall s | best | chunks | complete / pruned / fail "
            "| GPU busy | passes with 2+ members | compile s |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for row in replicate.get("results", {}).values():
            states = row["states"]
            lines.append(
                f"| {row['label']} | {_reached(row['time_to_target'])} | {_reached(row['time_to_loose_target'])} | "
                f"{row['wall']:.0f} | {_fmt(row['best'], 4)} | {row['chunks']} | "
                f"{states['COMPLETE']} / {states['PRUNED']} / {states['FAIL']} | {_fmt(row['gpu_busy_share'], 2)} | "
                f"{_fmt(row.get('multi_member_pass_share'), 2)} | {_fmt(row.get('compile_seconds'))} |"
            )
        for name, run in replicate.get("methods", {}).items():
            if "error" in run:
                lines.append(f"| {name} | failed: {run['error'].splitlines()[0][:200]} | | | | | | | | |")
        for row in replicate.get("results", {}).values():
            times = row.get("times")
            if times:
                lines += [
                    "",
                    f"{row['label']}: wall {row['wall']:.1f} s; first pass at {_fmt(row.get('first_pass_at'))} s; "
                    f"passes {_fmt(row.get('pass_seconds'))} s (host); evaluation {times['evaluation']:.1f} s, "
                    f"trial builds {times['builds']:.1f} s, chunk states copied to the host "
                    f"{times['state_copies']:.1f} s ({times['state_bytes'] / 1e6:.0f} MB, {times['chunks']} chunks).",
                ]
        compared = replicate.get("comparison") or {}
        if compared:
            lines += ["", ", ".join(f"{key} {_fmt(value, 2)}" for key, value in compared.items()) + "."]
    for key, title in (
        ("aggregate", f"Medians over the replicates measured at code {data.get('aggregate', {}).get('code')}"),
        ("aggregate_all", "Medians over every replicate (code of several versions)"),
    ):
        medians = {name: value for name, value in data.get(key, {}).items() if name != "code"}
        if medians:
            lines += [
                "",
                f"{title} (method / executor: > 1 means the executor is sooner): "
                + ", ".join(f"{name} {_fmt(value, 2)}" for name, value in medians.items())
                + ".",
            ]
    for mark, base in data.get("bases", {}).items():
        lines.append(
            f"Base {mark}: {base['parameters'] / 1e6:.3g}M-parameter Llama pretrained {base['steps']} steps "
            f"({base['train_seconds']:.0f} s, {base['tokens_per_second'] / 1e3:.0f}k tokens/s on {base['device']}) "
            f"on {base['corpus_tokens'] / 1e6:.1f}M corpus tokens, final train loss {base['final_train_loss']:.2f}."
        )
    return lines


def plot(data: dict[str, Any], path: Path) -> None:
    """search.png: per replicate, every method's best COMPLETE value against its seconds, with the targets."""
    replicates = sorted(data.get("replicates", {}).items(), key=lambda item: int(item[0]))
    replicates = [(seed, r) for seed, r in replicates if r.get("results")]
    if not replicates:
        return
    try:
        import matplotlib
    except ImportError:
        say("matplotlib is not installed: no search.png")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(replicates), figsize=(7 * len(replicates), 4.5), squeeze=False)
    for axis, (seed, replicate) in zip(axes[0], replicates, strict=True):
        for color, row in enumerate(replicate["results"].values()):
            curve = row["curve"]
            if not curve:
                continue
            times = [t for t, _ in curve] + [row["wall"]]
            values = [v for _, v in curve] + [curve[-1][1]]
            axis.step(times, values, where="post", color=f"C{color}", label=row["label"])
        goal = replicate.get("targets") or {}
        for name, style in (("best", "--"), ("loose", ":")):
            if name in goal:
                axis.axhline(goal[name], color="gray", linestyle=style, linewidth=1, label=f"target ({name})")
        axis.set_xlabel("seconds since the method started")
        axis.set_ylabel("best COMPLETE eval loss so far")
        axis.set_title(f"Replicate {seed}")
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def summary(data: dict[str, Any]) -> dict[str, Any]:
    """The part's keys of summary.json: medians over the replicates measured at the latest call's code (``search_code``)
    of method / executor (> 1: the executor sooner)."""
    medians = data.get("aggregate", {})
    keys = {
        "search_time_to_target_vs_processes": "time_to_target_vs_processes",
        "search_time_to_loose_target_vs_processes": "time_to_loose_target_vs_processes",
        "search_time_to_target_vs_sequential": "time_to_target_vs_sequential",
        "search_wall_vs_processes": "wall_vs_processes",
        "search_multi_member_pass_share": "multi_member_pass_share",
        "search_compile_share": "compile_share",
        "search_replicates": "replicates",
        "search_code": "code",
    }
    return {key: medians.get(name) for key, name in keys.items()} if medians else {}
