"""Storage helpers: URLs without passwords, and retries while the study's storage is unreachable.

A worker of a long study must ride out a database restart or a network blip: every call the executor's
trial threads make to the storage (Optuna's own ask, report and tell included) goes through
:func:`retrying`, which retries connection errors with exponential backoff for ``retry_seconds`` and
then raises :class:`StorageUnavailableError`. Only connection-level errors are retried; a refused write
(an integrity error, a finished trial) is raised at once.
"""

from __future__ import annotations

import os
import threading
import time
from typing import TYPE_CHECKING, Any, cast

from optuna.exceptions import StorageInternalError, UpdateFinishedTrialError
from optuna.storages import BaseStorage
from optuna.trial import TrialState

from optuna_rapidfire import _compat
from optuna_rapidfire._compat import BaseHeartbeat
from optuna_rapidfire._logging import get_logger
from optuna_rapidfire._study import _attrs

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from optuna.trial import FrozenTrial

_logger = get_logger(__name__)

RDB_BACKENDS: dict[str, int | None] = {"sqlite": None, "postgresql": 5432, "mysql": 3306, "oracle": 1521, "mssql": 1433}
"""The database backends an RDB storage URL may name (SQLAlchemy's, as Optuna's ``RDBStorage`` takes them), each with
its server's default port (``None``: a file)."""
_FIRST_DELAY = 0.5
_MAX_DELAY = 8.0

STALE_REASON = (
    "HeartbeatStale: its worker sent no heartbeat for longer than the storage's grace period (it died, or lost "
    "the storage); Optuna's heartbeat callback retries it as a new trial"
)


class StorageUnavailableError(RuntimeError):
    """The study's storage stayed unreachable for longer than the executor's ``storage_retry_seconds``."""


def hide_password(url: str) -> str:
    """``url`` with its password replaced by ``***`` (for logs, errors and attributes)."""
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # not an SQLAlchemy URL: hide anything between "://user:" and "@"
        scheme, sep, rest = url.partition("://")
        if sep and "@" in rest and ":" in rest.split("@", 1)[0]:
            user = rest.split("@", 1)[0].split(":", 1)[0]
            return f"{scheme}://{user}:***@{rest.split('@', 1)[1]}"
        return url


def file_path(study: Any, *, journal: bool = True) -> str | None:
    """The absolute path of the file ``study`` lives in: an SQLite database (or, with ``journal``, a
    journal file); ``None`` for a server database or memory."""
    storage = _compat.backend_storage(study)
    url = getattr(storage, "url", None)
    if isinstance(url, str) and url.startswith("sqlite:///"):
        path = url[len("sqlite:///") :].split("?")[0]
        return None if path in ("", ":memory:") else os.path.abspath(path)
    journal_file = _compat.journal_file(storage) if journal else None
    return None if journal_file is None else os.path.abspath(journal_file)


def is_transient(error: BaseException) -> bool:
    """Whether ``error`` means the storage could not be reached (worth retrying), not a refused call."""

    def direct(seen: BaseException) -> bool:
        if isinstance(seen, (ConnectionError, TimeoutError)):
            return True
        try:
            from sqlalchemy import exc
        except ImportError:  # no RDB storage in use
            return False
        if isinstance(seen, (exc.OperationalError, exc.InterfaceError, exc.DisconnectionError)):
            return True
        if isinstance(seen, exc.PendingRollbackError):  # a connection lost mid-transaction; Optuna rolls back
            return True
        return isinstance(seen, exc.DBAPIError) and bool(seen.connection_invalidated)

    if direct(error):
        return True
    # Optuna's RDB storage wraps errors raised at commit in StorageInternalError.
    return isinstance(error, StorageInternalError) and error.__cause__ is not None and direct(error.__cause__)


