"""optuna-dashboard in a real headless Chromium: the control form (no action pre-selected; clones of finished
trials asked for on a running trial's form) and the "Fail Trial" button."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import optuna
import pytest
from _servers import dashboard_server
from helpers import Background, by_number, lora, sft_args, wait_until
from optuna.trial import TrialState
from playwright.sync_api import Page, expect, sync_playwright

from optuna_rapidfire._study import _attrs

CONFIGS = [(lora(r=4), sft_args(learning_rate=1e-2 * (i + 1))) for i in range(3)]
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture
def browser_page() -> Iterator[Page]:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "Debian's chromium is needed (scripts/system-deps.sh installs it)"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_FLAGS)
        try:
            yield browser.new_page(viewport={"width": 1400, "height": 1000})
        finally:
            browser.close()


def _open_trial(page: Page, dashboard: str, study: optuna.Study, number: int) -> None:
    page.goto(f"{dashboard}/dashboard/studies/{study._study_id}/trials")
    page.get_by_text(f"Trial {number}", exact=True).click()
    page.get_by_text(f"Trial {number} (trial_id=").wait_for()


_RELEASED = 10**9  # a limit no trial reaches


def _held_at(study: optuna.Study, number: int, chunks: list[int]) -> Callable[[], bool]:
    """For ``slow_chunks(hold=...)``: no chunk starts while trial ``number`` has trained ``chunks[0]`` chunks or
    more (the test moves the limit on once the browser has done its part)."""

    def held() -> bool:
        trials = study.get_trials(deepcopy=False)
        return len(trials) > number and trials[number].user_attrs.get(_attrs.CHUNKS_DONE, 0) >= chunks[0]

    return held


def _form_action(study: optuna.Study, number: int) -> object:
    return study.trials[number].user_attrs.get(_attrs.ACTION)


def _submit(page: Page, action: str, text: str = "") -> None:
    if text:
        page.get_by_role("textbox").fill(text)
        page.wait_for_timeout(800)  # the dashboard takes the text 500 ms after the last keystroke
    page.get_by_label(action).check()
    page.get_by_role("button", name="Submit").click()


def test_stop_from_the_dashboard_form_pauses_while_the_others_continue(
    make_executor, slow_chunks, browser_page: Page, tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'rf.db'}"
    executor = make_executor(num_chunks=10, max_concurrent_trials=3)
    study = optuna.create_study(storage=url, study_name="ui", pruner=optuna.pruners.NopPruner())
    limit = [2]  # nothing trains once trial 1 has 2 chunks, until the browser's stop has reached the storage
    slow_chunks(0.1, hold=_held_at(study, 1, limit))
    with dashboard_server(url) as dashboard:
        run = Background(lambda: executor.optimize(study, by_number(CONFIGS), n_trials=3))
        wait_until(lambda: 0 in study.trials[1].intermediate_values, what="trial 1's first report")
        _open_trial(browser_page, dashboard, study, 1)
        _submit(browser_page, "stop (pause)")
        wait_until(lambda: _form_action(study, 1) not in (None, 0), what="the stop to reach the storage")
        limit[0] = _RELEASED

        wait_until(lambda: study.trials[1].user_attrs.get(_attrs.STATUS) == "paused", what="trial 1 to pause")
        paused_at = study.trials[1].user_attrs[_attrs.CHUNKS_DONE]
        # Under the default schedule ("promote") a leader may already have completed, and a trial that has
        # not started has no chunk count yet: each other trial trains on, or has ended.
        others = {n: study.trials[n].user_attrs.get(_attrs.CHUNKS_DONE, 0) for n in (0, 2)}

        def carried_on(n: int) -> bool:
            trial = study.trials[n]
            return trial.state.is_finished() or trial.user_attrs.get(_attrs.CHUNKS_DONE, 0) > others[n] + 1

        wait_until(lambda: all(carried_on(n) for n in (0, 2)), what="the other trials to continue")
        assert study.trials[1].user_attrs[_attrs.CHUNKS_DONE] == paused_at
        # After its chunk, or at once if it was waiting for the device when the stop came.
        done = study.trials[1].user_attrs[_attrs.ACTION_DONE]
        assert done.startswith(("stop: paused after chunk", "stop: paused while waiting after chunk")), done

        _open_trial(browser_page, dashboard, study, 1)
        _submit(browser_page, "resume")
        run.join()
    trial = study.trials[1]
    assert trial.state == TrialState.COMPLETE and list(trial.intermediate_values) == list(range(10))
    assert all(t.state == TrialState.COMPLETE for t in study.trials)


def test_fail_trial_button_ends_the_trial_cleanly_and_the_study_goes_on(
    make_executor, slow_chunks, browser_page: Page, tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'rf.db'}"
    executor = make_executor(num_chunks=10, max_concurrent_trials=3)
    study = optuna.create_study(storage=url, study_name="ui", pruner=optuna.pruners.NopPruner())
    limit = [2]  # nothing trains once trial 2 has 2 chunks, until the browser has failed it
    slow_chunks(0.1, hold=_held_at(study, 2, limit))
    with dashboard_server(url) as dashboard:
        run = Background(lambda: executor.optimize(study, by_number(CONFIGS), n_trials=3))
        wait_until(lambda: 0 in study.trials[2].intermediate_values, what="trial 2's first report")
        _open_trial(browser_page, dashboard, study, 2)
        browser_page.get_by_role("button", name="Fail Trial").click()
        wait_until(lambda: study.trials[2].state == TrialState.FAIL, what="the browser to fail trial 2")
        limit[0] = _RELEASED
        run.join()
    assert study.trials[2].state == TrialState.FAIL
    assert [study.trials[n].state for n in (0, 1)] == [TrialState.COMPLETE] * 2
    assert executor.stats().live_trials == 0


def _by_learning_rate(trial: optuna.Trial):
    return lora(r=4), sft_args(learning_rate=trial.suggest_float("learning_rate", 1e-4, 1e-1, log=True))


def test_a_bare_submit_does_nothing_and_a_running_trials_form_clones_a_finished_trial(
    make_executor, slow_chunks, browser_page: Page, tmp_path: Path
) -> None:
    page = browser_page
    url = f"sqlite:///{tmp_path / 'rf.db'}"
    # Lock-step: under "promote" trial 1 would wait at its first rung and a new config would start beside it.
    executor = make_executor(num_chunks=10, max_concurrent_trials=1, schedule="lockstep")
    study = optuna.create_study(storage=url, study_name="ui", pruner=optuna.pruners.NopPruner())
    study.enqueue_trial({"learning_rate": 1e-2})
    study.enqueue_trial({"learning_rate": 2e-2})
    executor.optimize(study, _by_learning_rate, n_trials=1)
    limit = [3]  # trial 1 waits after 3 chunks until the browser has done each part
    slow_chunks(0.2, hold=_held_at(study, 1, limit))
    with dashboard_server(url) as dashboard:
        # The dashboard itself greys out the form of a finished trial: no Submit there.
        _open_trial(page, dashboard, study, 0)
        page.get_by_text("Set User Attributes Form").wait_for()
        expect(page.get_by_role("button", name="Submit")).to_have_count(0)

        # One trial (trial 1); the clone asked for while it runs trains in the same call, beyond that budget.
        run = Background(lambda: executor.optimize(study, _by_learning_rate, n_trials=1))
        wait_until(lambda: 0 in study.trials[1].intermediate_values, what="trial 1's first report")
        _open_trial(page, dashboard, study, 1)
        expect(page.get_by_label("no action")).to_be_checked()
        expect(page.get_by_label("stop (pause)")).not_to_be_checked()
        page.get_by_role("button", name="Submit").click()
        wait_until(lambda: study.trials[1].user_attrs.get(_attrs.ACTION) == 0, what="the bare submit")
        submitted_at = study.trials[1].user_attrs[_attrs.CHUNKS_DONE]
        limit[0] = submitted_at + 2
        wait_until(lambda: study.trials[1].user_attrs[_attrs.CHUNKS_DONE] > submitted_at + 1, what="two more chunks")
        assert study.trials[1].user_attrs[_attrs.STATUS] == "running"
        assert _attrs.ACTION_DONE not in study.trials[1].user_attrs and len(study.trials) == 2

        _open_trial(page, dashboard, study, 1)
        _submit(page, "clone", "trial=0, learning_rate=5e-3, cold")
        wait_until(lambda: _form_action(study, 1) not in (None, 0), what="the clone to reach the storage")
        limit[0] = _RELEASED
        done = wait_until(lambda: study.trials[1].user_attrs.get(_attrs.ACTION_DONE), what="the clone")
        assert done.startswith("clone: enqueued as trial 2"), done
        assert study.trials[1].user_attrs[_attrs.CHUNKS_DONE] < 10  # applied while trial 1 ran
        run.join()
    parent, second, child = study.trials
    # Cold: trial 0 trained all its chunks, so a warm clone would have nothing to train.
    assert child.user_attrs[_attrs.CLONE_OF]["parent"] == 0 and not child.user_attrs[_attrs.CLONE_OF]["warm"]
    assert child.params == {"learning_rate": 5e-3}
    assert child.state == TrialState.COMPLETE and child.user_attrs[_attrs.PARENT] == 0
    assert parent.state == second.state == TrialState.COMPLETE


def test_a_clone_submitted_while_the_dashboard_still_holds_back_the_typed_text_clones_nothing_and_says_so(
    make_executor, slow_chunks, browser_page: Page, tmp_path: Path
) -> None:
    """optuna-dashboard takes a text field's value ~0.5 s after the last keystroke, so a fast Submit sends it
    empty: the clone is refused with that reason (not made unchanged); with the text taken, it is made."""
    page = browser_page
    url = f"sqlite:///{tmp_path / 'rf.db'}"
    executor = make_executor(num_chunks=10, max_concurrent_trials=1)
    study = optuna.create_study(storage=url, study_name="ui", pruner=optuna.pruners.NopPruner())
    study.enqueue_trial({"learning_rate": 1e-2})
    limit = [1]
    slow_chunks(0.1, hold=_held_at(study, 0, limit))
    with dashboard_server(url) as dashboard:
        run = Background(lambda: executor.optimize(study, _by_learning_rate, n_trials=1))
        wait_until(lambda: 0 in study.trials[0].intermediate_values, what="trial 0's first report")
        _open_trial(page, dashboard, study, 0)
        page.get_by_role("textbox").press_sequentially("learning_rate=5e-3", delay=10)
        page.get_by_label("clone").check()
        page.get_by_role("button", name="Submit").click()  # at once: the dashboard still holds the text back
        wait_until(lambda: _form_action(study, 0) not in (None, 0), what="the fast submit")
        assert study.trials[0].user_attrs[_attrs.ACTION_ARGS] == ""
        limit[0] = 2  # the chunk in flight ends; the command applies at its boundary
        done = wait_until(lambda: study.trials[0].user_attrs.get(_attrs.ACTION_DONE), what="the refusal")
        assert "clone with an empty args field: nothing cloned" in done, done
        assert len(study.trials) == 1

        _open_trial(page, dashboard, study, 0)
        _submit(page, "clone", "learning_rate=5e-3")  # waits for the dashboard to take the text
        wait_until(lambda: study.trials[0].user_attrs.get(_attrs.ACTION_ARGS), what="the text")
        limit[0] = _RELEASED
        done = wait_until(
            lambda: (d := study.trials[0].user_attrs.get(_attrs.ACTION_DONE)) and d.startswith("clone") and d,
            what="the clone",
        )
        assert done.startswith("clone: enqueued as trial 1"), done
        run.join()
    clone = study.trials[1]
    assert clone.params == {"learning_rate": 5e-3} and clone.user_attrs[_attrs.CLONE_OF]["parent"] == 0
    assert clone.state == TrialState.COMPLETE and clone.user_attrs[_attrs.CLONE] == "warm"
