"""Names of the trial user attributes the executor writes (one place, so readers and writers agree)."""

from __future__ import annotations

PREFIX = "rapidfire:"

ADAPTER_PATH = PREFIX + "adapter_path"
"""Directory of a COMPLETE trial's final adapter, in PEFT's format."""

CHUNKS_DONE = PREFIX + "chunks_done"
"""Chunks the trial has trained so far. Chunks are counted from 1 in every message and attribute ("after
chunk 3" means three chunks trained); the Optuna step a chunk reports at is its count minus one."""

TOTAL_CHUNKS = PREFIX + "total_chunks"
"""Chunks the trial trains when it is not stopped early (``num_chunks`` x epochs)."""

METRIC = PREFIX + "metric"
"""Name of the evaluation metric reported as intermediate and final values."""

TRAIN_LOSS = PREFIX + "train_loss"
"""Mean training loss of the trial's latest chunk."""

LEARNING_RATE = PREFIX + "learning_rate"
"""Learning rate at the end of the trial's latest chunk (a clone's new rate shows here at once)."""

WORKER = PREFIX + "worker"
"""Where the trial runs: ``host:pid:device``."""

FAIL_REASON = PREFIX + "fail_reason"
"""Why a FAIL trial failed (exception type and message, or ``deleted: <reason>``)."""

PRUNED_REASON = PREFIX + "pruned_reason"
"""Why and when a PRUNED trial was stopped: the pruner, the chunk, the value and how many trials it was
compared with at that step (or that it was still paused when the study ended)."""

STATUS = PREFIX + "status"
"""Where the trial is: ``running`` or ``paused`` while RUNNING; once finished ``complete``, ``pruned`` or
``failed``, or ``paused-at-end`` for a trial still paused when the study ended (it is then PRUNED) and
``deleted`` for a deleted one (then FAIL)."""

PARENT = PREFIX + "parent"
"""Number of the trial a clone was copied from."""

BRANCH_STEP = PREFIX + "branch_step"
"""Chunks the parent had trained when the clone was made; a warm clone's first own step."""

CLONE = PREFIX + "clone"
"""``warm`` (continues from the parent's state) or ``cold`` (starts from scratch)."""

COLD_REASON = PREFIX + "cold_reason"
"""Why a clone asked to be warm started cold (rank or target modules changed, no state available)."""

ACTIVITY = PREFIX + "activity"
"""What a running trial does now, in words: ``training``, ``waiting at its rung after chunk 3``, ``waiting for the
device``, ``queued`` (registered, not built yet), ``paused``; updated within ``poll_seconds`` of a change."""

CLONE_OF = PREFIX + "clone_of"
"""Request marker ``{"parent": n, "warm": bool, "from_chunk": k}``: a user attr of an enqueued clone, or a
system attr set by a sampler on the trial it is sampling. ``from_chunk``: the parent's chunk boundary the clone
branches from (the parent's chunks done when it was asked for, or the one named); absent: the latest."""

ACTION = PREFIX + "action"
"""Set through optuna-dashboard's form on a running trial: 0 no action (the default), 1 stop, 2 resume,
3 delete, 4 clone."""

ACTION_ARGS = PREFIX + "action_args"
"""Form text with the action: for clone, ``name=value`` overrides separated by commas, ``cold``, and
``trial=<n>`` to clone trial n (a finished one too) instead of the form's own trial."""

ACTION_DONE = PREFIX + "action_done"
"""What the executor did with the last form action."""

COMMAND_PREFIX = PREFIX + "command:"
"""Study system attrs holding control commands (one key per command, so none is lost)."""

DONE_PREFIX = PREFIX + "done:"
"""Study system attrs marking a command as applied (so none is applied twice)."""

RESUMED_FROM_STEP = PREFIX + "resumed_from_step"
"""On the retry of a trial whose worker died: the chunks it continued from (its predecessor's checkpoint);
it trained only the chunks after them."""

RETRY_OF = PREFIX + "retry_of"
"""On a retry: the number of the trial whose worker died."""

RESUME_FAILED = PREFIX + "resume_failed"
"""On a retry that had to start from scratch: why its predecessor's checkpoint could not be used."""

CHUNK_STATES_PREFIX = PREFIX + "chunk_states:"
"""Study system attr ``rapidfire:chunk_states:<trial number>``: the chunk states kept of that trial for clones
to branch from, ``{"<chunks done>": link}`` (links as :data:`CHECKPOINT`'s; one kept in a worker's memory says
which, ``"memory": "host:pid"``, and has no hash: ``"sha256": None``). A study attr, so it can be trimmed after the
trial finished."""

CHECKPOINT = PREFIX + "checkpoint"
"""System attr: the trial's latest per-chunk checkpoint in the artifact store, ``{"artifact_id", "step",
"sha256", "bytes"}``. Optuna's retry of a stale trial copies it to the retry, which resumes from it."""
