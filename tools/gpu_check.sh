#!/usr/bin/env bash
# The checks that need a CUDA GPU, as one run: the gpu test layer, then `cosine bench engine` on the GPU with a
# checkpoint of the target's shape (SmolLM2-135M: 30 layers, 576 wide, 49,152 tokens) and random weights — a step's
# time depends on the shapes, not on the values, and the real weights (540 MB) need not travel.
# Usage: tools/gpu_check.sh [OUTDIR]      (needs python3 with torch+CUDA and transformers; runs from the source tree)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-/tmp/gpu-check}}
mkdir -p "$out"
export PYTHONPATH=$PWD/services:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$out/gpu.txt"
python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu 2>&1 | tee "$out/gpu-tests.log"
python3 - "$out/target-shape" <<'PY'
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                  num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
                  rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
LlamaForCausalLM(cfg).save_pretrained(sys.argv[1])
PY
for dtype in float32 bfloat16; do
  python3 -m cosine.bench.engine --device cuda --model "$out/target-shape" --backends native,transformers \
    --dtype $dtype --repeats 20 --no-progress --json > "$out/engine-cuda-$dtype.json" \
    && python3 -c "import json,sys; from cosine.bench.engine import format_table; print(format_table(json.load(open(sys.argv[1]))))" \
       "$out/engine-cuda-$dtype.json" | tee "$out/engine-cuda-$dtype.txt"
done
rm -rf "$out/target-shape"
