#!/usr/bin/env bash
# Install, start the local cluster, stream one generation, stop the cluster.
# Usage: scripts/run.sh ["your prompt"]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
prompt=${1:-"Write a Python function that checks whether a number is prime."}
scripts/install.sh
"$PYTHON" -m cosine.cli up --detach
trap '"$PYTHON" -m cosine.cli down' EXIT
"$PYTHON" -m cosine.cli generate --chat --max-new-tokens 128 "$prompt"
