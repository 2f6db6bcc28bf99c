#!/usr/bin/env bash
# A short load test against a local cluster: `cosine up --detach`, a headless locust run, `cosine down`,
# then a summary table and plot of locust's CSVs.
# Usage: scripts/loadtest.sh [SECONDS=30] [USERS=2]
#   PROFILE=steady|ramp|burst   load profile (default steady)
#   TRACING=1                   every service exports its spans over OTLP to a local sink (loadtest/otlp_sink.py)
#   OUT=DIR                     where the CSVs, summary and plot go (default loadtest/results)
#   PORT=N                      router port (default 50051)
#   SKIP_INSTALL=1              do not run scripts/install.sh loadtest first
#   MAX_NEW_TOKENS=N            tokens per request (default 32)
# Streams still running at the end finish (--stop-timeout), so every stream counted is whole.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
SECONDS_=${1:-30}
USERS=${2:-2}
PROFILE=${PROFILE:-steady}
OUT=${OUT:-loadtest/results}
PORT=${PORT:-50051}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-32}
[ "${SKIP_INSTALL:-0}" = 1 ] || scripts/install.sh loadtest
mkdir -p "$OUT"
SINK_PID=""
cleanup() {
  "$PYTHON" -m cosine.cli down || true
  if [ -n "$SINK_PID" ]; then kill "$SINK_PID" 2>/dev/null || true; wait "$SINK_PID" 2>/dev/null || true; fi
}
trap cleanup EXIT
if [ "${TRACING:-0}" = 1 ]; then
  SINK_PORT=$("$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  "$PYTHON" loadtest/otlp_sink.py --port "$SINK_PORT" > "$OUT/otlp_sink.log" 2>&1 &
  SINK_PID=$!
  for svc in ROUTER SCHEDULER FUSION DRAFTER VERIFIER; do export "COSINE_${svc}_OTLP_ENDPOINT=127.0.0.1:$SINK_PORT"; done
fi
"$PYTHON" -m cosine.cli up --detach --port "$PORT"
"$PYTHON" -m locust -f loadtest/locustfile.py --headless -u "$USERS" -r "$USERS" -t "${SECONDS_}s" \
  --host "127.0.0.1:$PORT" --load-profile "$PROFILE" --max-new-tokens "$MAX_NEW_TOKENS" --stop-timeout 120 --csv "$OUT/cosine" --csv-full-history --only-summary
"$PYTHON" loadtest/summarize.py "$OUT/cosine"
