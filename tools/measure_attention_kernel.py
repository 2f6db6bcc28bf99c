"""CoSine's attention kernel (`attention_rows`) against the per-row SDPA it replaced, at a step's shapes.

    PYTHONPATH=services python tools/measure_attention_kernel.py                 # 2 threads
    PYTHONPATH=services python tools/measure_attention_kernel.py --threads 1

One layer of the target's attention (9 query heads over 3 kv heads, head size 64) for N new rows over L cached
keys each: the kernel, and SDPA the way the engine called it for exact rows (each row of each kv head a query
head of its own, an additive mask over the keys). Random data; median microseconds of 300 calls each, the two
alternating; fp32 and bf16.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from cosine.engine import kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=300)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not kernels.load():
        raise SystemExit("CoSine's kernels are not built here (python -m cosine.engine.kernels)")
    nh, nkv, hd, max_len = 9, 3, 64, 2048
    print(f"{args.threads} threads, {nh} heads over {nkv} kv heads, head size {hd}; median µs a call")
    print(f"{'dtype':9} {'rows':>4} {'keys':>5} {'kernel':>8} {'sdpa':>8} {'sdpa/kernel':>11}")
    for dt in (torch.float32, torch.bfloat16):
        if not kernels.available(torch.device("cpu"), dt):
            continue
        k = torch.randn(2, nkv, max_len, hd).to(dt)
        v = torch.randn(2, nkv, max_len, hd).to(dt)
        for n, L in ((1, 256), (5, 256), (17, 256), (1, 1024), (17, 1024)):
            q = torch.randn(n, nh, hd).to(dt)
            rows = (torch.zeros(n, dtype=torch.long), torch.full((n,), L), torch.zeros(n + 1, dtype=torch.long),
                    torch.zeros(0, dtype=torch.long))
            qp = q.view(1, n, nkv, nh // nkv, hd).permute(0, 2, 1, 3, 4).reshape(1, nkv * n, nh // nkv, hd)
            bias = torch.zeros(1, nkv * n, 1, L, dtype=dt)
            kk, vv = k[:1, :, :L], v[:1, :, :L]

            def kernel():
                torch.ops.cosine.attention_rows(q, k, v, *rows, 0.125)

            def sdpa():
                F.scaled_dot_product_attention(qp, kk, vv, attn_mask=bias, scale=0.125, enable_gqa=True)

            times = {kernel: [], sdpa: []}
            for fn in (kernel, sdpa):
                for _ in range(20):
                    fn()
            for _ in range(args.calls // 10):
                for fn in (kernel, sdpa):
                    t0 = time.perf_counter()
                    for _ in range(10):
                        fn()
                    times[fn].append((time.perf_counter() - t0) / 10 * 1e6)
            a, b = statistics.median(times[kernel]), statistics.median(times[sdpa])
            print(f"{str(dt).replace('torch.', ''):9} {n:>4} {L:>5} {a:8.1f} {b:8.1f} {b / a:11.2f}")


if __name__ == "__main__":
    main()
