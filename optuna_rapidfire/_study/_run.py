"""What the trial drivers of one ``optimize`` call (or of the objective handed to ``study.optimize``) share:
the device, the study services, the progress display, the pool that starts trials, and what happened to them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from optuna_rapidfire import events

if TYPE_CHECKING:
    import optuna

    from optuna_rapidfire._runtime._device import DeviceRuntime
    from optuna_rapidfire._runtime._slots import Lease
    from optuna_rapidfire._study._pool import TrialPool
    from optuna_rapidfire._study._progress import Progress
    from optuna_rapidfire._study._services import StudyServices


class Run:
    """What the trial drivers of one ``optimize`` call share (see the module docstring).

    Attributes:
        device: The device the trials train on.
        services: The executor's study services.
        progress: The progress display (disabled off a terminal).
        listeners: This call's own listeners of the study's events (:meth:`tell`): the progress display and the
            MLflow tracker.
        pool: The pool that starts trials (``None`` under a plain ``study.optimize``).
        externally_finished: Numbers of trials finished from outside (optuna-dashboard's "Fail Trial").
        error: A config error no trial can get past; ``optimize`` raises it at the end.
    """

    def __init__(
        self, device: DeviceRuntime, services: StudyServices, progress: Progress, pool: TrialPool | None = None
    ) -> None:
        self.device = device
        self.services = services
        self.progress = progress
        self.listeners: list[events.Listener] = [progress.hear]
        if services.tracker is not None:
            self.listeners.append(services.tracker.hear)
        self.pool = pool
        self.externally_finished: set[int] = set()
        self.error: BaseException | None = None

    def tell(self, event: events.Event) -> None:
        """Deliver a study event (:class:`~optuna_rapidfire.events.TrialStarted` ... ``TrialEnded``) to this call's
        own listeners, then to those of :mod:`optuna_rapidfire.events` that want it."""
        for listener in self.listeners:
            listener(event)
        if events.listening(type(event)):
            events.emit(event)

    def lease(self, trial_number: int, *, resume: bool = False, by_hand: bool = False) -> Lease:
        """A live-trial slot for ``trial_number``: the one the pool took for this thread, else a new one
        (``resume``: a resumed trial, before any new trial; ``by_hand``: a clone a person asked for, which the
        pool does not count toward ``n_trials``)."""
        pool = self.pool
        if pool is not None and not resume:
            lease = pool.take_lease(trial_number, by_hand=by_hand)
            pool.asked()
            if lease is not None:
                return lease
        return self.device.slots.acquire(resume=resume)

    def stop_study(self, study: optuna.Study, error: BaseException | None = None) -> None:
        """Stop the study at once for a mistake no trial can get past (``error`` is raised at the end).

        ``study.stop()`` alone takes effect when the failing trial is told; by then its slot is free and
        the pool could have started another trial that would fail the same way.
        """
        if error is not None and self.error is None:
            self.error = error
        if self.pool is not None:
            self.pool.stop()
        study.stop()
