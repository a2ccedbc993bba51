"""Memory budgets as users write them (bytes, a size such as ``"8GiB"``, or a share such as ``"40%"``)."""

from __future__ import annotations

import re
from dataclasses import dataclass

_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


@dataclass(frozen=True)
class MemoryBudget:
    """How much per-trial state may stay on the device: ``bytes`` exactly, or a ``fraction`` of the device
    memory left after the base model is loaded; neither means no limit."""

    bytes: int | None = None
    fraction: float | None = None

    @classmethod
    def parse(cls, setting: int | str | None, name: str = "state_memory_budget") -> MemoryBudget | None:
        """``None`` (no limit), ``"auto"`` (None here: the caller decides), bytes as an int, or a string:
        ``"40%"`` of the memory it is about, or a size such as ``"8GiB"``/``"512MB"``; ``name`` is the setting's
        name in errors."""
        if setting is None:
            return cls()
        if isinstance(setting, bool) or not isinstance(setting, (int, str)):
            raise TypeError(
                f"{name} must be 'auto', None, a number of bytes (int) or a string such as '40%' or "
                f"'8GiB', but got {setting!r}. A float is ambiguous (bytes or a fraction?): write '50%' or 8_000_000."
            )
        if isinstance(setting, int):
            if setting < 0:
                raise ValueError(f"{name} must not be negative, but got {name}={setting}.")
            return cls(bytes=setting)
        text = setting.strip().lower().replace(" ", "")
        if text == "auto":
            return None
        percent = re.fullmatch(r"(\d+(?:\.\d+)?)%", text)
        if percent is not None and 0 < float(percent.group(1)) <= 100:
            return cls(fraction=float(percent.group(1)) / 100)
        sized = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]i?b|b)", text)
        if sized is not None:
            return cls(bytes=int(float(sized.group(1)) * _UNITS[sized.group(2)]))
        raise ValueError(
            f"{name} must be 'auto', None, bytes, a percentage of the memory it bounds ('40%', "
            f"at most '100%') or a size ('8GiB', '512MB'), but got {setting!r}."
        )

    def resolve(self, free_bytes: int) -> int | None:
        """The budget in bytes on a device with ``free_bytes`` free (``None``: no limit)."""
        if self.fraction is not None:
            return int(free_bytes * self.fraction)
        return self.bytes
