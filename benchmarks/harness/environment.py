"""The machine and library versions that every result file carries."""

from __future__ import annotations

import os
import platform
from typing import Any

import optuna
import torch


def machine() -> dict[str, Any]:
    import peft
    import transformers
    import trl

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": trl.__version__,
        "peft": peft.__version__,
        "optuna": optuna.__version__,
        "cpu_count": os.cpu_count(),
    }
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        info["cuda"] = torch.version.cuda
    return info
