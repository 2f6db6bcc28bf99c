"""Two versions of the native engine's forward, side by side in one process, on the real target.

    git show BASE:services/cosine/engine/llama.py > /tmp/old_llama.py
    PYTHONPATH=services python tools/measure_engine_ab.py --old /tmp/old_llama.py --threads 1 --repeats 21
    PYTHONPATH=services python tools/measure_engine_ab.py --off COSINE_HUGE_PAGES --threads 2 --dtypes float32
    PYTHONPATH=services python tools/measure_engine_ab.py --off COSINE_GREEDY_HEAD --logits greedy --dtypes float32

`old` is the module file given (or, with --off VAR, the checkout's engine loaded with VAR=0), `new` the
checkout's cosine.engine.llama. With --logits greedy each row asks for its greedy token alone (as a greedy
request's verification does), else for its logits. Cases: one-token decode and a
16-node tree (depth 3) at batch 1 and 8 over a 128-token context, fp32 and bf16, interleaved round by round
so that machine noise falls on both alike. Prints the median and the minimum of each. With --threads 1 the
clock is the thread's CPU time (a descheduled step does not accrue it: robust on a shared machine); with
more threads, wall time (read the minimums when other jobs share the cores).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import statistics
import sys
import time

import torch

PARENTS16 = [-1] * 4 + [p for p in range(4) for _ in range(2)] + [4, 6, 8, 10]
CASES = (("decode", 1), ("decode", 8), ("tree16", 1), ("tree16", 8))


def load_old(path: str):
    spec = importlib.util.spec_from_file_location("old_llama", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["old_llama"] = mod
    spec.loader.exec_module(mod)
    return mod


def batch(mod, kind: str, n: int, ctx: int, rng: random.Random, vocab: int, logits: str):
    out = []
    for slot in range(n):
        if kind == "decode":
            out.append(mod.Seq(slot, [rng.randrange(vocab)], [ctx], logits=logits))
        else:
            parents = [-1] + [p + 1 for p in PARENTS16]
            depth = [0]
            for p in parents[1:]:
                depth.append(depth[p] + 1)
            out.append(mod.Seq(slot, [rng.randrange(vocab) for _ in parents], [ctx + d for d in depth], parents,
                               logits=logits))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    other = ap.add_mutually_exclusive_group(required=True)
    other.add_argument("--old", help="path of the other version's llama.py")
    other.add_argument("--off", metavar="VAR", help="old: this checkout's engine loaded with the environment's VAR=0 "
                                                    "(COSINE_HUGE_PAGES, COSINE_GREEDY_HEAD, COSINE_KERNELS)")
    ap.add_argument("--logits", choices=["all", "greedy"], default="all",
                    help="what each row asks for: its logits, or its greedy token alone")
    ap.add_argument("--model", default=None, help="model directory (default: the zoo's target)")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--context", type=int, default=128)
    args = ap.parse_args()
    if args.old and args.logits == "greedy":
        ap.error("--logits greedy needs --off: an older llama.py may not know greedy rows (it would skip their head)")
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    from cosine.engine import llama as new

    old = load_old(args.old) if args.old else new
    if args.model is None:
        from cosine.zoo.prepare import prepare_target

        args.model = prepare_target()
    rng = random.Random(0)
    engines = {}
    for dt in args.dtypes.split(","):
        for name, mod in (("old", old), ("new", new)):
            saved = os.environ.get(args.off) if args.off else None
            if args.off and name == "old":
                os.environ[args.off] = "0"
            m = mod.NativeLlama.from_pretrained(args.model, dtype=dt, max_positions=args.context + 64)
            if args.off:
                os.environ.pop(args.off, None)
                if saved is not None:
                    os.environ[args.off] = saved
            c = m.new_cache(8, args.context + 64)
            for _ in range(8):
                c.allocate()
            m.forward([mod.Seq(s, [rng.randrange(m.spec.vocab_size) for _ in range(args.context)],
                               list(range(args.context)), logits="none") for s in range(8)], c)
            engines[(name, dt)] = (mod, m, c)
    times: dict = {}
    for r in range(args.repeats + 1):  # round 0 warms up
        for key, (mod, m, c) in engines.items():
            for kind, n in CASES:
                b = batch(mod, kind, n, args.context, rng, m.spec.vocab_size, args.logits)
                t0 = clock()
                m.forward(b, c)
                ms = (clock() - t0) * 1e3
                for s in range(n):
                    c.set_length(s, args.context)
                if r:
                    times.setdefault((key, kind, n), []).append(ms)
    print(f"threads {args.threads}, clock {'thread CPU' if args.threads == 1 else 'wall'}, {args.repeats} rounds, "
          f"context {args.context}")
    for dt in args.dtypes.split(","):
        print(f"{dt:9s} {'case':7s} {'B':>2s} {'old med':>8s} {'new med':>8s} {'ratio':>6s} {'old min':>8s} {'new min':>8s} {'ratio':>6s}")
        for kind, n in CASES:
            o, w = times[(("old", dt), kind, n)], times[(("new", dt), kind, n)]
            om, wm, oi, wi = statistics.median(o), statistics.median(w), min(o), min(w)
            print(f"{dt:9s} {kind:7s} {n:2d} {om:8.2f} {wm:8.2f} {wm / om:6.2f} {oi:8.2f} {wi:8.2f} {wi / oi:6.2f}")
        for name in ("old", "new"):
            d, t = times[((name, dt), "decode", 1)], times[((name, dt), "tree16", 1)]
            print(f"  {name}: tree16 / decode at b1 = {statistics.median(t) / statistics.median(d):.2f} (medians), "
                  f"{min(t) / min(d):.2f} (minimums)")


if __name__ == "__main__":
    main()
