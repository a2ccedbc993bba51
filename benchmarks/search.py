"""The search part: how soon a user reaches the best fine-tuning config, with the executor or without it.

    python -m benchmarks.run --parts search --out DIR                                  # every step
    python -m benchmarks.run --parts search --search-steps record --seeds 0,1 --out DIR  # some steps, merged
    python -m benchmarks.run --parts search --search-steps replay --out DIR            # CPU: replays only

Methods, on the same configs (per seed, a seeded random sample of the search space):

(a) ``exhaustive``: every config trained to the end with TRL, one after another;
(b) ``sequential_optuna``: plain Optuna, one TRL ``SFTTrainer`` per trial reporting each chunk's eval loss
    through a ``TrainerCallback`` (report, should_prune, stop): what a user writes today;
(c) ``parallel_optuna_processes``: the same with ``--processes`` worker processes sharing the GPU;
(d) ``executor_lockstep``, (e) ``executor_promote``: ``RapidFireExecutor(engine="fused")`` with each schedule;
(f) ``executor_promote_clone``: (e) with ``CloneSampler`` over a sampler that replays the config list.

(d)-(f) are real runs. (a)-(c) are replayed (GPU time is scarce): every config's per-chunk eval values are
recorded once (step ``record``: one executor study per seed, fused engine, no pruner; the fused engine's
values equal a trial's alone-values within bf16 rounding); the time a plain TRL trainer takes per chunk,
per evaluation and per build is measured alone and under ``--processes`` processes sharing the GPU (step
``calibrate``); the replays then run real in-memory Optuna studies with the real pruner on those values
and times, (c) as a discrete-event simulation in which every report is judged in global time order against
one shared study. Step ``validate`` runs each baseline for real on a few configs and chunks, and the replay
of the same is compared with it in ``replay_check``.

Everything lands in ``DIR/search.json``; each call merges what it measured into it, so the part can be run
in several short calls. See benchmarks/README.md (search) for what each number means.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import hashlib
import json
import lzma
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import optuna
import torch
from optuna.distributions import BaseDistribution
from optuna.trial import FrozenTrial, TrialState
from peft import LoraConfig
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    PrinterCallback,
    TrainerCallback,
)
from trl import SFTConfig, SFTTrainer

from benchmarks.run import machine
from optuna_rapidfire import RapidFireExecutor
from optuna_rapidfire._engines._base import ChunkResult
from optuna_rapidfire._engines._fused_engine import FusedEngine
from optuna_rapidfire._resident._data import ChunkPlan
from optuna_rapidfire._study import _attrs
from optuna_rapidfire.demo import load_gsm8k
from optuna_rapidfire.samplers import CloneSampler

STEPS = ("pretrain", "record", "calibrate", "validate", "executor", "replay")
SCHEDULED = {"lockstep": "executor_lockstep", "promote": "executor_promote", "clone": "executor_promote_clone"}
METHODS = {
    "exhaustive": "(a) exhaustive sequential TRL (replayed)",
    "sequential_optuna": "(b) sequential Optuna + TRL + pruner (replayed)",
    "parallel_optuna_processes": "(c) Optuna, TRL processes sharing the GPU (replayed)",
    "executor_lockstep": "(d) executor, lockstep",
    "executor_promote": "(e) executor, promote",
    "executor_promote_clone": "(f) executor, promote + CloneSampler",
}
BASE_MODEL: dict[str, Any] = {
    "vocab_size": 8192,
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": True,
}
"""The base the search part pretrains: an 82M-parameter Llama."""
TARGET_SLACK = 0.01  # the target: within 1% of the best final value of the seed's exhaustive sweep


def make_pruner() -> optuna.pruners.BasePruner:
    """The one pruner of every method, real or replayed."""
    return optuna.pruners.MedianPruner(n_startup_trials=5, n_warmup_steps=1)


# -- the search space ------------------------------------------------------------------------------

TARGETS = {
    "attn": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "all": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}
BATCHES = (4, 8, 16)


def suggest(trial: optuna.Trial) -> dict[str, Any]:
    """The trial's params (an enqueued trial gets its fixed ones back)."""
    return {
        "learning_rate": trial.suggest_float("learning_rate", 1e-5, 3e-3, log=True),
        "r": trial.suggest_categorical("r", [8, 16, 32, 64]),
        "alpha_multiple": trial.suggest_categorical("alpha_multiple", [0.5, 1.0, 2.0]),  # lora_alpha / r
        "target_modules": trial.suggest_categorical("target_modules", list(TARGETS)),
        "lora_dropout": trial.suggest_float("lora_dropout", 0.0, 0.1),
        "batch_size": trial.suggest_categorical("batch_size", list(BATCHES)),
        "warmup_ratio": trial.suggest_float("warmup_ratio", 0.0, 0.1),
    }


def sample_configs(seed: int, n: int) -> list[dict[str, Any]]:
    """``n`` configs from a seeded random sampler: the list every non-adaptive method runs, in order."""
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))
    configs = []
    for _ in range(n):
        trial = study.ask()
        configs.append(suggest(trial))
        study.tell(trial, 0.0)
    return configs


def kind_of(params: dict[str, Any]) -> str:
    """What the time of a chunk depends on, besides the rank: per-device batch and target set."""
    return f"{params['batch_size']}/{params['target_modules']}"


