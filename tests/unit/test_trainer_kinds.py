"""What every trainer kind keeps (``_trainers/_base.py``), tested once for SFT, DPO and GRPO: the kind the args
select, the settings refused or ignored, the executor's own fields, and, over real TRL trainers on the tiny
model, building beside other trials, accumulation and the fused loss against the trainer's own loss."""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _numerics import assert_within_rounding, gradient_terms, loss_terms
from datasets import Dataset
from helpers import lora, sft_args, vowel_reward
from transformers import Trainer, TrainingArguments
from transformers.trainer_utils import IntervalStrategy, SaveStrategy
from trl import DPOConfig, GRPOConfig

from optuna_rapidfire import _compat
from optuna_rapidfire._resident._model import ResidentModel, load_model
from optuna_rapidfire._trainers import kind_for
from optuna_rapidfire._trainers._base import ACCELERATE_STATE, TrainerExtras, TrainerKind, accumulation_divisor
from optuna_rapidfire._trainers._dpo import DPOKind
from optuna_rapidfire._trainers._sft import SFTKind
from optuna_rapidfire._trainers.grpo._kind import GRPOKind

CPU = torch.device("cpu")


def _dpo_args(**overrides: Any) -> DPOConfig:
    return DPOConfig(**{"bf16": False, "per_device_train_batch_size": 2, "max_length": 64, **overrides})


def _grpo_args(**overrides: Any) -> GRPOConfig:
    settings = {"bf16": False, "per_device_train_batch_size": 4, "num_generations": 2, "max_completion_length": 8}
    return GRPOConfig(**{**settings, **overrides})


ARGS: dict[str, Callable[..., TrainingArguments]] = {"sft": sft_args, "dpo": _dpo_args, "grpo": _grpo_args}
KINDS: dict[str, type[TrainerKind]] = {"sft": SFTKind, "dpo": DPOKind, "grpo": GRPOKind}


@pytest.fixture(params=sorted(ARGS))
def name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


# -- the kind the args select -----------------------------------------------------------------------


def test_the_class_of_the_training_args_selects_the_kind(name: str) -> None:
    kind = kind_for(ARGS[name]())
    assert type(kind) is KINDS[name]
    assert kind.name == name


def test_training_args_of_another_type_are_refused_naming_the_type_and_the_supported_ones() -> None:
    with pytest.raises(TypeError, match=r"type TrainingArguments; .* supports SFTConfig, DPOConfig, GRPOConfig"):
        kind_for(TrainingArguments(output_dir="unused"))


# -- settings refused, ignored or taken over --------------------------------------------------------


def test_default_args_are_accepted_without_a_note(name: str) -> None:
    args = ARGS[name]()
    assert kind_for(args).check_args(args) == []


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"torch_compile": True}, r"\.torch_compile=True is not supported by RapidFireExecutor: compiling"),
        ({"neftune_noise_alpha": 5.0}, r"\.neftune_noise_alpha=5\.0 is not supported .*NEFTune"),
        ({"push_to_hub": True}, r"\.push_to_hub=True is not supported"),
        ({"max_steps": 10}, r"\.max_steps=10 is not supported: a trial's length is num_train_epochs"),
        ({"num_train_epochs": 0}, r"num_train_epochs=0"),
        (
            {"lr_scheduler_type": "reduce_lr_on_plateau", "eval_strategy": "steps", "eval_steps": 5},
            r"lr_scheduler_type='reduce_lr_on_plateau' is not supported",
        ),
        ({"gradient_accumulation_steps": 0}, r"must be at least 1, but got \d+ and 0"),
    ],
)
def test_settings_the_executor_cannot_honour_are_refused_by_name(
    name: str, overrides: dict[str, Any], message: str
) -> None:
    args = ARGS[name](**overrides)
    with pytest.raises(ValueError, match=message):
        kind_for(args).check_args(args)


def test_fields_the_executor_owns_are_noted_as_ignored_once_each(name: str) -> None:
    args = ARGS[name](logging_steps=7, save_steps=3, data_seed=5, eval_on_start=True)
    notes = kind_for(args).check_args(args)
    prefix = type(args).__name__
    assert notes == [
        f"{prefix}.save_steps=3 is ignored: the executor saves each COMPLETE trial's final adapter.",
        f"{prefix}.logging_steps=7 is ignored: the executor records per-chunk metrics in the study.",
        f"{prefix}.data_seed=5 is ignored: the executor's seed fixes the chunks and their order.",
        f"{prefix}.eval_on_start=True is ignored: the executor evaluates after every chunk.",
    ]


