"""Population Based Training with CloneSampler, plus hand-made stop/resume/clone while the study runs.

    python examples/pbt_and_control.py
    # meanwhile, in another terminal:
    optuna-rapidfire ls    --storage sqlite:///pbt.db --study-name pbt
    optuna-rapidfire stop  --storage sqlite:///pbt.db --study-name pbt 2
    optuna-rapidfire clone --storage sqlite:///pbt.db --study-name pbt 3 --set learning_rate=0.005
    optuna-dashboard sqlite:///pbt.db     # each running trial has a stop/resume/delete/clone form

The script itself also acts by hand (as another process would): it pauses the leading trial, clones
it with half its learning rate, and resumes it.
"""

from __future__ import annotations

import argparse
import threading
import time

import optuna
from peft import LoraConfig
from trl import SFTConfig

from optuna_rapidfire import RapidFireExecutor, control
from optuna_rapidfire.demo import build_tiny_model, load_gsm8k
from optuna_rapidfire.samplers import CloneSampler


def configure(trial: optuna.Trial) -> tuple[LoraConfig, SFTConfig]:
    lora = LoraConfig(
        r=8,
        lora_alpha=16,
        lora_dropout=trial.suggest_float("lora_dropout", 0.0, 0.3),
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
    )
    args = SFTConfig(
        learning_rate=trial.suggest_float("learning_rate", 1e-4, 1e-1, log=True),
        per_device_train_batch_size=8,
        num_train_epochs=1,
        max_length=256,
        bf16=False,
        gradient_checkpointing=False,
    )
    return lora, args


def by_hand(study: optuna.Study) -> None:
    """What a person would do from the CLI or the dashboard, here from a thread."""

    def wait_for(condition) -> None:  # type: ignore[no-untyped-def]
        while True:
            try:
                if condition():
                    return
            except (IndexError, KeyError):
                pass
            time.sleep(0.1)

    def early_runners() -> list[optuna.trial.FrozenTrial]:
        # Trials that reported their first chunk only: the pruner (n_warmup_steps=1) cannot stop them
        # before the pause applies, at the end of their next chunk at the latest.
        trials = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
        return [t for t in trials if sorted(t.intermediate_values) == [0]]

    for _ in range(5):
        wait_for(lambda: len(early_runners()) >= 1)
        leader = min(early_runners(), key=lambda t: t.intermediate_values[0])
        control.stop(study, leader.number)
        print(f"paused trial {leader.number}, the leader after its first chunk")

        def settled(number: int = leader.number) -> bool:
            trial = study.trials[number]
            return trial.user_attrs.get("rapidfire:status") == "paused" or trial.state.is_finished()

        wait_for(settled)
        if study.trials[leader.number].user_attrs.get("rapidfire:status") == "paused":
            break
        print(f"trial {leader.number} ended {study.trials[leader.number].state.name} before the pause applied")
    else:
        return
    child = control.clone(study, leader.number, params={"learning_rate": leader.params["learning_rate"] * 0.5})
    print(f"cloned trial {leader.number} as trial {child} with half its learning rate")
    control.resume(study, leader.number)
    print(f"resumed trial {leader.number}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--storage", default="sqlite:///pbt.db")
    parser.add_argument("--n-trials", type=int, default=12)
    parser.add_argument("--model", default=None, help="path or hub id (default: a tiny local model)")
    parser.add_argument("--train-rows", type=int, default=256)
    options = parser.parse_args()

    executor = RapidFireExecutor(
        model=options.model or str(build_tiny_model("tiny-model", vocab_size=2048)),
        train_dataset=load_gsm8k("train", num_rows=options.train_rows),
        eval_dataset=load_gsm8k("test", num_rows=32),
        num_chunks=8,
        max_concurrent_trials=4,
        pause_grace_seconds=30,
    )
    study = optuna.create_study(
        storage=options.storage,
        study_name="pbt",
        load_if_exists=True,
        sampler=CloneSampler(seed=0),
        pruner=optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=1),
    )
    helper = threading.Thread(target=by_hand, args=(study,), daemon=True)
    helper.start()
    with executor:
        executor.optimize(study, configure, n_trials=options.n_trials)
        helper.join(timeout=60)
        # A clone is an enqueued trial: one the budget above had no room for runs now.
        waiting = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,))
        if waiting:
            executor.optimize(study, configure, n_trials=len(waiting))
    for trial in study.trials:
        parent = trial.user_attrs.get("rapidfire:parent")
        origin = f" clone of {parent} at step {trial.user_attrs['rapidfire:branch_step']}" if parent is not None else ""
        print(f"trial {trial.number}: {trial.state.name} {trial.value}{origin}")
    print("best params:", study.best_params)


if __name__ == "__main__":
    main()
