"""Is the native engine's speculative output the same as its own plain decoding, in a given dtype?

    PYTHONPATH=services python tools/experiments/bf16/spec_vs_plain.py --dtype bfloat16 --tokens 48

On the real target (the zoo's), 8 prompts: plain decoding (one token per step, all requests batched),
then greedy speculation with random draft trees (or chains) whose main path follows the plain output for
a random length, as the engine's tests do. Prints, per shape, how many requests came out identical and
where the first difference fell. Measured 2026-12-03 (AMD EPYC, avx512_bf16, torch 2.13): float32 8/8
and 8/8; bfloat16 4/8 (trees) and 6/8 (chains). 2026-12-05 (Intel Xeon with AMX, 2 threads): bfloat16
2/8 and 2/8 before the engine's row-invariant bf16 (NativeLlama.row_chunk), 8/8 and 8/8 after, over
48 and 96 tokens (a bf16 tree is verified along its main chain since then).
"""

from __future__ import annotations

import argparse
import random

import torch

TEXTS = ["The capital of France is", "def fibonacci(n):\n    ",
         "Once upon a time, in a small village by the sea, there lived an old fisherman who", "1, 2, 3, 5, 8, 13,",
         "import numpy as np\nimport torch\n\ndef train(model, data):", "The three laws of thermodynamics are",
         "Dear hiring manager,\n\nI am writing to", "SELECT name, count(*) FROM users"]


def draft(rng: random.Random, vocab: int, truth: list[int], chain: bool, max_nodes: int = 10):
    from cosine.engine.tree import DraftTree

    n_true = rng.randint(0, min(len(truth), max_nodes))
    if chain:
        return DraftTree.chain(list(truth[:n_true]) + [rng.randrange(vocab) for _ in range(rng.randint(0, max_nodes - n_true))])
    tokens, parents, last, placed, n_rand = [], [], -1, 0, rng.randint(0, max_nodes - n_true)
    while placed < n_true or n_rand:
        if placed < n_true and (not n_rand or rng.random() < 0.5):
            tokens.append(truth[placed]), parents.append(last)
            last, placed = len(tokens) - 1, placed + 1
        else:
            tokens.append(rng.randrange(vocab)), parents.append(rng.randint(-1, len(tokens) - 2))
            n_rand -= 1
    return DraftTree(tokens, parents, [1.0] * len(tokens))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from cosine.engine.native_target import NativeTarget
    from cosine.engine.sampling import Sampling
    from cosine.engine.tree import DraftTree
    from cosine.zoo.prepare import prepare_target

    path = prepare_target()
    tok = AutoTokenizer.from_pretrained(str(path))
    prompts = {f"r{i}": tok(t)["input_ids"] for i, t in enumerate(TEXTS)}
    target = NativeTarget.from_pretrained(path, dtype=args.dtype, n_slots=len(prompts), max_context=256)
    target.open_batch([(r, p, len(p)) for r, p in prompts.items()])
    plain = {r: [] for r in prompts}
    for _ in range(args.tokens + 12):
        for r, o in zip(prompts, target.verify_batch([(r, DraftTree(), Sampling()) for r in prompts])):
            plain[r].extend(o.token_ids)
    for shape in ("tree", "chain"):
        for r in prompts:
            target.release(r)
        rng = random.Random(shape)
        got = {r: [] for r in prompts}
        target.open_batch([(r, p, len(p)) for r, p in prompts.items()])
        while live := [r for r in prompts if len(got[r]) < args.tokens]:
            items = [(r, draft(rng, target.vocab_size, plain[r][len(got[r]):], shape == "chain"), Sampling()) for r in live]
            for (r, _, _), out in zip(items, target.verify_batch(items)):
                got[r].extend(out.token_ids)
        same = sum(got[r][:args.tokens] == plain[r][:args.tokens] for r in prompts)
        first = [next((i for i, (a, b) in enumerate(zip(got[r], plain[r][:args.tokens])) if a != b), None) for r in prompts]
        print(f"{args.dtype} {shape}: speculative == plain decoding in {same}/{len(prompts)} requests of {args.tokens} "
              f"tokens; first difference at {first}")


if __name__ == "__main__":
    main()
