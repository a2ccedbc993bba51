"""Module loggers under ``optuna_rapidfire``, with a default stderr handler as Optuna has for ``optuna``."""

from __future__ import annotations

import logging
import re
import threading
import warnings

_lock = threading.Lock()
_ROOT = "optuna_rapidfire"


def get_logger(name: str) -> logging.Logger:
    """Return the logger ``name`` (a module's ``__name__``), configuring the package root once.

    The root ``optuna_rapidfire`` logger writes INFO and above to stderr in Optuna's format; change its
    level or handlers with the standard :mod:`logging` API.
    """
    with _lock:
        root = logging.getLogger(_ROOT)
        if not root.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("[%(levelname)1.1s %(asctime)s] %(message)s"))
            root.addHandler(handler)
            root.setLevel(logging.INFO)
            root.propagate = False
    return logging.getLogger(name)


# Deprecation warnings that other libraries' own defaults raise in every study, which a user cannot act on:
# TRL's SFTConfig defaults to the old name ``gradient_checkpointing=True``, and PEFT reads the model's
# ``is_gradient_checkpointing`` when the first adapter is added (transformers 5 renamed both to
# ``activation_checkpointing``).
_LIBRARY_NOISE = (
    r"`gradient_checkpointing` is deprecated and will be removed in v6",
    r"`is_gradient_checkpointing` is deprecated and will be removed in v6",
)


def quiet_library_noise() -> None:
    """Ignore the warnings of :data:`_LIBRARY_NOISE` (every other warning still shows)."""
    for message in _LIBRARY_NOISE:
        warnings.filterwarnings("ignore", message=message, category=FutureWarning)


class _Explained(logging.Filter):
    """Drops Optuna's two "Trial N failed ..." lines for a trial that returned NaN after this package said
    why it ended (a failure on the device, a delete): Optuna would add "The value nan is not acceptable"."""

    _LINE = re.compile(r"Trial (\d+) failed with ")

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._numbers: dict[int, int] = {}  # trial number -> Optuna lines still to drop

    def add(self, number: int) -> None:
        with self._lock:
            self._numbers[number] = 2

    def filter(self, record: logging.LogRecord) -> bool:
        found = self._LINE.match(str(record.msg))
        if found is None:
            return True
        number = int(found.group(1))
        with self._lock:
            left = self._numbers.get(number)
            if left is None:
                return True
            if left <= 1:
                del self._numbers[number]
            else:
                self._numbers[number] = left - 1
        return False


_explained = _Explained()
logging.getLogger("optuna.study._optimize").addFilter(_explained)


def explained(number: int) -> None:
    """Trial ``number`` is about to return NaN, its end already explained: leave out Optuna's own lines."""
    _explained.add(number)
