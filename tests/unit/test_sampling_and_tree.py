"""The target's token choice and the lossless tree walk."""

import math

import pytest
import torch

from cosine.engine.sampling import (
    RowChoices,
    Sampling,
    choose_tokens,
    greedy_tokens,
    sample_from,
    target_probs,
    uniform_at,
)
from cosine.engine.tree import DraftTree, walk


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 0.0, 1.0]])
    assert choose_tokens(logits, Sampling(), [0, 1]) == [1, 0]


@pytest.mark.parametrize("vocab", [49152, 1000, 7919])  # 7919 is prime: no chunk width, plain argmax
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_tokens_match_argmax_ties_and_nan_included(vocab, dtype):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(24, vocab, generator=gen).to(dtype)
    top = float(logits.float().max()) + 1
    logits[1, [5, vocab - 1]] = top  # a tie: the first index wins
    logits[2, [vocab - 3, vocab - 2]] = top  # a tie inside the last chunk
    logits[3] = float("-inf")  # no finite value at all: index 0
    logits[4, 7] = float("nan")  # argmax picks the NaN
    logits[5, [0, vocab // 2]] = float("inf")
    logits[6] = 0.0  # all equal
    logits[7, vocab // 3] = top  # the maximum at a chunk's edge region
    logits[7, vocab // 3 + 1] = top
    got = greedy_tokens(logits)
    assert got == logits.argmax(dim=-1).tolist()
    assert got[1] == 5 and got[2] == vocab - 3 and got[3] == 0 and got[4] == 7 and got[5] == 0 and got[6] == 0
    assert greedy_tokens(logits[:1]) == logits[:1].argmax(dim=-1).tolist()
    assert choose_tokens(logits, Sampling(), list(range(24))) == got


def _top_p_by_full_sort(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The top-p cut as the whole vocabulary sorted defines it (the reference)."""
    sorted_p, order = torch.sort(probs, dim=-1, descending=True)
    drop_sorted = torch.cumsum(sorted_p, dim=-1) - sorted_p >= top_p
    probs = probs.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


@pytest.mark.parametrize("vocab", [49152, 5000, 300, 50])
def test_top_p_equals_the_full_sort(vocab):
    """Peaked rows (the top 64 or 1024 hold the nucleus) and flat ones (the whole vocabulary sorted), mixed
    in one batch: the same probabilities, bit for bit, as sorting everything."""
    gen = torch.Generator().manual_seed(vocab)
    for scale in (0.2, 2.0, 6.0, 30.0):
        logits = torch.randn(9, vocab, generator=gen) * scale
        logits[0] *= 20  # one very peaked row among flatter ones
        for top_p in (0.05, 0.5, 0.9, 0.99, 0.999999):
            for top_k in (0, 40):
                s = Sampling(temperature=0.8, top_p=top_p, top_k=top_k)
                scaled = logits.double() / s.temperature
                if top_k:
                    kth = torch.topk(scaled, top_k, dim=-1).values[..., -1:]
                    scaled = scaled.masked_fill(scaled < kth, float("-inf"))
                ref = _top_p_by_full_sort(torch.softmax(scaled, dim=-1), top_p)
                got = target_probs(logits, s)
                assert torch.equal(got, ref), (vocab, scale, top_p, top_k)
                assert ((got > 0).sum(-1) >= 1).all()


def test_row_choices_choose_only_the_rows_read():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 1000, generator=gen) * 4
    positions = [40, 41, 42, 42, 43, 41]
    for sampling in (Sampling(), Sampling(temperature=0.9, top_p=0.8, top_k=30, seed=7)):
        rows = RowChoices(logits, sampling, positions)
        assert len(rows) == 6
        assert rows[3] == choose_tokens(logits[3:4], sampling, [42])[0]
        assert rows[0] == choose_tokens(logits[0:1], sampling, [40])[0]
        assert sorted(rows._chosen) == [0, 3]  # rows nobody read were never chosen
        assert [rows[i] for i in range(6)] == choose_tokens(logits, sampling, positions)
        with pytest.raises(IndexError):
            rows[6]
    with pytest.raises(ValueError):
        RowChoices(logits, Sampling(), positions[:5])
    # a walk reads the root's row, then the rows of the nodes it accepts, nothing else
    greedy = greedy_tokens(logits[:4])  # row 0: the root, row i + 1: node i
    tree = DraftTree([greedy[0], (greedy[0] + 1) % 1000, (greedy[1] + 1) % 1000], [-1, -1, 0])
    rows = RowChoices(logits[:4], Sampling(), [10, 11, 11, 12])
    assert walk(tree, rows) == ([0], greedy[1])  # node 0 accepted, node 2 rejected: the bonus is row 1's choice
    assert sorted(rows._chosen) == [0, 1]  # rows 2 and 3 (nodes 1 and 2) were never chosen


def test_top_k_and_top_p_mask_the_tail():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = target_probs(logits, Sampling(temperature=1.0, top_k=2))
    assert torch.allclose(p, torch.tensor([[0.625, 0.375, 0.0, 0.0]], dtype=p.dtype))
    p = target_probs(logits, Sampling(temperature=1.0, top_p=0.7))  # 0.5 + 0.3 reach 0.7
    assert torch.allclose(p, torch.tensor([[0.625, 0.375, 0.0, 0.0]], dtype=p.dtype))
    p = target_probs(logits, Sampling(temperature=1.0, top_p=0.4))  # the top token alone
    assert p[0].tolist() == [1.0, 0.0, 0.0, 0.0]


def test_temperature_sharpens():
    logits = torch.tensor([[1.0, 2.0]])
    cold = target_probs(logits, Sampling(temperature=0.5))[0, 1]
    hot = target_probs(logits, Sampling(temperature=2.0))[0, 1]
    assert cold > torch.softmax(logits, -1)[0, 1] > hot


def test_seeded_choice_depends_on_position_not_on_call():
    logits = torch.zeros(1, 50)
    s = Sampling(temperature=1.0, seed=7)
    a = [choose_tokens(logits, s, [t])[0] for t in range(20)]
    b = choose_tokens(logits.repeat(20, 1), s, list(range(20)))
    assert a == b
    assert len(set(a)) > 5  # not constant
    assert uniform_at(7, 3) != uniform_at(8, 3)


def test_inverse_cdf_sample_follows_the_distribution():
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3], dtype=torch.float64)
    n = 4000
    counts = torch.zeros(4)
    for i in range(n):
        counts[sample_from(probs, uniform_at(1, i))] += 1
    assert counts[1] == 0
    tv = 0.5 * (counts / n - probs.float()).abs().sum()
    assert tv < 0.03


@pytest.mark.parametrize("bad", [Sampling(temperature=-1), Sampling(temperature=math.nan), Sampling(temperature=math.inf),
                                 Sampling(top_p=0.0), Sampling(top_p=1.5), Sampling(top_k=-1)])
def test_bad_sampling_is_rejected(bad):
    with pytest.raises(ValueError):
        bad.check()


def test_walk_accepts_the_agreeing_prefix_of_a_chain():
    chain = DraftTree.chain([5, 6, 7])
    assert walk(chain, [5, 6, 9, 0]) == ([0, 1], 9)
    assert walk(chain, [1, 0, 0, 0]) == ([], 1)
    assert walk(chain, [5, 6, 7, 8]) == ([0, 1, 2], 8)  # leaf reached: one more target token


def test_walk_descends_into_side_branches():
    # root → 5 → 6 ; root → 4 → 8 → 9
    tree = DraftTree([5, 6, 4, 8, 9], [-1, 0, -1, 2, 3])
    choice = [4, 0, 0, 8, 9, 3]  # target: 4, then (after node 2) 8, then 9, then 3
    assert walk(tree, choice) == ([2, 3, 4], 3)


def test_tree_validation_and_shape():
    tree = DraftTree([5, 6, 4], [-1, 0, -1])
    assert tree.depths() == [1, 2, 1]
    assert tree.main_chain() == [0, 1]
    assert not tree.is_chain()
    with pytest.raises(ValueError):
        DraftTree([1, 2], [-1, 1]).validate(10)
    with pytest.raises(ValueError):
        DraftTree([11], [-1]).validate(10)
