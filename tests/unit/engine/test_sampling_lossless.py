"""Sampled outputs follow the target's exact distribution (DESIGN §3).

The shape of vLLM's rejection-sampler test, written afresh: on a small
vocabulary, the total-variation distance between the empirical distribution of
the first emitted tokens and the target's exact one falls with the number of
samples as it does for independent samples of the target itself, and stays far
below the distance to the drafter's distribution.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from cosine.engine.acceptance import rejection_sample, sample_inverse_cdf
from cosine.engine.native_target import NativeTarget
from cosine.engine.sampling import Sampling, target_probs
from cosine.engine.tree import DraftTree

pytestmark = pytest.mark.unit


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a.double() - b.double()).abs().sum())


def empirical(samples: torch.Tensor, V: int) -> torch.Tensor:
    """[N, m] token tuples → distribution over V**m outcomes."""
    m = samples.shape[1]
    code = sum(samples[:, i].long() * V ** (m - 1 - i) for i in range(m))
    return torch.bincount(code, minlength=V**m).double() / samples.shape[0]


def iid_tv(exact: torch.Tensor, n: int, gen: torch.Generator, reps: int = 5) -> float:
    """Mean TV of n independent samples of `exact` from it."""
    out = []
    for _ in range(reps):
        idx = torch.multinomial(exact.float(), n, replacement=True, generator=gen)
        out.append(tv(torch.bincount(idx, minlength=exact.numel()).double() / n, exact))
    return sum(out) / reps


# --- the rejection sampler alone, on a Markov target ---------------------------------

V, K, M = 6, 3, 3  # vocabulary, draft length, emitted tokens judged


def _markov_tables(gen):
    logits = torch.randn(V, V, generator=gen) * 1.5
    p = target_probs(logits, Sampling(temperature=0.8, top_k=5, top_p=0.95))  # p(next | last), processed
    q = torch.distributions.Dirichlet(torch.full((V,), 0.5)).sample((V,))  # a poor drafter
    return p, q.double()


def _joint(table: torch.Tensor, start: int) -> torch.Tensor:
    out = torch.zeros([V] * M, dtype=torch.float64)
    for seq in itertools.product(range(V), repeat=M):
        prob, last = 1.0, start
        for t in seq:
            prob *= float(table[last, t])
            last = t
        out[seq] = prob
    return out.flatten()


def _speculate(p, q, n, gen, start=0):
    last = torch.full((n,), start, dtype=torch.long)
    emitted = [[] for _ in range(n)]
    todo = torch.arange(n)
    while len(todo):
        b = len(todo)
        drafts, qs, ps = [], [], [p[last[todo]]]
        prev = last[todo]
        for _ in range(K):
            qrow = q[prev]
            x = torch.multinomial(qrow.float(), 1, generator=gen).squeeze(-1)
            drafts.append(x)
            qs.append(qrow)
            ps.append(p[x])
            prev = x
        out, n_acc = rejection_sample(torch.stack(drafts, 1), torch.stack(qs, 1), torch.stack(ps, 1), generator=gen)
        for row, i in enumerate(todo.tolist()):
            toks = out[row, : int(n_acc[row]) + 1].tolist()
            emitted[i].extend(toks)
            last[i] = toks[-1]
        todo = torch.tensor([i for i in todo.tolist() if len(emitted[i]) < M], dtype=torch.long)
    return torch.tensor([e[:M] for e in emitted])


def test_rejection_sampler_matches_target():
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    p, q = _markov_tables(gen)
    exact, drafter = _joint(p, 0), _joint(q, 0)
    far = tv(exact, drafter)
    dists = []
    for n in (1000, 4000, 16000):
        got = tv(empirical(_speculate(p, q, n, gen), V), exact)
        ref = iid_tv(exact, n, gen)
        dists.append(got)
        print(n, got, ref, far)
        assert got < 1.5 * ref + 0.01, (n, got, ref)
    assert dists[-1] < dists[0]
    assert dists[-1] < 0.15 * far, (dists, far)


def test_rejection_sampler_edges():
    p = torch.tensor([[[0.0, 1.0, 0.0], [0.5, 0.5, 0.0]]], dtype=torch.float64)
    q = torch.tensor([[[1.0, 0.0, 0.0]]], dtype=torch.float64)
    out, n = rejection_sample(torch.tensor([[0]]), q, p, torch.tensor([[0.3]]), torch.tensor([[0.9, 0.9]]))
    assert n.tolist() == [0] and out.tolist() == [[1, -1]]  # p(0) = 0: rejected, residual puts all on 1
    same = torch.tensor([[[0.2, 0.8, 0.0]]], dtype=torch.float64)
    p2 = torch.cat([same, torch.tensor([[[0.0, 0.0, 1.0]]], dtype=torch.float64)], 1)
    out, n = rejection_sample(torch.tensor([[1]]), same, p2, torch.tensor([[0.999]]), torch.tensor([[0.0, 0.5]]))
    assert n.tolist() == [1] and out.tolist() == [[1, 2]]  # p == q: always accepted, bonus from p
    lens = torch.tensor([0])
    out, n = rejection_sample(torch.tensor([[1]]), same, p2, torch.tensor([[0.0]]), torch.tensor([[0.1, 0.5]]), lens)
    assert n.tolist() == [0] and out[0, 0].item() in (0, 1)
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]])
    assert sample_inverse_cdf(probs, torch.tensor([0.0])).item() == 1
    assert sample_inverse_cdf(probs, torch.tensor([0.9999999])).item() == 3


# --- through the native engine: point-mass trees and q-chains ----------------------------


def _engine_exact(hf, prompt, sampling, vocab):
    """Exact target distribution of the first two emitted tokens, from transformers."""
    with torch.inference_mode():
        p1 = target_probs(hf(torch.tensor([prompt])).logits[0, -1:], sampling)[0]
        ctx = torch.tensor([prompt + [x] for x in range(vocab)])
        p2 = target_probs(hf(ctx).logits[:, -1], sampling)  # [vocab, vocab]
    return (p1[:, None] * p2).flatten()


@pytest.mark.parametrize("mode", ["tree", "q_chain"])
def test_engine_sampling_matches_target(tiny_models, hf_models, mode):
    hf = hf_models["tinyvocab"]
    vocab = hf.config.vocab_size
    prompt = [1, 5, 2, 7, 3]
    base = Sampling(temperature=1.0, top_k=6)
    exact = _engine_exact(hf, prompt, base, vocab)
    gen = torch.Generator().manual_seed(3)
    q = torch.distributions.Dirichlet(torch.full((vocab,), 0.4)).sample().double()  # context-free drafter
    drafter = (q[:, None] * q[None, :]).flatten()
    target = NativeTarget.from_pretrained(tiny_models["tinyvocab"], n_slots=64, max_context=32)
    n_total, batch = 3000, 64
    samples = []
    seed = 0
    while len(samples) < n_total:
        rids = [f"s{seed + i}" for i in range(batch)]
        seeds = {rid: seed + i for i, rid in enumerate(rids)}
        seed += batch
        target.open_batch([(rid, prompt, len(prompt)) for rid in rids])
        emitted = {rid: [] for rid in rids}
        while any(len(e) < 2 for e in emitted.values()):
            items = []
            for rid in rids:
                if len(emitted[rid]) >= 2:
                    continue
                samp = Sampling(temperature=1.0, top_k=6, seed=seeds[rid])
                if mode == "tree":  # two levels: 3 children of the root, 2 under the first
                    toks = torch.multinomial(q.float(), 5, replacement=True, generator=gen).tolist()
                    items.append((rid, DraftTree(toks, [-1, -1, -1, 0, 0]), samp))
                else:
                    toks = torch.multinomial(q.float(), 3, replacement=True, generator=gen).tolist()
                    items.append((rid, DraftTree.chain(toks), samp, q[None].expand(3, vocab)))
            for item, out in zip(items, target.verify_batch(items)):
                emitted[item[0]].extend(out.token_ids)
        for rid in rids:
            samples.append(emitted[rid][:2])
            target.release(rid)
    samples = torch.tensor(samples[:n_total])
    got = tv(empirical(samples, vocab), exact)
    ref = iid_tv(exact, n_total, gen)
    half = tv(empirical(samples[: n_total // 4], vocab), exact)
    ref_half = iid_tv(exact, n_total // 4, gen)
    print(mode, got, ref, half, ref_half, tv(exact, drafter))
    assert got < 1.5 * ref + 0.01, (got, ref)
    assert half < 1.5 * ref_half + 0.01, (half, ref_half)
    assert got < 0.25 * tv(exact, drafter), (got, tv(exact, drafter))


@pytest.mark.parametrize("sampling", [Sampling(temperature=0.9, top_p=0.9, seed=5),
                                      Sampling(temperature=1.3, top_k=20, top_p=0.97, seed=9),
                                      Sampling(temperature=0.7, seed=2)])
def test_seeded_trees_equal_plain_seeded_decoding(tiny_models, sampling):
    """Seeded sampling through draft trees (rows chosen only when the walk reads them) emits exactly the
    tokens of plain seeded decoding, and the trees are accepted often enough to exercise the tree path."""
    import random

    from .helpers import random_tree

    n_new = 40
    prompt = [3, 14, 15, 92, 65, 35]
    plain = NativeTarget.from_pretrained(tiny_models["llama"], n_slots=1, max_context=128)
    plain.open("p", prompt, len(prompt))
    ref: list[int] = []
    while len(ref) < n_new + 8:
        ref.extend(plain.verify("p", DraftTree(), sampling).token_ids)
    spec = NativeTarget.from_pretrained(tiny_models["llama"], n_slots=1, max_context=128)
    spec.open("s", prompt, len(prompt))
    rng = random.Random(sampling.seed)
    got: list[int] = []
    accepted = 0
    while len(got) < n_new:
        tree = random_tree(rng, 96, ref[len(got):], max_nodes=8, chain=False)
        out = spec.verify("s", tree, sampling)
        got.extend(out.token_ids)
        accepted += out.accepted_draft
    assert got[:n_new] == ref[:n_new]
    assert accepted >= n_new // 4, accepted
