"""Module loggers under ``optuna_rapidfire``, with a default stderr handler as Optuna has for ``optuna``."""

from __future__ import annotations

import logging
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
