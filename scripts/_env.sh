# Shared by scripts/demo.sh and scripts/test.sh: create .venv and install the project into it.
# Usage: source scripts/_env.sh EXTRAS   (EXTRAS: the pip extras to install, e.g. "dashboard" or "dev")
# pip's output goes to .venv/install.log; on a failure its last lines are shown with the log's path.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
. .venv/bin/activate
# Chained with &&: `set -e` does not apply inside a function called as an `if` condition.
_install() {
  python -m pip install --upgrade pip &&
    # torch first, in a range that a CPU-only machine can take from its local wheel cache or PyPI; a
    # machine that already has torch (a GPU box) keeps its own.
    { python -c "import torch" 2>/dev/null || python -m pip install "torch>=2.6,<2.14"; } &&
    python -m pip install -e ".[$1]"
}
# Installed once per set of extras and pyproject.toml (the install is editable: code changes need none), so a
# second run neither reinstalls nor needs the package index.
stamp=".venv/installed-$1-$(sha256sum pyproject.toml | cut -c1-16)"
if [ -f "$stamp" ] && python -c "import optuna_rapidfire" 2>/dev/null; then
  return 0 2>/dev/null || exit 0
fi
if ! _install "$1" >.venv/install.log 2>&1; then
  tail -n 30 .venv/install.log >&2
  echo "Installing the project failed; the whole log is in $(pwd)/.venv/install.log" >&2
  exit 1
fi
rm -f .venv/installed-"$1"-*
touch "$stamp"
