"""Where a GRPO study's wall time goes, and how busy the GPU is meanwhile (issue 35; an H200, or the CPU).

    CUDA_VISIBLE_DEVICES=0 python -m benchmarks.grpo_timeline --out benchmarks/results
    python -m benchmarks.grpo_timeline --smoke --out /tmp/bench      # tiny shape, CPU: host phases only

Runs the grpo part's fused study (``--engine time_sliced``: the time-sliced one) once to warm up at the
part's warm-up sizes, then once at its sizes with the host's phases recorded (the engine's own methods
wrapped: trial builds, adapter saves, snapshots, releases, the members' turns, the shared decodes, forward
and backward passes, TRL's steps and evaluation batches) and, on a GPU, every kernel and copy the device ran
(``torch.profiler`` with CUDA activity only, so the host is not slowed by per-operator records). Each moment
of the study belongs to the innermost phase open then (the one that started last); for each phase the table
gives its host seconds and the seconds the device was busy meanwhile (the union of its kernels and copies).
Where a phase's busy time is well under its host time, the GPU waits for the host there. The trials' checkpoints,
the snapshot files and the finished trials' adapter files, written by other threads meanwhile, are summed apart
(``background``).

Writes ``grpo_timeline_<engine>.json`` and prints the table; ``--spans`` also writes every recorded span, with the
name of the thread it ran in (``grpo_spans_<engine>.json``: seconds from the study's start), to follow a chunk's end
across the device's thread and the trials' threads (each trial's driver checkpoints, reports and decides there).
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import functools
import inspect
import itertools
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness.bench import Bench
from benchmarks.harness.environment import machine
from benchmarks.parts.grpo import GPU, SMOKE, run_study, warm_up_sizes
from benchmarks.run import build_parser

MEET = "(a member waiting)"
TURN = "members' turns"
PHASES = {
    "optuna_rapidfire._runtime._scheduler:Scheduler.next_task": "waiting for a task",
    "optuna_rapidfire._runtime._worker:DeviceWorker.deliver_all": "delivering chunks",
    "optuna_rapidfire._engines._base:Engine.build": "build",
    "optuna_rapidfire._resident._model:ResidentModel.add_adapter": "build: adapter",
    "trl:GRPOTrainer.__init__": "build: TRL trainer",
    "transformers:Trainer.create_optimizer": "build: optimizer",
    "optuna_rapidfire._engines._base:Engine.save_adapter": "save adapter",
    "optuna_rapidfire._engines._base:Engine.release": "release",
    "optuna_rapidfire._engines._trials:DeviceTrials.snapshots": "snapshot",
    "optuna_rapidfire._resident._snapshot:copied_to_cpu_apart": "snapshot: copies",
    "optuna_rapidfire._engines._trials:DeviceTrials.evaluate": "evaluate",
    "optuna_rapidfire._trainers.grpo._turns:Turns._sweep": "members' turns",
    "optuna_rapidfire._trainers.grpo._turns:Turns.meet": MEET,
    "optuna_rapidfire._trainers.grpo._generation:Generation.decode": "decode",
    "optuna_rapidfire._fused._launched_decode:_prefill": "decode: prefill",
    "optuna_rapidfire._fused._launched_decode:kept_workspace": "decode: workspace",
    "optuna_rapidfire._fused._launched_decode:LaunchedDecode._start": "decode: start",
    "optuna_rapidfire._fused._workspace:Workspace.load": "decode: adapters in",
    "optuna_rapidfire._fused._launched_decode:LaunchedDecode._draw": "decode: noise",
    "optuna_rapidfire._fused._launched_decode:LaunchedDecode._step": "decode: steps",
    "optuna_rapidfire._fused._launched_decode:LaunchedDecode._move": "decode: compaction",
    "optuna_rapidfire._fused._launched_decode:LaunchedDecode._output": "decode: output",
    "optuna_rapidfire._trainers.grpo._policy_pass:PolicyPasses.forward": "shared forward",
    "optuna_rapidfire._trainers.grpo._policy_pass:prefix_layout": "shared forward: layout",
    "optuna_rapidfire._trainers.grpo._policy_pass:token_stats": "shared forward: token stats",
    "optuna_rapidfire._fused._stacks:GangStacks.load": "shared forward: stacks load",
    "optuna_rapidfire._trainers.grpo._policy_pass:PolicyPasses.backward": "shared backward",
    "optuna_rapidfire._fused._stacks:GangStacks.hand_out": "shared backward: gradients handed out",
    "optuna_rapidfire._trainers.grpo._kind:GRPOKind.accumulate": "TRL steps",
    "optuna_rapidfire._trainers.grpo._kind:GRPOKind.eval_batch": "TRL evaluation batch",
    "trl:GRPOTrainer._generate_and_score_completions": "TRL: generate and score",
    "trl:GRPOTrainer.compute_loss": "TRL: loss",
    "optuna_rapidfire._engines._trials:DeviceTrials.resume_member": "member: resume",
    "optuna_rapidfire._resident._state:RngState.capture": "member: RNG capture",
    "torch.nn.utils:clip_grad_norm_": "member: clip",
    "torch.optim:AdamW.step": "member: optimizer step",
    "optuna_rapidfire._engines._trials:DeviceTrials.after_optimizer_step": "member: after step",
    "optuna_rapidfire._study._checkpoints:Checkpoints.save": "checkpoint (a trial's thread)",
    "optuna_rapidfire._resident._snapshot:TrialSnapshot.save": "snapshot file (the writer's thread)",
    "optuna_rapidfire._resident._adapter_files:_put_in_place": "adapter files (a trial's thread)",
    "optuna_rapidfire._study._trial_driver:TrialDriver._after_chunk": "a chunk's end (a trial's thread)",
    "optuna_rapidfire._study._trial_driver:TrialDriver._complete": "a trial's end (a trial's thread)",
}
"""``module:Class.method`` or ``module:function`` -> the phase it opens (where the name is looked up at call
time: a module's function is replaced in that module only)."""

BACKGROUND = (
    "checkpoint (a trial's thread)",
    "snapshot file (the writer's thread)",
    "adapter files (a trial's thread)",
    "a chunk's end (a trial's thread)",
    "a trial's end (a trial's thread)",
)
"""Phases of threads beside the device's and the members': summed on their own (:func:`background`), never the
phase a moment of the study belongs to."""


class Recorder:
    """Host intervals ``(start_ns, end_ns, phase, thread)`` (``time.time_ns``) of the wrapped methods."""

    def __init__(self) -> None:
        self.spans: list[tuple[int, int, str, int]] = []
        self.threads: list[str] = []  # the name of each span's thread (an ended thread's id may come again)
        self._lock = threading.Lock()
        self._undo: list[tuple[Any, str, Any, bool]] = []

    def install(self) -> None:
        import importlib

        for target, phase in PHASES.items():
            module_name, qualified = target.split(":")
            owner: Any = importlib.import_module(module_name)
            *path, name = qualified.split(".")
            for part in path:
                owner = getattr(owner, part)
            # A class's own attribute, or the one it inherits (``AdamW.step`` is ``Adam.step`` in some torch versions).
            original = inspect.getattr_static(owner, name) if isinstance(owner, type) else getattr(owner, name)
            own = not isinstance(owner, type) or name in owner.__dict__
            self._undo.append((owner, name, original, own))
            setattr(owner, name, self._wrapped(original, phase))

    def uninstall(self) -> None:
        for owner, name, original, own in reversed(self._undo):
            if own:
                setattr(owner, name, original)
            else:  # inherited: the class's own wrapper goes, the parent's method shows through again
                delattr(owner, name)
        self._undo.clear()

    def _wrapped(self, original: Any, phase: str) -> Any:
        if isinstance(original, (classmethod, staticmethod)):
            return type(original)(self._wrapped(original.__func__, phase))
        recorder = self

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.time_ns()
            try:
                return original(*args, **kwargs)
            finally:
                end = time.time_ns()
                thread = threading.current_thread()
                with recorder._lock:
                    recorder.spans.append((start, end, phase, thread.ident or 0))
                    recorder.threads.append(thread.name)

        return wrapper


def merged(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The union of ``intervals`` as sorted, disjoint intervals."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


class Busy:
    """How long the device was busy within any host interval (from its merged kernel intervals)."""

    def __init__(self, intervals: list[tuple[int, int]]) -> None:
        self.intervals = merged(intervals)
        self.starts = [start for start, _ in self.intervals]
        self.before = [0]  # busy time of the intervals before index i
        for start, end in self.intervals:
            self.before.append(self.before[-1] + end - start)

    def upto(self, t: int) -> int:
        """Busy nanoseconds before ``t``."""
        i = bisect.bisect_right(self.starts, t)
        if i == 0:
            return 0
        start, end = self.intervals[i - 1]
        return self.before[i - 1] + min(end, t) - start

    def within(self, start: int, end: int) -> int:
        return self.upto(end) - self.upto(start)


def running_phase(open_spans: list[tuple[int, int, str, int]]) -> str:
    """The phase of the code running at a moment, given the spans open then.

    Members take turns (one runs at a time, the coordinator waiting in its turn): while a turn is open, the
    running member is the thread with open spans none of which is a wait in :data:`MEET`, and the moment is
    its innermost span's; otherwise the open span that started last (meets aside).
    """
    turn = [span for span in open_spans if span[2] == TURN]
    if turn:
        waiting = {span[3] for span in open_spans if span[2] == MEET}
        members = [span for span in open_spans if span[3] != turn[0][3] and span[3] not in waiting]
        return max(members)[2] if members else TURN
    spans = [span for span in open_spans if span[2] != MEET]
    return max(spans)[2] if spans else "outside"


def attribute(
    spans: list[tuple[int, int, str, int]], begin: int, end: int, busy: Busy | None
) -> dict[str, list[float]]:
    """Per phase ``[host seconds, busy seconds]`` over ``[begin, end)`` (:func:`running_phase` of each moment;
    ``outside`` when no phase is open)."""
    bounds = sorted({begin, end, *(span[0] for span in spans), *(span[1] for span in spans)})
    bounds = [t for t in bounds if begin <= t <= end]
    by_start = sorted(spans)
    table: dict[str, list[float]] = {}
    open_spans: list[tuple[int, int, str, int]] = []
    j = 0
    for a, b in itertools.pairwise(bounds):
        while j < len(by_start) and by_start[j][0] <= a:
            open_spans.append(by_start[j])
            j += 1
        open_spans = [span for span in open_spans if span[1] > a]
        row = table.setdefault(running_phase(open_spans), [0.0, 0.0])
        row[0] += (b - a) / 1e9
        if busy is not None:
            row[1] += busy.within(a, b) / 1e9
    return table


def background(spans: list[tuple[int, int, str, int]]) -> dict[str, dict[str, float]]:
    """Per :data:`BACKGROUND` phase: its calls, their summed seconds, and the seconds some were running (the
    union of their spans: the trials' threads checkpoint at once at a lockstep chunk boundary)."""
    out: dict[str, dict[str, float]] = {}
    for phase in BACKGROUND:
        own = [(start, end) for start, end, name, _ in spans if name == phase]
        out[phase] = {
            "calls": len(own),
            "seconds": sum(end - start for start, end in own) / 1e9,
            "wall_seconds": sum(end - start for start, end in merged(own)) / 1e9,
        }
    return out


def named_spans(recorder: Recorder, begin: int) -> list[tuple[float, float, str, str]]:
    """The recorded spans as ``(start, end, phase, thread name)``, seconds from ``begin``, by start."""
    return sorted(
        ((start - begin) / 1e9, (end - begin) / 1e9, phase, name)
        for (start, end, phase, _), name in zip(recorder.spans, recorder.threads, strict=True)
    )


def device_intervals(profiler: Any) -> list[tuple[int, int]]:
    """Start and end (unix ns) of every kernel and copy the profiler saw on a device."""
    out = []
    for event in profiler.profiler.kineto_results.events():
        if event.device_type() == torch.autograd.DeviceType.CUDA:
            start = event.start_ns()
            out.append((start, start + event.duration_ns()))
    return out


def clock_offset(profiler_events: list[tuple[int, int]], marker_host_ns: int) -> int:
    """Device clock minus host clock: the profile's second kernel (the marker, launched on an idle device at
    ``marker_host_ns``, after a first kernel that takes the profiler's slow first launch) starts then."""
    starts = sorted(start for start, _ in profiler_events)
    return starts[1] - marker_host_ns if len(starts) > 1 else 0


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv  # the command recorded in the result names every option
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--smoke", action="store_true", help="tiny shape and sizes (the CPU)")
    parser.add_argument("--engine", choices=("fused", "time_sliced"), default="fused")
    parser.add_argument(
        "--host-only", action="store_true", help="no device profile (a time-sliced study's millions of kernels)"
    )
    parser.add_argument("--spans", action="store_true", help="also write every span with its thread's name")
    options = parser.parse_args(argv)
    bench = Bench(build_parser().parse_args(["--out", options.out, *(["--smoke"] if options.smoke else [])]))
    shape, sizes = ("tiny", SMOKE) if options.smoke else ("llama-3.2-1b", GPU)
    run_study(bench, shape, options.engine, warm_up_sizes(sizes))
    recorder = Recorder()
    recorder.install()
    on_gpu = torch.cuda.is_available() and not options.host_only
    activity = torch.profiler.ProfilerActivity.CUDA
    profiler: Any = torch.profiler.profile(activities=[activity]) if on_gpu else contextlib.nullcontext()
    try:
        with profiler:
            marker = 0
            if on_gpu:
                torch.cuda._sleep(1_000)  # the profiler's first launch is slow: not the marker's
                torch.cuda.synchronize()
                marker = time.time_ns()
                torch.cuda._sleep(1_000_000)  # a kernel on an idle device: aligns the two clocks
                torch.cuda.synchronize()
            begin = time.time_ns()
            found = run_study(bench, shape, options.engine, sizes)
            end = time.time_ns()
    finally:
        recorder.uninstall()
    if found["failed"]:
        raise SystemExit(f"{found['failed']} trials failed: see the log above")
    busy = None
    offset = 0
    if on_gpu:
        kernels = device_intervals(profiler)
        offset = clock_offset(kernels, marker)
        busy = Busy([(s - offset, e - offset) for s, e in kernels])
    table = attribute([span for span in recorder.spans if span[2] not in BACKGROUND], begin, end, busy)
    wall = (end - begin) / 1e9
    rows = sorted(table.items(), key=lambda item: -item[1][0])
    result = {
        "command": "python -m benchmarks.grpo_timeline " + " ".join(argv or []),
        "machine": machine(),
        "engine": options.engine,
        "model": shape,
        "wall_seconds": wall,
        "study_wall_seconds": found["wall_seconds"],
        "device_busy_seconds": busy.within(begin, end) / 1e9 if busy else None,
        "clock_offset_ns": offset,
        "phases": {
            phase: {"host_seconds": host, "device_busy_seconds": dev if busy else None} for phase, (host, dev) in rows
        },
        "gang_seconds": found["gang_seconds"],
        "background": background(recorder.spans),
    }
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"grpo_timeline_{options.engine}.json").write_text(json.dumps(result, indent=1))
    if options.spans:
        (out / f"grpo_spans_{options.engine}.json").write_text(json.dumps(named_spans(recorder, begin)))
    print(f"{options.engine}: wall {wall:.2f} s, device busy {result['device_busy_seconds']}")
    for phase, (host, dev) in rows:
        print(f"  {phase:24s} host {host:7.3f} s   device busy {dev:7.3f} s")
    for phase, row in result["background"].items():
        print(f"  {phase}: {row['calls']} calls, {row['seconds']:.3f} s in all, running {row['wall_seconds']:.3f} s")


if __name__ == "__main__":
    main()
