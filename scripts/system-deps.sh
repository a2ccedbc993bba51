#!/usr/bin/env bash
# Debian packages the test suite runs for real: a PostgreSQL server and Chromium (for optuna-dashboard).
# Installs only what is missing, and only as root; otherwise says what to install.
set -euo pipefail
need=()
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null || need+=(postgresql)
command -v chromium >/dev/null || need+=(chromium)
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
else
  echo "Please install these Debian packages first: ${need[*]}" >&2
  exit 1
fi