class _Retrying:
    """Forwards every storage call to ``inner``, retrying while the storage is unreachable.

    An outage is one for all the threads that call: the first call that fails says so, the first that
    gets through again says how long it lasted (one pair of lines per outage, not one per thread), and,
    when it lasted longer than the storage's heartbeat grace period, calls :attr:`after_long_outage`.
    """

    def __init__(self, inner: BaseStorage, retry_seconds: float) -> None:
        self._inner = inner
        self._retry_seconds = retry_seconds
        self._outage_lock = threading.Lock()
        self._down_since: float | None = None
        self._quiet_until = 0.0  # no stale check before this: just back, others' heartbeats may be on their way
        self.after_long_outage: Callable[[float], None] | None = None
        """Called (on the thread that got through first) with the outage's length in seconds, once the
        storage is back after an outage long enough for other workers to have failed this one's trials."""

    def __getattr__(self, name: str) -> Any:  # plain attributes (``_backend``, ``url``...)
        return getattr(self._inner, name)

    def _call(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        started: float | None = None
        delay = _FIRST_DELAY
        while True:
            try:
                result = getattr(self._inner, name)(*args, **kwargs)
            except Exception as error:
                if not is_transient(error) or self._retry_seconds <= 0:
                    raise
                now = time.monotonic()
                if started is None:
                    started = now
                self._went_down(now, error)  # (again after another call got through for a moment)
                waited = now - started
                if waited >= self._retry_seconds:
                    raise StorageUnavailableError(
                        f"The study's storage stayed unreachable for {waited:.0f} s ({type(error).__name__} in "
                        f"{name}). What was reported before is in the storage and each trial's latest checkpoint "
                        "is in the artifact store: start the study again once the storage is back (with "
                        "heartbeats, interrupted trials resume from their checkpoints)."
                    ) from error
                time.sleep(min(delay, self._retry_seconds - waited))
                delay = min(delay * 2, _MAX_DELAY)
                continue
            if started is not None:  # only a call that failed and then got through says the storage is back
                self._came_back()
            return result

    def _went_down(self, now: float, error: BaseException) -> None:
        with self._outage_lock:
            if self._down_since is not None:
                return
            self._down_since = now
        _logger.warning(
            "The study's storage is unreachable (%s); retrying for up to %.0f s.",
            type(error).__name__,
            self._retry_seconds,
        )

    def _came_back(self) -> None:
        timing = _compat.heartbeat_timing(self._inner)
        now = time.monotonic()
        with self._outage_lock:
            if self._down_since is None:
                return
            seconds = now - self._down_since
            self._down_since = None
            if timing is not None:
                # Other workers' heartbeat threads may still sleep in their backoff: judge nobody stale yet.
                self._quiet_until = now + timing[0] + _MAX_DELAY
        # A trial's last heartbeat got through up to an interval before the outage began.
        if timing is None or seconds <= timing[1] - timing[0]:
            _logger.warning("The study's storage is reachable again after %.1f s.", seconds)
            return
        _logger.warning(
            "The study's storage is reachable again after %.1f s, with a heartbeat grace period of %.0f s: another "
            "worker may have failed this worker's running trials and retried them from their checkpoints. Each "
            "such trial stops here now; its retry redoes the chunk that was in flight.",
            seconds,
            timing[1],
        )
        if self.after_long_outage is not None:
            try:
                self.after_long_outage(seconds)
            except Exception:  # the storage call that got through must not fail for it
                _logger.warning("Looking for trials failed elsewhere failed.", exc_info=True)

    def quiet(self) -> bool:
        """Whether the storage is down, or just back: no trial is judged stale then."""
        return self._down_since is not None or time.monotonic() < self._quiet_until


def _forwarder(name: str) -> Any:
    def method(self: _Retrying, *args: Any, **kwargs: Any) -> Any:
        return self._call(name, args, kwargs)

    method.__name__ = name
    return method


class RetryingStorage(_Retrying, BaseStorage):
    """A storage whose calls are retried while it is unreachable."""


class RetryingHeartbeatStorage(_Retrying, BaseStorage, BaseHeartbeat):
    """The same for storages with heartbeats (RDB): Optuna still sees the heartbeat interface.

    It also knows which trials beat *here*: a trial whose heartbeat thread, in this process, is sending
    (or retrying, while the storage is down) is alive, however old its last stored heartbeat, and this
    process's own stale check never fails it; only other workers' checks can.
    """

    def __init__(self, inner: BaseStorage, retry_seconds: float) -> None:
        super().__init__(inner, retry_seconds)
        self._beats_lock = threading.Lock()
        self._beating: dict[int, int] = {}  # trial id -> heartbeat calls in flight here
        self._last_beat: dict[int, float] = {}  # trial id -> when its latest heartbeat call here ended

    def record_heartbeat(self, trial_id: int) -> None:
        with self._beats_lock:
            self._beating[trial_id] = self._beating.get(trial_id, 0) + 1
        try:
            self._call("record_heartbeat", (trial_id,), {})
        except StorageUnavailableError:  # Optuna's heartbeat thread would die of it: beat again next time
            _logger.debug("Trial id %d: a heartbeat could not be recorded.", trial_id, exc_info=True)
        finally:
            with self._beats_lock:
                self._beating[trial_id] -= 1
                self._last_beat[trial_id] = time.monotonic()

    # A trial that turns RUNNING through this storage has a heartbeat from then on: Optuna's heartbeat thread
    # starts only after ``ask`` (the sampler's work) returns, and a worker killed in between would leave a
    # RUNNING trial without heartbeats, which no stale check ever fails (a study waiting for it never ends).
    def create_new_trial(self, study_id: int, template_trial: FrozenTrial | None = None) -> int:
        trial_id: int = self._call("create_new_trial", (study_id, template_trial), {})
        running = template_trial is None or template_trial.state == TrialState.RUNNING
        if running and _compat.heartbeats_enabled(self._inner):  # the next statement: only a commit in between
            self.record_heartbeat(trial_id)
        return trial_id

    def set_trial_state_values(self, trial_id: int, state: TrialState, values: Sequence[float] | None = None) -> bool:
        if state == TrialState.RUNNING and _compat.heartbeats_enabled(self._inner):
            # A waiting (enqueued, retried) trial this worker takes beats first: killed in between, the worker
            # leaves a waiting trial (a heartbeat does not make it run), never a running one without heartbeat.
            self.record_heartbeat(trial_id)
        changed: bool = self._call("set_trial_state_values", (trial_id, state, values), {})
        return changed

    def _alive_here(self, trial_id: int, grace: float) -> bool:
        with self._beats_lock:
            if self._beating.get(trial_id, 0) > 0:
                return True
            last = self._last_beat.get(trial_id)
        return last is not None and time.monotonic() - last < grace

    def _get_stale_trial_ids(self, study_id: int) -> list[int]:
        """The stale trials, each marked as failed with why before it is returned: whoever asked (the pool,
        or Optuna's own check when a trial starts) fails them next, and a finished trial's attributes can no
        longer be written. Marking here, not before the caller's own look, leaves no trial that went stale
        in between unmarked. Left out: trials alive here (their heartbeats are only late), and every trial
        while the storage is down or just back (the other workers' heartbeats may still be on their way)."""
        timing = _compat.heartbeat_timing(self._inner)
        if timing is None or self.quiet():
            return []
        stale = [t for t in self._call("_get_stale_trial_ids", (study_id,), {}) if not self._alive_here(t, timing[1])]
        for trial_id in stale:
            try:
                self.set_trial_user_attr(trial_id, _attrs.STATUS, "failed")
                self.set_trial_user_attr(trial_id, _attrs.FAIL_REASON, STALE_REASON)
            except UpdateFinishedTrialError:  # another worker failed it first
                continue
        return stale


for _cls, _bases in ((RetryingStorage, (BaseStorage,)), (RetryingHeartbeatStorage, (BaseStorage, BaseHeartbeat))):
    for _name in {n for base in _bases for n in dir(base) if not n.startswith("__") and n != "_abc_impl"}:
        if _name in vars(_cls):  # its own (heartbeats, stale trials)
            continue
        setattr(_cls, _name, _forwarder(_name))
    _cls.__abstractmethods__ = frozenset()


def on_long_outage(storage: BaseStorage, hook: Callable[[float], None]) -> None:
    """Call ``hook`` with the outage's length once ``storage`` (made by :func:`retrying`) is back after an
    outage longer than its heartbeat grace period."""
    if isinstance(storage, _Retrying):
        storage.after_long_outage = hook


def retrying(storage: BaseStorage, retry_seconds: float) -> BaseStorage:
    """``storage`` with retries (itself when already wrapped)."""
    if isinstance(storage, _Retrying):
        return storage
    # Their abstract methods forward to ``storage`` (set on the classes above), which the type checker cannot see.
    wrapper = RetryingHeartbeatStorage if isinstance(storage, BaseHeartbeat) else RetryingStorage
    return cast("Callable[[BaseStorage, float], BaseStorage]", wrapper)(storage, retry_seconds)
