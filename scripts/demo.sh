#!/usr/bin/env bash
# Set up (first run) and run a real study on embedded defaults: tiny local model, bundled GSM8K, SQLite.
# Offline (the tiny model is built here) and without the hub's loading bars.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh" dashboard
HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 python -m optuna_rapidfire.demo "$@"