def test_turning_an_owned_feature_off_is_not_worth_a_note(name: str) -> None:
    args = ARGS[name](report_to="none", save_strategy="no", eval_strategy="no")
    assert kind_for(args).check_args(args) == []


def test_effective_args_take_over_the_owned_fields_on_a_copy_and_pin_the_device(name: str, tmp_path: Path) -> None:
    args = ARGS[name](eval_strategy="steps", eval_steps=5, save_strategy="steps", logging_steps=7, data_seed=5)
    effective = kind_for(args).effective_args(args, str(tmp_path / "trial_0"), CPU)
    assert effective is not args
    assert effective.output_dir == str(tmp_path / "trial_0")
    assert effective.eval_strategy == IntervalStrategy.NO and effective.logging_strategy == IntervalStrategy.NO
    assert effective.save_strategy == SaveStrategy.NO
    assert effective.report_to == [] and effective.disable_tqdm is True and effective.data_seed is None
    assert effective.device == CPU and effective.n_gpu == 1
    # The user's own args (shared by the trial's thread) keep what they said.
    assert args.eval_strategy == IntervalStrategy.STEPS and args.save_strategy == SaveStrategy.STEPS
    assert args.data_seed == 5 and args.output_dir != effective.output_dir
    assert effective.learning_rate == args.learning_rate and effective.seed == args.seed


@pytest.mark.parametrize(
    ("epochs", "num_chunks", "expected"),
    [
        (1, 4, 4),
        (3, 4, 12),
        (1.5, 4, 6),
        (0.3, 4, 2),  # 1.2 chunks: a started chunk is trained whole
        (0.07, 100, 7),  # 0.07 * 100 is 7.000000000000001 in floats: 7 chunks, not 8
        (0.01, 4, 1),  # at least one
    ],
)
def test_a_trial_trains_num_train_epochs_passes_of_num_chunks_chunks(
    epochs: float, num_chunks: int, expected: int
) -> None:
    assert SFTKind().total_chunks(sft_args(num_train_epochs=epochs), num_chunks) == expected


def test_micro_batches_follow_the_order_and_drop_a_short_last_one_only_when_asked() -> None:
    order = np.array([4, 2, 0, 1, 3])
    assert SFTKind().micro_batches(sft_args(per_device_train_batch_size=2), order) == [[4, 2], [0, 1], [3]]
    dropping = sft_args(per_device_train_batch_size=2, dataloader_drop_last=True)
    assert DPOKind().micro_batches(dropping, order) == [[4, 2], [0, 1]]


def test_eval_batches_cover_the_eval_set_in_order_in_eval_batch_sized_pieces() -> None:
    assert SFTKind().eval_batches(sft_args(per_device_eval_batch_size=2), 5) == [[0, 1], [2, 3], [4]]


