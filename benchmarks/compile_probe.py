"""Compile one launched-pass decoder layer on this device and say what the compiler says.

    python -m benchmarks.compile_probe --out DIR

The fused engine compiles :func:`optuna_rapidfire._fused._decoder.decoder_layer` once per gang layout; a
layout that fails to compile runs uncompiled. This probe compiles the layer alone (Llama-3.2-1B shape, 16 rows
of 512 tokens, 8 slots of rank 64 on all seven projections, bf16 autocast) with and without adapter dropout,
in the process itself (``compile_threads=1``, so a failing kernel's error is shown whole), runs it forward
and backward against the uncompiled layer, and writes ``compile_probe.json``: per variant, whether it
compiled, the seconds, the largest relative difference of the output and of the gradients, or the error.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from optuna_rapidfire._fused import _dropout
from optuna_rapidfire._fused._decoder import LayerWeights, Lora, Rows, Shape, decoder_layer

HIDDEN, MLP, HEADS, KV, HEAD_DIM = 2048, 8192, 32, 8, 64
ROWS, TOKENS, SLOTS, RANK = 16, 512, 8, 64


def _inputs(device: torch.device, dropout: bool) -> tuple[Any, ...]:
    generator = torch.Generator(device=device).manual_seed(0)

    def w(*shape: int, scale: float = 0.02, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator, device=device) * scale).to(dtype)

    outs = [HEADS * HEAD_DIM, KV * HEAD_DIM, KV * HEAD_DIM, HIDDEN, MLP, MLP, HIDDEN]
    ins = [HIDDEN, HIDDEN, HIDDEN, HEADS * HEAD_DIM, HIDDEN, HIDDEN, MLP]
    weights = LayerWeights(
        torch.ones(HIDDEN, device=device, dtype=torch.bfloat16),
        torch.ones(HIDDEN, device=device, dtype=torch.bfloat16),
        None,
        None,
        tuple(w(o, i) for o, i in zip(outs, ins, strict=True)),
        (None,) * 7,
    )
    loras = tuple(
        Lora(
            w(SLOTS, RANK, i, scale=0.05, dtype=torch.float32).requires_grad_(),
            w(SLOTS, RANK, o, scale=0.05, dtype=torch.float32).requires_grad_(),
            torch.full((SLOTS,), 2.0, device=device),
        )
        for o, i in zip(outs, ins, strict=True)
    )
    units = torch.arange(SLOTS, device=device)
    keys = _dropout.row_keys(list(range(SLOTS)), [ROWS // SLOTS] * SLOTS).to(device) if dropout else None
    drop = torch.full((ROWS,), 0.1, device=device) if dropout else None
    tokens = _dropout.position_keys(TOKENS, device) if dropout else None
    features = tuple(_dropout.feature_keys(width, device) for width in ins) if dropout else None
    cos = torch.randn(1, TOKENS, HEAD_DIM, generator=generator, device=device).to(torch.bfloat16)
    sin = torch.randn(1, TOKENS, HEAD_DIM, generator=generator, device=device).to(torch.bfloat16)
    h = w(ROWS, TOKENS, HIDDEN, scale=1.0).requires_grad_()
    salts = torch.arange(7, device=device, dtype=torch.int64) * 7919
    shape = Shape(HEADS, KV, HEAD_DIM, 1e-5, HEAD_DIM**-0.5, gqa=KV != HEADS)
    return h, cos, sin, weights, loras, Rows(units, keys, drop, tokens, features), salts, shape


def _run(fn: Any, device: torch.device, dropout: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    h, cos, sin, weights, loras, rows, salts, shape = _inputs(device, dropout)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        out = fn(h, cos, sin, weights, loras, rows, salts, shape)
    out.float().square().mean().backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return out.detach().float(), [t.grad for lora in loras for t in (lora.a, lora.b)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--small", action="store_true", help="a small layer (a CPU dry run)")
    options = parser.parse_args()
    if options.small:
        global HIDDEN, MLP, HEADS, KV, HEAD_DIM, ROWS, TOKENS
        HIDDEN, MLP, HEADS, KV, HEAD_DIM, ROWS, TOKENS = 64, 128, 4, 2, 16, 16, 32
    import torch._inductor.config as inductor_config

    inductor_config.compile_threads = 1
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    results: dict[str, Any] = {"device": str(device), "torch": torch.__version__}
    for name, dropout in (("no_dropout", False), ("dropout", True)):
        expected, expected_grads = _run(decoder_layer, device, dropout)
        start = time.perf_counter()
        try:
            got, grads = _run(torch.compile(decoder_layer, fullgraph=True), device, dropout)
        except Exception as error:  # what the compiler says is the result
            results[name] = {"compiled": False, "error": "".join(traceback.format_exception(error))[-6000:]}
            print(f"{name}: FAILED\n{results[name]['error'][-3000:]}", flush=True)
            continue
        difference = float((got - expected).norm() / expected.norm())
        gradient = max(float((a - b).norm() / b.norm()) for a, b in zip(grads, expected_grads, strict=True))
        results[name] = {
            "compiled": True,
            "seconds": time.perf_counter() - start,
            "output_relative_difference": difference,
            "gradient_relative_difference": gradient,
        }
        print(f"{name}: {results[name]}", flush=True)
    Path(options.out).mkdir(parents=True, exist_ok=True)
    (Path(options.out) / "compile_probe.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
