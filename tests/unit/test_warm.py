"""The warming child's look-alike tensors: a call's arguments described in the training process and rebuilt in the
child keep every property a compiled graph is keyed on (shapes, strides, storage offsets, dtypes, requires_grad,
which tensors share a storage), so the child compiles the graph the training process then finds in the caches."""

from __future__ import annotations

import pickle

import torch

from optuna_rapidfire._engines import _warm
from optuna_rapidfire._fused._decoder import Lora, Rows, Shape
from optuna_rapidfire._fused._slots import GangSlots, Projection


def _props(tensor: torch.Tensor) -> tuple:
    return tuple(tensor.shape), tensor.stride(), tensor.storage_offset(), tensor.dtype, tensor.requires_grad


def test_look_alike_arguments_keep_shapes_strides_offsets_and_aliasing() -> None:
    projections = [Projection(0, "q_proj", 16, 16), Projection(0, "v_proj", 16, 8)]
    slots = GangSlots(projections, rank=8, slots=3, dtype=torch.float32, device=torch.device("cpu"))
    loras = tuple(Lora(slots.a[p], slots.b[p], slots.scale[p]) for p in projections)
    rows = Rows(torch.zeros(4, dtype=torch.int64), None, None)
    h = torch.zeros(8, 5, 16).requires_grad_(True)
    args = (h, loras, rows, Shape(2, 1, 8, 1e-6, 0.35), 3)
    storages: dict = {}
    described = pickle.loads(pickle.dumps([_warm.describe(a, storages) for a in args]))
    bases: dict = {}  # one call's tensors over shared bases, as the training process holds them
    built = [_warm.build(spec, torch.device("cpu"), bases) for spec in described]
    assert _props(built[0]) == _props(h)
    for original, copy in zip(loras, built[1], strict=True):
        assert type(copy) is Lora
        for a, b in zip(original, copy, strict=True):
            assert _props(a) == _props(b)
    a, b = built[1][0].a, built[1][1].b
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()  # views of one slot matrix, as there
    assert built[0].untyped_storage().data_ptr() != a.untyped_storage().data_ptr()
    assert type(built[2]) is Rows and built[2].keys is None
    assert built[3] == args[3] and built[4] == 3


def test_a_child_that_fails_costs_only_its_time() -> None:
    """A call the child cannot run (an unknown function) ends it with an error: warm() says so, raising nothing."""
    assert (
        _warm.warm("cpu", [{"function": "nonexistent", "args": [], "grad": False, "autocast": (False, None)}]) is False
    )


def test_a_pass_s_rows_and_tokens_are_marked_dynamic_on_copies() -> None:
    """The layer's arguments get their rows and tokens marked dynamic on copies (the device's tensors stay as they
    are); a size below 2 stays static."""
    h = torch.zeros(8, 6, 4).requires_grad_(True)
    cos, sin = torch.zeros(1, 6, 2), torch.zeros(1, 6, 2)
    rows = Rows(torch.zeros(1, dtype=torch.int64), torch.zeros(8, dtype=torch.int64), torch.zeros(8), None)
    args = (h, cos, sin, "weights", "loras", rows, "salts", "shape")
    marked = _warm.dynamic_pass(args)

    def dims(tensor: torch.Tensor) -> set[int]:
        return set(getattr(tensor, "_dynamo_dynamic_indices", set()))

    assert dims(marked[0]) == {0, 1} and marked[0].requires_grad and marked[0] is not h
    assert dims(marked[1]) == dims(marked[2]) == {1}
    assert dims(marked[5].units) == set() and dims(marked[5].keys) == dims(marked[5].drop) == {0}
    assert marked[5].tokens is None and marked[3:5] == args[3:5]
    assert dims(h) == dims(cos) == set()


def test_the_background_compiler_gets_copies_of_the_tensors_the_passes_train() -> None:
    """What the background compiler's thread compiles on holds none of the tensors the device's thread trains (a
    thread reading their autograd state while the other ran the pass on them deadlocked in torch): each tensor that
    requires grad is a zeroed leaf of its own layout, those that shared a storage share one copy, and the frozen
    ones are the same tensors (read, never written)."""
    from optuna_rapidfire._engines._background import _apart

    projections = [Projection(0, "q_proj", 16, 16), Projection(0, "v_proj", 16, 8)]
    slots = GangSlots(projections, rank=8, slots=3, dtype=torch.float32, device=torch.device("cpu"))
    loras = tuple(Lora(slots.a[p], slots.b[p], slots.scale[p]) for p in projections)
    weights = (torch.randn(16, 16), None)
    args = (torch.zeros(8, 5, 16).requires_grad_(True), weights, loras, Rows(torch.zeros(4, dtype=torch.int64)), 3)
    apart = _apart(args, {}, {})
    trained = [t for lora in loras for t in lora if t.requires_grad]
    copies = [t for lora in apart[2] for t in lora if t.requires_grad]
    assert len(trained) == len(copies) >= 4 and all(type(lora) is Lora for lora in apart[2])
    originals = {t.untyped_storage().data_ptr() for t in [*trained, args[0]]}
    assert not originals & {t.untyped_storage().data_ptr() for t in [*copies, apart[0]]}
    for original, copy in zip(trained, copies, strict=True):
        assert _props(copy) == _props(original) and copy.is_leaf and not copy.any()
    assert len({t.untyped_storage().data_ptr() for t in copies}) == len(
        {t.untyped_storage().data_ptr() for t in trained}
    )
    assert apart[1][0] is weights[0] and apart[3].units is args[3].units and apart[4] == 3
