"""How far a gang's bf16 losses and gradients are from each trial's own pass, on the GPU (issue 7).

    CUDA_VISIBLE_DEVICES=0 python -m benchmarks.fused_bf16 --out benchmarks/results
    python -m benchmarks.fused_bf16 --smoke --out /tmp/bench      # CPU, tiny shape, bf16 autocast

Llama-3.2-1B shape, base weights in bf16, adapters in float32 (PEFT's default), bf16 autocast as the
engine trains. Five adapters with mixed ranks, alphas, target modules and batch sizes (512-token rows,
no dropout) are run alone and in gangs of K = 2 and 5; for every trial it records the relative
difference of the loss and, per LoRA tensor, ``|g_gang - g_alone| / |g_alone|`` (Frobenius norms).
In float32 the two agree to 1e-5 (tests/test_fused.py); in bf16 the matmuls round differently when
their shapes differ, and this measures by how much, and how far each is from the float32 result (the
base cast up, no autocast). Writes ``fused_bf16.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig

from benchmarks.harness.environment import machine
from benchmarks.harness.models import SHAPES
from optuna_rapidfire._fused._fused_pass import Gang, fused_forward, segment_losses
from optuna_rapidfire._resident._model import ResidentModel

ADAPTERS: dict[str, tuple[dict[str, Any], int]] = {
    "t0": ({"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}, 2),
    "t1": ({"r": 16, "lora_alpha": 32, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}, 2),
    "t2": ({"r": 32, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}, 1),
    "t3": ({"r": 16, "lora_alpha": 16, "target_modules": ["v_proj", "o_proj"]}, 4),
    "t4": ({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}, 2),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shape: a dry run of the script")
    options = parser.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    shape, tokens = ("tiny", 32) if options.smoke else ("llama-3.2-1b", 512)
    device = torch.device("cpu" if options.smoke else "cuda")
    torch.manual_seed(0)
    with device:
        model = LlamaForCausalLM(LlamaConfig(**SHAPES[shape], max_position_embeddings=2048)).to(torch.bfloat16)
    resident = ResidentModel(model, tokenizer=None, device=device)  # type: ignore[arg-type]
    for seed, (name, (settings, _)) in enumerate(ADAPTERS.items()):
        # Non-zero B (init_lora_weights=False): every update matters.
        resident.add_adapter(name, LoraConfig(init_lora_weights=False, **settings), seed)
    resident.set_trainable(list(ADAPTERS), True)
    peft: Any = resident.peft
    peft.train()
    generator = torch.Generator().manual_seed(0)
    vocab = SHAPES[shape]["vocab_size"]
    batches = {
        n: torch.randint(0, vocab, (rows, tokens), generator=generator).to(device) for n, (_, rows) in ADAPTERS.items()
    }

    def run(
        names: list[str], precision: torch.dtype = torch.bfloat16
    ) -> dict[str, tuple[float, dict[str, torch.Tensor]]]:
        rows = [ADAPTERS[n][1] for n in names]
        ids = torch.cat([batches[n] for n in names])
        peft.zero_grad(set_to_none=True)
        with fused_forward(peft, Gang(names, rows, [0] * len(names))):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == torch.bfloat16):
                losses = segment_losses(peft(input_ids=ids).logits, ids, rows)
            torch.stack(losses).sum().backward()
        return {
            name: (loss.item(), {k: p.grad.float().clone() for k, p in peft.named_parameters() if f".{name}." in k})
            for name, loss in zip(names, losses, strict=True)
        }

    def difference(
        a: tuple[float, dict[str, torch.Tensor]], b: tuple[float, dict[str, torch.Tensor]]
    ) -> tuple[float, float]:
        """Relative difference of the losses, and the largest over LoRA tensors of the gradients'."""
        grads = max(float((a[1][k] - b[1][k]).norm() / b[1][k].norm().clamp(min=1e-30)) for k in b[1])
        return abs(a[0] - b[0]) / abs(b[0]), grads

    alone = {name: run([name])[name] for name in ADAPTERS}
    gangs = {k: run(list(ADAPTERS)[:k]) for k in (2, 5)}
    # The float32 truth: the base weights cast up, no autocast, each adapter alone.
    peft.float()
    truth = {name: run([name], torch.float32)[name] for name in ADAPTERS}
    results = {}
    for k, together in gangs.items():
        names = list(ADAPTERS)[:k]
        gang_vs_alone = [difference(together[n], alone[n]) for n in names]
        gang_vs_truth = [difference(together[n], truth[n]) for n in names]
        alone_vs_truth = [difference(alone[n], truth[n]) for n in names]
        results[f"k{k}"] = {
            "loss_max_relative_difference": max(d[0] for d in gang_vs_alone),
            "grad_max_relative_difference": max(d[1] for d in gang_vs_alone),
            "gang_vs_float32_grad_max_relative_error": max(d[1] for d in gang_vs_truth),
            "alone_vs_float32_grad_max_relative_error": max(d[1] for d in alone_vs_truth),
            "gang_vs_float32_loss_max_relative_error": max(d[0] for d in gang_vs_truth),
            "alone_vs_float32_loss_max_relative_error": max(d[0] for d in alone_vs_truth),
        }
        print(f"K={k}: {json.dumps(results[f'k{k}'])}", flush=True)
    report = {
        "command": " ".join([sys.executable, "-m", "benchmarks.fused_bf16", *sys.argv[1:]]),
        "machine": machine(),
        "model": shape,
        "tokens_per_row": tokens,
        "adapters": {n: {**settings, "rows": rows} for n, (settings, rows) in ADAPTERS.items()},
        "results": results,
    }
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fused_bf16.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
