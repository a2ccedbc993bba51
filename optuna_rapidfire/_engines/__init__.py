"""Training engines: how live trials share a device.

``_base`` is the contract the device's worker calls; ``_trials`` the services every engine composes
(building, clones, snapshots, memory budget, routing, evaluation, export, finishing a chunk);
``_time_sliced`` trains one trial at a time; ``_fused_engine`` trains gangs in shared passes (the kernels
are in :mod:`optuna_rapidfire._fused`), through ``_launched``'s compiled layouts where it can.
"""