# -- settings --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """Sizes of one search benchmark (``--smoke`` shrinks every one of them)."""

    smoke: bool
    configs: int  # configs per seed
    trial_rows: int  # GSM8K train rows per trial: its data budget (batch size changes steps, not data)
    num_chunks: int
    eval_rows: int  # GSM8K test rows every evaluation uses (the same for every method)
    eval_batch: int
    max_length: int
    record_concurrency: int
    concurrency: int  # live trials of the executor methods
    processes: int  # worker processes of (c)
    calibrate_chunks: int
    validate_chunks: int
    validate_sequential_configs: int
    pretrain_seconds: float
    pretrain_batch: int
    pretrain_length: int
    tokenizer_chars: int | None  # corpus characters the tokenizer trains on (None: all)
    model: dict[str, Any]  # LlamaConfig fields

    @staticmethod
    def from_options(options: Any) -> Settings:
        smoke = bool(options.smoke)

        def pick(name: str, full: Any, small: Any) -> Any:
            given = getattr(options, name, None)
            return given if given is not None else (small if smoke else full)

        model: dict[str, Any] = dict(BASE_MODEL)
        if smoke:
            model.update(vocab_size=1024, hidden_size=64, intermediate_size=128, max_position_embeddings=512)
            model.update(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        settings = Settings(
            smoke=smoke,
            configs=pick("search_configs", 32, 6),
            trial_rows=pick("trial_rows", 4096, 64),
            num_chunks=pick("search_chunks", 8, 2),
            eval_rows=128 if not smoke else 8,
            eval_batch=32 if not smoke else 8,
            max_length=512 if not smoke else 256,
            record_concurrency=pick("record_concurrency", 16, 6),
            concurrency=pick("search_concurrency", 8, 3),
            processes=pick("processes", 8, 2),
            calibrate_chunks=2,
            validate_chunks=min(3, pick("search_chunks", 8, 2)),
            validate_sequential_configs=4,
            pretrain_seconds=pick("pretrain_seconds", 150.0, 5.0),
            pretrain_batch=64 if not smoke else 8,
            pretrain_length=512 if not smoke else 128,
            tokenizer_chars=None if not smoke else 2_000_000,
            model=model,
        )
        step = settings.num_chunks * max(BATCHES)
        if settings.trial_rows % step:
            raise SystemExit(
                f"--trial-rows must be a multiple of chunks x the largest batch ({step}), so every chunk holds "
                f"whole batches at every batch size, but got {settings.trial_rows}."
            )
        return settings

    def comparable(self) -> dict[str, Any]:
        """What results merged from several calls must share (a record from other sizes is another benchmark)."""
        keep = ("smoke", "configs", "trial_rows", "num_chunks", "eval_rows", "eval_batch", "max_length", "model")
        return {name: getattr(self, name) for name in keep}

    def rows_per_chunk(self) -> int:
        return self.trial_rows // self.num_chunks


def lora_config(params: dict[str, Any]) -> LoraConfig:
    r = int(params["r"])
    return LoraConfig(
        r=r,
        lora_alpha=int(params["alpha_multiple"] * r),
        lora_dropout=float(params["lora_dropout"]),
        target_modules=TARGETS[params["target_modules"]],
        task_type="CAUSAL_LM",
    )


# Transformers 5 reads a float warmup_steps below 1 as a ratio of the run's steps; versions that still have
# warmup_ratio get the ratio there (the same schedule).
_WARMUP = "warmup_ratio" if "warmup_ratio" in {f.name for f in dataclasses.fields(SFTConfig)} else "warmup_steps"


def sft_config(params: dict[str, Any], settings: Settings, output_dir: str, **extra: Any) -> SFTConfig:
    """The trial's training args, the same for the executor and for plain TRL (``extra``: TRL-only fields)."""
    gpu = torch.cuda.is_available()
    return SFTConfig(
        output_dir=output_dir,
        learning_rate=float(params["learning_rate"]),
        per_device_train_batch_size=int(params["batch_size"]),
        per_device_eval_batch_size=settings.eval_batch,
        num_train_epochs=1,
        **{_WARMUP: float(params["warmup_ratio"])},
        max_length=settings.max_length,
        bf16=gpu,
        use_cpu=not gpu,
        gradient_checkpointing=False,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        seed=0,
        **extra,
    )


def _configure(trial: optuna.Trial, settings: Settings, output_dir: str) -> tuple[LoraConfig, SFTConfig]:
    params = suggest(trial)
    return lora_config(params), sft_config(params, settings, output_dir)


def train_rows(settings: Settings) -> Any:
    return load_gsm8k("train", num_rows=settings.trial_rows, format="prompt_completion")


def eval_rows(settings: Settings) -> Any:
    return load_gsm8k("test", num_rows=settings.eval_rows, format="prompt_completion")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _release() -> None:
    """Free what the last trainer or executor held, so the next one starts from the same memory."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _say(message: str) -> None:
    print(f"search: {message}", flush=True)


# -- the base model (step pretrain) ----------------------------------------------------------------


def read_corpus(corpus: Path, smoke: bool) -> list[str]:
    """The text of every ``*.txt.xz`` in ``corpus`` (sorted by name); a smoke run without it takes GSM8K's."""
    files = sorted(corpus.glob("*.txt.xz"))
    if not files and smoke:
        _say(f"no corpus in {corpus}: the smoke run pretrains on the bundled GSM8K train text")
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
    """Train the tokenizer and the base model from scratch for ``settings.pretrain_seconds``; save to ``base``.

    bf16 autocast over float32 weights, AdamW 1e-3, linear warmup over the first 5% of the time budget, then
    cosine to a tenth; the schedule runs on elapsed time, so the run ends when the budget does.
    """
    start = time.perf_counter()
    texts = read_corpus(corpus, settings.smoke)
    if settings.tokenizer_chars:
        texts = [t[: settings.tokenizer_chars // len(texts)] for t in texts]
    tokenizer = train_tokenizer(texts, settings)
    tokenizer_seconds = time.perf_counter() - start
    rows = _token_rows(texts, tokenizer, settings.pretrain_length)
    prepare_seconds = time.perf_counter() - start
    _say(f"pretrain: tokenizer {tokenizer_seconds:.1f} s, {rows.numel():,} corpus tokens, {prepare_seconds:.1f} s")
    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    config = LlamaConfig(
        **settings.model,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
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
    position, step, tokens = 0, 0, 0
    curve: list[list[float]] = []
    budget = settings.pretrain_seconds
    _sync()
    began = time.perf_counter()
    while (elapsed := time.perf_counter() - began) < budget:
        fraction = elapsed / budget
        scale = fraction / 0.05 if fraction < 0.05 else 0.1 + 0.45 * (1 + math.cos(math.pi * (fraction - 0.05) / 0.95))
        for group in optimizer.param_groups:
            group["lr"] = peak * scale
        if position + settings.pretrain_batch > len(order):
            order, position = torch.randperm(len(rows), device=device, generator=generator), 0
        batch = rows[order[position : position + settings.pretrain_batch]]
        position += settings.pretrain_batch
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=gpu):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        tokens += batch.numel()
        if step % 10 == 1:
            curve.append([step, round(time.perf_counter() - began, 3), tokens, loss.item()])
    _sync()
    seconds = time.perf_counter() - began
    curve.append([step, round(seconds, 3), tokens, loss.item()])
    base.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16 if gpu else torch.float32).save_pretrained(base)
    tokenizer.save_pretrained(base)
    info = {
        "model": settings.model,
        "parameters": sum(p.numel() for p in model.parameters()),
        "corpus": sorted(p.name for p in corpus.glob("*.txt.xz")) or ["bundled GSM8K train text"],
        "corpus_tokens": int(rows.numel()),
        "tokenizer_seconds": tokenizer_seconds,
        "prepare_seconds": prepare_seconds,
        "train_seconds": seconds,
        "steps": step,
        "tokens": tokens,
        "tokens_per_second": tokens / seconds,
        "batch": [settings.pretrain_batch, settings.pretrain_length],
        "final_train_loss": curve[-1][3],
        "loss_curve": curve,  # [step, seconds, tokens, loss]
        "device": torch.cuda.get_device_name(0) if gpu else "cpu",
        "saved_dtype": "bfloat16" if gpu else "float32",
    }
    (base / "pretrain.json").write_text(json.dumps(info, indent=1))
    del model, optimizer, rows
    if gpu:
        torch.cuda.empty_cache()
    return info


def fingerprint(base: Path) -> str:
    """A hash of the base model's weights: results from two different bases are never merged."""
    digest = hashlib.sha256()
    for path in sorted(base.glob("*.safetensors")):
        with path.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 24), b""):
                digest.update(block)
    return digest.hexdigest()[:16]


def load_base(base: Path) -> tuple[Any, Any]:
    gpu = torch.cuda.is_available()
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16 if gpu else torch.float32)
    return model, AutoTokenizer.from_pretrained(base)


def _model_kwargs() -> dict[str, Any]:
    return {"dtype": torch.bfloat16} if torch.cuda.is_available() else {}


# -- plain TRL: what a user runs without the executor ----------------------------------------------


class InOrderSFTTrainer(SFTTrainer):
    """TRL's trainer visiting the train set in the order given: the executor's shuffled chunks, so that its
    per-chunk values can be compared with the executor's recorded ones (a user would shuffle otherwise)."""

    def _get_train_sampler(self, train_dataset: Any = None) -> Any:
        return torch.utils.data.SequentialSampler(train_dataset or self.train_dataset)  # type: ignore[arg-type]


