"""The verifier's lookup on the real target, engine only: plain steps against plain steps with lookup, interleaved.

    PYTHONPATH=services python tools/measure_lookup.py --dtype bfloat16 --rounds 3

The bench's workload (`cosine bench compare`'s prompts: code, docs, literary, chat; `--per-domain` each) is decoded
greedily, `--tokens` new tokens per prompt, one request at a time (batch 1), by `VerifyBatcher` over the native
target — once with plain steps and once with the lookup (`VerifyRound.lookup` = `--lookup`) — prompt by prompt,
alternating which goes first, so machine drift falls on both alike. No gRPC, no other process: this is what the
lookup does to the model thread's time per token, the cluster's overheads aside. Prints per mode the model
steps, tokens per step, ms per token (sum over the prompts) and the ratio; the outputs must be identical.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import torch

from cosine.bench.workload import build_workload
from cosine.common.streams import ModelWorker
from cosine.engine.native_target import make_target
from cosine.engine.sampling import Sampling
from cosine.engine.tree import DraftTree
from cosine.verifier.batcher import VerifyBatcher
from cosine.verifier.lookup import RunLookup
from cosine.zoo.registry import TARGET, cache_root, path_of


async def decode(worker: ModelWorker, target, prompt: list[int], tokens: int, lookup: int, row_cost: float,
                 run: int) -> tuple[list[int], int, float]:
    """(tokens, model steps, seconds) of one greedy decode of ``tokens`` tokens, runs of ``run`` steps."""
    await worker.run(target.open, "m", prompt, len(prompt))
    steps = []
    b = VerifyBatcher(target, worker, on_batch=steps.append, lookup=RunLookup(row_cost))
    out: list[int] = []
    try:
        started = time.perf_counter()
        while len(out) < tokens:
            o, _ = await b.verify("m", DraftTree(), Sampling(), min(run, tokens - len(out)), lookup)
            out += o.token_ids
        return out[:tokens], len(steps), time.perf_counter() - started
    finally:
        await b.close()
        await worker.run(target.release, "m")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--per-domain", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--lookup", type=int, default=8, help="most looked-up tokens per step")
    ap.add_argument("--row-cost", type=float, default=0.3, help="the lookup's cost rule (COSINE_VERIFIER_LOOKUP_ROW_COST)")
    ap.add_argument("--run", type=int, default=4, help="steps per round (a decode run)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    path = path_of(TARGET)
    tok = AutoTokenizer.from_pretrained(path)
    workload = build_workload(args.per_domain, args.seed, cache_root())
    prompts = [p.token_ids(tok) for p in workload]
    target = make_target(path, "cpu", args.dtype, n_slots=2, max_context=2048, backend="native")
    totals = {m: [0, 0, 0.0] for m in ("plain", "lookup")}
    same = 0

    async def measure():
        nonlocal same
        worker = ModelWorker("measure-lookup")  # one model thread throughout, as in the verifier
        await worker.run(torch.set_num_threads, args.threads)  # (per thread, as the verifier sets it)
        try:
            await decode(worker, target, prompts[0], 8, 0, args.row_cost, args.run)  # warm-up
            for r in range(args.rounds):
                for i, prompt in enumerate(prompts):
                    order = ("plain", "lookup") if (i + r) % 2 == 0 else ("lookup", "plain")
                    outs = {}
                    for mode in order:
                        out, steps, seconds = await decode(worker, target, prompt, args.tokens,
                                                           args.lookup if mode == "lookup" else 0, args.row_cost, args.run)
                        outs[mode] = out
                        t = totals[mode]
                        t[0], t[1], t[2] = t[0] + len(out), t[1] + steps, t[2] + seconds
                    same += outs["plain"] == outs["lookup"]
                print(f"round {r + 1}/{args.rounds} done", flush=True)
        finally:
            worker.shutdown()

    asyncio.run(measure())
    print(f"{len(prompts)} prompts x {args.rounds} rounds, {args.tokens} tokens, {args.dtype}, {args.threads} threads, "
          f"runs of {args.run} steps, lookup {args.lookup}, row cost {args.row_cost}")
    print(f"{'mode':8} {'tokens':>7} {'steps':>6} {'tok/step':>8} {'ms/token':>9}")
    for mode, (n, steps, seconds) in totals.items():
        print(f"{mode:8} {n:7d} {steps:6d} {n / steps:8.3f} {seconds / n * 1000:9.3f}")
    (pn, _, ps), (ln, _, ls) = totals["plain"], totals["lookup"]
    print(f"lookup / plain, tokens per second: {(ln / ls) / (pn / ps):.3f}; identical outputs {same}/{len(prompts) * args.rounds}")


if __name__ == "__main__":
    main()
