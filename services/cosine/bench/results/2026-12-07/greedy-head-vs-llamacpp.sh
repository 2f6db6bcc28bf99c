#!/usr/bin/env bash
# fp32 decode at batch 1 (and the bench's other shapes): the native engine with GreedyHead off and on, and
# llama.cpp's own benchmark (llama-bench, tg64 after a 128-token context) on the same weights in f32, alternating,
# ROUNDS rounds, 2 threads each. Usage: greedy-head-vs-llamacpp.sh LLAMA_BENCH GGUF [ROUNDS]
set -euo pipefail
LB=$1 GGUF=$2 ROUNDS=${3:-3}
for r in $(seq "$ROUNDS"); do
  echo "== round $r $(date -u +%H:%M:%S)"
  "$LB" -m "$GGUF" -p 0 -n 64 -d 128 -t 2 -r 5 -o json 2>/dev/null \
    | python3 -c "import json,sys; d=json.load(sys.stdin)[0]; print(f\"llama.cpp f32 tg64 d128: {d['avg_ts']:.1f} tok/s = {1e3/d['avg_ts']:.2f} ms a token (sd {d['stddev_ts']:.1f})\")"
  for on in 0 1; do
    COSINE_GREEDY_HEAD=$on cosine bench engine --backends native --threads 2 --repeats 15 --json --no-progress 2>/dev/null \
      | python3 -c "
import json,sys; d=json.load(sys.stdin); rows={(r['case'],r['batch']): r for r in d['rows']}
print('native fp32 GreedyHead=$on: ' + ', '.join(f\"{c} b{b} {rows[(c,b)]['ms']:.2f} ms (min {rows[(c,b)]['min_ms']:.2f})\" for c,b in [('decode',1),('decode',8),('chain4',1),('tree16',1)]))"
  done
done
