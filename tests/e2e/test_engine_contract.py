"""The engine layer's seams without training: kinds' fused refusals, stats before the model loads."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from optuna_rapidfire._engines._types import EngineStats
from optuna_rapidfire._trainers._dpo import DPOKind
from optuna_rapidfire._trainers._sft import SFTKind
from optuna_rapidfire._trainers.grpo._kind import GRPOKind


@pytest.mark.parametrize(
    ("kind", "trainer", "args", "reason"),
    [
        (SFTKind(), SimpleNamespace(), SimpleNamespace(loss_type="nll", label_smoothing_factor=0.0), None),
        (SFTKind(), SimpleNamespace(), SimpleNamespace(loss_type="dft"), "uses a loss other than plain NLL"),
        (SFTKind(), SimpleNamespace(), SimpleNamespace(label_smoothing_factor=0.1), "uses a loss other than plain NLL"),
        (DPOKind(), SimpleNamespace(loss_types=["sigmoid"]), SimpleNamespace(), None),
        (
            DPOKind(),
            SimpleNamespace(loss_types=["hinge"]),
            SimpleNamespace(),
            "uses DPO loss_type ['hinge'] (the fused pass computes 'sigmoid')",
        ),
        (GRPOKind(), SimpleNamespace(), SimpleNamespace(), "is a GRPO trial (SFT and DPO trials are fused)"),
    ],
)
def test_each_trainer_kind_says_whether_its_trial_can_share_a_pass(kind, trainer, args, reason) -> None:
    assert kind.fused_refusal(trainer, args) == reason
    assert (kind.fused_loss is None) == isinstance(kind, GRPOKind)


def test_stats_are_zeros_before_the_model_is_loaded(make_executor) -> None:
    assert make_executor().stats() == EngineStats()
