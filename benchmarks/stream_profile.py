"""Where a streamed gang's time goes (issue 31, item 4): the search benchmark's executor study, profiled.

Runs the search part's executor study (its 16 configs of one seed, its data, pruner and default schedule) on a
base model: the search part's pretrained base (``--base``, as ``--search-base`` left it) or, without one, a
random-weight model of the same shape (speed does not depend on the weights; which trials the pruner stops
does). Every streamed pass is timed on the host (its launch) and on the device (CUDA events, read at the end:
nothing waits for them); of the time between passes, the members' evaluations at their chunks' ends and the
refills' trial builds are told apart. A window of passes runs under torch's profiler: kernels per pass, host
synchronisations per pass, and the top operators by host and device time, with each pass and each gap a range
of its own. All of it from the package's events (:mod:`optuna_rapidfire.events`): nothing of the package is
patched.

    python -m benchmarks.stream_profile --base /tmp/sb/base --compile auto --window 60:80 --out /tmp/profile

Writes ``stream_profile_<compile>.json`` and ``stream_profile_<compile>.txt`` (the operator tables) in ``--out``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import optuna
import torch

from benchmarks.harness.hooks import PackageLog
from benchmarks.parts.search.base import model_kwargs
from benchmarks.parts.search.settings import Settings, configure, eval_rows, train_rows
from benchmarks.parts.search.space import make_pruner, sample_configs
from optuna_rapidfire import RapidFireExecutor, events

# Host calls that make the host wait for the device.
_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::_local_scalar_dense")


def _random_base(folder: Path, shape: dict[str, Any]) -> Path:
    """A random-weight model of the search base's ``shape``, with a local tokenizer of its vocabulary size."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from optuna_rapidfire.demo._tiny_model import build_tiny_model

    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(folder / "tokenizer", vocab_size=shape["vocab_size"]))
    config = LlamaConfig(
        **shape,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    path = folder / "base"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


class _Timed:
    """Times the stream's passes and the gaps between them from the package's events, and profiles passes
    ``window`` (start, end): each pass and each gap is a range of the profiler's table ("stream: pass", "stream:
    gap"). A pass starts at its first :class:`~optuna_rapidfire.events.PassStarting` and ends at the stream's
    :class:`~optuna_rapidfire.events.PassTrained`; its host seconds are the event's, its device seconds those
    between CUDA events recorded at both ends (read at the end: nothing waits for them). ``rows``: each trial's
    micro-batch rows."""

    KINDS = (events.PassStarting, events.PassTrained, events.Evaluated, events.TrialBuilt)

    def __init__(self, window: tuple[int, int], device: torch.device, rows: dict[int, int]) -> None:
        self.window = window
        self.device = device
        self.rows = rows
        self.passes: list[dict[str, Any]] = []
        # gaps: the host's time between passes; evaluations: the members' at their chunks' ends (in the gaps);
        # builds: every trial's build (the refills' in the gaps, and those before the first pass).
        self.between: dict[str, float] = {"gaps": 0.0, "evaluations": 0.0, "builds": 0.0}
        self.profiler: Any = None
        self._events: list[tuple[Any, Any]] = []
        self._stopped = False
        self._begin: tuple[float, Any] | None = None  # the pass under way: its host start and CUDA event
        self._last_end: float | None = None
        self._range: Any = None  # the profiler range open now
        self._registration: Any = None

    def __enter__(self) -> _Timed:
        self._registration = events.listen(self._hear, *self.KINDS)
        return self

    def _mark(self) -> Any:
        if self.device.type != "cuda":
            return None
        mark = torch.cuda.Event(enable_timing=True)
        mark.record()
        return mark

    def _open(self, label: str) -> None:
        self._close()
        self._range = torch.profiler.record_function(label)
        self._range.__enter__()

    def _close(self) -> None:
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None

    def _hear(self, event: events.Event) -> None:
        now = time.perf_counter()
        if isinstance(event, events.PassStarting) and self._begin is None:  # a stream pass's first shared pass
            if self._last_end is not None:
                self.between["gaps"] += now - self._last_end
            if len(self.passes) == self.window[0]:
                self._start_profiler()
            self._open("stream: pass")
            self._begin = (now, self._mark())
        elif isinstance(event, events.PassTrained) and event.engine == "stream" and self._begin is not None:
            start, begin = self._begin
            self._events.append((begin, self._mark()))
            rows = sum(self.rows.get(trial, 0) for trial in event.trials)
            self.passes.append({"members": len(event.trials), "rows": rows, "host": event.seconds, "at": start})
            self._begin, self._last_end = None, now
            if len(self.passes) == self.window[1]:
                self._close()
                self._stop_profiler()
            else:
                self._open("stream: gap")
        elif isinstance(event, events.PassTrained) and event.engine != "stream":  # a fixed gang's: not timed
            self._begin = None
            self._close()
        elif isinstance(event, events.Evaluated) and event.phase == "eval":
            self.between["evaluations"] += event.seconds
        elif isinstance(event, events.TrialBuilt):
            self.between["builds"] += event.seconds

    def __exit__(self, *exc: object) -> None:
        self._registration()
        self._close()
        self._stop_profiler()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for entry, (begin, finish) in zip(self.passes, self._events, strict=True):
            entry["device"] = begin.elapsed_time(finish) / 1e3 if begin is not None else None

    def _start_profiler(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        self.profiler = profile(activities=activities)
        self.profiler.__enter__()

    def _stop_profiler(self) -> None:
        if self.profiler is not None and not self._stopped:
            self._stopped = True
            self.profiler.__exit__(None, None, None)


def _window_counts(profiler: Any, passes: int) -> dict[str, Any]:
    """Per pass of the window: kernels launched, host synchronisations, and the host's and device's time."""
    events = profiler.key_averages()
    kernels = sum(e.count for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA)
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    syncs = {e.key: e.count / passes for e in events if e.key in _SYNCS}
    copies = {e.key: e.count / passes for e in events if e.key.startswith("cudaMemcpy")}
    parts = {e.key: e.cpu_time_total / 1e6 / passes for e in events if e.key.startswith("stream: ")}
    return {
        "kernels_per_pass": kernels / passes,
        "launches_per_pass": launches / passes,
        "syncs_per_pass": syncs,
        "copies_per_pass": copies,
        "host_seconds_per_pass_in": parts,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default=None, help="the search part's base (default: random weights, same shape)")
    parser.add_argument("--compile", default="auto", help="the executor's compile option: auto, false, true")
    parser.add_argument("--window", default="60:80", help="passes profiled, start:end ('none': no profiler)")
    parser.add_argument("--warm-child", action="store_true", help="the background compiler warms in a child first")
    parser.add_argument("--seed", type=int, default=2, help="the search part's config seed")
    parser.add_argument("--engine", default="auto", help="the executor's engine (fused: a stream on the CPU too)")
    parser.add_argument("--schedule", default=None, help="the executor's schedule (default: its default)")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: a CPU dry run")
    options = parser.parse_args()
    compile_option: Any = {"auto": "auto", "false": False, "true": True}.get(options.compile, options.compile)
    start, end = (-1, -1) if options.window == "none" else (int(v) for v in options.window.split(":"))
    if options.warm_child:
        os.environ["RAPIDFIRE_WARM_COMPILER"] = "1"  # the background compiler warms in a child first
    settings = Settings.from_options(SimpleNamespace(smoke=options.smoke))
    configs = sample_configs(options.seed, settings.configs)
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory(prefix="stream-profile-") as work:
        base = Path(options.base) if options.base else _random_base(Path(work), settings.model)
        study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=options.seed), pruner=make_pruner())
        for config in configs:
            study.enqueue_trial(config)
        extra = {} if options.schedule is None else {"schedule": options.schedule}
        executor = RapidFireExecutor(
            model=str(base),
            model_kwargs=model_kwargs(),
            train_dataset=train_rows(settings),
            eval_dataset=eval_rows(settings),
            eval_samples=None,
            num_chunks=settings.num_chunks,
            seed=options.seed,
            output_dir=Path(work) / "out",
            show_progress_bar=False,
            dashboard_controls=False,
            compile=compile_option,
            engine=options.engine,
            **extra,
        )
        began = time.perf_counter()
        rows = {number: int(config["batch_size"]) for number, config in enumerate(configs)}  # enqueued in order
        with _Timed((start, end), device, rows) as timed, PackageLog() as log:
            executor.optimize(study, functools.partial(configure, settings=settings), n_trials=len(configs))
        wall = time.perf_counter() - began
        stats = executor.stats()
        executor.close()
    passes = timed.passes
    by_members: dict[int, list[dict[str, Any]]] = {}
    for entry in passes:
        by_members.setdefault(entry["members"], []).append(entry)

    def median(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return statistics.median(known) if known else None

    record: dict[str, Any] = {
        "machine": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "compile": options.compile,
        "base": "pretrained" if options.base else "random weights",
        "warm_child": options.warm_child,
        "wall": wall,
        "passes": len(passes),
        "pass_host_seconds": sum(e["host"] for e in passes),
        "pass_device_seconds": sum(e["device"] or 0.0 for e in passes),
        "between": timed.between,
        "by_members": {
            str(k): {
                "passes": len(v),
                "median_host": median([e["host"] for e in v]),
                "median_device": median([e["device"] for e in v]),
                "median_rows": median([e["rows"] for e in v]),
            }
            for k, v in sorted(by_members.items())
        },
        "compiles": stats.compiles,
        "graphs_recorded": stats.graphs_recorded,
        "graph_replays": stats.graph_replays,
        "graph_failures": stats.graph_failures,
        "log": log.lines,
        "gang_fill": list(stats.gang_fill),
        "states": {s.name: sum(t.state == s for t in study.trials) for s in optuna.trial.TrialState},
        "pass_log": [
            [round(e["at"] - began, 3), e["members"], e["rows"], round(e["host"], 4), e["device"]] for e in passes
        ],
    }
    label = f"stream_profile_{options.compile}{'_warm_child' if options.warm_child else ''}"
    label += "_graphs" if stats.graphs_recorded else ""
    if timed.profiler is not None and len(passes) >= end:
        record["window"] = {"passes": [start, end], **_window_counts(timed.profiler, end - start)}
        events = timed.profiler.key_averages()
        tables = [events.table(sort_by="self_cpu_time_total", row_limit=40)]
        if device.type == "cuda":
            tables.append(events.table(sort_by="self_cuda_time_total", row_limit=30))
        (out / f"{label}.txt").write_text("\n\n".join(tables))
    (out / f"{label}.json").write_text(json.dumps(record, indent=1))
    summary = {k: v for k, v in record.items() if k != "pass_log"}
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