class ChunkCallback(TrainerCallback):
    """What a user adds to a TRL trainer for Optuna: after each chunk's evaluation, ``trial.report`` and
    ``trial.should_prune`` (stop training when it says so); also timestamps and optional stop conditions."""

    def __init__(
        self,
        steps_per_chunk: int,
        *,
        trial: optuna.Trial | None = None,
        stop_after: int | None = None,
        done_after: int | None = None,
        done_file: Path | None = None,
        stop_file: Path | None = None,
    ) -> None:
        self.steps_per_chunk = steps_per_chunk
        self.trial = trial
        self.stop_after = stop_after
        self.done_after = done_after
        self.done_file = done_file
        self.stop_file = stop_file
        self.mark = time.time()
        self.train_seconds: list[float] = []
        self.eval_seconds: list[float] = []
        self.values: list[float] = []
        self.pruned = False

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step % self.steps_per_chunk == 0:
            _sync()
            now = time.time()
            self.train_seconds.append(now - self.mark)
            self.mark = now
        if self.stop_file is not None and self.stop_file.exists():
            control.should_training_stop = True

    def on_evaluate(self, args: Any, state: Any, control: Any, metrics: Any = None, **kwargs: Any) -> None:
        now = time.time()
        self.eval_seconds.append(now - self.mark)
        self.mark = now
        value = float(metrics["eval_loss"])
        self.values.append(value)
        chunk = len(self.values)
        if self.trial is not None:
            self.trial.report(value, chunk - 1)
            if self.trial.should_prune():
                self.pruned = True
                control.should_training_stop = True
        if self.stop_after is not None and chunk >= self.stop_after:
            control.should_training_stop = True
        if self.done_file is not None and chunk == self.done_after:
            self.done_file.touch()


def ordered_train(settings: Settings, seed: int) -> Any:
    """The train rows in the executor's order for ``seed``: its chunks, one after another."""
    rows = train_rows(settings)
    plan = ChunkPlan(num_rows=len(rows), num_chunks=settings.num_chunks, seed=seed)
    return rows.select([int(i) for c in range(settings.num_chunks) for i in plan.rows(c)])


def trl_trial(
    params: dict[str, Any],
    settings: Settings,
    base: Path,
    seed: int,
    *,
    per_chunk_eval: bool = True,
    **callback: Any,
) -> dict[str, Any]:
    """One trial as a user runs it with plain TRL: load the model, build the trainer, train (and evaluate).

    ``per_chunk_eval``: evaluate after every chunk through ``ChunkCallback`` (``callback`` are its options);
    else train to the end and evaluate once. Times are wall seconds; ``start``/``end`` are ``time.time()``.
    """
    start = time.time()
    model, tokenizer = load_base(base)
    steps_per_chunk = settings.rows_per_chunk() // int(params["batch_size"])
    hook = ChunkCallback(steps_per_chunk, **callback)
    extra: dict[str, Any] = {"eval_strategy": "steps", "eval_steps": steps_per_chunk} if per_chunk_eval else {}
    with tempfile.TemporaryDirectory(prefix="search-trl-") as scratch:
        trainer = InOrderSFTTrainer(
            model=model,
            args=sft_config(params, settings, scratch, **extra),
            train_dataset=ordered_train(settings, seed),
            eval_dataset=eval_rows(settings),
            processing_class=tokenizer,
            peft_config=lora_config(params),
            callbacks=[hook] if per_chunk_eval else [],
        )
        trainer.remove_callback(PrinterCallback)  # metrics go to the result, not to the log
        _sync()
        built = time.time()
        hook.mark = built
        trainer.train()
        _sync()
        trained = time.time()
        result: dict[str, Any] = {"params": params, "build": built - start, "start": start}
        if per_chunk_eval:
            result.update(train=hook.train_seconds, eval=hook.eval_seconds, values=hook.values, pruned=hook.pruned)
        else:
            value = float(trainer.evaluate()["eval_loss"])
            result.update(train=[trained - built], eval=[time.time() - trained], values=[value], pruned=False)
    result["end"] = time.time()
    del trainer, model
    _release()
    return result


_WARM = threading.Event()


def warm_up(settings: Settings, base: Path) -> float:
    """Once per process, untimed: CUDA context, kernels and allocator, as every timed method's process has."""
    if _WARM.is_set():
        return 0.0
    start = time.perf_counter()
    params = {
        "learning_rate": 1e-4,
        "r": 8,
        "alpha_multiple": 1.0,
        "target_modules": "all",
        "lora_dropout": 0.05,
        "batch_size": 4,
        "warmup_ratio": 0.0,
    }
    model, tokenizer = load_base(base)
    with tempfile.TemporaryDirectory(prefix="search-warm-") as scratch:
        trainer = SFTTrainer(
            model=model,
            args=sft_config(params, settings, scratch, max_steps=3),
            train_dataset=load_gsm8k("train", num_rows=16, format="prompt_completion"),
            eval_dataset=load_gsm8k("test", num_rows=8, format="prompt_completion"),
            processing_class=tokenizer,
            peft_config=lora_config(params),
        )
        trainer.remove_callback(PrinterCallback)
        trainer.train()
        trainer.evaluate()
    del trainer, model
    _release()
    _WARM.set()
    return time.perf_counter() - start


# -- the executor: recording values (step record) and real runs (step executor) ---------------------


class ChunkLog:
    """Per trial and chunk, the engine's training and evaluation seconds (hooks the fused engine's ``run``)."""

    def __init__(self) -> None:
        self.chunks: dict[int, dict[int, tuple[float, float]]] = {}
        self._original: Any = None

    def __enter__(self) -> ChunkLog:
        original = self._original = FusedEngine.run
        log = self

        def run(engine: FusedEngine, runtimes: Any) -> Any:
            start = time.perf_counter()
            results = original(engine, runtimes)
            steps = sorted({r.step for r in results if isinstance(r, ChunkResult)})
            _say(f"  gang of {len(runtimes)} at steps {steps}: {time.perf_counter() - start:.1f} s")
            for runtime, result in zip(runtimes, results, strict=True):
                if isinstance(result, ChunkResult):
                    times = (result.train_seconds, result.eval_seconds)
                    log.chunks.setdefault(runtime.spec.number, {})[result.step] = times
            return results

        FusedEngine.run = run  # type: ignore[method-assign, assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        FusedEngine.run = self._original  # type: ignore[method-assign]

    def count(self) -> int:
        return sum(len(chunks) for chunks in self.chunks.values())


def make_executor(settings: Settings, base: Path, seed: int, concurrency: int, schedule: str) -> RapidFireExecutor:
    return RapidFireExecutor(
        model=str(base),
        model_kwargs=_model_kwargs(),
        train_dataset=train_rows(settings),
        eval_dataset=eval_rows(settings),
        eval_samples=None,  # the whole (small) eval set, as the plain TRL trainers evaluate it
        num_chunks=settings.num_chunks,
        max_concurrent_trials=concurrency,
        seed=seed,
        engine="fused",
        output_dir=tempfile.mkdtemp(prefix="search-executor-"),
        show_progress_bar=False,
        dashboard_controls=False,
        schedule=schedule,
    )


def _free(executor: RapidFireExecutor) -> None:
    executor.close()
    _release()


