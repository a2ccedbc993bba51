"""Where one launched decode's time goes, kernel by kernel (issue 35; an H200, or the CPU for a dry run).

    CUDA_VISIBLE_DEVICES=0 python -m benchmarks.decode_profile --out benchmarks/results
    python -m benchmarks.decode_profile --smoke --out /tmp/bench      # tiny shape, CPU

Builds the grpo part's model shape (``llama-3.2-1b``, random weights, bf16 autocast on a GPU) with 8 LoRA
adapters (r16, attention targets, as the grpo part's trials), and the rows of one gang step of that part
(GSM8K train prompts tokenized by the benchmark's tokenizer, 4 completions each, up to 32 new tokens, TRL's
default sampling). For each case it runs two decodes to warm up (captures, plans), then profiles one with
``torch.profiler`` (CPU and CUDA activities):

- ``one_adapter_128``: one request of 128 rows through one adapter (the grpo part's ``decode_ceiling``);
- ``gang_k8_128``: 8 requests of 16 rows, each through its own adapter (a fused gang's decode);
- ``one_adapter_16``: one request of 16 rows (a time-sliced trial's decode).

- ``packing_x1`` ... ``packing_x16``: a gang decode (8 requests of 16 rows, 1 new token: the prefill and one step)
  whose prompts are uneven (a quarter of the distinct prompts repeated to 1x, 4x, 8x or 16x their length),
  prefilled packed by length as the decode does (``packed``), with passes 4x cheaper than it assumes
  (``cheap_passes``: more of them) and in one pass padded to the longest prompt (``one_pass``): each
  decode's seconds (median of 5), its passes and the prompt tokens it computed.

Writes ``decode_profile.json``: per case the decode's wall seconds (device synchronized around it), the
device's kernel time and kernel count over that decode, and the kernels that take the most device time;
``decode_profile.txt`` holds the profiler's tables. Kernel time well under the wall means the host (or
launch latency) bounds the decode; a kernel count per step in the hundreds means launches do.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from peft import get_peft_model

from benchmarks.harness.environment import machine
from benchmarks.harness.measure import sync
from benchmarks.harness.models import build_model, lora
from benchmarks.parts.grpo import GPU, anchor_rows
from optuna_rapidfire._fused import _launched_decode
from optuna_rapidfire._fused._fused_decode import DecodeRequest, decode
from optuna_rapidfire.demo import build_tiny_model

CASES = {"one_adapter_128": (1, 128), "gang_k8_128": (8, 16), "one_adapter_16": (1, 16)}
"""Case name -> (requests, rows per request)."""
TOP = 25


def _requests(
    rows: list[list[int]], per: int, count: int, settings: dict[str, Any], eos: tuple[int], device: torch.device
) -> list[DecodeRequest]:
    """``count`` requests of ``per`` rows each: request k takes rows ``k * per`` on, adapter ``a<k>``, a generator
    seeded with k."""
    return [
        DecodeRequest(
            adapter=f"a{k}",
            prompts=rows[k * per : (k + 1) * per],
            generator=torch.Generator(device=device).manual_seed(k),
            eos_token_ids=eos,
            **settings,
        )
        for k in range(count)
    ]


def profile_case(model: Any, tokenizer: Any, requests: int, rows: int, new_tokens: int) -> tuple[dict[str, Any], str]:
    """One case: two warm-up decodes, then one profiled; its numbers and the profiler's table."""
    device = next(model.parameters()).device
    prompts, settings, eos = anchor_rows(tokenizer, GPU)  # the grpo part's rows of one gang decode (128)
    settings = {**settings, "max_new_tokens": new_tokens}
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()

    def once() -> int:
        batch = _requests(prompts, rows, requests, settings, eos, device)
        with torch.no_grad(), autocast:
            out = decode(model, batch, int(tokenizer.pad_token_id))
        return sum(len(row) for completions in out for row in completions)

    for _ in range(2):
        once()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    sync()
    with torch.profiler.profile(activities=activities) as profiler:
        start = time.perf_counter()
        tokens = once()
        sync()
        wall = time.perf_counter() - start
    events = profiler.key_averages()
    device_events = [e for e in events if getattr(e, "device_time_total", 0) > 0 and e.device_type.name != "CPU"]
    kernel_us = sum(e.self_device_time_total for e in device_events)
    kernels = sum(e.count for e in device_events)
    top = sorted(device_events, key=lambda e: e.self_device_time_total, reverse=True)[:TOP]
    found = {
        "requests": requests,
        "rows": requests * rows,
        "new_tokens": tokens,
        "wall_seconds": wall,
        "steps": new_tokens,
        "device_kernel_seconds": kernel_us / 1e6,
        "device_kernels": kernels,
        "kernels_per_step": kernels / new_tokens,
        "top": [{"name": e.key[:120], "count": e.count, "device_seconds": e.self_device_time_total / 1e6} for e in top],
    }
    sort = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return found, events.table(sort_by=sort, row_limit=40, max_name_column_width=80)


