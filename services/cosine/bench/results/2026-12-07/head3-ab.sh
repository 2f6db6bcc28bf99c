#!/bin/bash
# The feature head through the cluster at c=4 and 16, after the rule that it does not run above floor 0.75: COSINE_VERIFIER_FEATURE_HEAD=off, then auto (the zoo's head), once,
# interleaved; the 16 hand-written prompts unlike the zoo's (--workload unlike); lookup on (the default 8) in both.
export COSINE_DRAFTER_MEMORY_TOKENS=0 COSINE_VERIFIER_MAX_CONTEXT=2048
for round in 1; do
  for cfg in off auto; do
    COSINE_VERIFIER_FEATURE_HEAD=$cfg cosine bench compare --systems cosine-plain,cosine-full --dtype bfloat16 --concurrency 4,16 --rate '' --sweep-tokens 0 --workload unlike --json head3-$cfg-$round.json > head3-$cfg-$round.txt 2>&1
    echo "$cfg $round done $(date +%T)"
  done
done
