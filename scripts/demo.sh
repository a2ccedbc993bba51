#!/usr/bin/env bash
# Set up (first run) and run a real study on embedded defaults: tiny local model, bundled GSM8K, SQLite.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh" dashboard
HF_HUB_OFFLINE=1 python -m optuna_rapidfire.demo "$@"
