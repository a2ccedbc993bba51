#!/usr/bin/env bash
# Set up (first run) and run the checks: ruff (lint + format), mypy, and the whole test suite.
"$(dirname "${BASH_SOURCE[0]}")/system-deps.sh"
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh" dev
ruff check .
ruff format --check .
mypy
HF_HUB_OFFLINE=1 python -m pytest -q "$@"
