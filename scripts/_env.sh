# Shared by scripts/demo.sh and scripts/test.sh: create .venv and install the project into it.
# Usage: source scripts/_env.sh EXTRAS   (EXTRAS: the pip extras to install, e.g. "dashboard" or "dev")
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null
# torch first, in a range that a CPU-only machine can take from its local wheel cache or PyPI; a
# machine that already has torch (a GPU box) keeps its own.
if ! python -c "import torch" 2>/dev/null; then
  python -m pip install -q "torch>=2.6,<2.14"
fi
python -m pip install -q -e ".[$1]"
