"""The base model, loaded once per device, and the adapters of the live trials on top of it."""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Union, cast

import torch

from optuna_rapidfire import _compat
from optuna_rapidfire._resident._adapter_files import AdapterWriter
from optuna_rapidfire._resident._injection import Injections
from optuna_rapidfire._resident._walks import ModeSwitch, publish_checkpointing

if TYPE_CHECKING:
    from peft import PeftConfig, PeftModel
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


ModelSource = Union[
    str,
    "PreTrainedModel",
    Callable[[], "tuple[PreTrainedModel, PreTrainedTokenizerBase]"],
]
"""What ``RapidFireExecutor(model=...)`` accepts: a path or hub id, a model, or a zero-arg factory."""


def resolve_device(devices: str | torch.device) -> torch.device:
    """Turn ``"auto"``, ``"cuda"``, ``"cuda:1"``, ``"cpu"``... into a device with an explicit index."""
    if isinstance(devices, str) and devices == "auto":
        devices = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(devices)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"devices must be 'auto' or a torch device, but got {devices=}.") from error
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"devices={str(devices)!r} asks for CUDA, but torch sees no CUDA device.")
        index = torch.cuda.current_device() if device.index is None else device.index
        if index >= torch.cuda.device_count():
            raise ValueError(
                f"devices={str(devices)!r} names GPU {index}, but only {torch.cuda.device_count()} are visible."
            )
        device = torch.device("cuda", index)
    return device


def resolve_devices(devices: str | torch.device | list[str | torch.device]) -> list[torch.device]:
    """``"auto"`` → every visible GPU (else the CPU); a device → ``[device]``; a list → each one, checked."""
    if isinstance(devices, str) and devices == "auto":
        if torch.cuda.is_available():
            return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
        return [torch.device("cpu")]
    items = list(devices) if isinstance(devices, (list, tuple)) else [devices]
    if not items:
        raise ValueError("devices must name at least one device, but got an empty list.")
    resolved = [resolve_device(item) for item in items]
    gpus = [d for d in resolved if d.type == "cuda"]
    if len(gpus) != len(set(gpus)):
        raise ValueError(f"devices names a GPU twice: {[str(d) for d in resolved]}. One worker runs per GPU.")
    return resolved


