"""The search part's base model (step pretrain): a tokenizer and a small Llama trained from scratch on a corpus."""

from __future__ import annotations

import hashlib
import json
import lzma
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from benchmarks.harness.measure import sync
from benchmarks.parts.search.settings import Settings, say
from optuna_rapidfire.demo import load_gsm8k

_DETERMINISTIC_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]


def read_corpus(corpus: Path, smoke: bool) -> list[str]:
    """The text of every ``*.txt.xz`` in ``corpus`` (sorted by name); a smoke run without it takes GSM8K's."""
    files = sorted(corpus.glob("*.txt.xz"))
    if not files and smoke:
        say(f"no corpus in {corpus}: the smoke run pretrains on the bundled GSM8K train text")
        rows = load_gsm8k("train", format="text")["text"]
        return ["\n\n".join(rows)]
    if not files:
        raise SystemExit(
            f"no *.txt.xz corpus in {corpus}: copy linux-6.1-docs.txt.xz and python-3.11-docs.txt.xz (and their "
            "COPYRIGHT files) there, or pass --corpus. They are not part of the repository."
        )
    texts = []
    for path in files:
        with lzma.open(path, "rt", encoding="utf-8") as handle:
            texts.append(handle.read())
    return texts


def _blocks(text: str, size: int = 1 << 16) -> Iterator[str]:
    """``text`` in pieces of about ``size`` characters, cut at blank lines (for batched tokenizing)."""
    start = 0
    while start < len(text):
        end = text.find("\n\n", start + size)
        end = len(text) if end < 0 else end + 2
        yield text[start:end]
        start = end


def train_tokenizer(texts: list[str], settings: Settings) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer of the model's vocabulary size, trained on the corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        (block for text in texts for block in _blocks(text)),
        trainers.BpeTrainer(
            vocab_size=int(settings.model["vocab_size"]),
            special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    tokenizer.model_max_length = int(settings.model["max_position_embeddings"])
    return tokenizer


def _token_rows(texts: list[str], tokenizer: PreTrainedTokenizerFast, length: int) -> torch.Tensor:
    """The corpus as one token stream (an end-of-sequence token between files), cut into rows."""
    stream: list[int] = []
    for text in texts:
        for encoding in tokenizer.backend_tokenizer.encode_batch(list(_blocks(text))):
            stream.extend(encoding.ids)
        stream.append(int(tokenizer.eos_token_id))
    rows = len(stream) // length
    return torch.tensor(stream[: rows * length], dtype=torch.long).view(rows, length)


def pretrain(settings: Settings, corpus: Path, base: Path) -> dict[str, Any]:
    """Train the tokenizer and the base model from scratch for ``settings.pretrain_steps``; save to ``base``.

    bf16 autocast over float32 weights, AdamW 1e-3, linear warmup over the first 5% of the steps, then cosine to
    a tenth. Fixed seeds, a fixed step count and deterministic kernels, so that the same recipe on the same
    kind of GPU and library versions rebuilds the same weights: :func:`fingerprint` tells whether it did.
    """
    # Deterministic cuBLAS needs this before its first call (this process trains nothing else on the GPU).
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    start = time.perf_counter()
    texts = read_corpus(corpus, settings.smoke)
    if settings.tokenizer_chars:
        texts = [t[: settings.tokenizer_chars // len(texts)] for t in texts]
    tokenizer = train_tokenizer(texts, settings)
    tokenizer_seconds = time.perf_counter() - start
    rows = _token_rows(texts, tokenizer, settings.pretrain_length)
    prepare_seconds = time.perf_counter() - start
    say(f"pretrain: tokenizer {tokenizer_seconds:.1f} s, {rows.numel():,} corpus tokens, {prepare_seconds:.1f} s")
    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    config = LlamaConfig(
        **settings.model,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device)  # type: ignore[arg-type]
    model.train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    peak = 1e-3
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
        lr=peak,
        betas=(0.9, 0.95),
        fused=gpu,
    )
    rows = rows.to(device)
    generator = torch.Generator(device=device).manual_seed(0)
    order = torch.randperm(len(rows), device=device, generator=generator)
    position, tokens = 0, 0
    curve: list[list[float]] = []
    steps = settings.pretrain_steps
    warmup = max(1, steps // 20)
    sync()
    began = time.perf_counter()
    for step in range(1, steps + 1):
        fraction = (step - warmup) / max(steps - warmup, 1)
        scale = step / warmup if step <= warmup else 0.1 + 0.45 * (1 + math.cos(math.pi * fraction))
        for group in optimizer.param_groups:
            group["lr"] = peak * scale
        if position + settings.pretrain_batch > len(order):
            order, position = torch.randperm(len(rows), device=device, generator=generator), 0
        batch = rows[order[position : position + settings.pretrain_batch]]
        position += settings.pretrain_batch
        # cuDNN's and the memory-efficient attention backward are not deterministic; flash's (or math's) is.
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=gpu), sdpa_kernel(_DETERMINISTIC_ATTENTION):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tokens += batch.numel()
        if step % 50 == 1 or step == steps:
            curve.append([step, round(time.perf_counter() - began, 3), tokens, loss.item()])
    sync()
    seconds = time.perf_counter() - began
    torch.use_deterministic_algorithms(deterministic)
    base.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16 if gpu else torch.float32).save_pretrained(base)
    tokenizer.save_pretrained(base)
    info = {
        "model": settings.model,
        "recipe": settings.pretrain_recipe(),
        "parameters": sum(p.numel() for p in model.parameters()),
        "corpus": sorted(p.name for p in corpus.glob("*.txt.xz")) or ["bundled GSM8K train text"],
        "corpus_tokens": int(rows.numel()),
        "tokenizer_seconds": tokenizer_seconds,
        "prepare_seconds": prepare_seconds,
        "train_seconds": seconds,
        "steps": steps,
        "tokens": tokens,
        "tokens_per_second": tokens / seconds,
        "batch": [settings.pretrain_batch, settings.pretrain_length],
        "final_train_loss": curve[-1][3],
        "loss_curve": curve,  # [step, seconds, tokens, loss]
        "device": torch.cuda.get_device_name(0) if gpu else "cpu",
        "saved_dtype": "bfloat16" if gpu else "float32",
        "fingerprint": fingerprint(base),
    }
    (base / "pretrain.json").write_text(json.dumps(info, indent=1))
    del model, optimizer, rows
    if gpu:
        torch.cuda.empty_cache()
    return info


def fingerprint(base: Path) -> str:
    """A hash of the base model's weights and tokenizer: a replicate's methods all run on one base."""
    digest = hashlib.sha256()
    for path in [*sorted(base.glob("*.safetensors")), base / "tokenizer.json"]:
        with path.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 24), b""):
                digest.update(block)
    return digest.hexdigest()[:16]


def load_base(base: Path) -> tuple[Any, Any]:
    gpu = torch.cuda.is_available()
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16 if gpu else torch.float32)
    return model, AutoTokenizer.from_pretrained(base)


def model_kwargs() -> dict[str, Any]:
    """How the executor loads the base: in the dtype :func:`load_base` loads it."""
    return {"dtype": torch.bfloat16} if torch.cuda.is_available() else {}