def record(settings: Settings, base: Path, seed: int) -> dict[str, Any]:
    """Every config of ``seed`` trained to the end once, no pruner: per chunk its value and times."""
    configs = sample_configs(seed, settings.configs)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed), pruner=optuna.pruners.NopPruner())
    for config in configs:
        study.enqueue_trial(config)
    with ChunkLog() as log:
        start = time.perf_counter()
        # Lock-step: equal progress, so every round fuses all live trials (values do not depend on the schedule).
        executor = make_executor(settings, base, seed, settings.record_concurrency, "lockstep")
        executor.optimize(study, functools.partial(_configure, settings=settings, output_dir=""), n_trials=len(configs))
        wall = time.perf_counter() - start
    _free(executor)
    trials = sorted(study.trials, key=lambda t: t.number)
    failed = [(t.number, t.user_attrs.get(_attrs.FAIL_REASON)) for t in trials if t.state != TrialState.COMPLETE]
    if failed:
        raise RuntimeError(f"record of seed {seed}: trials that did not complete: {failed}")
    out = []
    for index, (trial, config) in enumerate(zip(trials, configs, strict=True)):
        if trial.params != config:
            raise RuntimeError(f"record of seed {seed}: trial {trial.number} ran {trial.params}, not config {index}")
        times = log.chunks.get(trial.number, {})
        steps = range(settings.num_chunks)
        out.append(
            {
                "values": [trial.intermediate_values[s] for s in steps],
                "train_seconds": [times[s][0] if s in times else None for s in steps],
                "eval_seconds": [times[s][1] if s in times else None for s in steps],
            }
        )
    return {"configs": configs, "trials": out, "wall": wall, "concurrency": settings.record_concurrency}


class ReplaySampler(optuna.samplers.BaseSampler):
    """Hands out a fixed list of configs in order, one per trial it samples (a clone's params are the clone
    sampler's, so a clone takes none): the base sampler of (f), so that (f) draws what the others run."""

    def __init__(self, configs: list[dict[str, Any]]) -> None:
        self._configs = configs
        self._taken: dict[int, int] = {}
        self._lock = threading.Lock()

    def infer_relative_search_space(self, study: optuna.Study, trial: FrozenTrial) -> dict[str, BaseDistribution]:
        return {}

    def sample_relative(
        self, study: optuna.Study, trial: FrozenTrial, search_space: dict[str, BaseDistribution]
    ) -> dict[str, Any]:
        return {}

    def sample_independent(
        self, study: optuna.Study, trial: FrozenTrial, param_name: str, param_distribution: BaseDistribution
    ) -> Any:
        with self._lock:
            index = self._taken.setdefault(trial.number, len(self._taken))
        if index >= len(self._configs):
            raise RuntimeError(f"ReplaySampler: all {len(self._configs)} configs were handed out already.")
        return self._configs[index][param_name]


def executor_run(settings: Settings, base: Path, seed: int, method: str, configs: list[dict[str, Any]]) -> dict:
    """One real study of (d), (e) or (f): wall time from before the executor is built (model load included)."""
    schedule = "lockstep" if method == "lockstep" else "promote"
    if method == "clone":
        sampler: optuna.samplers.BaseSampler = CloneSampler(ReplaySampler(configs), seed=seed)
    else:
        sampler = optuna.samplers.RandomSampler(seed=seed)
    study = optuna.create_study(sampler=sampler, pruner=make_pruner())
    if method != "clone":
        for config in configs:
            study.enqueue_trial(config)
    completions: list[list[Any]] = []
    start = time.perf_counter()

    def finished(study: optuna.Study, trial: FrozenTrial) -> None:
        completions.append([time.perf_counter() - start, trial.number, trial.state.name, trial.value])

    with ChunkLog() as log:
        executor = make_executor(settings, base, seed, settings.concurrency, schedule)
        executor.optimize(
            study,
            functools.partial(_configure, settings=settings, output_dir=""),
            n_trials=settings.configs,
            callbacks=[finished],
        )
        wall = time.perf_counter() - start
    _free(executor)
    trials = sorted(study.trials, key=lambda t: t.number)
    return {
        "schedule": schedule,
        "concurrency": settings.concurrency,
        "wall": wall,
        "completions": completions,  # [seconds, trial number, state, value]
        "chunks": log.count(),
        "states": {state: sum(t.state.name == state for t in trials) for state in ("COMPLETE", "PRUNED", "FAIL")},
        "clones": {kind: sum(t.user_attrs.get(_attrs.CLONE) == kind for t in trials) for kind in ("warm", "cold")},
        "trials": [
            {
                "number": t.number,
                "params": t.params,
                "state": t.state.name,
                "value": t.value,
                "values": [t.intermediate_values[s] for s in sorted(t.intermediate_values)],
                "parent": t.user_attrs.get(_attrs.PARENT),
            }
            for t in trials
        ],
    }


# -- worker processes: calibration under contention and the real run of (c) ------------------------


def _worker_main(spec_path: str) -> None:
    """``python -m benchmarks.search --worker SPEC``: one plain-TRL process among ``processes`` on the GPU."""
    spec = json.loads(Path(spec_path).read_text())
    sync, index = Path(spec["dir"]), spec["index"]
    settings = Settings(**spec["settings"])
    base = Path(spec["base"])
    ready = time.time()
    warm = warm_up(settings, base)
    go = wait_for_go(sync, index)
    result: dict[str, Any] = {"index": index, "started": ready - spec["spawned"], "warm_up": warm}
    if spec["mode"] == "calibrate":
        run = trl_trial(
            spec["params"],
            settings,
            base,
            0,
            done_after=settings.calibrate_chunks,
            done_file=sync / f"done-{index}",
            stop_file=sync / "stop",
        )
        result["run"] = run
    else:
        storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(spec["storage"]))
        study = optuna.load_study(study_name="validate", storage=storage, pruner=make_pruner())
        runs: list[dict[str, Any]] = []

        def objective(trial: optuna.Trial) -> float:
            params = suggest(trial)
            run = trl_trial(params, settings, base, spec["seed"], trial=trial, stop_after=settings.validate_chunks)
            runs.append({**run, "number": trial.number})
            if run["pruned"]:
                raise optuna.TrialPruned()
            return float(run["values"][-1])

        study.optimize(objective, n_trials=1)
        result["runs"] = runs
    for run in [result.get("run"), *result.get("runs", [])]:
        if run:
            run["start"] -= go
            run["end"] -= go
    (sync / f"result-{index}.json").write_text(json.dumps(result))


def wait_for_go(sync: Path, index: int) -> float:
    """A worker's side of :func:`spawn_workers`: say it is ready, wait until every worker is; the go time."""
    (sync / f"ready-{index}").touch()
    while not (sync / "go").exists():
        time.sleep(0.01)
    return float((sync / "go").read_text())


