"""How long the target's linear layers alone take for M new rows: the floor under a decode step and a tree verify.

    python tools/measure_linear_floor.py                 # fp32 and bf16, rows 1 5 17 33, 1 thread
    python tools/measure_linear_floor.py --rows 1 17 --dtypes float32

The native engine's step is the target's linear layers (30 x qkv, o, gate/up, down, then the LM head: 134.5M
weights for SmolLM2-135M) plus small ops. This times exactly those GEMMs with oneDNN's prepacked weights (what the
engine uses on CPU), each layer with its own random weights so they stream from memory as in the model, on one
thread with the thread's CPU time as the clock (robust on a shared machine). A verify of a 16-node tree pushes 17
rows through them, a decode step 1: the ratio of the two rows' times is the least a tree verify can cost against a
one-token step with this kernel, and rows x 2 x 134.5M / time is the rate the kernel reaches.

Under each dtype's table, the kernel's peak: 512 rows through one gate/up weight (in cache, so bound by arithmetic,
not memory), and what each row count's arithmetic alone would take at that rate, against the 1-row step: the least
any kernel of this CPU and precision can make a tree verify cost.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

# SmolLM2-135M: hidden 576, intermediate 1536, 30 layers, 9 query heads / 3 kv heads of 64, vocabulary 49152
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
LAYERS, VOCAB, HIDDEN = 30, 49152, 576
PARAMS = LAYERS * sum(a * b for a, b in SHAPES.values()) + VOCAB * HIDDEN


def cpu_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.thread_time()
        fn()
        times.append((time.thread_time() - t) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 5, 17, 33], help="new rows per step (1: decode, 17: 16-node tree)")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(1)
    pack = torch.ops.mkldnn._reorder_linear_weight
    lin = torch.ops.mkldnn._linear_pointwise
    print(f"linear layers of a 135M Llama ({PARAMS / 1e6:.1f}M weights), oneDNN prepacked, 1 thread, CPU time, median of {args.repeats}")
    print(f"{'dtype':9} {'rows':>4} {'layers ms':>10} {'head ms':>8} {'total ms':>9} {'x rows=1':>8} {'GFLOPS':>7}")
    for name in args.dtypes:
        dt = getattr(torch, name)
        weights = {k: [pack(torch.randn(*s, dtype=dt) * 0.02, 16) for _ in range(LAYERS)] for k, s in SHAPES.items()}
        head = pack(torch.randn(VOCAB, HIDDEN, dtype=dt) * 0.02, 16)
        base = None
        for m in args.rows:
            xs = {k: torch.randn(m, s[1], dtype=dt) for k, s in SHAPES.items()}
            xh = torch.randn(m, HIDDEN, dtype=dt)

            def layers():
                for i in range(LAYERS):
                    for k in SHAPES:
                        lin(xs[k], weights[k][i], None, "none", [], "")

            t_layers = cpu_ms(layers, args.repeats)
            t_head = cpu_ms(lambda: lin(xh, head, None, "none", [], ""), args.repeats)
            total = t_layers + t_head
            base = total if base is None else base
            print(f"{name:9} {m:4d} {t_layers:10.2f} {t_head:8.2f} {total:9.2f} {total / base:8.2f} {2 * m * PARAMS / total / 1e6:7.0f}")
        rows, (n, k) = 512, SHAPES["gate_up"]
        x, w = torch.randn(rows, k, dtype=dt), weights["gate_up"][0]
        peak = 2 * rows * n * k / cpu_ms(lambda: lin(x, w, None, "none", [], ""), args.repeats) / 1e6
        at_peak = {m: 2 * m * PARAMS / peak / 1e6 for m in args.rows}  # ms
        floors = ", ".join(f"{m} rows {ms:.1f} ms ({ms / base:.2f}x)" for m, ms in at_peak.items())
        print(f"{name:9} peak {peak:.0f} GFLOPS (512 rows, one weight in cache); arithmetic alone at peak: {floors}")


if __name__ == "__main__":
    main()