def load_model(
    source: ModelSource,
    *,
    tokenizer: PreTrainedTokenizerBase | None,
    model_kwargs: dict[str, Any],
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load the base model and its tokenizer from a path/hub id, an instance or a factory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

    model: PreTrainedModel
    if isinstance(source, str):
        kwargs = {"dtype": "auto", **model_kwargs}
        model = cast("PreTrainedModel", AutoModelForCausalLM.from_pretrained(source, **kwargs))
        if tokenizer is None:
            tokenizer = AutoTokenizer.from_pretrained(source)
    elif isinstance(source, PreTrainedModel):
        if model_kwargs:
            raise ValueError("model_kwargs applies only when model is a path or hub id, not a loaded model.")
        model = source
        if tokenizer is None:
            raise ValueError("A loaded model needs its tokenizer: pass RapidFireExecutor(..., tokenizer=...).")
    elif callable(source):
        loaded = source()
        if not (isinstance(loaded, tuple) and len(loaded) == 2 and isinstance(loaded[0], PreTrainedModel)):
            raise TypeError(
                f"A model factory must return (PreTrainedModel, tokenizer), but it returned {type(loaded).__name__}."
            )
        model, tokenizer = loaded
    else:
        raise TypeError(
            "model must be a path or hub id, a transformers PreTrainedModel or a zero-argument callable "
            f"returning (model, tokenizer), but got {type(source).__name__}."
        )
    assert tokenizer is not None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


class ResidentModel:
    """One base model on one device, with one LoRA adapter per live trial.

    The base weights are frozen and never copied: trials differ only by which adapter is active.
    All methods run on the device's worker thread; the lock only guards against misuse.
    """

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, device: torch.device) -> None:
        self.device = device
        self.tokenizer = tokenizer
        torch.nn.Module.to(model, device)  # in place: the one copy of the base weights lives on the device
        self.base = model
        self.base.requires_grad_(False)
        self.peft: PeftModel | None = None
        # The base's own dropout layers (not the adapters'), with their probabilities as loaded.
        self._base_dropouts = {m: m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)}
        self._base_dropout_off = False
        self._active: str | None = None
        self._layers: list[torch.nn.Module] | None = None  # PEFT's adapter layers, listed once
        self._lora_layers: tuple[int, list[tuple[str, Any]]] = (-1, [])  # see lora_layers()
        # Each adapter's parameters, keyed as adapter_weights keys them (found once: a walk over the model's
        # parameters costs more with every adapter it holds).
        self._params: dict[str, dict[str, torch.nn.Parameter]] = {}
        self._checkpointing: tuple[bool, str] = (False, "")
        self._writer = AdapterWriter()
        self._injections = Injections()
        self._lock = threading.RLock()
        self._alone_depth = 0  # open alone() contexts
        # Counts every adapter added or removed: what is known of the adapters is stale once it changes.
        self.adapters_version = 0

    @property
    def module(self) -> torch.nn.Module:
        """The model to call: the ``PeftModel`` once an adapter exists."""
        return self.peft if self.peft is not None else self.base

    def base_nbytes(self) -> int:
        """Bytes of the base model's weights and buffers."""
        unique = {t.data_ptr(): t for t in [*self.base.parameters(), *self.base.buffers()]}
        return sum(t.numel() * t.element_size() for t in unique.values())

    def add_adapter(self, name: str, config: PeftConfig, seed: int) -> list[torch.nn.Parameter]:
        """Create the adapter ``name`` with weights drawn from ``seed`` and return its parameters."""
        from peft import PeftModel, get_peft_model

        config = copy.deepcopy(config)
        with self._lock:
            if self.peft is not None and name in self.peft.peft_config:
                raise RuntimeError(f"Adapter {name!r} already exists on {self.device}.")
            signature = self._injections.signature(config)  # before PEFT's injection completes the config
            # The adapter's initial weights depend only on its seed, never on which trials came before.
            with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
                torch.manual_seed(seed)
                try:
                    if self.peft is None:
                        peft = get_peft_model(self.base, config, adapter_name=name)
                        assert isinstance(peft, PeftModel)
                        self.peft = peft
                        # TRL's reference pass (GRPO, DPO with beta) enters disable_adapter() every step; PEFT's
                        # walks every module three times (its status check, then off and on again).
                        peft.__dict__["disable_adapter"] = self.adapters_off
                        # TRL calls train() and reads is_gradient_checkpointing at every step: no walks.
                        peft.__dict__["train"] = ModeSwitch(peft, lambda: self.adapters_version, self.hiding)
                        publish_checkpointing(peft, self.base)
                    else:
                        # PEFT's injection walks every module several times: the other adapters' are hidden.
                        with self.alone(name):
                            self._injections.add_adapter(self.peft, name, config, signature)
                except BaseException:
                    self._layers = None
                    self._discard(name)
                    raise
            self.adapters_version += 1
            self._params.pop(name, None)
            with self.alone(name):  # walks that see the base and this adapter only
                self._layers = None  # the adapter may have wrapped more of the base's modules
                self._point_at(name)
                # Only the active adapter is trainable: its trainer's optimizer takes every trainable parameter.
                for param in self.peft.parameters():
                    param.requires_grad_(False)
                self._named_params(name)
            # A fused gang may have left several adapters trainable.
            self.set_trainable([other for other in self.peft.peft_config if other != name], False)
            self.activate(name)
            return self.adapter_params(name)

    def alone(self, name: str) -> contextlib.AbstractContextManager[None]:
        """Context in which the model's module tree shows adapter ``name`` only (and the base).

        Building a trial (PEFT's injection, TRL's trainer, the optimizer's parameter groups) walks every
        module and parameter of the model several times; with 16 adapters resident on the 82M shape the
        walks cost more than the build itself. Inside the context each LoRA layer's per-adapter module
        dicts hold ``name``'s entries only (entries added inside are kept); on leaving, the other adapters'
        entries are put back in their order, before any added. Nothing may run the model meanwhile.
        """
        return _Alone(self, name)

    def hiding(self) -> bool:
        """Whether an :meth:`alone` context hides other adapters' modules now."""
        return self._alone_depth > 0

    def adapter_params(self, name: str) -> list[torch.nn.Parameter]:
        """The parameters that belong to adapter ``name``."""
        return list(self._named_params(name).values())

    def adapter_weights(self, name: str) -> dict[str, torch.Tensor]:
        """Adapter ``name``'s weights, keyed by parameter name with the adapter's own name removed."""
        return {key: param.data for key, param in self._named_params(name).items()}

    def _named_params(self, name: str) -> dict[str, torch.nn.Parameter]:
        assert self.peft is not None
        params = self._params.get(name)
        if params is None:
            marker = f".{name}."
            params = {
                f".{n}.".replace(marker, ".")[1:-1]: p for n, p in self.peft.named_parameters() if marker in f".{n}."
            }
            self._params[name] = params
        return params

    def load_adapter_weights(self, name: str, weights: dict[str, torch.Tensor]) -> None:
        """Copy ``weights`` (as returned by :meth:`adapter_weights`) into adapter ``name``."""
        own = self.adapter_weights(name)
        if set(own) != set(weights):
            raise ValueError(f"Adapter {name!r} does not have the weights given: {sorted(set(own) ^ set(weights))[:3]}")
        with torch.no_grad():
            for key, target in own.items():
                target.copy_(weights[key], non_blocking=True)

    def activate(self, name: str, only: bool = True) -> None:
        """Make ``name`` the adapter the next forward pass uses (and the only trainable one).

        This is the hot swap. PEFT's ``set_adapter`` walks every module and every parameter of every
        adapter; here the adapter layers are listed once, and only the two adapters concerned have their
        ``requires_grad`` changed, so a switch costs microseconds whatever the number of live trials.
        ``only=False`` (a gang's members taking turns, each training its own adapter): the adapters trainable
        now stay so, and ``name`` is made trainable unless it is.
        """
        assert self.peft is not None
        with self._lock:
            if self._active == name:
                return
            self._point_at(name)
            if only and self._active is not None and self._active in self._params:
                for param in self._params[self._active].values():
                    param.requires_grad_(False)
            params = self._named_params(name).values()
            if only or not all(param.requires_grad for param in params):
                for param in params:
                    param.requires_grad_(True)
            self._active = name

    @contextlib.contextmanager
    def adapters_off(self) -> Iterator[None]:
        """Within the context, every adapter is off (the frozen base computes alone), as PEFT's
        ``PeftModel.disable_adapter()`` makes it, from the adapter layers listed once."""
        self.set_adapters_off(True)
        try:
            yield
        finally:
            self.set_adapters_off(False)

    def adapter_layers(self) -> list[Any]:
        """PEFT's adapter layers of the model, listed once (again after an adapter was added)."""
        from peft.tuners.tuners_utils import BaseTunerLayer

        assert self.peft is not None
        if self._layers is None:
            self._layers = [m for m in self.peft.modules() if isinstance(m, BaseTunerLayer)]
        return cast("list[Any]", self._layers)

    def lora_layers(self) -> list[tuple[str, Any]]:
        """PEFT's LoRA ``Linear`` layers with the base model's name of each
        (:func:`~optuna_rapidfire._fused._fused_pass.named_lora_layers`), listed once per :attr:`adapters_version`."""
        from optuna_rapidfire._fused._fused_pass import named_lora_layers

        if self._lora_layers[0] != self.adapters_version:
            self._lora_layers = (self.adapters_version, named_lora_layers(self.module))
        return self._lora_layers[1]

    def adapters_are_off(self) -> bool:
        """Whether the adapters are off (inside :meth:`adapters_off` or PEFT's ``disable_adapter()``)."""
        layers = self.adapter_layers() if self.peft is not None else []
        return bool(layers) and bool(layers[0].disable_adapters)

    def set_adapters_off(self, off: bool) -> None:
        """Turn every adapter layer off or on."""
        for layer in self.adapter_layers():
            # A plain attribute of PEFT's layers: written in place, without nn.Module's checks of what is set (a
            # tenth of the time; TRL turns adapters off and on again at every step of a trial with a KL term).
            if "_disable_adapters" in layer.__dict__:
                layer.__dict__["_disable_adapters"] = off
            else:
                layer._disable_adapters = off

    def _point_at(self, name: str) -> None:
        """Make ``name`` the adapter PEFT's layers and models name as active (``requires_grad`` untouched)."""
        assert self.peft is not None
        _compat.point_peft_at(self.peft, self.adapter_layers(), name)

    def set_trainable(self, names: list[str], trainable: bool) -> None:
        """Make several adapters trainable at once (a fused gang), or none of them again.

        Afterwards no adapter counts as active: the next :meth:`activate` sets one up from scratch.
        """
        with self._lock:
            for name in names:
                for param in self._named_params(name).values():
                    param.requires_grad_(trainable)
            self._active = None

    def building(self, adapter: str) -> contextlib.AbstractContextManager[Callable[[], Any]]:
        """Context for constructing a trial's TRL trainer without leaking its changes to other trials.

        TRL trainers patch the model's ``forward`` (a fused LM head, with outputs that depend on the
        trainer) and may turn dropout off in the whole model. Inside the context the model has its
        original forward; afterwards the trainer's forward is handed back (call the yielded function)
        and the original restored, and every dropout keeps its probability except the trial's own
        adapter dropouts, which keep what the trainer set.
        """
        return _Building(self, adapter)

    def use_forward(self, forward: Any) -> None:
        """Make ``forward`` (a trial's patched forward, or ``None`` for the original) the model's forward."""
        if forward is None:
            self.base.__dict__.pop("forward", None)
        else:
            self.base.forward = forward

    def set_base_dropout(self, off: bool) -> None:
        """Turn the base model's own dropout layers off (for trials whose args disable dropout) or back on."""
        if off == self._base_dropout_off:
            return
        for module, probability in self._base_dropouts.items():
            module.p = 0.0 if off else probability
        self._base_dropout_off = off

    def has_base_dropout(self) -> bool:
        """Whether the base model has dropout layers of its own that drop anything (as loaded; in train mode,
        unless :meth:`set_base_dropout` turned them off)."""
        return any(probability > 0 for probability in self._base_dropouts.values())

    def set_checkpointing(self, enabled: bool, kwargs: dict[str, Any] | None) -> None:
        """Turn activation checkpointing on or off for the next forward passes (a per-trial setting)."""
        key = (enabled, repr(sorted((kwargs or {}).items())))
        if key == self._checkpointing:
            return
        if enabled:
            kw = dict(kwargs or {})
            kw.setdefault("use_reentrant", False)
            if hasattr(self.base, "activation_checkpointing_enable"):
                self.base.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
            else:
                self.base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
        elif hasattr(self.base, "activation_checkpointing_disable"):
            self.base.activation_checkpointing_disable()
        else:
            self.base.gradient_checkpointing_disable()
        self._checkpointing = key
        if self.peft is not None:
            publish_checkpointing(self.peft, self.base)

    def delete_adapter(self, name: str) -> None:
        """Remove adapter ``name`` and free its weights."""
        with self._lock:
            self._discard(name)

    def _discard(self, name: str) -> None:
        self.adapters_version += 1
        if self.peft is None:
            return
        if name in self.peft.peft_config:
            others = [n for n in self.peft.peft_config if n != name]
            if others and self.peft.active_adapter == name:
                # Point PEFT at another adapter first: deleting the active one makes PEFT pick one and warn.
                self._point_at(others[0])
            try:
                # PEFT's deletion walks every module three times: the other adapters' are hidden meanwhile (a gang's
                # eight 1B trials ending together took 5-31 ms each to delete on H100 hosts, one after another).
                with self.alone(name):
                    self.peft.delete_adapter(name)
            except (ValueError, KeyError, AttributeError):
                # A half-built adapter (its injection failed) may be missing from some layers.
                self.peft.peft_config.pop(name, None)
        if self._active == name:
            self._active = None
        # PEFT leaves its layers wrapped when an adapter goes: the list of layers stays right.
        self._params.pop(name, None)

    def save_adapter(self, name: str, directory: str) -> None:
        """Write adapter ``name`` in PEFT's format (``adapter_config.json`` + safetensors) to ``directory``."""
        self.adapter_savers([(name, directory)])[0]()

    def adapter_savers(self, adapters: list[tuple[str, str]]) -> list[Callable[[], None]]:
        """:meth:`save_adapter` of each ``(name, directory)`` in two parts: this call does what needs the model (the
        weights copied to the host together), and each function returned writes the files from any thread."""
        assert self.peft is not None
        chosen = [(name, self.adapter_weights(name), directory) for name, directory in adapters]
        return self._writer.savers(self.peft, chosen, self.adapter_layers())


