"""The target's matmuls alone: CoSine's packed kernel (`cosine.engine.kernels`) against oneDNN's prepacked linear.

    PYTHONPATH=services python tools/measure_kernel_vs_onednn.py                  # fp32 and bf16, 2 threads
    PYTHONPATH=services python tools/measure_kernel_vs_onednn.py --rows 1 17 --dtypes bfloat16

Times one pass of M rows through the 120 layer weights of a 135M Llama (SmolLM2-135M: 30 x qkv, o, gate/up,
down; random weights, each layer its own so that they stream from memory as in the model), with each
library's packing (oneDNN's `_reorder_linear_weight` with the engine's batch hint of 16; the kernel's
`pack_weight`), alternating the two a round at a time; wall-time medians in ms. Also checks each call's
rows bitwise against the same rows multiplied alone (`row-invariant`).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from cosine.engine import kernels

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
LAYERS = 30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 17, 64, 300])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=4, help="timed passes per round")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    onednn_pack, onednn = torch.ops.mkldnn._reorder_linear_weight, torch.ops.mkldnn._linear_pointwise
    print(f"the target's {LAYERS * len(SHAPES)} layer matmuls, {args.threads} threads, wall ms (median of "
          f"{args.rounds} x {args.repeats}); row-invariant: every row of the call equals it alone, bitwise")
    header = f"{'dtype':9} {'rows':>4} {'oneDNN':>8} {'kernel':>8} {'kernel/oneDNN':>13}"
    print(f"{header} {'row-invariant (oneDNN, kernel)':>31}")
    for name in args.dtypes:
        dt = getattr(torch, name)
        if not kernels.available(torch.device("cpu"), dt):
            print(f"{name:9} the kernel does not run here in {name}")
            continue
        gen = torch.Generator().manual_seed(0)
        plain = {k: [(torch.randn(*s, generator=gen) * 0.02).to(dt) for _ in range(LAYERS)]
                 for k, s in SHAPES.items()}
        packed_onednn = {k: [onednn_pack(w, 16) for w in ws] for k, ws in plain.items()}
        packed_kernel = {k: [torch.ops.cosine.pack_weight(w) for w in ws] for k, ws in plain.items()}
        for m in args.rows:
            x = {k: torch.randn(m, s[1], generator=gen).to(dt) for k, s in SHAPES.items()}

            def run_onednn(x=x):
                for i in range(LAYERS):
                    for k in SHAPES:
                        onednn(x[k], packed_onednn[k][i], None, "none", [], "")

            def run_kernel(x=x):
                for i in range(LAYERS):
                    for k in SHAPES:
                        torch.ops.cosine.packed_linear(x[k], packed_kernel[k][i], None, None)

            times = {"onednn": [], "kernel": []}
            for _ in range(args.rounds):
                for label, fn in (("onednn", run_onednn), ("kernel", run_kernel)):
                    fn()
                    for _ in range(args.repeats):
                        t = time.perf_counter()
                        fn()
                        times[label].append((time.perf_counter() - t) * 1e3)
            invariant = []
            for call in (lambda a: onednn(a, packed_onednn["down"][0], None, "none", [], ""),
                         lambda a: torch.ops.cosine.packed_linear(a, packed_kernel["down"][0], None, None)):
                whole = call(x["down"])
                invariant.append(all(torch.equal(call(x["down"][i:i + 1]), whole[i:i + 1]) for i in range(min(m, 64))))
            a, b = statistics.median(times["onednn"]), statistics.median(times["kernel"])
            print(f"{name:9} {m:>4} {a:>8.2f} {b:>8.2f} {b / a:>13.2f} {str(invariant[0]):>15} {str(invariant[1]):>15}",
                  flush=True)


if __name__ == "__main__":
    main()
