"""What a looked-up position costs a step: b requests' one-token step against the same step with a few of them
carrying a short chain, on the real target through `NativeTarget.verify_batch`, interleaved.

    PYTHONPATH=services python tools/measure_mixed_rows.py --dtype bfloat16

The verifier's lookup and feature head add positions to some requests of a plain step (`cosine.verifier.lookup`),
and its cost rule prices a position as a share of a one-request step. This prints, for batch 1, 4, 8 and 16
(prompts of --context random tokens), the median ms of: every request plain; one request with a 1-token and a
3-token chain; two requests with 2-token chains; every request with a 2-token chain — and each over the plain
step. Greedy; every step is cut back to the prompt; cases alternate round by round so drift falls on all alike.
The model runs on its own thread, as the verifier's does (a target built on one thread and stepped on another
pays for a second OpenMP team).
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time

import torch

from cosine.bench.engine import _target_path
from cosine.engine.llama import NativeLlama
from cosine.engine.native_target import NativeTarget
from cosine.engine.sampling import Sampling
from cosine.engine.tree import DraftTree

CASES = (("plain", 0, 0), ("one+1", 1, 1), ("one+3", 1, 3), ("two+2", 2, 2), ("all+2", None, 2))


def measure(args) -> None:
    torch.set_num_threads(args.threads)
    model = NativeLlama.from_pretrained(args.model or _target_path(), dtype=args.dtype)
    target = NativeTarget(model, max_context=args.context + 32, n_slots=17)
    rng = random.Random(0)
    greedy = Sampling(0.0, 1.0, 0, 0)
    print(f"real target, {args.dtype}, context {args.context}, {args.threads} threads, median ms of {args.repeats} "
          "interleaved rounds (× the plain step of the same batch)", flush=True)
    for b in (1, 4, 8, 16):
        for rid in list(target._reqs):
            target.release(rid)
        target.open_batch([(f"r{i}", [rng.randrange(target.vocab_size) for _ in range(args.context)], args.context)
                           for i in range(b)])

        def step(k: int | None, n: int) -> float:
            k = b if k is None else min(k, b)
            trees = [DraftTree([rng.randrange(target.vocab_size) for _ in range(n)], list(range(-1, n - 1)), [0.9] * n)
                     if i < k else DraftTree([], [], []) for i in range(b)]
            t0 = time.perf_counter()
            target.verify_batch([(f"r{i}", tree, greedy) for i, tree in enumerate(trees)])
            ms = (time.perf_counter() - t0) * 1e3
            for i in range(b):
                target.truncate(f"r{i}", args.context)
            return ms

        times: dict[str, list[float]] = {}
        for _, k, n in CASES:  # warm-up
            step(k, n)
        for _ in range(args.repeats):
            for name, k, n in CASES:
                times.setdefault(name, []).append(step(k, n))
        base = statistics.median(times["plain"])
        print(f"b={b:2d} " + "  ".join(f"{name} {statistics.median(t):6.2f} ({statistics.median(t) / base:.2f})"
                                       for name, t in times.items()), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=None, help="model directory (default: the zoo's target)")
    args = ap.parse_args()
    worker = threading.Thread(target=measure, args=(args,))
    worker.start()
    worker.join()


if __name__ == "__main__":
    main()