def packing_case(model: Any, tokenizer: Any, stretch: int, budgets: dict[str, int]) -> dict[str, Any]:
    """A ``packing_x<stretch>`` case (see the module's docstring); ``budgets``: each variant's name and what one
    more prefill pass costs it, in tokens (the decode's ``_BUCKET_TOKENS`` while it runs)."""
    device = next(model.parameters()).device
    prompts, settings, eos = anchor_rows(tokenizer, GPU)
    generations = GPU.generations
    uneven = [p * stretch if i % 4 == 0 else p for i, p in enumerate(prompts[::generations])]
    rows = [p for p in uneven for _ in range(generations)]
    per = len(rows) // 8
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    lm = model.get_base_model()

    def once() -> _launched_decode.LaunchedDecode:
        batch = _requests(rows, per, 8, {**settings, "max_new_tokens": 1}, eos, device)
        run = _launched_decode.LaunchedDecode(model, lm, batch, int(tokenizer.pad_token_id), device)
        with torch.no_grad(), autocast:
            run.run()
        return run

    found: dict[str, Any] = {"stretch": stretch, "lengths": sorted(len(p) for p in uneven)}
    for name, pass_tokens in budgets.items():
        previous, _launched_decode._BUCKET_TOKENS = _launched_decode._BUCKET_TOKENS, pass_tokens
        try:
            seconds = []
            for _ in range(2 + 5):
                sync()
                start = time.perf_counter()
                run = once()
                sync()
                seconds.append(time.perf_counter() - start)
        finally:
            _launched_decode._BUCKET_TOKENS = previous
        found[name] = {
            "pass_tokens": pass_tokens,
            "seconds": statistics.median(seconds[2:]),
            "passes": [list(p) for p in run.prefilled],
            "prompt_tokens": sum(prompts * width for prompts, width in run.prefilled),
        }
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for decode_profile.json and decode_profile.txt")
    parser.add_argument("--smoke", action="store_true", help="the tiny shape on the CPU, 4 new tokens")
    options = parser.parse_args()
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    shape, new_tokens = ("tiny", 4) if options.smoke else ("llama-3.2-1b", 32)
    tokenizer_dir = str(build_tiny_model(Path(tempfile.mkdtemp(prefix="rapidfire-profile-")) / "tok", vocab_size=2048))
    model, tokenizer = build_model(shape, tokenizer_dir)
    peft_model = get_peft_model(model, lora(16), adapter_name="a0")
    for k in range(1, max(requests for requests, _ in CASES.values())):
        peft_model.add_adapter(f"a{k}", lora(16))
    results: dict[str, Any] = {"command": "python -m benchmarks.decode_profile", "machine": machine(), "model": shape}
    tables: list[str] = []
    for name, (requests, rows) in CASES.items():
        found, table = profile_case(peft_model, tokenizer, requests, rows, new_tokens)
        results[name] = found
        said = f"{found['wall_seconds']:.4f} s wall, {found['device_kernel_seconds']:.4f} s of kernels"
        tables += [f"== {name}: {said}", table]
        print(
            f"{name}: {found['wall_seconds'] * 1e3:.1f} ms wall, {found['device_kernel_seconds'] * 1e3:.1f} ms of "
            f"kernels, {found['kernels_per_step']:.0f} kernels per step",
            flush=True,
        )
    own = _launched_decode._BUCKET_TOKENS
    budgets = {"packed": own, "cheap_passes": own // 4, "one_pass": 10**12}
    for stretch in (1, 4) if options.smoke else (1, 4, 8, 16):
        packing = packing_case(peft_model, tokenizer, stretch, budgets)
        packing["one_pass_over_packed"] = packing["one_pass"]["seconds"] / packing["packed"]["seconds"]
        results[f"packing_x{stretch}"] = packing
        said = [
            f"{name} {found['seconds'] * 1e3:.1f} ms ({len(found['passes'])} passes, {found['prompt_tokens']} tokens)"
            for name, found in packing.items()
            if name in budgets
        ]
        print(f"packing x{stretch}: " + ", ".join(said), flush=True)
    (out / "decode_profile.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "decode_profile.txt").write_text("\n\n".join(tables) + "\n")


if __name__ == "__main__":
    main()
