"""Warming the compiler's caches in a process of its own, for the background compiler of the launched pass.

A graph compiled in a thread of the training process shares the interpreter's lock with the training thread:
every op of the training thread waits for it, and the eager passes crawl while a layout compiles (2-20x slower
on the H200). So the long part of a compilation (AOTAutograd, Inductor's lowering and code generation) runs
first in a child process, on tensors that look like the pass's (shapes, strides, storage offsets, dtypes,
aliasing, requires_grad; their values are zeros), with the same calls in the same order, so that it makes the
same graphs; Inductor's and AOTAutograd's caches on disk then hold them, and the compilation in the training
process (:class:`~optuna_rapidfire._engines._background.BackgroundCompiler`) takes them from there in a few seconds.

:func:`describe` turns a call's arguments into a picklable description, :func:`warm` runs a child on a list of
calls and waits for it; the child is ``python -m optuna_rapidfire._engines._warm`` reading the calls on stdin.
A child that fails costs nothing but its time: the in-process compilation then compiles as before.

Not used by default (``BackgroundCompiler.warms``): the one H200 study run with it did not end within 250 s where the
executor without it ends in about 130 s, and why is not known yet.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

_TUPLE_TYPES = ("Rows", "Lora", "LayerWeights")


def describe(value: Any, storages: dict[int, tuple[int, int, str]] | None = None) -> Any:
    """A picklable description of an argument: tensors by shape, stride, offset, dtype, requires_grad and their
    storage (tensors sharing one keep sharing it), named tuples of the decoder by type name, the rest as is."""
    import torch

    storages = {} if storages is None else storages
    if isinstance(value, torch.Tensor):
        storage = value.untyped_storage()
        key = storage.data_ptr()
        if key not in storages:
            storages[key] = (len(storages), storage.nbytes(), str(value.dtype))
        index = storages[key][0]
        return (
            "tensor",
            index,
            tuple(value.shape),
            tuple(value.stride()),
            value.storage_offset(),
            str(value.dtype),
            value.requires_grad,
            storage.nbytes(),
        )
    if isinstance(value, tuple) and type(value).__name__ in _TUPLE_TYPES:
        return ("named", type(value).__name__, [describe(v, storages) for v in value])
    if isinstance(value, tuple):
        return ("tuple", [describe(v, storages) for v in value])
    return ("value", value)


def dynamic_pass(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """A decoder layer's arguments (``h, cos, sin, weights, loras, rows, salts, shape``) with the pass's rows and
    tokens marked dynamic (``torch._dynamo.mark_dynamic``) on copies of the tensors that carry them, so that one
    compiled graph serves every row count and width of a layout and mode (a size below 2 stays static: the
    compiler specialises sizes 0 and 1). The training process and a warming child mark alike, so they make the
    same graph."""
    import torch

    from optuna_rapidfire._fused._decoder import Rows

    h, cos, sin, weights, loras, rows, salts, shape = args

    def marked(tensor: torch.Tensor | None, *dims: int) -> Any:
        if tensor is None:
            return None
        copy = tensor.detach().clone().requires_grad_(tensor.requires_grad)
        for dim in dims:
            if copy.shape[dim] >= 2:
                torch._dynamo.mark_dynamic(copy, dim)
        return copy

    rows = Rows(
        marked(rows.units, 0), marked(rows.keys, 0), marked(rows.drop, 0), marked(rows.tokens, 0), rows.features
    )
    return (marked(h, 0, 1), marked(cos, 1), marked(sin, 1), weights, loras, rows, salts, shape)


def build(spec: Any, device: torch.device, bases: dict[int, torch.Tensor]) -> Any:
    """A look-alike of the argument :func:`describe` described: zeroed tensors of its layout (those that shared a
    storage sharing one of ``bases``, by the description's storage index), the decoder's named tuples, the rest as
    is."""
    import torch

    from optuna_rapidfire._fused import _decoder

    kind = spec[0]
    if kind == "tensor":
        _, index, shape, stride, offset, dtype, requires_grad, nbytes = spec
        dtype = getattr(torch, dtype.removeprefix("torch."))
        base = bases.get(index)
        if base is None:
            base = bases[index] = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        tensor = base.view(dtype).as_strided(shape, stride, offset)
        return tensor.requires_grad_(True) if requires_grad else tensor
    if kind == "named":
        return getattr(_decoder, spec[1])(*[build(v, device, bases) for v in spec[2]])
    if kind == "tuple":
        return tuple(build(v, device, bases) for v in spec[1])
    return spec[1]


def warm(device: str, calls: list[dict[str, Any]], timeout: float = 600.0) -> bool:
    """Compile ``calls`` (each: ``function`` "layer" or "step", ``args``, ``grad``, ``autocast``) in a child process,
    in order; ``True`` when it ended well."""
    environment = dict(os.environ)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "optuna_rapidfire._engines._warm"],
            input=pickle.dumps({"device": device, "calls": calls}),
            capture_output=True,
            timeout=timeout,
            env=environment,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def _main() -> None:
    import torch
    import torch._functorch.config

    from optuna_rapidfire import _compat
    from optuna_rapidfire._fused._decoder import decoder_layer
    from optuna_rapidfire._fused._slots import adamw_step

    job = pickle.loads(sys.stdin.buffer.read())
    device = torch.device(job["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    _compat.allow_recompiles(64)
    torch._functorch.config.force_non_lazy_backward_lowering = True
    functions: dict[str, Callable[..., Any]] = {
        "layer": torch.compile(decoder_layer, fullgraph=True, backend="inductor"),
        "step": torch.compile(adamw_step, fullgraph=True, backend="inductor"),
    }
    for call in job["calls"]:
        bases: dict[int, torch.Tensor] = {}
        args = tuple(build(spec, device, bases) for spec in call["args"])
        if call["function"] == "layer" and call.get("dynamic"):
            args = dynamic_pass(args)
        enabled, dtype = call["autocast"]
        with torch.set_grad_enabled(call["grad"]), torch.autocast(device.type, dtype=dtype, enabled=enabled):
            functions[call["function"]](*args)


if __name__ == "__main__":
    _main()