class _Alone:
    """See :meth:`ResidentModel.alone`."""

    def __init__(self, resident: ResidentModel, name: str) -> None:
        self.resident = resident
        self.name = name
        self._hidden: list[tuple[dict[str, Any], dict[str, Any], dict[str, Any]]] = []

    def __enter__(self) -> None:
        self.resident._lock.acquire()
        self.resident._alone_depth += 1
        try:
            self._hide()
        except BaseException:
            self.__exit__()
            raise

    def _hide(self) -> None:
        resident = self.resident
        if resident.peft is None:
            return
        for layer in resident.adapter_layers():
            for attribute in (*layer.adapter_layer_names, *layer.other_param_names):
                held = getattr(layer, attribute, None)
                if not isinstance(held, torch.nn.ModuleDict) or not held._modules:
                    continue
                modules = held._modules
                hidden = {key: module for key, module in modules.items() if key != self.name}
                if hidden:
                    # The dict itself stays (PEFT may hold it); only its entries change.
                    self._hidden.append((modules, dict(modules), hidden))
                    for key in hidden:
                        del modules[key]

    def __exit__(self, *exc: object) -> None:
        try:
            for modules, before, hidden in self._hidden:
                now = dict(modules)
                modules.clear()
                for key in before:
                    if key in hidden:
                        modules[key] = hidden[key]
                    elif key in now:
                        modules[key] = now.pop(key)
                modules.update(now)
            self._hidden.clear()
        finally:
            self.resident._alone_depth -= 1
            self.resident._lock.release()


class _Building:
    """See :meth:`ResidentModel.building`."""

    def __init__(self, resident: ResidentModel, adapter: str) -> None:
        self.resident = resident
        self.adapter = adapter
        self.forward: Any = None

    def __enter__(self) -> Callable[[], Any]:
        assert self.resident.peft is not None
        self._previous = self.resident.base.__dict__.get("forward")
        self.resident.use_forward(None)
        self._dropouts = {m: m.p for m in self.resident.peft.modules() if isinstance(m, torch.nn.Dropout)}
        return lambda: self.forward

    def __exit__(self, *exc: object) -> None:
        resident = self.resident
        assert resident.peft is not None
        self.forward = resident.base.__dict__.get("forward")
        resident.use_forward(self._previous)
        marker = f".{self.adapter}"
        own = {m for n, m in resident.peft.named_modules() if n.endswith(marker) and isinstance(m, torch.nn.Dropout)}
        for module, probability in self._dropouts.items():
            if module not in own:
                module.p = probability