def test_checkpointing_is_read_from_the_args_with_its_kwargs() -> None:
    kind = SFTKind()
    assert kind.checkpointing(sft_args(gradient_checkpointing=False))[0] is False
    enabled = sft_args(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": True})
    assert kind.checkpointing(enabled) == (True, {"use_reentrant": True})


@pytest.mark.parametrize(("field", "dtype"), [("bf16", torch.bfloat16), ("fp16", torch.float16), (None, torch.float32)])
def test_autocast_computes_in_the_trials_mixed_precision(field: str | None, dtype: torch.dtype) -> None:
    args = sft_args()
    if field is not None:
        setattr(args, field, True)  # a CPU-only machine refuses to construct such args
    a = torch.ones(2, 2)
    with SFTKind().autocast(args, CPU):
        assert (a @ a).dtype == dtype


def test_base_dropout_is_off_only_for_args_that_disable_it() -> None:
    assert DPOKind().base_dropout_off(_dpo_args(disable_dropout=True)) is True
    assert DPOKind().base_dropout_off(_dpo_args(disable_dropout=False)) is False
    assert SFTKind().base_dropout_off(sft_args()) is False  # SFTConfig has no such field


def test_each_kind_brings_its_gang_strategy_and_a_shared_passes_kind_has_a_fused_loss() -> None:
    from optuna_rapidfire._trainers._gangs import SHARED_PASSES, GangStrategy
    from optuna_rapidfire._trainers.grpo._gang import GENERATION_TURNS

    assert {type(kind).__name__: kind.gang for kind in (SFTKind(), DPOKind(), GRPOKind())} == {
        "SFTKind": SHARED_PASSES,
        "DPOKind": SHARED_PASSES,
        "GRPOKind": GENERATION_TURNS,
    }
    assert all(isinstance(kind.gang, GangStrategy) for kind in (SFTKind(), DPOKind(), GRPOKind()))
    assert SHARED_PASSES.streams and not GENERATION_TURNS.streams  # only shared-pass gangs stream
    assert SFTKind().fused_loss is not None and DPOKind().fused_loss is not None and GRPOKind().fused_loss is None


def test_a_kind_s_per_device_state_is_made_once_per_device_and_only_for_its_trials() -> None:
    """GRPO's decode is a part of the device, made the first time a GRPO trial needs it there: an SFT trial's
    install makes none, and each device has its own."""
    from optuna_rapidfire._trainers._gangs import SHARED_PASSES
    from optuna_rapidfire._trainers.grpo._gang import generation
    from optuna_rapidfire._trainers.grpo._generation import Generation

    class Host:  # the part store of a device (DeviceTrials.part)
        def __init__(self) -> None:
            self.parts: dict[str, object] = {}

        def part(self, key, make):
            if key not in self.parts:
                self.parts[key] = make()
            return self.parts[key]

    first, second = Host(), Host()
    SHARED_PASSES.install(first, object())  # type: ignore[arg-type]
    assert first.parts == {}
    made = generation(first)  # type: ignore[arg-type]
    assert isinstance(made, Generation) and made.trials is first
    assert generation(first) is made and generation(second) is not made  # type: ignore[arg-type]
    zero = dict.fromkeys(("members", "decode", "rewards", "logps", "backward"), 0.0)
    assert made.counters() == {
        "decodes": 0,
        "decoded_requests": 0,
        "fused_steps": 0,
        "scoring_passes": 0,
        "prefix_passes": 0,
        "stacked_passes": 0,
        "gang_seconds": zero,
    }


def test_a_strategy_of_one_s_own_chooses_what_the_engine_does_with_the_gang() -> None:
    """README's "Extending" example: a strategy is one class; the engine's offer is all it needs."""
    from optuna_rapidfire._trainers._gangs import GangStrategy

    class PairsOfTwo(GangStrategy):
        streams = False

        def run(self, engine, members):
            results = []
            for first in range(0, len(members), 2):
                results += engine.shared_passes(members[first : first + 2])
            return results

    class Engine:  # records what a strategy asks of the fused engine
        def __init__(self) -> None:
            self.asked: list[tuple[str, list[int]]] = []

        def shared_passes(self, members):
            self.asked.append(("shared_passes", list(members)))
            return [f"chunk of {m}" for m in members]

    engine = Engine()
    assert PairsOfTwo().run(engine, [0, 1, 2]) == ["chunk of 0", "chunk of 1", "chunk of 2"]  # type: ignore[arg-type]
    assert engine.asked == [("shared_passes", [0, 1]), ("shared_passes", [2])]


def test_only_kinds_without_a_fused_loss_refuse_a_shared_pass_by_kind() -> None:
    assert GRPOKind().fused_refusal(None, _grpo_args()) == "is a GRPO trial (SFT and DPO trials are fused)"  # type: ignore[arg-type]
    assert SFTKind().fused_refusal(None, sft_args()) is None  # type: ignore[arg-type]
    assert DPOKind().fused_refusal(types.SimpleNamespace(), _dpo_args()) is None  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("trainer", "num_items", "expected"),
    [
        ({"loss_is_scaled_for_ga": True}, None, 1),
        ({"loss_is_scaled_for_ga": False}, 40, 3),
        ({"model_accepts_loss_kwargs": True, "compute_loss_func": None}, 40, 1),  # normalized over the tokens
        ({"model_accepts_loss_kwargs": True, "compute_loss_func": None}, None, 3),  # a mean per micro-batch
        ({"model_accepts_loss_kwargs": False, "compute_loss_func": None}, 40, 3),
        ({"model_accepts_loss_kwargs": False, "compute_loss_func": len}, None, 1),
    ],
)
def test_a_micro_batchs_loss_is_divided_as_trainer_training_step_divides_it(
    trainer: dict[str, Any], num_items: int | None, expected: int
) -> None:
    assert accumulation_divisor(types.SimpleNamespace(**trainer), num_items, 3) == expected  # type: ignore[arg-type]


