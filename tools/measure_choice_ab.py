"""The target's token choice in tree verification, two versions side by side in one process, on the real target.

    git show BASE:services/cosine/engine/sampling.py > /tmp/old_sampling.py
    PYTHONPATH=services python tools/measure_choice_ab.py --old /tmp/old_sampling.py --threads 1 --repeats 9

`old`: that module's `choose_tokens` over every row of the tree (how NativeTarget chose before RowChoices);
`new`: the checkout's `RowChoices`. Greedy, temperature 0.8, and temperature 0.8 with top-p 0.9; cases: a
one-token decode, a 16-node tree (depth 3) of random tokens, and the same tree with a depth-3 path the target
takes (its own seeded continuation), batch 1, 128-token context, interleaved round by round. Prints medians
and tree16 / decode. With --threads 1 the clock is the thread's CPU time; with more, wall time.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import sys
import time

import torch

PARENTS16 = [-1] * 4 + [p for p in range(4) for _ in range(2)] + [4, 6, 8, 10]


def load_old(path: str):
    spec = importlib.util.spec_from_file_location("old_sampling", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["old_sampling"] = mod
    spec.loader.exec_module(mod)
    return mod


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old", required=True, help="an earlier cosine/engine/sampling.py")
    ap.add_argument("--model", default=None, help="model directory (default: the zoo's target)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    import cosine.engine.native_target as nt
    from cosine.engine.sampling import RowChoices, Sampling
    from cosine.engine.tree import DraftTree

    old = load_old(args.old)
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    if args.model is None:
        from cosine.zoo.prepare import prepare_target

        args.model = prepare_target()
    target = nt.NativeTarget.from_pretrained(args.model, dtype=args.dtype, n_slots=1, max_context=192)
    rng = random.Random(0)
    vocab = target.vocab_size
    prompt = [rng.randrange(vocab) for _ in range(128)]
    target.open("a", prompt, len(prompt))
    versions = {"old": lambda logits, sampling, positions: old.choose_tokens(logits, sampling, positions),
                "new": RowChoices}
    print(f"{args.dtype}, {args.threads} thread(s), {'CPU' if args.threads == 1 else 'wall'} clock, median of "
          f"{args.repeats}, ms per verify (forward + token choice + cut back)")
    for sampling in (Sampling(), Sampling(temperature=0.8, seed=3), Sampling(temperature=0.8, top_p=0.9, seed=3)):
        nt.RowChoices = RowChoices
        truth: list[int] = []
        while len(truth) < 3:
            truth.extend(target.verify("a", DraftTree(), sampling).token_ids)
        target.truncate("a", len(prompt))
        taken = DraftTree([rng.randrange(vocab) for _ in range(16)], list(PARENTS16))
        taken.tokens[0], taken.tokens[4], taken.tokens[12] = truth[:3]  # nodes 0 -> 4 -> 12: depth 3
        times: dict[tuple[str, str], list[float]] = {}
        accepted = 0
        for r in range(args.repeats + 1):  # round 0 warms up
            for name, choose in versions.items():
                nt.RowChoices = choose
                for case in ("decode", "tree16 random", "tree16 taken"):
                    if case == "decode":
                        draft = DraftTree()
                    elif case == "tree16 random":
                        draft = DraftTree([rng.randrange(vocab) for _ in range(16)], list(PARENTS16))
                    else:
                        draft = taken
                    t0 = clock()
                    out = target.verify("a", draft, sampling)
                    target.truncate("a", len(prompt))
                    if r:
                        times.setdefault((name, case), []).append((clock() - t0) * 1e3)
                    if case == "tree16 taken":
                        accepted = out.accepted_draft
        nt.RowChoices = RowChoices
        label = "greedy" if sampling.greedy else f"temperature {sampling.temperature}, top-p {sampling.top_p}"
        for name in versions:
            md = {case: statistics.median(times[(name, case)]) for case in ("decode", "tree16 random", "tree16 taken")}
            print(f"{label:<28} {name}: decode {md['decode']:6.2f} | tree16 random {md['tree16 random']:6.2f} "
                  f"({md['tree16 random'] / md['decode']:.2f}x) | tree16 with {accepted} accepted "
                  f"{md['tree16 taken']:6.2f} ({md['tree16 taken'] / md['decode']:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
