#!/usr/bin/env bash
# Install, build the drafter zoo if it is missing, start the local cluster, stream one generation, stop the cluster.
# Usage: scripts/run.sh ["your prompt"]
#   COSINE_ZOO_MINUTES=20   budget of the first run's drafter build (`cosine zoo build --minutes`)
#   COSINE_ZOO_DOMAINS=     the domains to build drafters for (default: all four; e.g. code)
#   SKIP_ZOO=1              don't build drafters (the cluster then drafts with prompt lookup and an untrained LM)
#   COSINE_CACHE=~/.cache/cosine   where models and drafters are kept
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
prompt=${1:-"Write a Python function that checks whether a number is prime."}
minutes=${COSINE_ZOO_MINUTES:-20}
cache=${COSINE_CACHE:-~/.cache/cosine}

cat <<EOF
CoSine: install, prepare models, build the drafter zoo if missing, start the local cluster, generate, stop.
  1. install CoSine and redis-server (first run: about 2 minutes), into the Python at $PYTHON
  2. prepare the target and a small drafter (first run: about 1 minute), into $cache
EOF
if [ "${SKIP_ZOO:-0}" != "1" ]; then
  echo "  3. build the missing domain drafters (first run: about $minutes minutes on 2 cores; cosine zoo build)"
  echo "     (COSINE_ZOO_MINUTES=5 for a quicker, weaker zoo; SKIP_ZOO=1 to skip; later runs: seconds)"
else
  echo "  3. (SKIP_ZOO=1: no drafter build; the cluster drafts with prompt lookup and an untrained LM)"
fi
echo "  4. start the cluster (about 30 seconds), stream one generation, stop the cluster"
echo

started=$(date +%s)
scripts/install.sh
if [ "${SKIP_ZOO:-0}" != "1" ]; then
  echo "==> building the drafter zoo (what is missing; progress below, a line every 10 s when not on a terminal)"
  "$PYTHON" -m cosine.cli zoo build --minutes "$minutes" ${COSINE_ZOO_DOMAINS:+--domains "$COSINE_ZOO_DOMAINS"}
fi

finish() {
  status=$?
  "$PYTHON" -m cosine.cli down >/dev/null 2>&1 || true
  echo
  if [ "$status" -eq 0 ]; then
    echo "==> done in $(( $(date +%s) - started ))s. Models and drafters (kept for later runs, in $cache):"
    "$PYTHON" -m cosine.cli zoo list | sed 's/^/    /'
    echo "    next: cosine up --detach; cosine generate --chat \"...\"; cosine down   (README: Using it)"
  else
    echo "==> failed after $(( $(date +%s) - started ))s (exit $status); the cluster is stopped" >&2
  fi
}
echo "==> starting the local cluster"
"$PYTHON" -m cosine.cli up --detach
trap finish EXIT
echo "==> generating: $prompt"
"$PYTHON" -m cosine.cli generate --chat --max-new-tokens 128 "$prompt"
