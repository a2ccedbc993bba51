"""A first speed probe of the fused multi-adapter pass (issue 7 groundwork), on one GPU.

    CUDA_VISIBLE_DEVICES=0 python -m benchmarks.fused_probe --out benchmarks/results

Llama-3.2-1B shape, bf16, 8 LoRA r16 adapters on q/k/v/o, 512-token rows. Per optimizer step it times
(a) time-sliced: each of the 8 adapters in turn at batch 2 (forward, backward, AdamW step);
(b) fused: the 8 adapters at batch 2 each in one forward/backward (two batched matmuls per LoRA layer,
    zero-padded ranks), then one AdamW step over 8 param groups (foreach);
(c) the ceiling: one adapter at batch 32.
Writes ``fused_probe.json``. No CUDA graphs, no custom kernels: this is the plain-PyTorch bmm version.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig

from benchmarks.harness.environment import machine
from benchmarks.harness.models import SHAPES
from optuna_rapidfire._fused._fused_pass import Gang, fused_forward, segment_losses
from optuna_rapidfire._resident._model import ResidentModel

K, BATCH, TOKENS, CEILING_BATCH = 8, 2, 512, 32
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shape: a dry run of the script")
    parser.add_argument("--profile", action="store_true", help="also write the fused step's top operators")
    options = parser.parse_args()
    shape = "tiny" if options.smoke else "llama-3.2-1b"
    from transformers import LlamaConfig, LlamaForCausalLM

    device = torch.device("cpu" if options.smoke else "cuda")
    torch.manual_seed(0)
    with device:
        model = LlamaForCausalLM(LlamaConfig(**SHAPES[shape], max_position_embeddings=2048))
        model = model.to(torch.float32 if options.smoke else torch.bfloat16)
    names = [f"t{i}" for i in range(K)]
    resident = ResidentModel(model, tokenizer=None, device=device)  # type: ignore[arg-type]
    for seed, name in enumerate(names):
        resident.add_adapter(name, LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS), seed)
    resident.set_trainable(names, True)
    peft: Any = resident.peft
    peft.train()
    params = {name: resident.adapter_params(name) for name in names}
    optimizers = {name: torch.optim.AdamW(params[name], lr=1e-4, foreach=True) for name in names}
    joint = torch.optim.AdamW([{"params": params[n], "lr": 1e-4 * (i + 1)} for i, n in enumerate(names)], foreach=True)
    vocab = SHAPES[shape]["vocab_size"]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def ids(rows: int) -> torch.Tensor:
        return torch.randint(0, vocab, (rows, TOKENS), device=device)

    def sliced_step() -> int:
        for name in names:
            peft.set_adapter(name)
            for other in names:
                for p in params[other]:
                    p.requires_grad_(other == name)
            batch = ids(BATCH)
            loss = segment_losses(peft(input_ids=batch).logits, batch, [BATCH])[0]
            loss.backward()
            optimizers[name].step()
            optimizers[name].zero_grad(set_to_none=True)
        return K * BATCH * TOKENS

    gang = Gang(names, [BATCH] * K, [0] * K)

    def fused_step() -> int:
        for name in names:
            for p in params[name]:
                p.requires_grad_(True)
        batch = ids(K * BATCH)
        with fused_forward(peft, gang):
            losses = segment_losses(peft(input_ids=batch).logits, batch, gang.rows)
        torch.stack(losses).sum().backward()
        joint.step()
        joint.zero_grad(set_to_none=True)
        return K * BATCH * TOKENS

    def ceiling_step() -> int:
        peft.set_adapter(names[0])
        for other in names:
            for p in params[other]:
                p.requires_grad_(other == names[0])
        batch = ids(CEILING_BATCH)
        segment_losses(peft(input_ids=batch).logits, batch, [CEILING_BATCH])[0].backward()
        optimizers[names[0]].step()
        optimizers[names[0]].zero_grad(set_to_none=True)
        return CEILING_BATCH * TOKENS

    results = {}
    for label, step in (
        ("time_sliced_k8_bs2", sliced_step),
        ("fused_k8_bs2", fused_step),
        ("ceiling_bs32", ceiling_step),
    ):
        for _ in range(2):
            step()
        sync()
        start, tokens = time.perf_counter(), 0
        for _ in range(options.steps):
            tokens += step()
        sync()
        results[label] = tokens / (time.perf_counter() - start)
        print(f"{label}: {results[label]:.0f} tokens/s", flush=True)
    if options.profile:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            for _ in range(2):
                fused_step()
            sync()
        sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=40)
        Path(options.out).mkdir(parents=True, exist_ok=True)
        (Path(options.out) / "fused_probe_profile.txt").write_text(table)
    report = {
        "command": " ".join([sys.executable, "-m", "benchmarks.fused_probe", *sys.argv[1:]]),
        "machine": machine(),
        "tokens_per_second": results,
        "fused_over_time_sliced": results["fused_k8_bs2"] / results["time_sliced_k8_bs2"],
        "fused_over_ceiling": results["fused_k8_bs2"] / results["ceiling_bs32"],
        "peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
    }
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fused_probe.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "machine"}, indent=1))


if __name__ == "__main__":
    main()
