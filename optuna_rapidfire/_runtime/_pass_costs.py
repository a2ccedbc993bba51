"""What one more member costs a fused pass on this device, measured from the passes a stream trained.

Where a fused pass is bound by its kernel launches, a second member adds rows to kernels that run anyway and
costs a few percent of the pass; where it is bound by its arithmetic, each member adds its own share (on an
H200 the 82M search's float32 gang measured about 40 % of a lone pass per member: 36-45 ms alone, 60-150 ms for
6-8 members). :class:`PassCosts` tells the cases apart from the passes already trained (their seconds by member
count: device seconds on CUDA, where the stream times passes with events; host seconds elsewhere), so that a
schedule fills a gang's free slots only as far as that keeps the trials that must train fast.
"""

from __future__ import annotations

import statistics
import threading
from collections import deque

from optuna_rapidfire._logging import get_logger

_logger = get_logger(__name__)

_KEEP = 64  # the latest passes kept per member count: the pass's cost moves as its layout and widths settle
_ENOUGH = 8  # passes of a member count before its median is trusted (the first passes include compilation)


class PassCosts:
    """The seconds of the latest passes, by how many members each trained. Thread-safe."""

    def __init__(self) -> None:
        self._seconds: dict[int, deque[float]] = {}
        self._lock = threading.Lock()
        self._said = False

    def add(self, members: int, seconds: float) -> None:
        """One pass of ``members`` members took ``seconds``."""
        if members < 1 or not seconds > 0:
            return
        with self._lock:
            self._seconds.setdefault(members, deque(maxlen=_KEEP)).append(seconds)

    def member_cost(self) -> float | None:
        """How much longer a pass gets per extra member, as a share of a pass of the fewer members: from the
        median seconds of the two smallest member counts with enough passes, ``(t(m2) - t(m1)) / (m2 - m1) /
        t(m1)`` (small gangs are where free slots are, and a pass's cost is not linear in its members: a
        launch-bound floor below, arithmetic above); ``None`` until two member counts have enough passes."""
        with self._lock:
            medians = {m: statistics.median(s) for m, s in self._seconds.items() if len(s) >= _ENOUGH}
        if len(medians) < 2:
            return None
        low, high = sorted(medians)[:2]
        cost = max(0.0, (medians[high] - medians[low]) / (high - low) / medians[low])
        if not self._said:  # the first estimate (later ones follow the gang's smallest sizes)
            self._said = True
            _logger.info(
                "A fused pass here takes %.1f%% longer per member: %.1f ms with %d members, %.1f ms with %d.",
                100 * cost,
                1000 * medians[low],
                low,
                1000 * medians[high],
                high,
            )
        return cost
