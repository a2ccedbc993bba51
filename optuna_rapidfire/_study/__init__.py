"""The Optuna side: one trial's life (driver, pool, pruning view, commands, checkpoints, storages, MLflow, progress)."""
