#!/usr/bin/env bash
# Install CoSine and what it needs into the current Python 3.11 environment:
# the package (with the CPU build of torch pinned in pyproject.toml), a Redis server, the default models.
# Usage: scripts/install.sh [extra]     e.g. scripts/install.sh test
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
extra=${1:-}

if ! command -v redis-server >/dev/null 2>&1; then
  echo "==> installing redis-server"
  sudo=""; [ "$(id -u)" -ne 0 ] && sudo="sudo"
  if command -v apt-get >/dev/null 2>&1; then
    $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq redis-server >/dev/null
    # the Debian package starts a system Redis on 6379; CoSine starts its own on a free port
    $sudo systemctl disable --now redis-server >/dev/null 2>&1 || true
  else
    echo "redis-server not found and no apt-get: install Redis 7 and put redis-server on PATH" >&2
    exit 1
  fi
fi

echo "==> installing cosine${extra:+[$extra]}"
"$PYTHON" -m pip install -q --disable-pip-version-check -e ".${extra:+[$extra]}"

echo "==> building CoSine's CPU kernels (cached in \${COSINE_CACHE:-~/.cache/cosine}/kernels; without a C++ compiler the engine uses oneDNN)"
"$PYTHON" -m cosine.engine.kernels

echo "==> preparing models (cached in \${COSINE_CACHE:-~/.cache/cosine})"
"$PYTHON" -m cosine.cli zoo >/dev/null
