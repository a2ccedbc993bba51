"""``python -m benchmarks.parts.search.worker --worker SPEC``: one process of a method, started by
:func:`benchmarks.harness.workers.spawn_workers`. Every method's processes start the same way: import, warm up
once (untimed), say they are ready, wait for the go, then run their part of the method on the clock."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.harness.workers import wait_for_go, worker_main, write_result
from benchmarks.parts.search.runs import executor_worker, optuna_worker
from benchmarks.parts.search.settings import Settings
from benchmarks.parts.search.trl_runs import warm_up


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    folder, index = Path(spec["dir"]), spec["index"]
    settings = Settings(**spec["settings"])
    base = Path(spec["base"])
    warm = warm_up(settings, base)
    go = wait_for_go(folder, index)
    work = executor_worker if spec["mode"] == "executor" else optuna_worker
    result = work(spec, settings, base, go)
    write_result(folder, index, {"index": index, "warm_up": warm, "go": go, **result})


if __name__ == "__main__":
    worker_main(main, "run the search part with: python -m benchmarks.run --parts search --out DIR")
