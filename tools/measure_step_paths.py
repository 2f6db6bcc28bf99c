"""The native engine's step on the real target through its three paths, interleaved on the same machine.

    PYTHONPATH=services python tools/measure_step_paths.py                       # context 128, 7 rounds
    PYTHONPATH=services python tools/measure_step_paths.py --context 512 --repeats 9

* fused  — `decoder_step`: every layer in one C++ call over CoSine's matmul and attention kernels (the default
  where both run);
* layers — the TorchScript layers with CoSine's attention kernel (`NativeLlama(fused_step=False)`);
* sdpa   — the TorchScript layers with PyTorch's SDPA (`NativeLlama(attention="sdpa")`; bf16 on a CPU then
  verifies a tree along its main chain only: its tree16 rows are a 3-token chain).

For fp32 and bf16 (where this CPU runs it), batch 1, 4 and 8: a one-token decode, a 4-token chain and a 16-node
tree, each the median wall time of one `NativeTarget.verify_batch` (greedy, then a cut back to the prompt), in ms,
the paths and cases alternating round by round so that the machine's drift falls on all alike.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch

from cosine.bench.engine import CASES, _target_path, make_draft
from cosine.engine.llama import NativeLlama
from cosine.engine.models import fast_bf16
from cosine.engine.native_target import NativeTarget
from cosine.engine.sampling import Sampling

PATHS = {"fused": {}, "layers": {"fused_step": False}, "sdpa": {"attention": "sdpa"}}
BATCHES = (1, 4, 8)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=128, help="prompt length of every request")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=None, help="model directory (default: the zoo's target)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtypes = ["float32"] + (["bfloat16"] if fast_bf16("cpu") else [])
    greedy = Sampling(0.0, 1.0, 0, 0)
    sides = {}
    for dt in dtypes:
        for name, kw in PATHS.items():
            model = NativeLlama.from_pretrained(args.model or _target_path(), dtype=dt, **kw)
            if name == "fused" and not model.fused_step:
                print(f"{dt}: the fused step does not run here (CoSine's kernels not built, or no AVX-512)",
                      file=sys.stderr)
                return 1
            sides[(dt, name)] = NativeTarget(model, max_context=args.context + 64, n_slots=max(BATCHES) + 1)
    rng = random.Random(0)
    vocab = next(iter(sides.values())).vocab_size
    prompt = [rng.randrange(vocab) for _ in range(args.context)]
    times: dict[tuple, list[float]] = {}
    for batch in BATCHES:
        for t in sides.values():
            for rid in list(t._reqs):
                t.release(rid)
            t.open_batch([(f"b{i}", prompt, len(prompt)) for i in range(batch)])

        def step(t: NativeTarget, kind: str, n: int) -> float:
            drafts = [make_draft(kind, n, rng, vocab) for _ in range(batch)]
            t0 = time.perf_counter()
            t.verify_batch([(f"b{i}", d, greedy) for i, d in enumerate(drafts)])
            ms = (time.perf_counter() - t0) * 1e3
            for i in range(batch):
                t.truncate(f"b{i}", len(prompt))
            return ms

        for t in sides.values():  # warm up
            for kind, n in CASES:
                step(t, kind, n)
        for _ in range(args.repeats):
            for key, t in sides.items():
                for kind, n in CASES:
                    times.setdefault((key, kind, batch), []).append(step(t, kind, n))
    print(f"real target, context {args.context}, {args.threads} threads, median ms of {args.repeats} interleaved rounds")
    print(f"{'dtype':9} {'case':7} {'b':>2} " + " ".join(f"{p:>8}" for p in PATHS) + "  layers/fused  sdpa/fused")
    for dt in dtypes:
        for kind, _ in CASES:
            for b in BATCHES:
                med = {p: statistics.median(times[((dt, p), kind, b)]) for p in PATHS}
                print(f"{dt:9} {kind:7} {b:>2} " + " ".join(f"{med[p]:8.2f}" for p in PATHS)
                      + f"  {med['layers'] / med['fused']:12.2f} {med['sdpa'] / med['fused']:11.2f}")
    for dt in dtypes:
        for p in PATHS:
            med = {(k, b): statistics.median(times[((dt, p), k, b)]) for k, _ in CASES for b in BATCHES}
            print(f"{dt} {p}: tree16/decode at batch 1 {med[('tree16', 1)] / med[('decode', 1)]:.2f}; decode "
                  + ", ".join(f"b{b} {b * 1e3 / med[('decode', b)]:.0f}" for b in BATCHES) + " tok/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
