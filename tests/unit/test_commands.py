"""Control commands read from optuna-dashboard's form, and the form's registration: no model, no browser."""

from __future__ import annotations

import optuna
import pytest
from optuna.trial import TrialState
from optuna_dashboard import ChoiceWidget, TextInputWidget, register_user_attr_form_widgets
from optuna_dashboard._form_widget import get_form_widgets_json

from optuna_rapidfire._study import _attrs, _commands


def _form_trial(number: int, action: float, text: str = "") -> optuna.trial.FrozenTrial:
    trial = optuna.trial.create_trial(
        state=TrialState.RUNNING, user_attrs={_attrs.ACTION: action, _attrs.ACTION_ARGS: text}
    )
    trial.number = number
    return trial


def test_the_form_preselects_no_action_and_a_bare_submit_is_no_command() -> None:
    study = optuna.create_study()
    assert _commands.register_dashboard_form(study)
    form = get_form_widgets_json(study._storage.get_study_system_attrs(study._study_id))
    assert form is not None
    choice = next(w for w in form["widgets"] if w["type"] == "choice")
    # The dashboard pre-selects the first choice and submits every widget.
    assert (choice["choices"][0], choice["values"][0]) == ("no action", 0.0)
    assert _commands._form_command(_form_trial(3, choice["values"][0])) is None
    stop = choice["values"][choice["choices"].index("stop (pause)")]
    command = _commands._form_command(_form_trial(3, stop))
    assert command is not None and command.op == "stop"


def test_an_older_rapidfire_form_is_replaced_but_a_users_own_form_is_kept() -> None:
    study = optuna.create_study()
    old = [  # what this package registered before "no action" existed
        ChoiceWidget(choices=["stop (pause)", "resume"], values=[1.0, 2.0], user_attr_key=_attrs.ACTION),
        TextInputWidget(user_attr_key=_attrs.ACTION_ARGS, optional=True),
    ]
    register_user_attr_form_widgets(study, old)
    assert _commands.register_dashboard_form(study)
    form = get_form_widgets_json(study._storage.get_study_system_attrs(study._study_id))
    assert form is not None and [w["type"] for w in form["widgets"]] == ["text", "choice"]

    mine = ChoiceWidget(choices=["good", "bad"], values=[1.0, 0.0], user_attr_key="rating")
    register_user_attr_form_widgets(study, [mine])
    assert not _commands.register_dashboard_form(study)
    assert get_form_widgets_json(study._storage.get_study_system_attrs(study._study_id)) == {
        "output_type": "user_attr",
        "widgets": [mine.to_dict()],
    }


def test_a_form_clone_may_name_another_trial_and_other_actions_may_not() -> None:
    clone = _commands._form_command(_form_trial(3, 4.0, "trial=0, learning_rate=1e-4, cold"))
    assert clone is not None
    assert (clone.op, clone.trial, clone.params, clone.warm) == ("clone", 0, {"learning_rate": 1e-4}, False)
    own = _commands._form_command(_form_trial(3, 4.0, "learning_rate=1e-4"))
    assert own is not None and (own.op, own.trial) == ("clone", 3)
    for action, text in ((1.0, "trial=0"), (3.0, "trial=0"), (4.0, "trial=best")):
        command = _commands._form_command(_form_trial(3, action, text))
        assert command is not None and (command.op, command.trial) == ("invalid", 3), (action, text)
    stop_self = _commands._form_command(_form_trial(3, 1.0, "trial=3"))
    assert stop_self is not None and (stop_self.op, stop_self.trial) == ("stop", 3)


def test_a_form_clone_with_an_empty_args_field_clones_nothing_and_says_why() -> None:
    # optuna-dashboard sends the text ~0.5 s after the last keystroke: an empty field may be text not taken yet.
    empty = _commands._form_command(_form_trial(3, 4.0, ""))
    assert empty is not None and empty.op == "invalid" and "empty args field: nothing cloned" in str(empty.reason)
    unchanged = _commands._form_command(_form_trial(3, 4.0, "warm"))
    assert unchanged is not None and (unchanged.op, unchanged.trial, unchanged.params, unchanged.warm) == (
        "clone",
        3,
        {},
        True,
    )
    branch = _commands._form_command(_form_trial(3, 4.0, "from_chunk=2, r=8"))
    assert branch is not None and (branch.from_chunk, branch.params) == (2, {"r": 8})


def test_a_command_to_a_trial_whose_worker_died_reaches_its_retry_and_ls_shows_both(tmp_path, capsys) -> None:
    from optuna_rapidfire import control
    from optuna_rapidfire.cli import main

    url = f"sqlite:///{tmp_path / 'c.db'}"
    study = optuna.create_study(storage=url, study_name="s")
    dead = study.ask({"x": optuna.distributions.FloatDistribution(0, 1)})
    early = control.stop(study, dead.number)  # sent while its worker is dying: it still looks RUNNING
    study.tell(dead, state=TrialState.FAIL)  # what the heartbeat check does
    optuna.storages.RetryFailedTrialCallback()(study, study.trials[dead.number])  # Optuna's retry, WAITING
    retry = study.trials[-1]
    late = control.delete(study, dead.number, reason="not needed")  # sent after it was failed
    assert retry.number != dead.number
    found = {c.key: c for c in _commands.pending(study, study.trials[retry.number])}
    assert set(found) == {early, late} and {c.trial for c in found.values()} == {retry.number}
    assert [c.key for c in _commands.pending(study, study.trials[dead.number])] == [early]  # the late one: retry's
    main(["ls", "--storage", url, "--study-name", "s"])
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith(str(retry.number)))
    assert "[pending: stop, delete]" in row and f"retry of {dead.number}" in row
    finished = study.ask()
    study.tell(finished, 1.0)
    try:
        control.stop(study, finished.number)
    except ValueError as error:
        assert "is COMPLETE: only a running trial can be stopped" in str(error)
    else:
        raise AssertionError("a command to a finished trial without a retry must be refused")


def test_a_changed_warm_clone_of_a_finished_trial_is_refused_only_when_its_run_is_known_to_be_no_longer() -> None:
    """What the executor that ran the study here learned from configure decides; what it cannot tell (another
    process, or a configure that fails on the params) enqueues the clone."""
    from optuna.distributions import FloatDistribution

    study = optuna.create_study(study_name="run-lengths")
    study.add_trial(
        optuna.trial.create_trial(
            params={"lr": 1e-3},
            distributions={"lr": FloatDistribution(1e-5, 1e-1, log=True)},
            value=0.5,
            user_attrs={_attrs.CHUNKS_DONE: 3, _attrs.TOTAL_CHUNKS: 3},
        )
    )
    asked: list[dict] = []

    def run_length(params: dict) -> int | None:
        asked.append(params)
        return {1e-2: 3, 2e-2: 6}.get(params["lr"])

    _commands.learn_run_length("run-lengths", run_length)
    try:
        with pytest.raises(ValueError, match="a run with these params is 3 chunks"):
            _commands.enqueue_clone(study, 0, {"lr": 1e-2}, warm_start=True)
        longer = _commands.enqueue_clone(study, 0, {"lr": 2e-2}, warm_start=True)
        unknown = _commands.enqueue_clone(study, 0, {"lr": 3e-2}, warm_start=True)
    finally:
        _commands._RUN_LENGTHS.pop("run-lengths")
    assert [p["lr"] for p in asked] == [1e-2, 2e-2, 3e-2]
    assert [t.number for t in study.get_trials(states=(TrialState.WAITING,))] == [longer, unknown]
