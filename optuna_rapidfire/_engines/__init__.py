"""Training engines: how live trials share a device (time-sliced now; fused later)."""
