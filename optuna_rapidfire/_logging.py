"""Module loggers under ``optuna_rapidfire``, with a default stderr handler as Optuna has for ``optuna``."""

from __future__ import annotations

import logging
import threading

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
