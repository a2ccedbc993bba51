"""The search part: how soon a user reaches the best fine-tuning config, with the executor or without it.

    python -m benchmarks.run --parts search --out DIR                                  # every step
    python -m benchmarks.run --parts search --search-steps record --seeds 0,1 --out DIR  # some steps, merged
    python -m benchmarks.run --parts search --search-steps replay --out DIR            # CPU: replays only

Methods, on the same configs (per seed, a seeded random sample of the search space):

(a) ``exhaustive``: every config trained to the end with TRL, one after another;
(b) ``sequential_optuna``: plain Optuna, one TRL ``SFTTrainer`` per trial reporting each chunk's eval loss
    through a ``TrainerCallback`` (report, should_prune, stop): what a user writes today;
(c) ``parallel_optuna_processes``: the same with ``--processes`` worker processes sharing the GPU;
(d) ``executor_lockstep``, (e) ``executor_promote``: ``RapidFireExecutor(engine="fused")`` with each schedule;
(f) ``executor_promote_clone``: (e) with ``CloneSampler`` over a sampler that replays the config list.

(d)-(f) are real runs. (a)-(c) are replayed (GPU time is scarce): every config's per-chunk eval values are
recorded once (step ``record``: one executor study per seed, fused engine, no pruner; the fused engine's
values equal a trial's alone-values within bf16 rounding); the time a plain TRL trainer takes per chunk,
per evaluation and per build is measured alone and under ``--processes`` processes sharing the GPU (step
``calibrate``); the replays then run real in-memory Optuna studies with the real pruner on those values
and times, (c) as a discrete-event simulation in which every report is judged in global time order against
one shared study. Step ``validate`` runs each baseline for real on a few configs and chunks, and the replay
of the same is compared with it in ``replay_check``.

Everything lands in ``DIR/search.json``; each call merges what it measured into it, so the part can be run
in several short calls. See benchmarks/README.md (search) for what each number means.

Modules, in the order of the data: :mod:`.space` (search space, configs, pruner, methods), :mod:`.settings`
(sizes, the trials' configs and data), :mod:`.base` (step pretrain), :mod:`.trl_runs` (plain TRL: one trial as
a user runs it), :mod:`.executor_runs` (steps record and executor), :mod:`.calibrate`, :mod:`.validate` and
:mod:`.worker` (the plain-TRL worker processes), :mod:`.replay` (the replays and their check),
:mod:`.aggregate` (per seed and over seeds), :mod:`.report` (results.md section, search.png) and :mod:`.part`
(the steps).
"""

from __future__ import annotations

from benchmarks.parts.search.part import run
from benchmarks.parts.search.report import markdown, plot, summary

__all__ = ["markdown", "plot", "run", "summary"]