def spawn_workers(
    specs: list[dict[str, Any]], stop_when_done: bool, module: str = "benchmarks.search"
) -> list[dict[str, Any]]:
    """Start one worker process per spec, let them go together once all are warm, collect their results.

    ``stop_when_done``: tell every worker to stop once all have trained their timed chunks, so each timed
    chunk ran with every other process still training. ``module``: the workers' code, run as ``python -m
    module --worker SPEC``; a worker reads its spec (with ``index`` and the folder ``dir``), calls
    :func:`wait_for_go` once it is ready and writes ``result-<index>.json`` in ``dir`` last.
    """
    sync = Path(tempfile.mkdtemp(prefix="search-workers-"))
    procs = []
    for index, spec in enumerate(specs):
        spec = {**spec, "index": index, "dir": str(sync), "spawned": time.time()}
        path = sync / f"spec-{index}.json"
        path.write_text(json.dumps(spec))
        command = [sys.executable, "-m", module, "--worker", str(path)]
        with (sync / f"log-{index}.txt").open("w") as log:
            procs.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=os.getcwd()))

    def wait_for(name: str, what: str) -> None:
        while sum((sync / name.format(i)).exists() for i in range(len(specs))) < len(specs):
            for index, proc in enumerate(procs):
                if proc.poll() is not None and not (sync / f"result-{index}.json").exists():
                    tail = (sync / f"log-{index}.txt").read_text()[-3000:]
                    for other in procs:
                        if other.poll() is None:
                            other.kill()
                    raise RuntimeError(f"worker {index} exited with {proc.returncode} before {what}:\n{tail}")
            time.sleep(0.05)

    wait_for("ready-{}", "it was ready")
    (sync / "go.tmp").write_text(repr(time.time()))
    (sync / "go.tmp").replace(sync / "go")  # whole, never half-written, when a worker sees it
    if stop_when_done:
        wait_for("done-{}", "its timed chunks")
        (sync / "stop").touch()
    wait_for("result-{}.json", "it wrote its result")
    for proc in procs:
        proc.wait()
    return [json.loads((sync / f"result-{i}.json").read_text()) for i in range(len(specs))]


# -- calibration (step calibrate) ------------------------------------------------------------------


def _calibration_params(kind: str, r: int = 8) -> dict[str, Any]:
    batch, target = kind.split("/")
    return {
        "learning_rate": 1e-4,
        "r": r,
        "alpha_multiple": 1.0,
        "target_modules": target,
        "lora_dropout": 0.05,
        "batch_size": int(batch),
        "warmup_ratio": 0.05,
    }


KINDS = [f"{batch}/{target}" for batch in BATCHES for target in TARGETS]
RANK_KIND = "8/all"


def calibrate_alone(settings: Settings, base: Path) -> dict[str, Any]:
    """Plain TRL alone: per kind (batch, targets) at r8, the first and a later chunk's training time, the
    evaluation time and the build time (model load + trainer, which tokenizes the train set); r64 once."""
    warm = warm_up(settings, base)
    kinds: dict[str, Any] = {}
    chunks = settings.calibrate_chunks
    for kind in [*KINDS, f"{RANK_KIND}@r64"]:
        name, _, rank = kind.partition("@r")
        run = trl_trial(_calibration_params(name, int(rank or 8)), settings, base, 0, stop_after=chunks)
        kinds[kind] = {
            "build": run["build"],
            "first_chunk": run["train"][0],
            "chunk": statistics.mean(run["train"][1:]) if len(run["train"]) > 1 else run["train"][0],
            "eval": statistics.mean(run["eval"]),
            "raw": {key: run[key] for key in ("train", "eval", "values")},
        }
        _say(f"calibrate alone {kind}: build {run['build']:.1f} s, chunks {run['train']}, evals {run['eval']}")
    return {"warm_up_seconds": warm, "chunks_timed": chunks, "kinds": kinds}


def calibrate_processes(settings: Settings, base: Path) -> dict[str, Any]:
    """The same under ``processes`` OS processes sharing the GPU, with mixed kinds, all training at once."""
    specs = [
        {
            "mode": "calibrate",
            "settings": dataclasses.asdict(settings),
            "base": str(base),
            "params": _calibration_params(KINDS[i % len(KINDS)]),
        }
        for i in range(settings.processes)
    ]
    results = spawn_workers(specs, stop_when_done=True)
    workers = []
    for result in results:
        run = result["run"]
        timed = settings.calibrate_chunks
        workers.append(
            {
                "kind": kind_of(run["params"]),
                "started": result["started"],
                "warm_up": result["warm_up"],
                "build": run["build"],
                "train": run["train"][:timed],
                "eval": run["eval"][:timed],
            }
        )
    return {"processes": settings.processes, "workers": workers}


def slowdowns(calibration: dict[str, Any]) -> dict[str, Any]:
    """Time under ``processes`` processes over time alone: per kind for training, one factor for evaluation
    and one for building (each worker against the alone run of its own kind)."""
    alone = calibration["alone"]["kinds"]
    train: dict[str, list[float]] = {}
    evals, builds = [], []
    for worker in calibration["processes"]["workers"]:
        mine = alone[worker["kind"]]
        expected = mine["first_chunk"] + mine["chunk"] * (len(worker["train"]) - 1)
        train.setdefault(worker["kind"], []).append(sum(worker["train"]) / expected)
        evals.append(statistics.mean(worker["eval"]) / mine["eval"])
        builds.append(worker["build"] / mine["build"])
    per_kind = {kind: statistics.mean(values) for kind, values in train.items()}
    return {
        "train": per_kind,
        "train_mean": statistics.mean(per_kind.values()),
        "eval": statistics.mean(evals),
        "build": statistics.mean(builds),
    }


# -- validation of the replays (step validate) -----------------------------------------------------


def validate_exhaustive(settings: Settings, base: Path, params: dict[str, Any], seed: int) -> dict[str, Any]:
    """(a) one config trained to the end with real TRL, evaluated once."""
    warm_up(settings, base)
    run = trl_trial(params, settings, base, seed, per_chunk_eval=False)
    return {"seed": seed, "params": params, "run": run}


def validate_sequential(settings: Settings, base: Path, configs: list[dict[str, Any]], seed: int) -> dict[str, Any]:
    """(b) real sequential Optuna + TRL + callback on ``configs``, stopped after ``validate_chunks`` chunks."""
    warm_up(settings, base)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed), pruner=make_pruner())
    for config in configs:
        study.enqueue_trial(config)
    runs: list[dict[str, Any]] = []
    completions: list[list[Any]] = []
    start = time.time()

    def objective(trial: optuna.Trial) -> float:
        run = trl_trial(suggest(trial), settings, base, seed, trial=trial, stop_after=settings.validate_chunks)
        runs.append({**run, "number": trial.number, "start": run["start"] - start, "end": run["end"] - start})
        if run["pruned"]:
            raise optuna.TrialPruned()
        return float(run["values"][-1])

    def finished(study: optuna.Study, trial: FrozenTrial) -> None:
        completions.append([time.time() - start, trial.number, trial.state.name, trial.value])

    study.optimize(objective, n_trials=len(configs), callbacks=[finished])
    return {"seed": seed, "configs": configs, "wall": time.time() - start, "runs": runs, "completions": completions}


def validate_processes(settings: Settings, base: Path, configs: list[dict[str, Any]], seed: int) -> dict[str, Any]:
    """(c) real worker processes, one per config, sharing a journal-file study, ``validate_chunks`` chunks."""
    folder = Path(tempfile.mkdtemp(prefix="search-journal-"))
    path = str(folder / "study.log")
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(path))
    study = optuna.create_study(study_name="validate", storage=storage, pruner=make_pruner())
    for config in configs:
        study.enqueue_trial(config)
    spec = {"mode": "validate", "settings": dataclasses.asdict(settings), "base": str(base), "storage": path}
    spec["seed"] = seed
    results = spawn_workers([spec] * len(configs), stop_when_done=False)
    runs = [run for result in results for run in result["runs"]]
    trials = {t.number: t for t in study.trials}
    for run in runs:
        run["state"] = trials[run["number"]].state.name
    return {
        "seed": seed,
        "configs": configs,
        "wall": max(run["end"] for run in runs),
        "runs": sorted(runs, key=lambda run: run["number"]),
        "started": [result["started"] for result in results],
    }