# -- over real TRL trainers on the tiny model ---------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """The tiny model's ops run on one thread: more gain nothing at this size, and on a busy machine
    threads waiting for each other turn a step of milliseconds into seconds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def resident(tiny_model: str) -> ResidentModel:
    model, tokenizer = load_model(tiny_model, tokenizer=None, model_kwargs={})
    return ResidentModel(model, tokenizer, CPU)


@pytest.fixture(scope="module")
def rows(train_ds: Dataset) -> dict[str, Dataset]:
    """Short raw rows for each kind (a few dozen tokens: fast, and no DPO pair is cut at ``max_length=64``)."""
    some = train_ds.select(range(8))
    prompts, answers = [p[:40] for p in some["prompt"]], [c[:30] for c in some["completion"]]
    rejected = [a[:12] for a in answers[1:] + answers[:1]]
    return {
        "sft": Dataset.from_dict({"prompt": prompts, "completion": answers}),
        "dpo": Dataset.from_dict({"prompt": prompts, "chosen": answers, "rejected": rejected}),
        "grpo": Dataset.from_dict({"prompt": prompts}),
    }


@contextlib.contextmanager
def _trial(
    resident: ResidentModel, args: TrainingArguments, adapter: str, sample: Dataset, tmp_path: Path
) -> Iterator[tuple[TrainerKind, Trainer]]:
    """A trial's adapter and TRL trainer, built as the device builds them, with the model routed through the
    trial; its adapter is deleted afterwards."""
    kind = kind_for(args)
    extras = TrainerExtras(reward_funcs=(vowel_reward,))
    with ACCELERATE_STATE:
        effective = kind.effective_args(args, str(tmp_path / adapter), CPU)
    resident.add_adapter(adapter, lora(), seed=effective.seed)
    try:
        with ACCELERATE_STATE, resident.building(adapter) as forward:
            trainer = kind.build_trainer(resident, effective, sample.select([0]), extras)
            kind.isolate(trainer)
        resident.activate(adapter)
        resident.use_forward(forward())
        resident.module.train()
        yield kind, trainer
    finally:
        resident.use_forward(None)
        resident.delete_adapter(adapter)


def _perturb(resident: ResidentModel, adapter: str) -> list[torch.nn.Parameter]:
    """Give the adapter non-zero B matrices (a fresh adapter computes the base exactly); its parameters."""
    generator = torch.Generator().manual_seed(7)
    weights = resident.adapter_weights(adapter)
    perturbed = {
        k: torch.randn(v.shape, generator=generator) * 0.3 if "lora_B" in k else v.clone() for k, v in weights.items()
    }
    resident.load_adapter_weights(adapter, perturbed)
    return resident.adapter_params(adapter)


