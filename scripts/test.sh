#!/usr/bin/env bash
# Install what the tests need (package, test extras, redis-server, models) and run them.
# Usage: scripts/test.sh [pytest arguments]     e.g. scripts/test.sh -m "unit or integration"
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
scripts/install.sh test,loadtest
exec "$PYTHON" -m pytest -q -p no:cacheprovider "$@"
