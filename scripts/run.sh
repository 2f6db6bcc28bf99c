#!/usr/bin/env bash
# Install, build the drafter zoo if it is missing, start the local cluster, stream one generation, stop the cluster.
# Usage: scripts/run.sh ["your prompt"]
#   COSINE_ZOO_MINUTES=20   budget of the first run's drafter build (`cosine zoo build --minutes`)
#   SKIP_ZOO=1              don't build drafters (the cluster then drafts with prompt lookup and an untrained LM)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
prompt=${1:-"Write a Python function that checks whether a number is prime."}
scripts/install.sh
if [ "${SKIP_ZOO:-0}" != "1" ]; then
  # builds only the domain drafters that are missing: the first run takes about COSINE_ZOO_MINUTES, later ones seconds
  "$PYTHON" -m cosine.cli zoo build --minutes "${COSINE_ZOO_MINUTES:-20}" >/dev/null
fi
"$PYTHON" -m cosine.cli up --detach
trap '"$PYTHON" -m cosine.cli down' EXIT
"$PYTHON" -m cosine.cli generate --chat --max-new-tokens 128 "$prompt"
