#!/bin/bash
# The feature head at concurrency 1 through the cluster, three more interleaved pairs (off, then auto); the 16
# hand-written prompts unlike the zoo's; lookup on (the default 8) in both.
export COSINE_DRAFTER_MEMORY_TOKENS=0 COSINE_VERIFIER_MAX_CONTEXT=2048
for round in 1 2 3; do
  for cfg in off auto; do
    COSINE_VERIFIER_FEATURE_HEAD=$cfg cosine bench compare --systems cosine-plain,cosine-full --dtype bfloat16 --concurrency 1 --rate '' --sweep-tokens 0 --workload unlike --json head4-$cfg-$round.json > head4-$cfg-$round.txt 2>&1
    echo "$cfg $round done $(date +%T)"
  done
done
