"""What lives on a device for a study.

The base model with the trials' adapters, the prepared data, each trial's swappable state, and snapshots.
"""