# -- replays ---------------------------------------------------------------------------------------


class TimeModel:
    """Seconds a plain TRL trial spends, from the calibration: alone, and slowed down among ``processes``.

    A chunk's training time is its kind's (batch, targets) at r8, scaled linearly in the rank by the r8/r64
    measurement; the first chunk of a trainer has its own time (data loader and optimizer set-up). Among n
    active processes a phase takes its alone time times ``1 + (f - 1)(n - 1)/(P - 1)``, where f is the
    slowdown measured with all P processes busy (so the last configs of a study, with fewer peers, run faster).
    """

    def __init__(self, calibration: dict[str, Any]) -> None:
        self.kinds = calibration["alone"]["kinds"]
        r8, r64 = self.kinds[RANK_KIND], self.kinds[f"{RANK_KIND}@r64"]
        self.rank_slope = (r64["chunk"] / r8["chunk"] - 1) / (64 - 8)
        self.build_seconds = statistics.median(self.kinds[kind]["build"] for kind in KINDS)
        self.processes = 1
        self.factors: dict[str, Any] = {}
        if "processes" in calibration:
            self.processes = calibration["processes"]["processes"]
            self.factors = slowdowns(calibration)

    def build(self, params: dict[str, Any]) -> float:
        return self.build_seconds

    def chunk(self, params: dict[str, Any], index: int) -> float:
        kind = self.kinds[kind_of(params)]
        return kind["first_chunk" if index == 0 else "chunk"] * (1 + self.rank_slope * (int(params["r"]) - 8))

    def eval(self, params: dict[str, Any]) -> float:
        return self.kinds[kind_of(params)]["eval"]

    def factor(self, phase: str, params: dict[str, Any], active: int) -> float:
        if active <= 1 or self.processes <= 1:
            return 1.0
        if phase == "train":
            full = self.factors["train"].get(kind_of(params), self.factors["train_mean"])
        else:
            full = self.factors[phase]
        return 1 + (full - 1) * (min(active, self.processes) - 1) / (self.processes - 1)


@dataclass
class _Slot:
    """One worker of a replay: the config it runs, its phase and the alone-seconds left in that phase."""

    config: int | None = None
    trial: optuna.Trial | None = None
    phase: str = ""
    left: float = 0.0
    chunk: int = 0


def simulate(
    configs: list[dict[str, Any]],
    values: list[list[float]],
    times: TimeModel,
    *,
    workers: int,
    chunks: int,
    pruner: optuna.pruners.BasePruner,
    per_chunk_eval: bool = True,
    seed: int = 0,
) -> dict[str, Any]:
    """Replay plain Optuna + TRL on recorded values: ``workers`` take the configs in order and share one real
    in-memory study with the real ``pruner``; every phase (build, a chunk's training, an evaluation) lasts
    its calibrated time, stretched by the number of workers busy meanwhile; reports and pruning decisions
    happen in global time order (a RUNNING peer stays RUNNING: Optuna's pruners compare with COMPLETE ones).
    Without ``per_chunk_eval`` a trial evaluates once, at its end, and nothing is reported."""
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed), pruner=pruner)
    waiting = list(range(len(configs)))
    slots = [_Slot() for _ in range(workers)]
    now, trained = 0.0, 0
    completions: list[list[Any]] = []
    timeline: dict[int, dict[str, Any]] = {}

    def take(slot: _Slot) -> None:
        slot.config = waiting.pop(0) if waiting else None
        if slot.config is not None:
            study.enqueue_trial(configs[slot.config])
            slot.trial = study.ask()
            suggest(slot.trial)
            slot.phase, slot.left, slot.chunk = "build", times.build(configs[slot.config]), 0
            timeline[slot.config] = {"start": now}

    def train_next(slot: _Slot, params: dict[str, Any]) -> None:
        slot.phase, slot.left, slot.chunk = "train", times.chunk(params, slot.chunk), slot.chunk + 1

    def end(slot: _Slot, index: int, state: TrialState, value: float | None = None) -> None:
        assert slot.trial is not None
        study.tell(slot.trial, value, state=state)
        if state == TrialState.COMPLETE:
            completions.append([now, index, state.name, value])
        timeline[index].update(end=now, state=state.name, chunks=slot.chunk)
        take(slot)

    def advance(slot: _Slot) -> None:
        nonlocal trained
        index = slot.config
        assert index is not None and slot.trial is not None
        params = configs[index]
        if slot.phase == "build":
            train_next(slot, params)
        elif slot.phase == "train":
            trained += 1
            if per_chunk_eval or slot.chunk == chunks:
                slot.phase, slot.left = "eval", times.eval(params)
            else:
                train_next(slot, params)
        else:  # an evaluation ended: report it, then prune, complete or go on
            value = values[index][slot.chunk - 1]
            if per_chunk_eval:
                slot.trial.report(value, slot.chunk - 1)
                if slot.trial.should_prune():
                    end(slot, index, TrialState.PRUNED)
                    return
            if slot.chunk == chunks:
                end(slot, index, TrialState.COMPLETE, value)
            else:
                train_next(slot, params)

    for slot in slots:
        take(slot)
    while busy := [slot for slot in slots if slot.config is not None]:
        stretch = [times.factor(slot.phase, configs[slot.config], len(busy)) for slot in busy]  # type: ignore[index]
        first = min(range(len(busy)), key=lambda i: busy[i].left * stretch[i])
        step = busy[first].left * stretch[first]
        now += step
        for i, slot in enumerate(busy):
            slot.left = 0.0 if i == first else max(slot.left - step / stretch[i], 0.0)
        for slot in busy:  # in worker order: ties are taken as they come
            if slot.left <= 1e-12:
                advance(slot)
    return {
        "wall": now,
        "completions": completions,  # [seconds, config index, state, value]
        "chunks": trained,
        "states": {s: sum(t["state"] == s for t in timeline.values()) for s in ("COMPLETE", "PRUNED")},
        "timeline": timeline,
    }


def replays(record: dict[str, Any], times: TimeModel, settings: Settings, seed: int) -> dict[str, dict[str, Any]]:
    """(a), (b) and (c) of one seed, replayed on its recorded values."""
    configs, values = record["configs"], [trial["values"] for trial in record["trials"]]
    chunks = settings.num_chunks
    out = {
        "exhaustive": simulate(
            configs,
            values,
            times,
            workers=1,
            chunks=chunks,
            pruner=optuna.pruners.NopPruner(),
            per_chunk_eval=False,
            seed=seed,
        ),
        "sequential_optuna": simulate(
            configs, values, times, workers=1, chunks=chunks, pruner=make_pruner(), seed=seed
        ),
    }
    if times.processes > 1:
        out["parallel_optuna_processes"] = simulate(
            configs, values, times, workers=times.processes, chunks=chunks, pruner=make_pruner(), seed=seed
        )
    for result in out.values():
        result.pop("timeline")
    return out


# -- the replay check ------------------------------------------------------------------------------


