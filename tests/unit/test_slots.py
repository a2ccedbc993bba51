"""Gang slots: one AdamW launch for every member equals each member's own optimizer and clipping."""

from __future__ import annotations

import pytest
import torch
from _numerics import assert_within_rounding

from optuna_rapidfire._fused._slots import (
    GangAdamW,
    GangSlots,
    MemberAdapter,
    Projection,
    adam_settings,
    rank_bucket,
)

PROJECTIONS = [Projection(0, "q_proj", 12, 12), Projection(1, "down_proj", 20, 12)]
# rank, projections adapted, optimizer settings, max_grad_norm, accumulation
MEMBERS = [
    (4, [0, 1], {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}, 1.0, 1),
    (8, [0], {"lr": 3e-3, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.1, "fused": False}, 0.0, 2),
    (2, [1], {"lr": 5e-2, "betas": (0.95, 0.9), "eps": 1e-7, "weight_decay": 0.01, "foreach": True}, 0.05, 1),
]


def _member(seed: int, rank: int, adapted: list[int]) -> MemberAdapter:
    generator = torch.Generator().manual_seed(seed)
    projections = {}
    for i in adapted:
        p = PROJECTIONS[i]
        a = torch.nn.Parameter(torch.randn(rank, p.features_in, generator=generator))
        b = torch.nn.Parameter(torch.randn(p.features_out, rank, generator=generator))
        projections[p] = (a, b, 2.0)
    return MemberAdapter(projections, rank, 0.0)


def _params(member: MemberAdapter) -> list[torch.nn.Parameter]:
    return [t for a, b, _ in member.projections.values() for t in (a, b)]


def _grads(step: int, member: MemberAdapter, k: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + k)
    return [torch.randn(p.shape, generator=generator) * (10.0 if k == 2 else 1.0) for p in _params(member)]


@pytest.mark.numerics
def test_one_gang_step_equals_each_members_own_adamw_with_clipping_and_accumulation() -> None:
    own = [_member(k, rank, adapted) for k, (rank, adapted, _, _, _) in enumerate(MEMBERS)]
    ganged = [_member(k, rank, adapted) for k, (rank, adapted, _, _, _) in enumerate(MEMBERS)]
    optimizers = [
        torch.optim.AdamW(_params(m), **settings) for m, (_, _, settings, _, _) in zip(own, MEMBERS, strict=True)
    ]
    gang_optimizers = [
        torch.optim.AdamW(_params(m), **settings) for m, (_, _, settings, _, _) in zip(ganged, MEMBERS, strict=True)
    ]
    slots = GangSlots(PROJECTIONS, rank_bucket(8), slots=4, dtype=torch.float32, device=torch.device("cpu"))
    optimizer = GangAdamW(slots)
    for k, (member, opt, (_, _, _, clip, _)) in enumerate(zip(ganged, gang_optimizers, MEMBERS, strict=True)):
        settings = adam_settings(opt, _params(member), clip)
        assert not isinstance(settings, str)
        slots.load(k, member, opt)
        optimizer.configure(k, settings)
    steps = 6
    for step in range(steps):
        ready = torch.zeros(4)
        lr = torch.zeros(4, dtype=torch.float64)
        for k, (member, opt, (_, _, settings, clip, accumulation)) in enumerate(
            zip(own, optimizers, MEMBERS, strict=True)
        ):
            grads = _grads(step, member, k)
            for param, grad in zip(_params(member), grads, strict=True):
                param.grad = grad.clone() if param.grad is None else param.grad + grad
            for index, (projection, (a, _, _)) in enumerate(ganged[k].projections.items()):
                slots.a[projection].grad[k, : a.shape[0]] += grads[2 * index]
                slots.b[projection].grad[k, : a.shape[0]] += grads[2 * index + 1].t()
            if (step + 1) % accumulation == 0:
                if clip:
                    torch.nn.utils.clip_grad_norm_(_params(member), clip)
                opt.step()
                opt.zero_grad(set_to_none=True)
                ready[k], lr[k] = 1.0, settings["lr"]
        optimizer.step(ready, lr)
    for k, opt in enumerate(gang_optimizers):
        slots.store(k, opt)
    terms = max(sum(p.numel() for p in _params(m)) for m in own)  # a member's gradient norm sums its squares
    for k, (mine, theirs) in enumerate(zip(own, ganged, strict=True)):
        for param, got in zip(_params(mine), _params(theirs), strict=True):
            assert_within_rounding(got.detach(), param.detach(), terms=terms, what=f"member {k} weights")
            want_state, got_state = optimizers[k].state[param], gang_optimizers[k].state[got]
            for key in ("exp_avg", "exp_avg_sq"):
                assert_within_rounding(got_state[key], want_state[key], terms=terms, what=f"member {k} {key}")
            assert float(got_state["step"]) == float(want_state["step"]) == steps // MEMBERS[k][4]
            assert got_state["step"].device == want_state["step"].device


def test_slots_give_back_what_they_were_given_and_keep_padding_zero() -> None:
    member = _member(0, 4, [0, 1])
    optimizer = torch.optim.AdamW(_params(member), lr=1e-3)
    before = [p.detach().clone() for p in _params(member)]
    slots = GangSlots(PROJECTIONS, 8, slots=2, dtype=torch.float32, device=torch.device("cpu"))
    slots.load(1, member, optimizer)
    assert torch.count_nonzero(slots.params[0]) == 0
    assert torch.count_nonzero(slots.a[PROJECTIONS[0]][1, 4:]) == 0  # the padded rank
    slots.store(1, optimizer)
    for param, value in zip(_params(member), before, strict=True):
        assert torch.equal(param.detach(), value)
    assert slots.members == [None, None]


def test_optimizers_the_gang_cannot_step_are_named() -> None:
    params = [torch.nn.Parameter(torch.zeros(2))]
    assert "SGD" in str(adam_settings(torch.optim.SGD(params, lr=0.1), params, None))
    assert "amsgrad" in str(adam_settings(torch.optim.AdamW(params, amsgrad=True), params, None))
    assert "L2" in str(adam_settings(torch.optim.Adam(params, weight_decay=0.1), params, None))
    settings = adam_settings(torch.optim.Adam(params, betas=(0.5, 0.6)), params, 2.0)
    assert not isinstance(settings, str) and (settings.beta1, settings.max_grad_norm) == (0.5, 2.0)
