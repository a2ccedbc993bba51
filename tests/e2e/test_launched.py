"""The fused engine's launched pass: what the model computes, compiled once per layout, and its fall-backs.

The pass (``_fused/_decoder.py``) computes a Llama-family decoder from its weights; these tests pin it to
the model's own modules (the same gang through PEFT's layers, patched by the older fused pass), pin the
compiled pass to the uncompiled one on whole studies, and count compilations as gangs change.
"""

from __future__ import annotations

import logging
import types

import optuna
import pytest
import torch
from _numerics import assert_within_rounding, gradient_terms
from helpers import lora, sft_args
from peft import LoraConfig
from transformers import AutoConfig, AutoModelForCausalLM

from optuna_rapidfire._engines._launched import LaunchedPasses
from optuna_rapidfire._fused._decoder import Rows
from optuna_rapidfire._fused._dropout import feature_keys, position_keys, row_keys
from optuna_rapidfire._fused._fused_pass import Gang, backbone_and_head, fused_forward
from optuna_rapidfire._resident._model import ResidentModel

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL_LINEAR = [*ATTENTION, "gate_proj", "up_proj", "down_proj"]
# rank, targets, dropout, rows in the pass
MEMBERS = [(4, ["q_proj", "v_proj"], 0.0, 2), (8, ALL_LINEAR, 0.2, 4), (2, ATTENTION, 0.1, 2)]
TOKENS = 24