def _relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _check_optuna(
    validation: dict[str, Any], record: dict[str, Any], times: TimeModel, settings: Settings, workers: int
) -> dict[str, Any]:
    """A real plain-Optuna run (b or c) against its replay on the recorded values of the same configs."""
    configs = validation["configs"]
    chunks = settings.validate_chunks
    recorded = [record["trials"][record["configs"].index(config)]["values"][:chunks] for config in configs]
    replay = simulate(
        configs, recorded, times, workers=workers, chunks=chunks, pruner=make_pruner(), seed=validation["seed"]
    )
    trials, value_differences, end_differences = [], [], []
    ratios: dict[str, list[float]] = {"build": [], "chunk": [], "eval": []}
    for run in validation["runs"]:
        index = configs.index(run["params"])
        params = configs[index]
        state = run.get("state") or ("PRUNED" if run["pruned"] else "COMPLETE")
        simulated = replay["timeline"][index]
        differences = [_relative(v, r) for v, r in zip(run["values"], recorded[index], strict=False)]
        value_differences += differences
        end_differences.append(_relative(run["end"], simulated["end"]))
        ratios["build"].append(run["build"] / times.build(params))
        ratios["chunk"] += [t / times.chunk(params, i) for i, t in enumerate(run["train"][: len(run["values"])])]
        ratios["eval"] += [t / times.eval(params) for t in run["eval"]]
        trials.append(
            {
                "config": index,
                "real": {"state": state, "chunks": len(run["values"]), "end": run["end"], "values": run["values"]},
                "replay": {
                    "state": simulated["state"],
                    "chunks": simulated["chunks"],
                    "end": simulated["end"],
                    "values": recorded[index][: simulated["chunks"]],
                },
            }
        )
    agree = sum(
        t["real"]["state"] == t["replay"]["state"] and t["real"]["chunks"] == t["replay"]["chunks"] for t in trials
    )
    return {
        "configs": len(configs),
        "workers": workers,
        "chunks": chunks,
        "decisions_agree": f"{agree}/{len(trials)}",
        "values_max_relative_difference": max(value_differences, default=None),
        "values_median_relative_difference": statistics.median(value_differences) if value_differences else None,
        "wall_real": validation["wall"],
        "wall_replay": replay["wall"],
        "wall_relative_difference": _relative(replay["wall"], validation["wall"]),
        "trial_end_median_relative_difference": statistics.median(end_differences) if end_differences else None,
        "real_over_alone_model_median": {k: statistics.median(v) for k, v in ratios.items() if v},
        "trials": trials,
    }


def replay_check(data: dict[str, Any], times: TimeModel, settings: Settings) -> dict[str, Any]:
    """The real runs of step validate against the replay of the same configs and chunks."""
    validation = data.get("validation", {})
    check: dict[str, Any] = {}
    for name, run in validation.items():
        record = data.get("records", {}).get(str(run["seed"]))
        if record is None:
            check[name] = f"needs the record of seed {run['seed']}"
            continue
        if name == "exhaustive":
            params = run["params"]
            real = run["run"]
            recorded = record["trials"][record["configs"].index(params)]["values"][-1]
            train = sum(times.chunk(params, i) for i in range(settings.num_chunks))
            predicted = times.build(params) + train + times.eval(params)
            real_total = real["build"] + real["train"][0] + real["eval"][0]
            check[name] = {
                "value_real": real["values"][0],
                "value_recorded": recorded,
                "value_relative_difference": _relative(real["values"][0], recorded),
                "seconds_real": {"build": real["build"], "train": real["train"][0], "eval": real["eval"][0]},
                "seconds_replay": {"build": times.build(params), "train": train, "eval": times.eval(params)},
                "total_relative_difference": _relative(predicted, real_total),
            }
        else:
            workers = 1 if name == "sequential" else len(run["configs"])
            check[name] = _check_optuna(run, record, times, settings, workers)
    return check


# -- results: per seed, aggregate, report ------------------------------------------------------------


def summarize(run: dict[str, Any], target: float, b_end: float | None) -> dict[str, Any]:
    """A method's anytime curve (best COMPLETE value so far against seconds since it started) and its marks."""
    curve: list[list[float]] = []
    for seconds, _, state, value in sorted(run["completions"], key=lambda c: c[0]):
        if state == "COMPLETE" and value is not None and (not curve or value < curve[-1][1]):
            curve.append([seconds, value])
    reached = next((t for t, v in curve if v <= target), None)
    held = [v for t, v in curve if b_end is not None and t <= b_end]
    return {
        "time_to_target": reached,
        "wall": run["wall"],
        "best": curve[-1][1] if curve else None,
        "best_at_b_end": held[-1] if held else None,
        "chunks": run["chunks"],
        "states": run["states"],
        "curve": curve,
    }


def _quantile(values: list[float], q: float) -> float:
    """The q-quantile with linear interpolation; infinite when it reaches an infinite value."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low, high = math.floor(position), math.ceil(position)
    if math.isinf(ordered[high]):
        return math.inf
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _finite(value: float) -> float | None:
    return None if math.isinf(value) else value


def aggregate(seeds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per method over seeds: time to target (median, IQR; a seed that never reached it counts as infinite),
    how many seeds never reached it, wall time, and the regret held when (b) finished."""
    methods: dict[str, Any] = {}
    for method in METHODS:
        entries = [(seed, seed["methods"][method]) for seed in seeds if method in seed["methods"]]
        if not entries:
            continue
        reached = [e["time_to_target"] if e["time_to_target"] is not None else math.inf for _, e in entries]
        regrets = [
            (e["best_at_b_end"] - seed["best_exhaustive"]) / seed["best_exhaustive"]
            for seed, e in entries
            if e["best_at_b_end"] is not None
        ]
        methods[method] = {
            "seeds": len(entries),
            "never_reached": sum(math.isinf(t) for t in reached),
            "time_to_target_median": _finite(_quantile(reached, 0.5)),
            "time_to_target_q25": _finite(_quantile(reached, 0.25)),
            "time_to_target_q75": _finite(_quantile(reached, 0.75)),
            "wall_median": statistics.median(e["wall"] for _, e in entries),
            "regret_at_b_end_median": statistics.median(regrets) if regrets else None,
            "no_complete_trial_at_b_end": len(entries) - len(regrets),
            "chunks_median": statistics.median(e["chunks"] for _, e in entries),
        }
    ratios = {}
    for key, (numerator, denominator) in {
        "time_to_target_vs_sequential_optuna": ("sequential_optuna", "executor_promote"),
        "time_to_target_vs_parallel_optuna_processes": ("parallel_optuna_processes", "executor_promote"),
        "time_to_target_vs_exhaustive": ("exhaustive", "executor_promote"),
        "time_to_target_lockstep_over_promote": ("executor_lockstep", "executor_promote"),
        "time_to_target_clone_over_promote": ("executor_promote_clone", "executor_promote"),
    }.items():
        top = methods.get(numerator, {}).get("time_to_target_median")
        bottom = methods.get(denominator, {}).get("time_to_target_median")
        ratios[key] = top / bottom if top is not None and bottom else None
    return {"methods": methods, "ratios": ratios}


