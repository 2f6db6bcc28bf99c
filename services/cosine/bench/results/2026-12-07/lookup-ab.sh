#!/bin/bash
export COSINE_DRAFTER_MEMORY_TOKENS=0 COSINE_VERIFIER_MAX_CONTEXT=2048
for round in 1 2; do
  for cfg in off on; do
    case $cfg in off) L=0;; on) L=8;; esac
    COSINE_SCHEDULER_LOOKUP_TOKENS=$L cosine bench compare --systems cosine-plain,cosine-full --dtype bfloat16 --concurrency 1,4,16 --rate '' --sweep-tokens 0 --per-domain 4 --json lookup-$cfg-$round.json > lookup-$cfg-$round.txt 2>&1
    echo "$cfg $round done $(date +%T)"
  done
done
