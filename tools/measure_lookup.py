"""The verifier's own drafting on the real target, engine only: plain steps against plain steps with the lookup,
with the lookup and the feature head's chains, and with its trees (where `cosine zoo head` trained one), interleaved.

    PYTHONPATH=services python tools/measure_lookup.py --dtype bfloat16 --rounds 3

The bench's workload (`cosine bench compare`'s prompts: code, docs, literary, chat; `--per-domain` each) is decoded
greedily, `--tokens` new tokens per prompt, one request at a time (batch 1), by `VerifyBatcher` over the native
target — with plain steps, with the lookup (`VerifyRound.lookup` = `--lookup`), and with the lookup and the
feature head — prompt by prompt, rotating which goes first, so machine drift falls on all alike. The prompts are
the bench's, not the zoo's: the head never trained on them. No gRPC, no other process: this is what the
lookup does to the model thread's time per token, the cluster's overheads aside. Prints per mode the model
steps, tokens per step, ms per token (sum over the prompts) and the ratio; the outputs must be identical.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
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


async def decode(worker: ModelWorker, target, prompt: list[int], tokens: int, lookup: int, finder: RunLookup,
                 run: int) -> tuple[list[int], int, float, int, int]:
    """(tokens, model steps, seconds, head tokens drafted, accepted) of one greedy decode of ``tokens`` tokens,
    runs of ``run`` steps."""
    await worker.run(target.open, "m", prompt, len(prompt))
    steps = []
    b = VerifyBatcher(target, worker, on_batch=steps.append, lookup=finder)
    out: list[int] = []
    drafted = accepted = 0
    try:
        started = time.perf_counter()
        while len(out) < tokens:
            o, _ = await b.verify("m", DraftTree(), Sampling(), min(run, tokens - len(out)), lookup)
            out += o.token_ids
            drafted, accepted = drafted + o.head_drafted, accepted + o.head_accepted
        return out[:tokens], len(steps), time.perf_counter() - started, drafted, accepted
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
    ap.add_argument("--workload", default="zoo", choices=["zoo", "unlike"],
                    help="the bench's prompts: the zoo's held-out ones, or 16 hand-written ones unlike the zoo's")
    ap.add_argument("--head", default="auto", help="the feature head (COSINE_VERIFIER_FEATURE_HEAD; off: lookup only)")
    ap.add_argument("--uncalibrated", action="store_true",
                    help="also the head's chains with its probabilities as trained (mode raw; its temperatures set aside)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    path = path_of(TARGET)
    tok = AutoTokenizer.from_pretrained(path)
    workload = build_workload(args.per_domain, args.seed, cache_root(), source=args.workload)
    prompts = [p.token_ids(tok) for p in workload]
    from cosine.engine.feature_head import load_for_target

    totals: dict[str, list] = {}
    same = 0
    head = None

    async def measure():
        nonlocal same
        nonlocal head
        worker = ModelWorker("measure-lookup")  # one model thread throughout, as in the verifier
        await worker.run(torch.set_num_threads, args.threads)  # (per thread, as the verifier sets it)
        # built on the model thread, as the verifier does: a target built on the main thread and run on another
        # left a second OpenMP team behind, and its steps took 14-15 ms instead of 8-9
        target = await worker.load(make_target, path, "cpu", args.dtype, 2, 2048, "native")
        head = await worker.load(load_for_target, args.head, path, args.dtype)
        finders = {"plain": RunLookup(args.row_cost), "lookup": RunLookup(args.row_cost)}
        if head is not None:
            finders["chain"] = RunLookup(args.row_cost, head=head, head_trees=False)
            finders["head"] = RunLookup(args.row_cost, head=head)
            if args.uncalibrated and head.temperatures:
                raw = copy.copy(head)  # the same weights, its probabilities as trained
                raw.temperatures = []
                finders["raw"] = RunLookup(args.row_cost, head=raw, head_trees=False)
        modes = list(finders)
        totals.update({m: [0, 0, 0.0, 0, 0] for m in modes})
        try:
            for mode in modes:  # warm-up
                await decode(worker, target, prompts[0], 8, args.lookup, finders[mode], args.run)
            for r in range(args.rounds):
                for i, prompt in enumerate(prompts):
                    k = (i + r) % len(modes)
                    outs = {}
                    for mode in modes[k:] + modes[:k]:
                        out, steps, seconds, hd, ha = await decode(
                            worker, target, prompt, args.tokens, args.lookup if mode != "plain" else 0, finders[mode],
                            args.run)
                        outs[mode] = out
                        t = totals[mode]
                        t[0], t[1], t[2], t[3], t[4] = t[0] + len(out), t[1] + steps, t[2] + seconds, t[3] + hd, t[4] + ha
                    same += all(o == outs["plain"] for o in outs.values())
                print(f"round {r + 1}/{args.rounds} done", flush=True)
        finally:
            worker.shutdown()

    asyncio.run(measure())
    print(f"{len(prompts)} prompts ({args.workload}) x {args.rounds} rounds, {args.tokens} tokens, {args.dtype}, {args.threads} threads, "
          f"runs of {args.run} steps, lookup {args.lookup}, row cost {args.row_cost}")
    print(f"modes: plain; lookup; chain = lookup and the feature head's greedy chains; head = lookup and the head's "
          f"trees (the verifier's default); raw = chain with the head's uncalibrated probabilities "
          f"({'no head trained' if head is None else f'head temperatures {head.temperatures}'})")
    print(f"{'mode':8} {'tokens':>7} {'steps':>6} {'tok/step':>8} {'ms/token':>9} {'x plain':>8} {'head acc/drafted':>17}")
    pn, _, ps, _, _ = totals["plain"]
    for mode, (n, steps, seconds, hd, ha) in totals.items():
        print(f"{mode:8} {n:7d} {steps:6d} {n / steps:8.3f} {seconds / n * 1000:9.3f} {(n / seconds) / (pn / ps):8.3f} "
              f"{f'{ha}/{hd}' if hd else '':>17}")
    print(f"identical outputs (every mode): {same}/{len(prompts) * args.rounds}")


if __name__ == "__main__":
    main()
