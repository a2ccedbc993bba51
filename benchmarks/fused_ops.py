"""How many operators one fused pass launches, by gang shape (issue 14 groundwork; any machine).

    python -m benchmarks.fused_ops --out benchmarks/results            # CPU is fine: it counts, not times

On a small model every search method is launch-bound (benchmarks/README.md, search on the H200): a step's
cost follows the number of operators it dispatches, not its FLOPs. This script builds the search
benchmark's model shape (an 82M Llama: hidden 768, 12 layers) with random weights, and counts the ATen
operators of one forward + backward pass, with torch.profiler, for:

* ``alone``: one adapter (r16, attention targets) on 8 rows, through the fused pass as a lone trial;
* ``equal_k``: K adapters of one shape (r16, attention targets, no dropout) on 8 rows each;
* ``equal_stacked``: the same gang with its adapters kept stacked (``_fused/_stacks.py``, as GRPO gangs' shared
  passes read them), the stacks' load and the gradients' hand-out counted with the pass;
* ``mixed_k``: K adapters as a search makes them: ranks 8/16/32/64, attention or all-linear targets,
  dropout 0.05, rows 4/8/16.

It writes ``fused_ops.json``: operators per pass, per member, and the ones called most. Counts do not
depend on the machine (the same dispatcher calls run on a CPU and a GPU); times here are CPU times and
only say where a CPU spends the pass.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks.harness.environment import machine
from benchmarks.parts.search.settings import BASE_MODEL
from optuna_rapidfire._fused._fused_pass import Gang, fused_forward, layer_plans, segment_losses
from optuna_rapidfire._fused._stacks import GangStacks
from optuna_rapidfire._resident._model import ResidentModel

MODEL = BASE_MODEL
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL_LINEAR = [*ATTENTION, "gate_proj", "up_proj", "down_proj"]


def _members(kind: str, k: int) -> list[dict[str, Any]]:
    if kind == "alone":
        return [{"r": 16, "targets": ATTENTION, "dropout": 0.0, "rows": 8}]
    if kind in ("equal", "equal_stacked"):
        return [{"r": 16, "targets": ATTENTION, "dropout": 0.0, "rows": 8} for _ in range(k)]
    ranks, rows = (8, 16, 32, 64), (4, 8, 16)
    return [
        {"r": ranks[i % 4], "targets": ALL_LINEAR if i % 2 else ATTENTION, "dropout": 0.05, "rows": rows[i % 3]}
        for i in range(k)
    ]


def count(kind: str, k: int, length: int, shape: dict[str, Any]) -> dict[str, Any]:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**shape))
    members = _members(kind, k)
    names = [f"{kind}{i}" for i in range(len(members))]
    resident = ResidentModel(model, tokenizer=None, device=torch.device("cpu"))  # type: ignore[arg-type]
    for seed, (name, m) in enumerate(zip(names, members, strict=True)):
        config = LoraConfig(r=m["r"], lora_alpha=2 * m["r"], lora_dropout=m["dropout"], target_modules=m["targets"])
        resident.add_adapter(name, config, seed)
    resident.set_trainable(names, True)
    peft: Any = resident.peft
    peft.train()
    rows = [m["rows"] for m in members]
    gang = Gang(names=names, rows=rows, keys=list(range(len(members))))
    plans = layer_plans(peft, gang)
    stacks = GangStacks(plans, names) if kind == "equal_stacked" else None
    ids = torch.randint(0, MODEL["vocab_size"], (sum(rows), length))

    def one_pass() -> None:
        if stacks is not None:
            stacks.load(grad=True)
        with fused_forward(peft, gang, plans, stacks):
            logits = peft(input_ids=ids).logits
            losses = segment_losses(logits, ids, rows)
            torch.stack(losses).sum().backward()
        if stacks is not None:
            stacks.hand_out(range(len(names)))
        for name in names:
            for param in resident.adapter_params(name):
                param.grad = None

    one_pass()  # warm: lazy initialisation is not part of a pass
    start = time.perf_counter()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        one_pass()
    seconds = time.perf_counter() - start
    events = [e for e in profile.events() if e.name.startswith("aten::")]
    top = [e for e in events if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
    by_name = collections.Counter(e.name for e in top)
    return {
        "kind": kind,
        "members": members,
        "tokens": sum(rows) * length,
        "aten_calls": len(events),
        "top_level_aten_calls": len(top),
        "top_level_per_member": len(top) / len(members),
        "cpu_seconds_profiled": seconds,
        "most_called": by_name.most_common(15),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--k", type=int, default=8, help="gang size of the equal and mixed gangs")
    parser.add_argument("--length", type=int, default=128, help="tokens per row (counts do not depend on it)")
    parser.add_argument("--smoke", action="store_true", help="2 layers: a quick dry run")
    options = parser.parse_args(argv)
    shape = dict(MODEL, num_hidden_layers=2) if options.smoke else MODEL
    runs = [count(kind, options.k, options.length, shape) for kind in ("alone", "equal", "equal_stacked", "mixed")]
    for run in runs:
        print(
            f"{run['kind']:13s} members {len(run['members']):2d}: "
            f"{run['top_level_aten_calls']:6d} top-level ATen calls "
            f"({run['top_level_per_member']:.0f} per member), {run['aten_calls']} in all, "
            f"{run['cpu_seconds_profiled']:.2f} s CPU (profiled)",
            flush=True,
        )
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "command": " ".join([sys.executable, "-m", "benchmarks.fused_ops", *(argv or sys.argv[1:])]),
        "machine": machine(),
        "model": shape,
        "runs": runs,
    }
    (out / "fused_ops.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