def _loss_and_grads(
    kind: TrainerKind, trainer: Trainer, resident: ResidentModel, params: list[torch.nn.Parameter], batches: Any
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    for p in params:
        p.grad = None
    loss = kind.accumulate(trainer, resident.module, batches, CPU, None)
    return loss, [p.grad.clone() for p in params if p.grad is not None]


def test_building_a_trainer_beside_another_trial_leaves_exactly_the_two_adapters(
    name: str, resident: ResidentModel, rows: dict[str, Dataset], tmp_path: Path
) -> None:
    """DPO and GRPO trainers copy an adapter named ``default`` into a ``ref`` one; here the reference is the
    base itself, and neither may stay behind, nor may another trial's adapter go."""
    resident.add_adapter("other", lora(), seed=1)
    try:
        with _trial(resident, ARGS[name](), "trial_0", rows[name], tmp_path) as (kind, trainer):
            assert sorted(resident.peft.peft_config) == ["other", "trial_0"]  # type: ignore[union-attr]
            assert trainer.args.device == CPU and trainer.args.report_to == []
            assert (getattr(trainer, "reward_funcs", None) == [vowel_reward]) is kind.needs_rewards
    finally:
        resident.delete_adapter("other")


@pytest.mark.numerics
@pytest.mark.parametrize("name", ["sft", "dpo"])
def test_accumulating_two_micro_batches_equals_one_step_over_their_union(
    name: str, resident: ResidentModel, rows: dict[str, Dataset], tmp_path: Path
) -> None:
    """SFT normalizes over the accumulated tokens, DPO averages the micro-batches' means: either way two
    micro-batches of two give the loss and gradients of one micro-batch of four (catches a wrong divisor)."""
    with _trial(resident, ARGS[name](), "trial_0", rows[name], tmp_path) as (kind, trainer):
        params = _perturb(resident, "trial_0")
        prepared = kind.prepare(trainer, rows[name], "train")
        examples = [prepared[i] for i in range(4)]
        split_loss, split_grads = _loss_and_grads(kind, trainer, resident, params, [examples[:2], examples[2:]])
        union_loss, union_grads = _loss_and_grads(kind, trainer, resident, params, [examples])
        length = int(trainer.data_collator(examples)["input_ids"].shape[1])
        config = resident.base.config
        assert_within_rounding(split_loss, union_loss, terms=loss_terms(config, rows=8, length=length), what="loss")
        assert split_grads and len(split_grads) == len(union_grads) == len(params)
        terms = gradient_terms(config, rows=8, length=length)
        for split, union in zip(split_grads, union_grads, strict=True):
            assert_within_rounding(split, union, terms=terms, what="gradient")
        assert float(union_loss) > 0


def test_a_dpo_trials_first_loss_is_log_2_because_its_reference_is_the_base(
    resident: ResidentModel, rows: dict[str, Dataset], tmp_path: Path
) -> None:
    """A fresh LoRA adapter computes exactly the base: every pair's log-ratio to the reference is 0 and its
    loss -log(sigmoid(0)) = log 2, whatever the pairs (any other reference would move it)."""
    with _trial(resident, _dpo_args(), "trial_0", rows["dpo"], tmp_path) as (kind, trainer):
        prepared = kind.prepare(trainer, rows["dpo"], "train")
        loss = kind.accumulate(trainer, resident.module, [[prepared[0], prepared[1]]], CPU, None)
        terms = loss_terms(resident.base.config, rows=4, length=64)
        assert_within_rounding(loss, torch.tensor(float(np.log(2.0))), terms=terms, what="loss")


@pytest.mark.parametrize("name", ["dpo", "grpo"])
def test_trainers_with_a_reference_build_no_copy_of_the_trials_adapter(
    name: str, resident: ResidentModel, rows: dict[str, Dataset], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TRL copies a ``default`` adapter into a frozen ``ref`` one for DPO, and for GRPO with a KL term; a trial's
    reference is the base, so no adapter is injected while its trainer is built (and none is left)."""
    from peft import PeftModel

    added: list[str] = []
    add_adapter = PeftModel.add_adapter

    def counted(self: PeftModel, adapter_name: str, *args: Any, **kwargs: Any) -> Any:
        added.append(adapter_name)
        return add_adapter(self, adapter_name, *args, **kwargs)

    monkeypatch.setattr(PeftModel, "add_adapter", counted)
    args = _dpo_args() if name == "dpo" else _grpo_args(beta=0.04)
    with _trial(resident, args, "trial_0", rows[name], tmp_path) as (_, trainer):
        assert getattr(trainer, "beta", 0.1) != 0.0
        assert resident.peft is not None and "ref" not in resident.peft.peft_config
        assert "default" not in resident.peft.peft_config
    assert "ref" not in added


def test_a_trainer_unwraps_the_resident_model_without_walking_it(
    resident: ResidentModel, rows: dict[str, Dataset], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TRL unwraps its model several times a step; accelerate's unwrap walks every module. The resident model is
    returned as it is without the walk; another model still goes through accelerate."""
    import accelerate.utils.other

    walked: list[Any] = []
    has_compiled_regions = accelerate.utils.other.has_compiled_regions

    def counted(module: torch.nn.Module) -> bool:
        walked.append(module)
        return has_compiled_regions(module)

    monkeypatch.setattr(accelerate.utils.other, "has_compiled_regions", counted)
    with _trial(resident, _grpo_args(), "trial_0", rows["grpo"], tmp_path) as (_, trainer):
        walked.clear()  # the build's own unwraps, before the trainer was set up
        assert trainer.accelerator.unwrap_model(trainer.model) is resident.module
        assert trainer.accelerator.unwrap_model(trainer.model, keep_fp32_wrapper=False) is resident.module
        assert not walked
        other = torch.nn.Sequential(torch.nn.Linear(2, 2))
        assert trainer.accelerator.unwrap_model(other) is other
        assert walked == [other]


def test_accelerates_gpu_probe_runs_once_however_many_trainers_reset_its_state(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each trainer build resets accelerate's state, whose set-up on a GPU runs ``nvidia-smi`` (a subprocess): its
    answer, which depends on the machine alone, is asked once per process and the state is still reset."""
    from accelerate import state

    asked: list[int] = []

    def probe() -> bool:
        asked.append(1)
        return True

    monkeypatch.setattr(state, "check_cuda_p2p_ib_support", probe)
    state.PartialState()
    for _ in range(3):
        _compat.reset_accelerate_state()
        assert not state.PartialState._shared_state  # cleared for the next trainer's accelerator
        assert state.check_cuda_p2p_ib_support() and state.check_cuda_p2p_ib_support()
    assert asked == [1]


def test_accelerates_handlers_leave_the_environment_to_other_threads() -> None:
    """An Accelerator's handlers compute their defaults with the process's environment emptied: a thread reading it
    meanwhile (an HTTP client looking for proxies) found variables gone. Computed once per class now, the
    environment stays whole under another thread's reads, and each handler's kwargs are what accelerate gives."""
    from accelerate.utils import AutocastKwargs, GradScalerKwargs

    _compat.keep_accelerate_environment()
    missing: list[KeyError] = []
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            try:
                dict(os.environ.items())
            except KeyError as error:
                missing.append(error)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for _ in range(500):
            assert AutocastKwargs(enabled=False).to_kwargs() == {"enabled": False}
            assert GradScalerKwargs(init_scale=2.0).to_kwargs() == {"init_scale": 2.0}
            assert GradScalerKwargs().to_kwargs() == {}
    finally:
        done.set()
        reader.join()
    assert not missing


def _token_nll(resident: ResidentModel, batch: dict[str, Any], labels: torch.Tensor, base: bool) -> torch.Tensor:
    """Each loss token's negative log-probability from the plain model's logits (``base``: adapters off)."""
    row, column = (labels != -100).nonzero(as_tuple=True)
    peft = resident.peft
    assert peft is not None
    with peft.disable_adapter() if base else contextlib.nullcontext(), torch.set_grad_enabled(not base):
        logits = resident.module(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        log_probs = logits[row, column].float().log_softmax(-1)
        return -log_probs.gather(1, labels[row, column][:, None])[:, 0]


@pytest.mark.numerics
@pytest.mark.parametrize("name", ["sft", "dpo"])
def test_the_fused_loss_of_a_trial_equals_its_trainers_own_loss_and_gradients(
    name: str, resident: ResidentModel, rows: dict[str, Dataset], tmp_path: Path
) -> None:
    """The kind's ``FusedLoss`` (labels, lay-out, reference, losses, scale) over the plain model's token
    log-probabilities gives what TRL's ``compute_loss`` gives for one optimizer step of two micro-batches."""
    with _trial(resident, ARGS[name](), "trial_0", rows[name], tmp_path) as (kind, trainer):
        params = _perturb(resident, "trial_0")
        prepared = kind.prepare(trainer, rows[name], "train")
        micro = [[prepared[0], prepared[1]], [prepared[2], prepared[3]]]
        trl_loss, trl_grads = _loss_and_grads(kind, trainer, resident, params, micro)

        loss = kind.fused_loss
        assert loss is not None
        resident.use_forward(None)  # shared passes call the plain model
        collated = [loss.collate(trainer, batch) for batch in micro]
        count = _compat.num_items_in_batch(trainer, collated, CPU)
        divisor = accumulation_divisor(trainer, count, len(collated))
        for p in params:
            p.grad = None
        total = torch.zeros(())
        for batch in collated:
            labels = loss.labels(batch)
            token_rows, columns = (labels != -100).nonzero(as_tuple=True)
            rows_in_pass = len(batch["input_ids"])
            segment, extras = loss.lay_out([rows_in_pass], [token_rows], [trainer.args])
            # The pass's convention: each loss token's flat position, its sum, its label.
            flat = token_rows * batch["input_ids"].shape[1] + columns
            where = torch.stack([flat, segment, labels[token_rows, columns]])
            reference = loss.reference(
                functools.partial(_token_nll, resident, batch, labels, True), where, rows_in_pass
            )
            nll = _token_nll(resident, batch, labels, base=False)
            member = loss.losses(nll, reference, where, extras, rows_in_pass, 1)
            total = total + member[0] * loss.scale(batch, len(token_rows), count, divisor, CPU)
        total.backward()

        length = max(int(b["input_ids"].shape[1]) for b in collated)
        config = resident.base.config
        assert_within_rounding(total.detach(), trl_loss, terms=loss_terms(config, rows=4, length=length), what="loss")
        terms = gradient_terms(config, rows=4, length=length)
        fused_grads = [p.grad for p in params if p.grad is not None]
        assert len(fused_grads) == len(trl_grads) == len(params)
        for fused, trl in zip(fused_grads, trl_grads, strict=True):
            assert_within_rounding(fused, trl, terms=terms, what="gradient")


def test_metrics_the_trainer_collected_are_averaged_once_then_forgotten(
    resident: ResidentModel, rows: dict[str, Dataset], tmp_path: Path
) -> None:
    with _trial(resident, sft_args(), "trial_0", rows["sft"], tmp_path) as (kind, trainer):
        prepared = kind.prepare(trainer, rows["sft"], "train")
        for start in (0, 2):  # two steps: each records its token accuracy
            kind.accumulate(trainer, resident.module, [[prepared[start], prepared[start + 1]]], CPU, None)
        recorded = list(_compat.trainer_metrics(trainer, "train")["mean_token_accuracy"])
        metrics = kind.drain_metrics(trainer, "train")
        assert len(recorded) == 2 and metrics["mean_token_accuracy"] == sum(recorded) / 2
        assert kind.drain_metrics(trainer, "train") == {}


def test_an_eval_batch_gives_its_loss_and_rows_and_the_outputs_only_when_asked(
    resident: ResidentModel, rows: dict[str, Dataset], tmp_path: Path
) -> None:
    with _trial(resident, sft_args(), "trial_0", rows["sft"], tmp_path) as (kind, trainer):
        prepared = kind.prepare(trainer, rows["sft"], "eval")
        batch = [prepared[i] for i in range(3)]
        resident.module.eval()
        loss, examples, logits, labels = kind.eval_batch(trainer, resident.module, batch, CPU, with_outputs=False)
        assert examples == 3 and logits is None and labels is None and float(loss) > 0
        again, _, logits, labels = kind.eval_batch(trainer, resident.module, batch, CPU, with_outputs=True)
        assert float(again) == float(loss)
        assert logits is not None and labels is not None and labels.shape[0] == 3


def test_sft_packs_the_eval_split_per_eval_packing_and_keeps_only_the_models_columns(
    resident: ResidentModel, rows: dict[str, Dataset], tmp_path: Path
) -> None:
    raw = rows["sft"].add_column("id", list(range(len(rows["sft"]))))
    with _trial(resident, sft_args(packing=False, eval_packing=True), "trial_0", raw, tmp_path) as (kind, trainer):
        train, evaluation = kind.prepare(trainer, raw, "train"), kind.prepare(trainer, raw, "eval")
    assert len(train) == len(raw) and train.column_names == ["input_ids", "labels"]
    assert len(evaluation) < len(raw)  # rows of a few dozen tokens packed up to max_length=128
    with _trial(resident, sft_args(remove_unused_columns=False), "trial_0", raw, tmp_path) as (kind, trainer):
        kept = kind.prepare(trainer, raw, "train")
    assert {"prompt", "completion", "id", "input_ids", "labels"} <= set(kept.column_names)
