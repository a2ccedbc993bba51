"""The promote schedule: ASHA's promotion rule over the chunk boundaries of the live trials."""

from __future__ import annotations

from typing import TYPE_CHECKING

from optuna_rapidfire._runtime._schedule import BaseSchedule, Reports, Status, Stop

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from optuna_rapidfire._runtime._schedule import TrialView


_ON_ITS_WAY_SECONDS = 0.2


class PromoteSchedule(BaseSchedule):
    """ASHA's promotion rule (Li et al., "A System for Massively Parallel Hyperparameter Tuning", MLSys 2020;
    Syne Tune's promotion variant): trials wait at rungs and only the best go on.

    A *rung* is a chunk boundary: after chunks 1, eta, eta², ... (``rungs="geometric"``, the default) or after
    every chunk (``rungs="every"``). A trial that has just reported at a rung waits there, and is promoted
    (trains its next chunk) when at least ``eta`` trials have reported at that rung on this device (running,
    paused, pruned or complete ones alike) and its value is as good as the ``floor(n / eta)``-th best of those
    ``n`` (ties go on, as in Optuna's SuccessiveHalvingPruner). A trial waiting at a rung holds no slot: as many
    new configs start beside it, so the device keeps ``max_concurrent_trials`` trials with work. Whom the
    device trains, in this order, at most ``max_concurrent_trials`` together:

    1. promotable trials, the highest rung first, the best value first;
    2. trials that have not reported yet (new trials and fresh clones), oldest first;
    3. trials between rungs, the most chunks first;
    4. when none of these is there and no live trial is being decided on or built:

       - a new trial is on its way: wait for it;
       - the study's budget is spent (no new trial will come): rungs are final, so the best of a rung holding
         fewer than ``eta`` goes on (at least one of each rung, as Optuna's pruner keeps the first); when no
         waiting trial can go on even so, every waiting trial ends as PRUNED, with its rung, its rank and how
         many reported there (``when_exhausted="stop"``, the default: ASHA never promotes them), or the best
         waiting trial goes on (``when_exhausted="promote"``, the behaviour before: every trial may end
         COMPLETE, at the price of training the losers);
       - nobody can tell (trials come from a plain ``study.optimize``, whose threads the waiting trials hold):
         wait ``new_trial_seconds`` for a new trial, then promote the best waiting trial (the highest rung,
         the best value there).

    On an engine that fuses, everything of 1-3 trains together as a gang, each member its own next chunk. Once
    the budget is spent, a gang with free slots also takes the best waiting trials of the better half of their
    rung (``fill_free_slots``), as many as keep the pass within ``fill_max_cost`` of one member's cost
    measured on this device (on an H200 a member of the 82M search's gang costs about 40 % of a lone pass, so
    a lone trial takes up to two runners-up): a slot ASHA leaves empty trains a runner-up for a fraction of a
    pass, and the search completes more of its best configs (curves cross after a rung). They only ride
    beside trials that train anyway: a filler is a promoted trial from then on, judged at its next rung and by
    the study's pruner as any other.
    The study's pruner still makes every other stop, judging a trial at step s against every trial that has
    reported step s; the schedule decides who trains next. Ties in the order go to the older trial.

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
            misses a pass trains alone, and the rest of the gang after it), and, while it has room, for new
            trials on their way (asked for and being configured). Never waits for a paused trial.
        new_trial_seconds: When nobody can tell whether a new trial comes, how long the device waits for one
            before it promotes the best waiting trial instead.
        when_exhausted: What happens to the waiting trials once no new trial will come and none of them can be
            promoted: ``"stop"`` (end them as PRUNED) or ``"promote"`` (train the best on, one at a time).
        fill_free_slots: Once no new trial will come, let the best waiting trials (the better half of their
            rung, rank below ``n // 2`` of the ``n`` there) take a fusing gang's free slots while other trials
            train.
        fill_max_cost: How much slower than a pass of one member a gang's pass may get from its fillers, as a
            share (``1.0``: up to twice as long), estimated from this device's own passes
            (``Reports.member_cost``); no filler before that is measured. In a simulation over learning curves
            with the search benchmark's shape, this default completed the best config in 91 of 100 seeds where
            ASHA's stop did in 80, and sooner at the median, even where a member costs a whole one-member pass.
    """

    name = "promote"

    def __init__(
        self,
        eta: int = 3,
        rungs: str = "geometric",
        gang_wait_seconds: float = 2.0,
        new_trial_seconds: float = 1.0,
        when_exhausted: str = "stop",
        fill_free_slots: bool = True,
        fill_max_cost: float = 1.0,
    ) -> None:
        if not (isinstance(eta, int) and not isinstance(eta, bool) and eta >= 2):
            raise ValueError(f"eta must be an integer of at least 2, but got {eta=}.")
        if rungs not in ("geometric", "every"):
            raise ValueError(f"rungs must be 'geometric' or 'every', but got {rungs=}.")
        numbers = (
            ("gang_wait_seconds", gang_wait_seconds),
            ("new_trial_seconds", new_trial_seconds),
            ("fill_max_cost", fill_max_cost),
        )
        for name, value in numbers:
            if not (isinstance(value, (int, float)) and value >= 0):
                raise ValueError(f"{name} must be a number of at least 0, but got {name}={value!r}.")
        if when_exhausted not in ("stop", "promote"):
            raise ValueError(f"when_exhausted must be 'stop' or 'promote', but got {when_exhausted=}.")
        if not isinstance(fill_free_slots, bool):
            raise ValueError(f"fill_free_slots must be True or False, but got {fill_free_slots=}.")
        self.eta = eta
        self.rungs = rungs
        self.gang_wait_seconds = float(gang_wait_seconds)
        self.new_trial_seconds = float(new_trial_seconds)
        self.when_exhausted = when_exhausted
        self.fill_free_slots = fill_free_slots
        self.fill_max_cost = float(fill_max_cost)

    def is_rung(self, chunks: int) -> bool:
        """Whether a trial that has trained ``chunks`` chunks stands at a rung."""
        if chunks < 1:
            return False
        if self.rungs == "every":
            return True
        while chunks % self.eta == 0:
            chunks //= self.eta
        return chunks == 1

    def promotable(self, entry: TrialView, reports: Reports, *, final: bool = False) -> bool:
        """Whether ``entry``, waiting at its rung, is as good as the ``floor(n / eta)``-th best of the ``n``
        trials that reported there (ties go on), with at least ``eta`` there; ``final``: no trial will come to
        the rung any more, so a rung of fewer than ``eta`` lets its best go on."""
        values = reports.values.get(entry.chunks_done - 1, {})
        mine = values.get(entry.number)
        if mine is None or mine != mine or (len(values) < self.eta and not final):  # not there, NaN, too few
            return False
        top = max(1, len(values) // self.eta)
        cutoff = _ranked(values, reports.maximize)[top - 1][1]
        return mine >= cutoff if reports.maximize else mine <= cutoff

    def _classify(self, ready: Sequence[TrialView], reports: Reports) -> tuple[list[TrialView], ...]:
        """The ready trials as promotable, fresh, between rungs and waiting at a rung (in the order of choice)."""
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
        waiting.sort(key=lambda e: (-e.chunks_done, _rank(e, reports)))
        return promoted, fresh, between, waiting

    def waiting(self, live: Sequence[TrialView], reports: Reports) -> frozenset[int]:
        ready = [e for e in live if e.status is Status.READY]
        return frozenset(e.number for e in self._classify(ready, reports)[3])

    def choose(
        self, live: Sequence[TrialView], *, fuse: bool, now: float, reports: Reports | None = None
    ) -> list[TrialView] | Stop | float | None:
        reports = reports or Reports(values={})
        promoted, fresh, between, waiting = self._classify([e for e in live if e.status is Status.READY], reports)
        chosen = promoted + fresh + between
        fillers = self._fillers(live, chosen, waiting, reports) if fuse else []
        if fillers:
            chosen = chosen + fillers
        elif not chosen:
            if not waiting or any(e.status in (Status.AWAITING, Status.BUILDING, Status.TRAINING) for e in live):
                return None  # a report or a build to come changes what may be promoted
            if reports.more_trials:
                return _ON_ITS_WAY_SECONDS  # a new config is on its way (looked at again: it may fail to come)
            if reports.more_trials is None:
                if now - reports.last_change < self.new_trial_seconds:
                    return self.new_trial_seconds - (now - reports.last_change)  # the sampler's next config
                return waiting[:1]
            chosen = [e for e in waiting if self.promotable(e, reports, final=True)]
            if not chosen:
                if self.when_exhausted == "promote":
                    return waiting[:1]
                return Stop({e.number: self._stop_reason(e, reports) for e in waiting})
        if not fuse:
            return chosen[:1]
        deciding = [now - e.awaiting_since for e in live if e.status is Status.AWAITING]
        if len(chosen) < reports.capacity and reports.arriving_since is not None:
            deciding.append(now - reports.arriving_since)  # a new config on its way joins this pass
        if deciding and not reports.streaming:
            # Each member gets gang_wait_seconds from its own chunk's delivery (a new trial from when it was
            # started); still bounded, since no trial becomes AWAITING while the device waits.
            waited = min(deciding)
            if waited < self.gang_wait_seconds:
                return self.gang_wait_seconds - waited
        return chosen[: max(reports.capacity, 1)]

    def _fillers(
        self, live: Sequence[TrialView], chosen: Sequence[TrialView], waiting: Sequence[TrialView], reports: Reports
    ) -> list[TrialView]:
        """The waiting trials that take a gang's free slots beside ``chosen`` and the members training (or being
        decided on): only once no new trial will come, only beside others, only from the better half of their
        rung, and only as many as keep the pass within ``fill_max_cost`` of a one-member pass."""
        cost = reports.member_cost
        if not (self.fill_free_slots and waiting and reports.more_trials is False and cost is not None):
            return []
        gang = len(chosen) + sum(e.status in (Status.TRAINING, Status.AWAITING) for e in live)
        if gang == 0:
            return []
        size = reports.capacity if cost <= 0 else min(reports.capacity, 1 + int(self.fill_max_cost / cost))
        return [e for e in waiting if _better_half(e, reports)][: max(0, size - gang)]

    def _stop_reason(self, entry: TrialView, reports: Reports) -> str:
        values = reports.values.get(entry.chunks_done - 1, {})
        top = max(1, len(values) // self.eta)
        return (
            f"Stopped by the promote schedule at its rung after chunk {entry.chunks_done}: rank "
            f"{_rank(entry, reports) + 1} of the {len(values)} trials that reported there, below the top {top} "
            f"that go on (eta={self.eta}), and the study's budget is spent, so no new trial can change that "
            "(schedule='promote_all' trains it on instead)."
        )

    def __repr__(self) -> str:
        return (
            f"PromoteSchedule(eta={self.eta}, rungs={self.rungs!r}, gang_wait_seconds={self.gang_wait_seconds}, "
            f"new_trial_seconds={self.new_trial_seconds}, when_exhausted={self.when_exhausted!r}, "
            f"fill_free_slots={self.fill_free_slots}, fill_max_cost={self.fill_max_cost})"
        )


def _ranked(values: Mapping[int, float], maximize: bool) -> list[tuple[int, float]]:
    """Trials by value, best first (a NaN last), ties to the older trial."""

    def badness(item: tuple[int, float]) -> tuple[float, int]:
        value = item[1]
        if value != value:  # NaN
            return (float("inf"), item[0])
        return (-value if maximize else value, item[0])

    return sorted(values.items(), key=badness)


def _better_half(entry: TrialView, reports: Reports) -> bool:
    """Whether ``entry`` ranks in the better half of the ``n`` trials at its rung (below ``n // 2``, at least the
    best), with a value that is not NaN."""
    values = reports.values.get(entry.chunks_done - 1, {})
    mine = values.get(entry.number)
    return mine is not None and mine == mine and _rank(entry, reports) < max(1, len(values) // 2)


def _rank(entry: TrialView, reports: Reports) -> int:
    """``entry``'s place at the rung it stands on (0: best)."""
    values = reports.values.get(entry.chunks_done - 1, {})
    order = [number for number, _ in _ranked(values, reports.maximize)]
    return order.index(entry.number) if entry.number in order else len(order)
