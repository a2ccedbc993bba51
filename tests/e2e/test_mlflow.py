"""Per-chunk MLflow tracking against a real ``mlflow server``, read back with MlflowClient."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest
from _servers import mlflow_server
from helpers import by_number, lora, sft_args
from mlflow.tracking import MlflowClient

from optuna_rapidfire import control


class PruneTrialOne(optuna.pruners.BasePruner):
    def prune(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> bool:
        return trial.number == 1 and trial.last_step == 1


def test_each_trial_is_a_nested_run_with_per_chunk_metrics(make_executor, tmp_path: Path) -> None:
    with mlflow_server(tmp_path / "mlflow") as url:
        executor = make_executor(num_chunks=3, max_concurrent_trials=3, mlflow_tracking_uri=url)
        study = optuna.create_study(study_name="tracked", pruner=PruneTrialOne())
        configs = [(lora(r=4), sft_args()), (lora(r=8), sft_args(learning_rate=3e-2)), (lora(r=0), sft_args())]
        executor.optimize(study, by_number(configs), n_trials=3)
        # A warm clone of trial 0 (finished) with a longer run: inherits its curve and trains on.
        child = control.clone(study, 0, from_chunk=3)  # from its last chunk: the configure below runs longer
        executor.optimize(study, by_number([*configs, (lora(r=4), sft_args(num_train_epochs=2))]), n_trials=1)

        client = MlflowClient(tracking_uri=url)
        experiment = client.get_experiment_by_name("tracked")
        assert experiment is not None
        runs = client.search_runs([experiment.experiment_id])
        parents = [r for r in runs if r.data.tags.get("rapidfire.role") == "study"]
        trials = {
            int(r.data.tags["optuna.trial_number"]): r for r in runs if r.data.tags.get("rapidfire.role") == "trial"
        }
        assert len(parents) == 1 and sorted(trials) == [0, 1, 2, child]
        assert all(r.data.tags["mlflow.parentRunId"] == parents[0].info.run_id for r in trials.values())

        done, pruned, failed, clone = trials[0], trials[1], trials[2], trials[child]
        assert done.info.status == "FINISHED" and done.data.tags["optuna.state"] == "COMPLETE"
        assert pruned.info.status == "KILLED" and failed.info.status == "FAILED"
        assert done.data.params == {"index": str(study.trials[0].params["index"])}
        history = client.get_metric_history(done.info.run_id, "eval_loss")
        assert [m.step for m in history] == [0, 1, 2]
        assert [m.value for m in history] == [study.trials[0].intermediate_values[s] for s in range(3)]
        for name in ("train_loss", "train_num_tokens", "chunk_seconds"):
            assert [m.step for m in client.get_metric_history(done.info.run_id, name)] == [0, 1, 2]
        assert [m.step for m in client.get_metric_history(pruned.info.run_id, "eval_loss")] == [0, 1]
        artifacts = {a.path for a in client.list_artifacts(done.info.run_id, "adapter")}
        assert {"adapter/adapter_config.json", "adapter/adapter_model.safetensors"} <= artifacts
        assert clone.data.tags["rapidfire.parent_trial"] == "0" and clone.data.tags["rapidfire.clone"] == "warm"
        assert [m.step for m in client.get_metric_history(clone.info.run_id, "eval_loss")] == [0, 1, 2, 3, 4, 5]


def test_an_unreachable_tracking_server_is_a_clear_error_up_front(make_executor) -> None:
    with pytest.raises(ValueError, match="no MLflow server answers there"):
        make_executor(mlflow_tracking_uri="http://127.0.0.1:9")


def test_a_tracking_server_that_goes_away_never_fails_or_holds_up_a_trial(
    make_executor, tmp_path, monkeypatch, listen
) -> None:
    import threading

    from optuna_rapidfire import events

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # each call to the dead server fails at once
    hanging, release = threading.Event(), threading.Event()

    class Hanging:
        """A client of the server whose first call (finding the study's run) hangs until released."""

        def __init__(self, url: str) -> None:
            self.client = MlflowClient(tracking_uri=url)

        def get_experiment_by_name(self, *args, **kwargs):
            hanging.set()
            release.wait()
            return self.client.get_experiment_by_name(*args, **kwargs)

        def __getattr__(self, name: str):
            return getattr(self.client, name)

    with mlflow_server(tmp_path / "mlflow") as url:
        executor = make_executor(num_chunks=2, max_concurrent_trials=2, mlflow_tracking_uri=Hanging(url))
    # The server is gone; every tracking call now fails, and the first one hangs until released: the trials
    # finish all the same, each while it hangs (the last one's end releases it, for optimize waits for the
    # tracking calls before it returns).
    hung_at_end: list[bool] = []

    def ended(event: events.Event) -> None:
        hung_at_end.append(hanging.is_set() and not release.is_set())
        if len(hung_at_end) == 2:
            release.set()

    listen(ended, events.TrialEnded)
    study = optuna.create_study(pruner=optuna.pruners.NopPruner())
    executor.optimize(study, by_number([(lora(), sft_args())] * 2), n_trials=2)
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials)
    assert hung_at_end == [True, True]  # a tracking call was still hanging when each trial ended
    tracker = executor._services.tracker
    executor.close()  # stops the tracker's thread
    tracker._thread.join(60)
    assert not tracker._thread.is_alive()
