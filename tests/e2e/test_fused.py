"""Fused multi-adapter LoRA (groundwork for the fused engine): one pass equals each trial alone."""

from __future__ import annotations

import contextlib
import types
from typing import Any

import pytest
import torch
from _numerics import assert_within_rounding, gradient_terms, loss_terms
from peft import LoraConfig
from transformers import AutoModelForCausalLM

from optuna_rapidfire._fused._fused_pass import Gang, clip_gang, fused_forward, layer_plans, segment_losses
from optuna_rapidfire._fused._stacks import GangStacks
from optuna_rapidfire._resident._model import ResidentModel
from optuna_rapidfire._trainers.grpo._policy_pass import PolicyPasses

# Mixed ranks, target modules, dropout and batch sizes, as trials of one study would have.
ADAPTERS = {
    "t0": ({"r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0}, 2),
    "t1": ({"r": 8, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.1}, 3),
    "t2": (
        {"r": 4, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"], "lora_dropout": 0.0},
        1,
    ),
    "t3": ({"r": 4, "lora_alpha": 8, "target_modules": ["v_proj", "o_proj"], "lora_dropout": 0.2}, 2),
    "t4": ({"r": 2, "lora_alpha": 2, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.05}, 4),
}
TOKENS = 12


def _with_adapters(tiny_model: str, configs: dict[str, LoraConfig]) -> torch.nn.Module:
    """The tiny model with these adapters (the i-th drawn from seed i), all trainable, in training mode."""
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    resident = ResidentModel(base, tokenizer=None, device=torch.device("cpu"))  # type: ignore[arg-type]
    for seed, (name, config) in enumerate(configs.items()):
        resident.add_adapter(name, config, seed)
    resident.set_trainable(list(configs), True)
    assert resident.peft is not None
    resident.peft.train()
    return resident.peft


@pytest.fixture
def model(tiny_model: str) -> torch.nn.Module:
    # Non-zero B (init_lora_weights=False): every update matters.
    configs = {name: LoraConfig(init_lora_weights=False, **settings) for name, (settings, _) in ADAPTERS.items()}
    return _with_adapters(tiny_model, configs)


def _batches() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    out = {}
    for name, (_, rows) in ADAPTERS.items():
        ids = torch.randint(0, 1024, (rows, TOKENS), generator=generator)
        labels = ids.clone()
        labels[:, :3] = -100  # a prompt part, as in completion-only training
        out[name] = (ids, labels)
    return out


def _run(
    model: torch.nn.Module, names: list[str], dropout: bool = True
) -> dict[str, tuple[float, dict[str, torch.Tensor]]]:
    batches = _batches()
    rows = [ADAPTERS[n][1] for n in names]
    gang = Gang(names, rows, [100 + list(ADAPTERS).index(n) for n in names])
    if not dropout:
        model.eval()  # no dropout masks: only the rounding of the shared pass differs
    ids = torch.cat([batches[n][0] for n in names])
    labels = torch.cat([batches[n][1] for n in names])
    model.zero_grad(set_to_none=True)
    with fused_forward(model, gang):
        logits = model(input_ids=ids).logits
    losses = segment_losses(logits, labels, rows)
    torch.stack(losses).sum().backward()
    out = {}
    for name, loss in zip(names, losses, strict=True):
        grads = {k: p.grad.clone() for k, p in model.named_parameters() if f".{name}." in k and p.grad is not None}
        out[name] = (loss.item(), grads)
    model.train()
    return out


@pytest.mark.numerics
@pytest.mark.parametrize("k", [1, 2, 5])
def test_a_gang_gives_each_trial_its_own_loss_and_gradients(model: torch.nn.Module, k: int) -> None:
    names = list(ADAPTERS)[:k] if k < 5 else list(ADAPTERS)
    together = _run(model, names)
    # The gang's pass runs over all its rows (zero-padded to the largest rank and row count), so its sums
    # take another order than one trial's: equal up to the rounding of the gang's batch.
    rows = sum(ADAPTERS[n][1] for n in names)
    losses, gradients = (f(model.config, rows=rows, length=TOKENS) for f in (loss_terms, gradient_terms))
    for name in names:
        alone = _run(model, [name])[name]
        loss, grads = together[name]
        assert_within_rounding(loss, alone[0], terms=losses, what=name)
        assert grads.keys() == alone[1].keys() and grads
        for key, grad in grads.items():
            assert_within_rounding(grad, alone[1][key], terms=gradients, what=key)


@pytest.mark.numerics
def test_equal_adapters_take_the_batched_path_and_give_each_trial_its_own_gradients(tiny_model: str) -> None:
    """Same rank, targets and rows, no dropout: the rows reshape without copies and the update adds in place."""
    names = ["a", "b", "c"]
    model = _with_adapters(
        tiny_model,
        {
            name: LoraConfig(r=4, lora_alpha=8 * (i + 1), target_modules=["q_proj", "v_proj"], init_lora_weights=False)
            for i, name in enumerate(names)
        },
    )
    plans = layer_plans(model, Gang(names, [2, 2, 2], [0] * 3))
    assert plans and all(plan.uniform for _, plan in plans)
    ids = torch.randint(0, 1024, (6, TOKENS), generator=torch.Generator().manual_seed(1))

    def run(chosen: list[str], rows: torch.Tensor) -> tuple[list[float], dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        with fused_forward(model, Gang(chosen, [2] * len(chosen), [0] * len(chosen))):
            losses = segment_losses(model(input_ids=rows).logits, rows, [2] * len(chosen))
        torch.stack(losses).sum().backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        return [loss.item() for loss in losses], grads

    together, grads = run(names, ids)
    losses, gradients = (f(model.config, rows=len(ids), length=TOKENS) for f in (loss_terms, gradient_terms))
    for i, name in enumerate(names):
        alone, own = run([name], ids[2 * i : 2 * i + 2])
        assert_within_rounding(together[i], alone[0], terms=losses, what=name)
        assert own and all(f".{name}." in key for key in own)
        for key, grad in own.items():
            assert_within_rounding(grads[key], grad, terms=gradients, what=key)


@pytest.mark.numerics
def test_in_bf16_a_gang_stays_within_the_documented_tolerance(model: torch.nn.Module) -> None:
    """bf16 base and autocast (adapters in float32, as PEFT keeps them): losses within 1e-3 relative,
    each LoRA gradient within 5e-2 of its norm (benchmarks/fused_bf16.py measures the GPU)."""
    model.to(torch.bfloat16)
    for name, param in model.named_parameters():
        if "lora_" in name:
            param.data = param.data.float()
    names = ["t0", "t2", "t4"]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        together = _run(model, names, dropout=False)
        alone = {name: _run(model, [name], dropout=False)[name] for name in names}
    for name in names:
        assert together[name][0] == pytest.approx(alone[name][0], rel=1e-3)
        for key, grad in together[name][1].items():
            reference = alone[name][1][key]
            assert float((grad - reference).norm() / reference.norm()) < 5e-2, key


@pytest.mark.numerics
def test_the_fused_pass_equals_peft_s_own_forward_without_dropout(model: torch.nn.Module) -> None:
    batches = _batches()
    for name in ("t0", "t2"):  # the adapters without dropout: PEFT draws masks from the global RNG
        ids, labels = batches[name]
        model.set_adapter(name)
        model.zero_grad(set_to_none=True)
        reference = segment_losses(model(input_ids=ids).logits, labels, [len(ids)])[0]
        reference.backward()
        expected = {k: p.grad.clone() for k, p in model.named_parameters() if f".{name}." in k and p.grad is not None}
        for param_name, param in model.named_parameters():
            param.requires_grad_("lora_" in param_name)
        loss, grads = _run(model, [name])[name]
        losses, gradients = (f(model.config, rows=len(ids), length=TOKENS) for f in (loss_terms, gradient_terms))
        assert_within_rounding(loss, reference.item(), terms=losses, what=name)
        for key, grad in grads.items():
            assert_within_rounding(grad, expected[key], terms=gradients, what=key)


def _stackable(tiny_model: str, alphas: list[int]) -> tuple[torch.nn.Module, list[str]]:
    """Three adapters of rank 4 on q and v (scalings alpha / 4), the last one on o too: q and v are stacked, o
    (one member) is not."""
    names = ["a", "b", "c"]
    configs = {
        name: LoraConfig(
            r=4,
            lora_alpha=alpha,
            target_modules=["q_proj", "v_proj", "o_proj"] if name == "c" else ["q_proj", "v_proj"],
            init_lora_weights=False,
        )
        for name, alpha in zip(names, alphas, strict=True)
    }
    return _with_adapters(tiny_model, configs), names


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.numerics
@pytest.mark.parametrize("alphas", [[8, 8, 8], [8, 16, 24]], ids=["one scaling", "own scalings"])
def test_stacked_adapters_give_the_pass_and_gradients_of_stacking_them_in_each_layer(
    tiny_model: str, alphas: list[int]
) -> None:
    """A gang's adapters kept stacked (GangStacks): the same losses and gradients, each member's gradient handed
    out as a view of its stack's; layers some member does not target stack their adapters themselves."""
    model, names = _stackable(tiny_model, alphas)
    gang = Gang(names, [2, 2, 2], [0, 0, 0])
    plans = layer_plans(model, gang)
    ids = torch.randint(0, 1024, (6, TOKENS), generator=torch.Generator().manual_seed(2))
    stacks = GangStacks(plans, names)
    layers = model.config.num_hidden_layers
    assert len(stacks) == 2 * layers  # q and v of every layer
    lora = [(name, layer) for name, layer in model.named_modules() if hasattr(layer, "lora_A")]
    assert lora and all((stacks.of(layer) is None) == name.endswith("o_proj") for name, layer in lora)

    def run(stacked: GangStacks | None) -> tuple[list[float], dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        if stacked is not None:
            stacked.load(grad=True)
        with fused_forward(model, gang, plans, stacked):
            losses = segment_losses(model(input_ids=ids).logits, ids, gang.rows)
        torch.stack(losses).sum().backward()
        if stacked is not None:
            assert stacked.open == {0, 1, 2}
            stacked.hand_out(range(3))
            assert not stacked.open
        return [loss.item() for loss in losses], _grads(model)

    expected_losses, expected = run(None)
    got_losses, got = run(stacks)
    losses, gradients = (f(model.config, rows=len(ids), length=TOKENS) for f in (loss_terms, gradient_terms))
    assert_within_rounding(torch.tensor(got_losses), torch.tensor(expected_losses), terms=losses)
    assert got.keys() == expected.keys() and len(got) == 14 * layers  # a and b: q, v; c: q, v, o (A and B each)
    for key, grad in got.items():
        assert_within_rounding(grad, expected[key], terms=gradients, what=key)
    # Each member's stacked gradients were handed out in one buffer of its own (one copy, not one per parameter),
    # which holds nothing else: no member's gradients keep another's alive.
    params = dict(model.named_parameters())
    for name in names:
        own = [p for key, p in params.items() if f".{name}." in key and "o_proj" not in key]
        storages = {p.grad.untyped_storage().data_ptr() for p in own}
        assert len(storages) == 1, name
        assert own[0].grad.untyped_storage().nbytes() == sum(p.grad.nbytes for p in own)


@pytest.mark.numerics
def test_stacks_in_the_autocast_dtype_give_what_autocast_gives_and_gradients_in_the_parameters_dtype(
    tiny_model: str,
) -> None:
    """bf16 base, float32 adapters, bf16 autocast: stacks held in bf16 (the casts autocast makes in each matmul,
    made once at the load) give the pass and gradients of stacking in each layer, the gradients in float32."""
    model, names = _stackable(tiny_model, [8, 8, 8])
    model.to(torch.bfloat16)
    for name, param in model.named_parameters():
        if "lora_" in name:
            param.data = param.data.float()
    gang = Gang(names, [2, 2, 2], [0, 0, 0])
    plans = layer_plans(model, gang)
    ids = torch.randint(0, 1024, (6, TOKENS), generator=torch.Generator().manual_seed(6))
    stacks = GangStacks(plans, names, compute=torch.bfloat16)
    held = [stacks.of(layer) for layer, _ in plans]
    assert all(stack.dtype == torch.bfloat16 for pair in held if pair is not None for stack in pair)
    # Adapters with scalings of their own scale the stacked up-projections in the pass: in float32, as before the cast.
    mixed_plans = layer_plans(_stackable(tiny_model, [8, 16, 24])[0], gang)
    mixed = GangStacks(mixed_plans, names, compute=torch.bfloat16)
    pairs = [pair for pair in (mixed.of(layer) for layer, _ in mixed_plans) if pair is not None]
    assert pairs and all(stack.dtype == torch.float32 for pair in pairs for stack in pair)

    def run(stacked: GangStacks | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        if stacked is not None:
            stacked.load(grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16), fused_forward(model, gang, plans, stacked):
            losses = torch.stack(segment_losses(model(input_ids=ids).logits, ids, gang.rows))
        losses.sum().backward()
        if stacked is not None:
            stacked.hand_out(range(3))
        return losses.detach(), _grads(model)

    expected_losses, expected = run(None)
    got_losses, got = run(stacks)
    assert torch.allclose(got_losses, expected_losses, rtol=1e-3, atol=0)
    assert got.keys() == expected.keys() and got
    for key, grad in got.items():
        assert grad.dtype == torch.float32, key
        assert float((grad - expected[key]).norm() / expected[key].norm()) < 5e-2, key


def test_the_gradients_of_partial_backwards_and_of_two_passes_add_up_as_autograd_adds_them(tiny_model: str) -> None:
    """Members' losses backpropagated apart (a member comes later) get their own gradients only, and a second
    pass's gradients add to the first's, as autograd's own accumulation does."""
    model, names = _stackable(tiny_model, [8, 8, 8])
    gang = Gang(names, [2, 2, 2], [0, 0, 0])
    plans = layer_plans(model, gang)
    ids = torch.randint(0, 1024, (6, TOKENS), generator=torch.Generator().manual_seed(4))
    params = dict(model.named_parameters())

    def run(stacked: GangStacks | None) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        for step in range(2):
            if stacked is not None:
                stacked.load(grad=True)
            with fused_forward(model, gang, plans, stacked):
                losses = segment_losses(model(input_ids=ids).logits, ids, gang.rows)
            losses[0].backward(retain_graph=True)
            if stacked is not None:
                stacked.hand_out([0])
                assert stacked.open == {1, 2}
            if step == 0:  # only the first member has gradients yet
                assert {k.split(".")[-2] for k, p in params.items() if p.grad is not None and p.grad.any()} == {"a"}
            (losses[1] + losses[2]).backward()
            if stacked is not None:
                stacked.hand_out([1, 2])
        return _grads(model)

    expected = run(None)
    got = run(GangStacks(plans, names))
    gradients = 2 * gradient_terms(model.config, rows=len(ids), length=TOKENS)
    assert got.keys() == expected.keys()
    for key, grad in got.items():
        assert_within_rounding(grad, expected[key], terms=gradients, what=key)


def test_stacks_a_pass_still_needs_are_not_loaded_again(tiny_model: str) -> None:
    """Loading stacks whose pass waits for its backward is refused; loaded anyway (after ``forget``), the
    waiting backward fails instead of reading other weights."""
    model, names = _stackable(tiny_model, [8, 8, 8])
    gang = Gang(names, [2, 2, 2], [0, 0, 0])
    plans = layer_plans(model, gang)
    stacks = GangStacks(plans, names)
    ids = torch.randint(0, 1024, (6, TOKENS), generator=torch.Generator().manual_seed(5))
    stacks.load(grad=True)
    with fused_forward(model, gang, plans, stacks):
        loss = model(input_ids=ids).logits.square().mean()
    with pytest.raises(RuntimeError, match="while a pass that read them is open"):
        stacks.load(grad=False)
    stacks.forget(range(3))
    stacks.load(grad=False)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_a_gang_s_passes_load_the_kept_stacks_unless_an_open_pass_holds_them(tiny_model: str) -> None:
    """PolicyPasses keeps a gang's stacks from pass to pass: a pass while the gang's step waits for its backward
    (an evaluation, say) gets stacks of its own, and new adapters or another autocast dtype get new ones."""
    model, names = _stackable(tiny_model, [8, 8, 8])
    gang = Gang(names, [2, 2, 2], [0, 0, 0])
    plans = layer_plans(model, gang)
    trials = types.SimpleNamespace(device=torch.device("cpu"), resident=types.SimpleNamespace(adapters_version=1))

    def member(autocast: bool) -> Any:
        def context(args: Any, device: torch.device) -> Any:
            return torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()

        return types.SimpleNamespace(
            spec=types.SimpleNamespace(kind=types.SimpleNamespace(autocast=context)), args=None
        )

    passes = PolicyPasses(trials)  # type: ignore[arg-type]
    plain = member(autocast=False)
    step = passes._loaded_stacks(gang, plans, True, plain)
    assert step is not None and step.open == {0, 1, 2}
    evaluation = passes._loaded_stacks(gang, plans, False, plain)
    assert evaluation is not None and evaluation is not step and not evaluation.open
    step.hand_out(range(3))
    assert passes._loaded_stacks(gang, plans, False, plain) is step  # the kept ones again, once handed out
    mixed = passes._loaded_stacks(gang, plans, False, member(autocast=True))
    assert mixed is not None and mixed is not step and mixed.of(plans[0][0])[0].dtype == torch.bfloat16  # type: ignore[index]
    trials.resident.adapters_version = 2  # an adapter was added or removed: the layers' adapters may differ
    assert passes._loaded_stacks(gang, plans, False, plain) not in (step, mixed)


def test_a_gang_refuses_bad_shapes(model: torch.nn.Module) -> None:
    with pytest.raises(ValueError, match="at least one row"):
        Gang(["t0", "t1"], [2, 0], [0, 0])
    with pytest.raises(ValueError, match="must differ"):
        Gang(["t0", "t0"], [1, 1], [0, 0])
    gang = Gang(["t0", "t1"], [2, 3], [0, 0])
    with fused_forward(model, gang), pytest.raises(ValueError, match="gang expects 5"):
        model(input_ids=torch.zeros(4, TOKENS, dtype=torch.long))


@pytest.mark.numerics
def test_clipping_a_gang_equals_clipping_each_trial_alone() -> None:
    generator = torch.Generator().manual_seed(3)
    trials = [
        [torch.randn(4, 3, generator=generator) * s for _ in range(n)] for s, n in ((5.0, 3), (0.01, 2), (2.0, 1))
    ]
    max_norms = [1.0, 1.0, None]
    expected = [[g.clone() for g in trial] for trial in trials]
    expected_norms = [
        torch.nn.utils.clip_grad_norm_(_as_params(t), m or float("inf"))
        for t, m in zip(expected, max_norms, strict=True)
    ]
    norms = clip_gang(trials, max_norms)
    terms = max(sum(g.numel() for g in trial) for trial in trials)  # a trial's norm sums its squares
    for got, want in zip(trials, expected, strict=True):
        for a, b in zip(got, want, strict=True):
            assert_within_rounding(a, b, terms=terms)
    for got, want in zip(norms, expected_norms, strict=True):
        assert_within_rounding(got, want, terms=terms)
    # Clipped to max_norm: clip_grad_norm_ divides by the norm plus 1e-6, 3e-8 relative here, below rounding.
    assert_within_rounding(torch.linalg.vector_norm(torch.stack([g.norm() for g in trials[0]])), 1.0, terms=terms)


def _as_params(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Tensors whose .grad is ``grads`` (clip_grad_norm_ takes parameters), sharing their memory."""
    params = []
    for grad in grads:
        param = torch.zeros_like(grad, requires_grad=True)
        param.grad = grad
        params.append(param)
    return params
