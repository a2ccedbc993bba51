"""The user's SFTConfig is honoured: one trial trained chunk by chunk equals TRL's own SFTTrainer.train()."""

from __future__ import annotations

import optuna
import torch
from helpers import by_number, lora
from peft import get_peft_model_state_dict
from safetensors.torch import load_file
from torch.utils.data import SequentialSampler
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer

from optuna_rapidfire._resident._data import ChunkPlan
from optuna_rapidfire._study._attrs import ADAPTER_PATH


class _InOrderSFTTrainer(SFTTrainer):
    """TRL's trainer visiting the train set in order (the executor's order is the shuffled chunks)."""

    def _get_train_sampler(self, train_dataset=None):
        return SequentialSampler(train_dataset or self.train_dataset)


def _args(tmp_path) -> SFTConfig:
    return SFTConfig(
        output_dir=str(tmp_path / "trl"),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=2e-2,
        lr_scheduler_type="cosine",
        warmup_steps=2,
        weight_decay=0.1,
        max_grad_norm=0.5,
        num_train_epochs=2,
        max_length=512,
        bf16=False,
        gradient_checkpointing=False,
        seed=11,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
    )


def test_one_trial_matches_trl_sft_trainer(make_executor, tiny_model, train_ds, tmp_path) -> None:
    rows = train_ds.select(range(16))
    peft_config = lora(r=4, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"])

    executor = make_executor(train_dataset=rows, num_chunks=2, max_concurrent_trials=1, seed=5)
    study = optuna.create_study(pruner=optuna.pruners.NopPruner())
    executor.optimize(study, by_number([(peft_config, _args(tmp_path))]), n_trials=1)
    ours = load_file(f"{study.trials[0].user_attrs[ADAPTER_PATH]}/adapter_model.safetensors")

    # TRL on the same rows in the executor's order. In the second epoch the executor reshuffles
    # within each chunk, so TRL gets that order too, epoch by epoch.
    plan = ChunkPlan(num_rows=len(rows), num_chunks=2, seed=5)
    first = [int(i) for c in range(2) for i in plan.rows(c)]
    second = [int(plan.rows(c)[j]) for c in range(2) for j in plan.visit_order(len(plan.rows(c)), 1, c)]
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    trainer = _InOrderSFTTrainer(
        model=model,
        args=_args(tmp_path),
        train_dataset=rows.select(first + second),
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    trainer.args.num_train_epochs = 1  # the two epochs are laid out in the dataset itself
    trainer.train()
    theirs = get_peft_model_state_dict(trainer.model)

    assert set(ours) == set(theirs)
    for key, value in theirs.items():
        torch.testing.assert_close(ours[key], value.detach(), rtol=1e-5, atol=1e-6, msg=key)
    assert any(k.endswith("lora_B.weight") and ours[k].abs().sum() > 0 for k in ours)  # it did train
