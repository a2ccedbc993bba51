"""The body of ``executor.optimize`` and of its objective, as free functions over their parts.

A :class:`~optuna_rapidfire._study._run.Run` is what the trial drivers of one ``optimize`` call (or of the
objective handed to ``study.optimize``) share. :func:`optimize` runs trials of a study on one device;
:func:`make_objective` makes the objective a plain ``study.optimize`` calls. The executor's front only
builds the parts and calls these.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from optuna_rapidfire._logging import get_logger
from optuna_rapidfire._runtime._schedule import Status
from optuna_rapidfire._study import _commands
from optuna_rapidfire._study._pool import TrialPool
from optuna_rapidfire._study._progress import Progress
from optuna_rapidfire._study._run import Run
from optuna_rapidfire._study._trial_driver import EndPaused, Interrupted, StorageWasLost, TrialDriver, run_length_of

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    import optuna
    from optuna.trial import TrialState

    from optuna_rapidfire._runtime._device import DeviceRuntime
    from optuna_rapidfire._runtime._entry import Entry
    from optuna_rapidfire._study._services import StudyServices
    from optuna_rapidfire._study._trial_driver import Configure


_logger = get_logger(__name__)


def end_paused(device: DeviceRuntime) -> None:
    """Tell every paused trial of the device that the study is over (they end as PRUNED)."""
    for entry in device.paused.entries():
        entry.events.put(EndPaused())


class Terminated(KeyboardInterrupt):
    """SIGTERM (a pipeline's cancel), raised by the CLI's handler: the study ends as on Ctrl-C, and says SIGTERM."""


def interrupt(device: DeviceRuntime, error: BaseException | None = None) -> None:
    """Ctrl-C (or SIGTERM, a :class:`Terminated` ``error``): the device starts nothing new, live trials end after
    their chunk in flight (as PRUNED, their state kept for clones, what they reported kept), paused ones end as
    at a study's end."""
    cause = "SIGTERM" if isinstance(error, Terminated) else "Ctrl-C"

    def tell(entry: Entry) -> None:
        entry.events.put(Interrupted(cause))

    entries = device.scheduler.drain(on_late=tell)  # and one registered from now on is told as it comes
    live = [entry for entry in entries if entry.status is not Status.PAUSED]
    _logger.warning(
        "Interrupted (%s): no new trial or chunk starts; %d live trial(s) end after their chunk in flight, their "
        "state kept for clones. %s again to quit at once.",
        cause,
        len(live),
        "Press Ctrl-C" if cause == "Ctrl-C" else "Send SIGTERM (or press Ctrl-C)",
    )
    for entry in entries:  # a paused one ends as at a study's end; one being paused, once it is
        tell(entry)
    end_paused(device)


def look_for_lost_trials(device: DeviceRuntime) -> None:
    """After a storage outage longer than the heartbeat grace period: each live trial looks (in its own
    thread) whether another worker failed it meanwhile, and if so stops here at once (or after its chunk in
    flight), rather than train for a trial its retry now continues."""
    for entry in device.scheduler.entries():
        entry.events.put(StorageWasLost())


def make_objective(run: Run, configure: Configure) -> Callable[[optuna.Trial], float]:
    """The objective of one trial: its driver follows it on ``run``'s device."""

    def objective(trial: optuna.Trial) -> float:
        return TrialDriver(run, trial, configure).run()

    return objective


def optimize(
    device: DeviceRuntime,
    services: StudyServices,
    study: optuna.Study,
    configure: Configure,
    *,
    n_trials: int | None,
    timeout: float | None,
    callbacks: Sequence[Callable[[optuna.Study, optuna.trial.FrozenTrial], None]],
    catch: tuple[type[Exception], ...],
    gc_after_trial: bool,
    target: tuple[int, tuple[TrialState, ...]] | None,
    take_ticket: Callable[[], bool] | None = None,
) -> None:
    """Run trials of ``configure`` on ``study`` on one device, ``max_concurrent_trials`` at a time.

    ``target`` (from a ``MaxTrialsCallback``): run until the study holds ``n`` trials in these states, all
    workers together. ``take_ticket``: with several worker processes, takes one of the trials they have left
    to start (``False``: none is left).
    """
    config = services.config
    device.start()
    budget = n_trials if n_trials is not None else (None if target is None else target[0])
    first_wave = config.max_concurrent_trials if budget is None else min(budget, config.max_concurrent_trials)
    device.scheduler.expect(first_wave)
    run = Run(device, services, Progress(config.show_progress_bar, total_trials=n_trials))
    # How long a run of given params is here: a warm clone with nothing left to train is refused when asked for.
    _commands.learn_run_length(study.study_name, run_length_of(configure, config.num_chunks))
    run.pool = TrialPool(
        study,
        make_objective(run, configure),
        device.slots,
        n_trials=n_trials,
        timeout=timeout,
        callbacks=callbacks,
        catch=catch,
        gc_after_trial=gc_after_trial,
        paused=lambda: len(device.paused),
        end_paused=lambda: end_paused(device),
        pause_grace=config.pause_grace_seconds,
        externally_finished=lambda number: number in run.externally_finished,
        take_ticket=take_ticket,
        target=target,
        retry_seconds=config.storage_retry_seconds,
        after_long_outage=lambda seconds: look_for_lost_trials(device),
    )
    try:
        run.pool.run(on_interrupt=lambda error: interrupt(device, error))
    finally:
        device.slots.set_starting(None)  # a plain study.optimize may use the device next: nobody tells then
        device.scheduler.drain(False)
        device.flush()
        if services.tracker is not None:
            services.tracker.flush()
        run.progress.close()
        device.scheduler.expect(config.max_concurrent_trials)
    error = device.fatal or run.error
    if error is not None:
        raise error