def finalize(data: dict[str, Any], settings: Settings) -> None:
    """Replays, per-seed results, the aggregate and the replay check, from whatever ``data`` holds so far."""
    calibration = data.get("calibration", {})
    times = TimeModel(calibration) if "alone" in calibration else None
    seeds = []
    for key in sorted(data.get("records", {}), key=int):
        record = data["records"][key]
        best = min(trial["values"][-1] for trial in record["trials"])
        target = best * (1 + TARGET_SLACK)
        runs: dict[str, dict[str, Any]] = replays(record, times, settings, int(key)) if times else {}
        runs.update(data.get("executor_runs", {}).get(key, {}))
        b_end = runs["sequential_optuna"]["wall"] if "sequential_optuna" in runs else None
        seeds.append(
            {
                "seed": int(key),
                "configs": record["configs"],
                "best_exhaustive": best,
                "target": target,
                "methods": {name: summarize(run, target, b_end) for name, run in sorted(runs.items())},
            }
        )
    data["seeds"] = seeds
    data["aggregate"] = aggregate(seeds)
    if times is not None and data.get("validation"):
        data["replay_check"] = replay_check(data, times, settings)
    if "processes" in calibration:
        calibration["slowdown"] = slowdowns(calibration)


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
        _say("matplotlib is not installed: no search.png")
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
        middle, low, high = (np.array([_quantile(list(col), q) for col in table.T]) for q in (0.5, 0.25, 0.75))
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


# -- the part's entry ------------------------------------------------------------------------------


def _settings_record(settings: Settings) -> dict[str, Any]:
    return {
        "comparable": settings.comparable(),
        "values": dataclasses.asdict(settings),
        "pruner": "MedianPruner(n_startup_trials=5, n_warmup_steps=1)",
        "target": "best COMPLETE value <= best final value of the seed's exhaustive sweep x 1.01",
        "search_space": {
            "learning_rate": "log-uniform [1e-5, 3e-3]",
            "r": [8, 16, 32, 64],
            "lora_alpha": "alpha_multiple x r, alpha_multiple in {0.5, 1, 2}",
            "target_modules": TARGETS,
            "lora_dropout": "uniform [0, 0.1]",
            "per_device_train_batch_size": list(BATCHES),
            "warmup_ratio": "uniform [0, 0.1]",
        },
        "data": "bundled GSM8K, prompt-completion; train: the first trial_rows rows (shuffled by the executor's "
        "seed into chunks; plain TRL gets the same order); eval: the first eval_rows test rows",
    }


def _use_base(data: dict[str, Any], base: Path) -> str:
    """The base's fingerprint, refusing a base other than the one the results in ``data`` were measured on."""
    if not (base / "config.json").exists():
        raise SystemExit(f"no base model in {base}: run --search-steps pretrain first (same --out)")
    mark = fingerprint(base)
    known = data.get("pretrain", {}).get("fingerprint")
    if known is not None and known != mark:
        raise SystemExit(
            f"the base model in {base} ({mark}) is not the one the results in --out were measured on ({known}): "
            "a new base means a new benchmark; use another --out"
        )
    return mark


def _has_results(data: dict[str, Any]) -> bool:
    return any(data.get(key) for key in ("records", "calibration", "validation", "executor_runs"))


def run(options: Any, save: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """The search part: the steps asked for, merged into ``--out/search.json`` (``save`` writes it)."""
    settings = Settings.from_options(options)
    datasets.disable_progress_bars()
    path = Path(options.out) / "search.json"
    data: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    if "settings" not in data:
        data = {}  # nothing of this part's yet (or the earlier search part's format, which this replaces)
    if data.get("settings") and data["settings"]["comparable"] != settings.comparable():
        raise SystemExit(
            f"{path} holds results for other settings ({data['settings']['comparable']}): use another --out"
        )
    data["settings"] = _settings_record(settings)
    steps = list(STEPS) if options.search_steps == "all" else options.search_steps.split(",")
    unknown = sorted(set(steps) - set(STEPS))
    methods = options.search_methods.split(",")
    if unknown or set(methods) - set(SCHEDULED):
        raise SystemExit(f"--search-steps: choose among {', '.join(STEPS)}; --search-methods: {', '.join(SCHEDULED)}")
    seeds = [int(s) for s in (options.seeds or ("0,1" if settings.smoke else "0,1,2,3,4")).split(",")]
    default_base = ".bench/search-base-smoke" if settings.smoke else ".bench/search-base"
    base = Path(options.search_base or default_base)
    if set(steps) - {"replay"} or "machine" not in data:
        data["machine"] = machine()
    call = {"command": " ".join([sys.executable, *sys.argv]), "steps": steps, "seeds": seeds, "methods": methods}
    data.setdefault("calls", []).append(call)
    began = time.perf_counter()

    def done(what: str, since: float) -> None:
        finalize(data, settings)
        call["seconds"] = time.perf_counter() - began
        save(data)
        _say(f"{what}: {time.perf_counter() - since:.1f} s")

    for step in (s for s in STEPS if s in steps):
        start = time.perf_counter()
        if step == "pretrain":
            reuse = (base / "pretrain.json").exists() and (base / "config.json").exists()
            if not reuse and _has_results(data):
                raise SystemExit(
                    f"no base model in {base}, and {path} holds results measured on another one: a new base means "
                    "a new benchmark; use another --out"
                )
            info = (
                json.loads((base / "pretrain.json").read_text())
                if reuse
                else pretrain(settings, Path(options.corpus or ".bench/corpus"), base)
            )
            data["pretrain"] = {**info, "fingerprint": _use_base(data, base), "reused": reuse}
            done(f"pretrain ({'reused ' + str(base) if reuse else 'trained'})", start)
            continue
        if step == "replay":
            done("replay", start)
            continue
        _use_base(data, base)
        if step == "record":
            for seed in seeds:
                begun = time.perf_counter()
                data.setdefault("records", {})[str(seed)] = record(settings, base, seed)
                done(f"record seed {seed}", begun)
        elif step == "calibrate":
            calibration: dict[str, Any] = {"alone": calibrate_alone(settings, base)}
            data["calibration"] = calibration
            done("calibrate alone", start)
            begun = time.perf_counter()
            calibration["processes"] = calibrate_processes(settings, base)
            done(f"calibrate {settings.processes} processes", begun)
        elif step == "validate":
            validation = data.setdefault("validation", {})
            configs = sample_configs(0, settings.configs)
            record0 = data.get("records", {}).get("0")
            best = configs[0]
            if record0 is not None:
                best = min(zip(configs, record0["trials"], strict=True), key=lambda p: p[1]["values"][-1])[0]
            begun = time.perf_counter()
            validation["exhaustive"] = validate_exhaustive(settings, base, best, 0)
            done("validate (a), one config to the end", begun)
            begun = time.perf_counter()
            validation["sequential"] = validate_sequential(
                settings, base, configs[: settings.validate_sequential_configs], 0
            )
            done(f"validate (b), {settings.validate_sequential_configs} configs", begun)
            begun = time.perf_counter()
            validation["processes"] = validate_processes(settings, base, configs[: settings.processes], 0)
            done(f"validate (c), {settings.processes} processes", begun)
        elif step == "executor":
            warm_up(settings, base)
            for seed in seeds:
                configs = sample_configs(seed, settings.configs)
                for method in methods:
                    begun = time.perf_counter()
                    result = executor_run(settings, base, seed, method, configs)
                    data.setdefault("executor_runs", {}).setdefault(str(seed), {})[SCHEDULED[method]] = result
                    done(f"executor seed {seed} {method}", begun)
    finalize(data, settings)
    call["seconds"] = time.perf_counter() - began
    return data


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        datasets.disable_progress_bars()
        _worker_main(sys.argv[2])
    else:
        raise SystemExit("run the search part with: python -m benchmarks.run --parts search --out DIR")
