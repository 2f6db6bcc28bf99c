"""Random draft trees that sometimes follow a known continuation, and a greedy speculative loop."""

from __future__ import annotations

import random

import torch

from cosine.engine.sampling import Sampling
from cosine.engine.tree import DraftTree


def random_tree(rng: random.Random, vocab: int, truth: list[int], max_nodes: int, chain: bool) -> DraftTree:
    """A tree (or chain) of up to max_nodes random nodes with a path that follows `truth` for a random length."""
    n_true = rng.randint(0, min(len(truth), max_nodes))
    if chain:
        toks = list(truth[:n_true])
        toks += [rng.randrange(vocab) for _ in range(rng.randint(0, max_nodes - n_true))]
        return DraftTree.chain(toks)
    tokens: list[int] = []
    parents: list[int] = []
    last_true = -1
    placed = 0
    n_rand = rng.randint(0, max_nodes - n_true)
    while placed < n_true or n_rand:
        if placed < n_true and (not n_rand or rng.random() < 0.5):
            tokens.append(truth[placed])
            parents.append(last_true)
            last_true = len(tokens) - 1
            placed += 1
        else:
            tokens.append(rng.randrange(vocab))
            parents.append(rng.randint(-1, len(tokens) - 2))
            n_rand -= 1
    return DraftTree(tokens, parents, [1.0] * len(tokens))


def hf_greedy(model, prompt: list[int], n_new: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=n_new, do_sample=False)
    return out[0, len(prompt):].tolist()


def speculative_greedy(target, prompts: dict[str, list[int]], refs: dict[str, list[int]], n_new: int,
                       rng: random.Random, chain: bool, max_nodes: int = 10) -> dict[str, list[int]]:
    """Batched rounds of verify_batch with random drafts until each request has n_new tokens."""
    produced = {rid: [] for rid in prompts}
    target.open_batch([(rid, p, len(p)) for rid, p in prompts.items()])
    while True:
        live = [rid for rid in prompts if len(produced[rid]) < n_new]
        if not live:
            break
        items = []
        for rid in live:
            truth = refs[rid][len(produced[rid]):]
            items.append((rid, random_tree(rng, target.vocab_size, truth, max_nodes, chain), Sampling()))
        for (rid, _, _), out in zip(items, target.verify_batch(items)):
            produced[rid].extend(out.token_ids)
    return {rid: toks[:n_new] for rid, toks in produced.items()}


def rows_differing_from_alone(model, rng: random.Random, row_counts, context: tuple[int, int],
                              cache_len: int) -> list[tuple[int, int, int]]:
    """(n_rows, request, row) of every row of a 4-request step of n_rows new tokens whose logits differ, bitwise,
    from the same token decoded alone (one token per request per step) after the same context."""
    from cosine.engine.llama import Seq

    vocab = model.spec.vocab_size
    differing = []
    for n_rows in row_counts:
        ctxs = [[rng.randrange(vocab) for _ in range(rng.randint(*context))] for _ in range(4)]
        new = [[rng.randrange(vocab) for _ in range(n_rows)] for _ in range(4)]
        cache = model.new_cache(4, cache_len)
        model.forward([Seq(i, c, list(range(len(c))), logits="none") for i, c in enumerate(ctxs)], cache)
        step = model.forward([Seq(i, t, list(range(len(c), len(c) + n_rows)), logits="all")
                              for i, (c, t) in enumerate(zip(ctxs, new))], cache)
        for i, c in enumerate(ctxs):
            cache.truncate(i, len(c))
        for j in range(n_rows):
            alone = model.forward([Seq(i, [new[i][j]], [len(c) + j]) for i, c in enumerate(ctxs)], cache)
            differing += [(n_rows, i, j) for i in range(4) if not torch.equal(alone[i][0], step[i][j])]
    return differing


def tree_nodes_differing_from_plain(model, rng: random.Random, context_lengths: tuple[int, ...], trials: int = 1,
                                    nodes: int = 12) -> list[tuple[int, int, int]]:
    """(trial, request, node) of every node of random `nodes`-node trees (one request per context length, all in
    one step; parents drawn at random, so most nodes sit off the main chain) whose logits differ, bitwise, from
    plain decoding of the same token after the same path, one token per step."""
    from cosine.engine.llama import Seq

    vocab = model.spec.vocab_size
    cache_len = max(context_lengths) + nodes + 8
    differing = []
    for trial in range(trials):
        ctxs = [[rng.randrange(vocab) for _ in range(n)] for n in context_lengths]
        trees = []  # row 0: the last committed token; nodes under it or under earlier nodes
        for c in ctxs:
            parents = [-1] + [rng.randrange(0, i) for i in range(1, nodes)]
            trees.append(([c[-1]] + [rng.randrange(vocab) for _ in parents[1:]], parents))
        cache = model.new_cache(len(ctxs), cache_len)
        model.forward([Seq(i, c[:-1], list(range(len(c) - 1)), logits="none") for i, c in enumerate(ctxs)], cache)
        paths = []
        for toks, parents in trees:
            paths.append([])
            for node, par in enumerate(parents):
                paths[-1].append((paths[-1][par] if par >= 0 else []) + [node])
        batch = [Seq(i, toks, [len(c) - 2 + len(p) for p in ps], parents)
                 for i, (c, (toks, parents), ps) in enumerate(zip(ctxs, trees, paths))]
        tree_logits = model.forward(batch, cache)
        for i, (c, (toks, _), ps) in enumerate(zip(ctxs, trees, paths)):
            for node, path in enumerate(ps):
                plain = model.new_cache(1, cache_len)
                model.forward([Seq(0, c[:-1], list(range(len(c) - 1)), logits="none")], plain)
                for j, k in enumerate(path):
                    out = model.forward([Seq(0, [toks[k]], [len(c) - 1 + j])], plain)[0]
                if not torch.equal(out[0], tree_logits[i][node]):
                    differing.append((trial, i, node))
    return differing
