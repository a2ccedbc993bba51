"""Replays of (a)-(c) on the recorded values and calibrated times, and their check against the real runs of step
validate."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.trial import TrialState

from benchmarks.parts.search.calibrate import KINDS, RANK_KIND, slowdowns
from benchmarks.parts.search.settings import Settings
from benchmarks.parts.search.space import kind_of, make_pruner, suggest


class TimeModel:
    """Seconds a plain TRL trial spends, from the calibration: alone, and slowed down among ``processes``.

    A chunk's training time is its kind's (batch, targets) at r8, scaled linearly in the rank by the r8/r64
    measurement; the first chunk of a trainer has its own time (data loader and optimizer set-up). Among n
    active processes a phase takes its alone time times ``1 + (f - 1)(n - 1)/(P - 1)``, where f is the
    slowdown measured with all P processes busy (so the last configs of a study, with fewer peers, run faster).
    """

    def __init__(self, calibration: dict[str, Any]) -> None:
        self.kinds = calibration["alone"]["kinds"]
        r8, r64 = self.kinds[RANK_KIND], self.kinds[f"{RANK_KIND}@r64"]
        self.rank_slope = (r64["chunk"] / r8["chunk"] - 1) / (64 - 8)
        self.build_seconds = statistics.median(self.kinds[kind]["build"] for kind in KINDS)
        self.processes = 1
        self.factors: dict[str, Any] = {}
        if "processes" in calibration:
            self.processes = calibration["processes"]["processes"]
            self.factors = slowdowns(calibration)

    def build(self, params: dict[str, Any]) -> float:
        return self.build_seconds

    def chunk(self, params: dict[str, Any], index: int) -> float:
        kind = self.kinds[kind_of(params)]
        return kind["first_chunk" if index == 0 else "chunk"] * (1 + self.rank_slope * (int(params["r"]) - 8))

    def eval(self, params: dict[str, Any]) -> float:
        return self.kinds[kind_of(params)]["eval"]

    def factor(self, phase: str, params: dict[str, Any], active: int) -> float:
        if active <= 1 or self.processes <= 1:
            return 1.0
        if phase == "train":
            full = self.factors["train"].get(kind_of(params), self.factors["train_mean"])
        else:
            full = self.factors[phase]
        return 1 + (full - 1) * (min(active, self.processes) - 1) / (self.processes - 1)


@dataclass
class _Slot:
    """One worker of a replay: the config it runs, its phase and the alone-seconds left in that phase."""

    config: int | None = None
    trial: optuna.Trial | None = None
    phase: str = ""
    left: float = 0.0
    chunk: int = 0


def simulate(
    configs: list[dict[str, Any]],
    values: list[list[float]],
    times: TimeModel,
    *,
    workers: int,
    chunks: int,
    pruner: optuna.pruners.BasePruner,
    per_chunk_eval: bool = True,
    seed: int = 0,
) -> dict[str, Any]:
    """Replay plain Optuna + TRL on recorded values: ``workers`` take the configs in order and share one real
    in-memory study with the real ``pruner``; every phase (build, a chunk's training, an evaluation) lasts
    its calibrated time, stretched by the number of workers busy meanwhile; reports and pruning decisions
    happen in global time order (a RUNNING peer stays RUNNING: Optuna's pruners compare with COMPLETE ones).
    Without ``per_chunk_eval`` a trial evaluates once, at its end, and nothing is reported."""
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed), pruner=pruner)
    waiting = list(range(len(configs)))
    slots = [_Slot() for _ in range(workers)]
    now, trained = 0.0, 0
    completions: list[list[Any]] = []
    timeline: dict[int, dict[str, Any]] = {}

    def take(slot: _Slot) -> None:
        slot.config = waiting.pop(0) if waiting else None
        if slot.config is not None:
            study.enqueue_trial(configs[slot.config])
            slot.trial = study.ask()
            suggest(slot.trial)
            slot.phase, slot.left, slot.chunk = "build", times.build(configs[slot.config]), 0
            timeline[slot.config] = {"start": now}

    def train_next(slot: _Slot, params: dict[str, Any]) -> None:
        slot.phase, slot.left, slot.chunk = "train", times.chunk(params, slot.chunk), slot.chunk + 1

    def end(slot: _Slot, index: int, state: TrialState, value: float | None = None) -> None:
        assert slot.trial is not None
        study.tell(slot.trial, value, state=state)
        if state == TrialState.COMPLETE:
            completions.append([now, index, state.name, value])
        timeline[index].update(end=now, state=state.name, chunks=slot.chunk)
        take(slot)

    def advance(slot: _Slot) -> None:
        nonlocal trained
        index = slot.config
        assert index is not None and slot.trial is not None
        params = configs[index]
        if slot.phase == "build":
            train_next(slot, params)
        elif slot.phase == "train":
            trained += 1
            if per_chunk_eval or slot.chunk == chunks:
                slot.phase, slot.left = "eval", times.eval(params)
            else:
                train_next(slot, params)
        else:  # an evaluation ended: report it, then prune, complete or go on
            value = values[index][slot.chunk - 1]
            if per_chunk_eval:
                slot.trial.report(value, slot.chunk - 1)
                if slot.trial.should_prune():
                    end(slot, index, TrialState.PRUNED)
                    return
            if slot.chunk == chunks:
                end(slot, index, TrialState.COMPLETE, value)
            else:
                train_next(slot, params)

    for slot in slots:
        take(slot)
    while busy := [slot for slot in slots if slot.config is not None]:
        stretch = [times.factor(slot.phase, configs[slot.config], len(busy)) for slot in busy]  # type: ignore[index]
        first = min(range(len(busy)), key=lambda i: busy[i].left * stretch[i])
        step = busy[first].left * stretch[first]
        now += step
        for i, slot in enumerate(busy):
            slot.left = 0.0 if i == first else max(slot.left - step / stretch[i], 0.0)
        for slot in busy:  # in worker order: ties are taken as they come
            if slot.left <= 1e-12:
                advance(slot)
    return {
        "wall": now,
        "completions": completions,  # [seconds, config index, state, value]
        "chunks": trained,
        "states": {s: sum(t["state"] == s for t in timeline.values()) for s in ("COMPLETE", "PRUNED")},
        "timeline": timeline,
    }


def replays(record: dict[str, Any], times: TimeModel, settings: Settings, seed: int) -> dict[str, dict[str, Any]]:
    """(a), (b) and (c) of one seed, replayed on its recorded values."""
    configs, values = record["configs"], [trial["values"] for trial in record["trials"]]
    chunks = settings.num_chunks
    out = {
        "exhaustive": simulate(
            configs,
            values,
            times,
            workers=1,
            chunks=chunks,
            pruner=optuna.pruners.NopPruner(),
            per_chunk_eval=False,
            seed=seed,
        ),
        "sequential_optuna": simulate(
            configs, values, times, workers=1, chunks=chunks, pruner=make_pruner(), seed=seed
        ),
    }
    if times.processes > 1:
        out["parallel_optuna_processes"] = simulate(
            configs, values, times, workers=times.processes, chunks=chunks, pruner=make_pruner(), seed=seed
        )
    for result in out.values():
        result.pop("timeline")
    return out


def _relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _check_optuna(
    validation: dict[str, Any], record: dict[str, Any], times: TimeModel, settings: Settings, workers: int
) -> dict[str, Any]:
    """A real plain-Optuna run (b or c) against its replay on the recorded values of the same configs."""
    configs = validation["configs"]
    chunks = settings.validate_chunks
    recorded = [record["trials"][record["configs"].index(config)]["values"][:chunks] for config in configs]
    replay = simulate(
        configs, recorded, times, workers=workers, chunks=chunks, pruner=make_pruner(), seed=validation["seed"]
    )
    trials, value_differences, end_differences = [], [], []
    ratios: dict[str, list[float]] = {"build": [], "chunk": [], "eval": []}
    for run in validation["runs"]:
        index = configs.index(run["params"])
        params = configs[index]
        state = run.get("state") or ("PRUNED" if run["pruned"] else "COMPLETE")
        simulated = replay["timeline"][index]
        differences = [_relative(v, r) for v, r in zip(run["values"], recorded[index], strict=False)]
        value_differences += differences
        end_differences.append(_relative(run["end"], simulated["end"]))
        ratios["build"].append(run["build"] / times.build(params))
        ratios["chunk"] += [t / times.chunk(params, i) for i, t in enumerate(run["train"][: len(run["values"])])]
        ratios["eval"] += [t / times.eval(params) for t in run["eval"]]
        trials.append(
            {
                "config": index,
                "real": {"state": state, "chunks": len(run["values"]), "end": run["end"], "values": run["values"]},
                "replay": {
                    "state": simulated["state"],
                    "chunks": simulated["chunks"],
                    "end": simulated["end"],
                    "values": recorded[index][: simulated["chunks"]],
                },
            }
        )
    agree = sum(
        t["real"]["state"] == t["replay"]["state"] and t["real"]["chunks"] == t["replay"]["chunks"] for t in trials
    )
    return {
        "configs": len(configs),
        "workers": workers,
        "chunks": chunks,
        "decisions_agree": f"{agree}/{len(trials)}",
        "values_max_relative_difference": max(value_differences, default=None),
        "values_median_relative_difference": statistics.median(value_differences) if value_differences else None,
        "wall_real": validation["wall"],
        "wall_replay": replay["wall"],
        "wall_relative_difference": _relative(replay["wall"], validation["wall"]),
        "trial_end_median_relative_difference": statistics.median(end_differences) if end_differences else None,
        "real_over_alone_model_median": {k: statistics.median(v) for k, v in ratios.items() if v},
        "trials": trials,
    }


def replay_check(data: dict[str, Any], times: TimeModel, settings: Settings) -> dict[str, Any]:
    """The real runs of step validate against the replay of the same configs and chunks."""
    validation = data.get("validation", {})
    check: dict[str, Any] = {}
    for name, run in validation.items():
        record = data.get("records", {}).get(str(run["seed"]))
        if record is None:
            check[name] = f"needs the record of seed {run['seed']}"
            continue
        if name == "exhaustive":
            params = run["params"]
            real = run["run"]
            recorded = record["trials"][record["configs"].index(params)]["values"][-1]
            train = sum(times.chunk(params, i) for i in range(settings.num_chunks))
            predicted = times.build(params) + train + times.eval(params)
            real_total = real["build"] + real["train"][0] + real["eval"][0]
            check[name] = {
                "value_real": real["values"][0],
                "value_recorded": recorded,
                "value_relative_difference": _relative(real["values"][0], recorded),
                "seconds_real": {"build": real["build"], "train": real["train"][0], "eval": real["eval"][0]},
                "seconds_replay": {"build": times.build(params), "train": train, "eval": times.eval(params)},
                "total_relative_difference": _relative(predicted, real_total),
            }
        else:
            workers = 1 if name == "sequential" else len(run["configs"])
            check[name] = _check_optuna(run, record, times, settings, workers)
    return check
