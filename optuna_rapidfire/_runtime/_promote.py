"""The promote schedule: ASHA's promotion rule over the chunk boundaries of the live trials."""

from __future__ import annotations

from typing import TYPE_CHECKING

from optuna_rapidfire._runtime._schedule import BaseSchedule, Reports, Status

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from optuna_rapidfire._runtime._schedule import TrialView


class PromoteSchedule(BaseSchedule):
    """ASHA's promotion rule (Li et al., "A System for Massively Parallel Hyperparameter Tuning", MLSys 2020;
    Syne Tune's promotion variant): trials wait at rungs and only the best go on.

    A *rung* is a chunk boundary: after chunks 1, eta, eta², ... (``rungs="geometric"``, the default) or after
    every chunk (``rungs="every"``). A trial that has just reported at a rung waits there, and is promoted
    (trains its next chunk) only when it ranks in the top ``floor(n / eta)`` of the ``n`` trials that have
    reported at that rung on this device (running, paused, pruned or complete ones alike), and at least
    ``eta`` have. Whom the device trains, in this order:

    1. promotable trials, the highest rung first, the best value first;
    2. trials that have not reported yet (new trials and fresh clones), oldest first;
    3. trials between rungs, the most chunks first;
    4. when none of these is there and no live trial is being decided on or built: ask for the sampler's next
       config (when every slot holds a waiting trial, the device lends one more slot beside them, up to four
       times ``max_concurrent_trials``; waiting trials' states leave the device as the memory budget needs)
       and wait ``new_trial_seconds`` for it; if none comes (the study's budget is spent), promote the best
       waiting trial (the highest rung, the best value there).

    On an engine that fuses, everything of 1-3 trains together as a gang, each member its own next chunk.
    The study's pruner still makes every stop, judging a trial at step s against every trial that has
    reported step s; the schedule only decides who trains next. Ties go to the older trial.

    Worked example (eta = 2, rungs after every chunk, a minimizing study): trials 0-3 report 0.9, 0.5, 0.7,
    0.6 after chunk 1. Of the 4 at rung 1 the top 2 (1 and 3) are promoted and train chunk 2; 0 and 2 wait.
    1 and 3 report 0.4 and 0.55 after chunk 2: of the 2 at rung 2 the top 1 (trial 1) goes on; 3 waits. A
    new trial 4 arrives and trains before anyone waiting; it reports 0.45 after chunk 1: now 5 at rung 1,
    the top 2 are 1 and 4 (1 is past it), so 4 goes on.

    Args:
        eta: The reduction factor: the top 1/eta of a rung goes on (at least 2).
        rungs: ``"geometric"`` (after chunks 1, eta, eta², ...) or ``"every"`` chunk.
        gang_wait_seconds: On an engine that fuses, how long a gang waits for members whose decision
            about their last chunk is in flight (reporting and pruning take milliseconds; a member that
            misses a pass trains alone, and the rest of the gang after it). Never waits for a trial
            that is paused or being built.
        new_trial_seconds: How long a device with a free slot waits for a new trial before it promotes
            the best waiting one instead (4 above).
    """

    name = "promote"

    def __init__(
        self,
        eta: int = 3,
        rungs: str = "geometric",
        gang_wait_seconds: float = 2.0,
        new_trial_seconds: float = 1.0,
    ) -> None:
        if not (isinstance(eta, int) and not isinstance(eta, bool) and eta >= 2):
            raise ValueError(f"eta must be an integer of at least 2, but got {eta=}.")
        if rungs not in ("geometric", "every"):
            raise ValueError(f"rungs must be 'geometric' or 'every', but got {rungs=}.")
        for name, value in (("gang_wait_seconds", gang_wait_seconds), ("new_trial_seconds", new_trial_seconds)):
            if not (isinstance(value, (int, float)) and value >= 0):
                raise ValueError(f"{name} must be a number of at least 0, but got {name}={value!r}.")
        self.eta = eta
        self.rungs = rungs
        self.gang_wait_seconds = float(gang_wait_seconds)
        self.new_trial_seconds = float(new_trial_seconds)

    def is_rung(self, chunks: int) -> bool:
        """Whether a trial that has trained ``chunks`` chunks stands at a rung."""
        if chunks < 1:
            return False
        if self.rungs == "every":
            return True
        while chunks % self.eta == 0:
            chunks //= self.eta
        return chunks == 1

    def promotable(self, entry: TrialView, reports: Reports) -> bool:
        """Whether ``entry``, waiting at its rung, ranks in the top ``1/eta`` of the trials that reported there."""
        values = reports.values.get(entry.chunks_done - 1, {})
        if entry.number not in values or len(values) < self.eta:
            return False
        top = len(values) // self.eta
        return entry.number in [number for number, _ in _ranked(values, reports.maximize)[:top]]

    def choose(
        self, live: Sequence[TrialView], *, fuse: bool, now: float, reports: Reports | None = None
    ) -> list[TrialView] | float | None:
        reports = reports or Reports(values={})
        ready = [e for e in live if e.status is Status.READY]
        promoted, fresh, between, waiting = [], [], [], []
        for e in ready:
            values = reports.values.get(e.chunks_done - 1, {})
            if e.chunks_done == 0 or e.number not in values:
                fresh.append(e)
            elif not self.is_rung(e.chunks_done):
                between.append(e)
            elif self.promotable(e, reports):
                promoted.append(e)
            else:
                waiting.append(e)
        promoted.sort(key=lambda e: (-e.chunks_done, _rank(e, reports)))
        fresh.sort(key=lambda e: e.number)
        between.sort(key=lambda e: (-e.chunks_done, e.number))
        chosen = promoted + fresh + between
        if not chosen:
            if not waiting or any(e.status in (Status.AWAITING, Status.BUILDING) for e in live):
                return None  # a report or a build to come changes what may be promoted
            if now - reports.last_change < self.new_trial_seconds and len(live) < reports.capacity:
                return self.new_trial_seconds - (now - reports.last_change)  # the sampler's next config
            if len(live) >= reports.capacity and reports.ask_for_trial is not None and reports.ask_for_trial():
                return self.new_trial_seconds  # a slot beside the waiting trials, for the sampler's next config
            return [min(waiting, key=lambda e: (-e.chunks_done, _rank(e, reports)))]
        if not fuse:
            return chosen[:1]
        deciding = [now - e.awaiting_since for e in live if e.status is Status.AWAITING]
        if deciding:
            # Each member gets gang_wait_seconds from its own chunk's delivery; still bounded, since no
            # trial becomes AWAITING while the device waits.
            waited = min(deciding)
            if waited < self.gang_wait_seconds:
                return self.gang_wait_seconds - waited
        return chosen

    def __repr__(self) -> str:
        return (
            f"PromoteSchedule(eta={self.eta}, rungs={self.rungs!r}, gang_wait_seconds={self.gang_wait_seconds}, "
            f"new_trial_seconds={self.new_trial_seconds})"
        )


def _ranked(values: Mapping[int, float], maximize: bool) -> list[tuple[int, float]]:
    """Trials by value, best first (a NaN last), ties to the older trial."""

    def badness(item: tuple[int, float]) -> tuple[float, int]:
        value = item[1]
        if value != value:  # NaN
            return (float("inf"), item[0])
        return (-value if maximize else value, item[0])

    return sorted(values.items(), key=badness)


def _rank(entry: TrialView, reports: Reports) -> int:
    """``entry``'s place at the rung it stands on (0: best)."""
    values = reports.values.get(entry.chunks_done - 1, {})
    order = [number for number, _ in _ranked(values, reports.maximize)]
    return order.index(entry.number) if entry.number in order else len(order)
