"""The search part: how soon a user reaches a good fine-tuning config, with the executor or what they run today,
every method trained for real.

    python -m benchmarks.run --parts search --out DIR                                   # defaults
    python -m benchmarks.run --parts search --seeds 1 --search-methods executor,processes_8 --out DIR

Per replicate (``--seeds``: each seed's config list, from a seeded RandomSampler over the part's space), every
method runs the same configs in the same order on the same pretrained base, with one pruner and one data budget:

- ``sequential`` (b): plain ``study.optimize``, one TRL ``SFTTrainer`` per trial with a ``TrainerCallback`` that
  reports each chunk's eval loss and stops on ``trial.should_prune()``: what users write today;
- ``processes_N`` (c), ``processes_N_compiled``: N such worker processes sharing one ``JournalStorage`` study on
  the one GPU, taking the enqueued configs until none is left (``_compiled``: TRL's ``torch_compile=True``);
- ``executor`` (e): ``RapidFireExecutor`` as a user gets it (defaults), and (d) the variants a default could be:
  ``executor_lockstep``, ``executor_time_sliced``, ``executor_fused``, ``executor_promote_all``.

Each method's processes are fresh: import, one untimed warm-up, then one go; every clock starts before the
method's first model load. Everything lands in ``DIR/search.json``, merged by replicate and saved as each method
ends. See benchmarks/README.md (search) for what each number means.

Modules, in the order of the data: :mod:`.space` (search space, configs, pruner, methods), :mod:`.settings`
(sizes, the trials' configs and data), :mod:`.base` (the pretrained base), :mod:`.trl_runs` (one plain-TRL
trial), :mod:`.runs` (a method's work in its process) and :mod:`.worker` (that process), :mod:`.methods` (one
method of a replicate, from the parent), :mod:`.aggregate` (targets, times, comparisons), :mod:`.report`
(results.md section, search.md, search.png) and :mod:`.part` (the entry).
"""

from __future__ import annotations

from benchmarks.parts.search.aggregate import finalize
from benchmarks.parts.search.part import run
from benchmarks.parts.search.report import markdown, plot, summary

__all__ = ["finalize", "markdown", "plot", "run", "summary"]