def _tiny(family: str, tiny_model: str) -> torch.nn.Module:
    """The tiny Llama of the suite, or a Qwen2 (biased q/k/v) or Qwen3 (q/k norms) of the same size."""
    if family == "llama":
        return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    config = AutoConfig.for_model(
        family,
        vocab_size=1024,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _runtime(resident: ResidentModel, name: str, number: int) -> types.SimpleNamespace:
    """What the launched pass reads of a built trial: its adapter's name and parameters, optimizer, args."""
    params = resident.adapter_params(name)
    args = types.SimpleNamespace(max_grad_norm=1.0, gradient_checkpointing=False, activation_checkpointing=False)
    kind = types.SimpleNamespace(checkpointing=lambda args: (False, None))
    return types.SimpleNamespace(
        spec=types.SimpleNamespace(number=number, kind=kind),
        args=args,
        state=types.SimpleNamespace(adapter_name=name, params=params, optimizer=torch.optim.AdamW(params)),
    )


@pytest.mark.numerics
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_the_launched_pass_computes_what_the_models_own_modules_compute(tiny_model: str, family: str) -> None:
    resident = ResidentModel(_tiny(family, tiny_model), tokenizer=None, device=torch.device("cpu"))  # type: ignore[arg-type]
    names = [f"t{i}" for i in range(len(MEMBERS))]
    for seed, (name, (rank, targets, dropout, _)) in enumerate(zip(names, MEMBERS, strict=True)):
        config = LoraConfig(r=rank, lora_alpha=rank + seed, target_modules=targets, lora_dropout=dropout)
        config.init_lora_weights = False  # non-zero B: every update matters
        resident.add_adapter(name, config, seed)
    runtimes = [_runtime(resident, name, i) for i, name in enumerate(names)]
    launched = LaunchedPasses(resident, compile=False, capacity=4)
    assert launched.refusal(runtimes) is None
    rows = [count for *_, count in MEMBERS]
    keys = [101, 202, 303]
    ids = torch.randint(0, 1024, (sum(rows), TOKENS), generator=torch.Generator().manual_seed(0))
    weights = torch.linspace(-1, 1, sum(rows) * TOKENS * resident.base.config.hidden_size)
    model = resident.module
    model.train()

    def grads() -> dict[str, torch.Tensor]:
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    resident.set_trainable(names, True)
    with fused_forward(model, Gang(names, rows, keys)):
        backbone, _ = backbone_and_head(resident.base)
        expected = backbone(input_ids=ids, use_cache=False).last_hidden_state
    (expected.flatten() * weights).sum().backward()
    own = grads()
    model.zero_grad(set_to_none=True)

    layout = launched.load(runtimes)
    drops = [p for _, _, p, count in MEMBERS for _ in range(count)]
    units = torch.tensor([k for k, count in enumerate(rows) for _ in range(count // 2)])
    features = tuple(feature_keys(width, ids.device) for width in launched.decoder.feature_widths())
    pass_rows = Rows(units, row_keys(keys, rows), torch.tensor(drops), position_keys(TOKENS, ids.device), features)
    hidden = launched.hidden(ids, pass_rows, layout)
    (hidden.flatten() * weights).sum().backward()
    launched.store(layout, runtimes)  # the weights come back unchanged (no step was taken)

    # Besides a decoder's products (gradient_terms), the passes sum the LoRA updates' (rank bucket 8 and the
    # input features) and the RMSNorms' squares (hidden size twice, and q/k norms over the head size), forward
    # and backward.
    config = resident.base.config
    head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    extra = 2 * config.num_hidden_layers * (8 + config.intermediate_size + 2 * config.hidden_size + 2 * head)
    terms = gradient_terms(config, rows=sum(rows), length=TOKENS) + extra
    assert_within_rounding(hidden.detach(), expected.detach(), terms=terms, what="hidden states")
    slots = layout.slots
    assert slots is not None
    for k, (rank, _, _, _) in enumerate(MEMBERS):
        member = launched.member(runtimes[k])
        assert not isinstance(member, str)
        for projection, (a, b, _) in member.adapter.projections.items():
            a_name = next(n for n, p in model.named_parameters() if p is a)
            b_name = next(n for n, p in model.named_parameters() if p is b)
            got_a = slots.a[projection].grad[k, :rank]
            got_b = slots.b[projection].grad[k, :rank].t()
            assert_within_rounding(got_a, own[a_name], terms=terms, what=a_name)
            assert_within_rounding(got_b, own[b_name], terms=terms, what=b_name)
        assert torch.count_nonzero(slots.a[next(iter(member.adapter.projections))].grad[k, rank:]) == 0


# Mixed ranks, targets, dropout, batch sizes, accumulation and clipping, as a search makes them.
STUDY = [
    {"r": 4, "targets": ["q_proj", "v_proj"], "dropout": 0.0, "batch": 2, "accumulation": 1, "clip": 1.0},
    {"r": 8, "targets": ALL_LINEAR, "dropout": 0.1, "batch": 4, "accumulation": 2, "clip": 0.0},
    {"r": 2, "targets": ATTENTION, "dropout": 0.0, "batch": 2, "accumulation": 1, "clip": 0.5},
]


def _configure(trial: optuna.Trial):
    c = STUDY[trial.suggest_int("config", 0, len(STUDY) - 1)]
    args = sft_args(
        learning_rate=1e-2,
        per_device_train_batch_size=c["batch"],
        gradient_accumulation_steps=c["accumulation"],
        max_grad_norm=c["clip"],
        lr_scheduler_type="cosine",
        packing=True,
        packing_strategy="wrapped",
        max_length=64,
        seed=3,
    )
    return lora(r=c["r"], lora_dropout=c["dropout"], target_modules=c["targets"]), args


def _study(make_executor, compile, configs=(0, 1, 2), concurrent=3, **kwargs):
    executor = make_executor(
        engine="fused", compile=compile, num_chunks=2, max_concurrent_trials=concurrent, schedule="lockstep", **kwargs
    )
    study = optuna.create_study(pruner=optuna.pruners.NopPruner())
    for config in configs:
        study.enqueue_trial({"config": config})
    executor.optimize(study, _configure, n_trials=len(configs))
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.COMPLETE] * len(configs)
    stats = executor.stats()
    assert stats.launched_steps == stats.fused_steps > 0
    return [dict(t.intermediate_values) for t in study.trials], stats


def _terms(tiny_model: str) -> int:
    return gradient_terms(AutoConfig.from_pretrained(tiny_model), rows=8, length=64)


def test_a_compiled_study_reports_the_uncompiled_values(make_executor, tiny_model) -> None:
    """Inductor's kernels (fused training and evaluation passes, the gang's AdamW) against the same functions
    uncompiled, on a gang with mixed ranks, targets, dropout, batch sizes, accumulation and clipping."""
    eager, plain = _study(make_executor, compile=False)
    compiled, stats = _study(make_executor, compile=True)
    assert plain.compiles == 0 and stats.compiles > 0 and stats.compile_failures == 0
    for a, b in zip(eager, compiled, strict=True):
        assert_within_rounding(b, a, terms=_terms(tiny_model))


def test_a_gang_a_seen_layout_covers_runs_in_it_with_the_values_of_its_own_layout(
    make_executor, tiny_model, caplog
) -> None:
    """A narrower gang after a wider one (the promote schedule's gangs change from chunk to chunk) runs in the
    wider layout, zeros around its adapters: no new layout is compiled, and it reports what it reports in a
    layout of its own."""
    own, _ = _study(make_executor, compile="aot_eager", configs=(0, 2), concurrent=2)
    executor = make_executor(
        engine="fused", compile="aot_eager", num_chunks=2, max_concurrent_trials=2, schedule="lockstep"
    )
    values = []
    for configs in ((1, 0), (0, 2)):  # all-linear rank 8 with dropout, then attention rank <= 4 without
        study = optuna.create_study(pruner=optuna.pruners.NopPruner())
        for config in configs:
            study.enqueue_trial({"config": config})
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="optuna_rapidfire"):
            executor.optimize(study, _configure, n_trials=2)
        values = [dict(t.intermediate_values) for t in study.trials]
        layouts = [r.getMessage() for r in caplog.records if "Compiled the launched pass for layout" in r.getMessage()]
        assert len(layouts) == (1 if configs == (1, 0) else 0), layouts
    for a, b in zip(own, values, strict=True):
        assert_within_rounding(b, a, terms=_terms(tiny_model))


def test_a_trial_joining_a_seen_layout_compiles_nothing_and_a_new_layout_compiles_once(make_executor) -> None:
    """Waves of two trials (lock-step, two slots): a wave of the same ranks and targets reuses the first
    wave's graphs; a wave with a larger rank bucket is a new layout, compiled once and then reused too.

    (A new layout compiles at most what the first one did: the compiler remembers which sizes it saw vary.)
    """
    counts = []

    def configure(trial: optuna.Trial):
        rank = trial.suggest_categorical("r", [4, 8, 16])
        args = sft_args(
            learning_rate=1e-2,
            per_device_train_batch_size=2,
            packing=True,
            packing_strategy="wrapped",
            max_length=64,
            seed=trial.number,
        )
        return lora(r=rank, target_modules=["q_proj", "v_proj"]), args

    executor = make_executor(
        engine="fused", compile="aot_eager", num_chunks=2, max_concurrent_trials=2, schedule="lockstep"
    )
    study = optuna.create_study(pruner=optuna.pruners.NopPruner())
    waves = [(4, 8), (8, 8), (4, 8), (16, 8), (16, 4)]  # rank bucket 8, 8, 8, then 16, 16
    for wave in waves:
        for rank in wave:
            study.enqueue_trial({"r": rank})
    for _ in waves:
        executor.optimize(study, configure, n_trials=2)
        counts.append(executor.stats().compiles)
    first = counts[0]
    assert first > 0
    assert counts[1] == counts[2] == first  # the same layout: no compilation
    assert first < counts[3] <= 2 * first  # a new layout compiles, at most what the first one did
    assert counts[4] == counts[3]  # and is reused as well


def test_a_layout_that_fails_to_compile_runs_uncompiled_with_the_same_values(make_executor, tiny_model, caplog) -> None:
    @torch._dynamo.register_backend(name="rapidfire_test_broken")
    def broken(graph, example_inputs):
        raise RuntimeError("this backend cannot compile")

    eager, _ = _study(make_executor, compile=False)
    with caplog.at_level(logging.WARNING, logger="optuna_rapidfire"):
        values, stats = _study(make_executor, compile="rapidfire_test_broken")
    assert stats.compile_failures == 1
    assert "failed (BackendCompilerFailed" in caplog.text and "running it uncompiled" in caplog.text
    for a, b in zip(eager, values, strict=True):
        assert_within_rounding(b, a, terms=_terms(tiny_model))


def test_gangs_the_launched_pass_cannot_run_train_in_the_models_modules_and_say_why(make_executor, caplog) -> None:
    def sgd(trial: optuna.Trial):
        peft_config, args = _configure(trial)
        if trial.number == 1:
            args.optim = "sgd"
        return peft_config, args

    executor = make_executor(engine="fused", num_chunks=2, max_concurrent_trials=2, schedule="lockstep")
    study = optuna.create_study()
    for config in (0, 2):
        study.enqueue_trial({"config": config})
    with caplog.at_level(logging.INFO, logger="optuna_rapidfire"):
        executor.optimize(study, sgd, n_trials=2)
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials)
    assert "not the launched pass: trial 1 its optimizer is SGD" in caplog.text
    stats = executor.stats()
    assert stats.fused_steps > 0 and stats.launched_steps == 0


def test_compile_must_be_a_known_backend(make_executor) -> None:
    with pytest.raises(
        ValueError, match=r"compile must be 'auto', True, False or the name of a torch\.compile backend"
    ):
        make_executor(compile="warp")


def test_a_trial_that_takes_an_earlier_trials_adapter_name_is_seen_as_itself(tiny_model: str) -> None:
    """A later study's trials reuse the adapter names of an earlier one's (``trial_0``...): what the launched
    pass knew of the earlier trial must not serve the later one (its parameters, its targets)."""
    resident = ResidentModel(_tiny("llama", tiny_model), tokenizer=None, device=torch.device("cpu"))  # type: ignore[arg-type]
    launched = LaunchedPasses(resident, compile=False, capacity=2)
    resident.add_adapter("trial_0", LoraConfig(r=4, target_modules=["q_proj"]), seed=0)
    before = launched.member(_runtime(resident, "trial_0", 0))
    resident.delete_adapter("trial_0")
    resident.add_adapter("trial_0", LoraConfig(r=8, target_modules=["q_proj", "down_proj"]), seed=1)
    runtime = _runtime(resident, "trial_0", 0)
    after = launched.member(runtime)
    assert not isinstance(before, str) and not isinstance(after, str)
    assert after.adapter.rank == 8 and {p.name for p in after.adapter.projections} == {"q_proj", "down_proj"}
    owned = {id(t) for a, b, _ in after.adapter.projections.values() for t in (a, b)}
    assert owned == {id(p) for p in runtime.state.params}


def test_models_of_other_shapes_in_one_process_compile_too(tiny_model: str) -> None:
    """The compiler remembers which integers varied between calls of the layer function and makes them symbolic
    for the next model: the pass must not hand attention a symbolic bool (it failed on the H200 this way)."""
    for family in ("llama", "qwen3", "qwen2"):  # 4, 2 and 2 KV heads
        resident = ResidentModel(_tiny(family, tiny_model), tokenizer=None, device=torch.device("cpu"))  # type: ignore[arg-type]
        resident.add_adapter("a", LoraConfig(r=4, target_modules=["q_proj"]), seed=0)
        launched = LaunchedPasses(resident, compile="aot_eager", capacity=1)
        layout = launched.load([_runtime(resident, "a", 0)])
        ids = torch.randint(0, 1024, (2, 16), generator=torch.Generator().manual_seed(0))
        launched.hidden(ids, Rows(torch.tensor([0])), layout).sum().backward()
        assert (launched.compiles, launched.compile_failures) == (1, 0), family


def test_a_study_compiles_each_graph_at_most_twice_whatever_its_rows(make_executor) -> None:
    """Packing leaves a shorter last row in a chunk, and short last micro-batches: the passes keep the chunk's
    shapes (rows padded to the batch size, tokens to the chunk's longest). Only the gang's size changes the
    rows of a pass, and the compiler then makes them dynamic: each of the three graphs (training pass,
    evaluation pass, optimizer step) compiles at most twice, and a second study of the same trials compiles
    nothing."""

    def configure(trial: optuna.Trial):
        args = sft_args(
            learning_rate=1e-2,
            per_device_train_batch_size=3,
            packing=True,
            packing_strategy="wrapped",
            max_length=96,
            seed=trial.number,
        )
        return lora(r=trial.suggest_categorical("r", [4, 8]), lora_dropout=0.1, target_modules=ALL_LINEAR), args

    executor = make_executor(engine="fused", compile="aot_eager", num_chunks=3, max_concurrent_trials=2)
    counts = []
    for _ in range(2):
        study = optuna.create_study(pruner=optuna.pruners.NopPruner())
        for rank in (4, 8):
            study.enqueue_trial({"r": rank})
        executor.optimize(study, configure, n_trials=2)
        counts.append(executor.stats().compiles)
    stats = executor.stats()
    assert stats.launched_steps == stats.fused_steps > 0 and stats.compile_failures == 0
    assert 3 <= counts[0] <= 6 and counts[1] == counts[0]


def test_a_closed_executor_that_compiled_lets_its_model_go(make_executor) -> None:
    """The compiler keeps its compiled code for the life of the process; a closed executor's model must not stay
    alive through it (on the H200 a closed 8B executor held 46 GB, and the next run ran out of memory)."""
    import gc
    import weakref

    executor = make_executor(engine="fused", compile="aot_eager", num_chunks=2, max_concurrent_trials=2)
    study = optuna.create_study(pruner=optuna.pruners.NopPruner())
    executor.optimize(study, lambda t: (lora(r=4), sft_args(per_device_train_batch_size=2, seed=t.number)), n_trials=2)
    assert executor.stats().compiles > 0
    engine = executor._device.engine
    assert engine is not None
    model = weakref.ref(engine.trials.resident.base)
    del engine
    executor.close()
    gc.collect()
    assert model() is None
