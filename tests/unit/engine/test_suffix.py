"""Suffix decoding: the index finds the longest suffix match, proposals are continuations that occurred, depth
follows the match, the global memory stays bounded, and a request drafts better over text an earlier one wrote."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cosine.engine.suffix import KEYS, SMOOTHING, SuffixDrafter, SuffixIndex, SuffixMemory, continuations
from cosine.zoo.build import _model_free_tau
from cosine.zoo.distill import Sample

seqs = st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=30), min_size=1, max_size=5)


def brute_match(sequences: list[list[int]], query: list[int], max_match: int) -> tuple[int, set[tuple[int, int]]]:
    """(L, {(sequence, continuation index)}) by exhaustive search."""
    best, found = 0, set()
    for s, seq in enumerate(sequences):
        for i in range(1, len(seq)):  # a continuation at seq[i]
            length = 0
            while length < min(max_match, len(query), i) and seq[i - length - 1] == query[-length - 1]:
                length += 1
            if length == 0:
                continue
            if length > best:
                best, found = length, {(s, i)}
            elif length == best:
                found.add((s, i))
    return best, found


def build(sequences: list[list[int]], max_tokens: int | None = None) -> tuple[SuffixIndex, list[int]]:
    """An index of `sequences` and the global position each sequence starts at."""
    index = SuffixIndex(max_tokens)
    starts = []
    for seq in sequences:
        starts.append(index.end + (1 if index.end else 0))
        index.add(seq)
    return index, starts


@settings(max_examples=300, deadline=None)
@given(seqs, st.lists(st.integers(0, 4), min_size=1, max_size=12), st.integers(1, 8))
def test_the_index_finds_the_longest_suffix_match_and_every_occurrence_of_it(sequences, query, max_match):
    index, starts = build(sequences)
    length, positions = index.match(query, max_match=max_match, max_candidates=10_000)
    best, found = brute_match(sequences, query, max_match)
    assert length == best
    located = set()
    for pos in positions:
        s = max(k for k, start in enumerate(starts) if start <= pos)
        located.add((s, pos - starts[s]))
    assert located == found
    assert positions == sorted(positions, reverse=True)  # most recent first


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=40), seqs, st.lists(st.integers(0, 5), max_size=8), st.integers(1, 8))
def test_proposals_are_continuations_that_actually_occurred(prompt, earlier, committed, depth):
    memory = SuffixMemory(1000)
    for seq in earlier:
        memory.add(seq)
    d = SuffixDrafter(memory=memory, min_prob=0.0)
    d.open("r", prompt)
    own = prompt + committed
    chain, probs = d.draft("r", committed, depth)
    texts = [own] + earlier
    assert len(chain) <= depth and all(0 < p <= 1 for p in probs)
    # each token followed the longest match of what came before it, and most often (brute force over the texts)
    for k, tok in enumerate(chain):
        length, found = brute_match(texts, own + chain[:k], d.max_match)
        counts = {}
        for s, i in found:
            counts[texts[s][i]] = counts.get(texts[s][i], 0) + 1
        assert counts.get(tok, 0) == max(counts.values())
    # so did every root-to-node path of the tree
    tree = d.draft_tree("r", [], depth, budget=12)
    m = d.match(own, d._reqs["r"].index)
    assert m.length == brute_match(texts, own, d.max_match)[0]
    for node in range(len(tree)):
        path, n = [], node
        while n >= 0:
            path.append(tree.tokens[n])
            n = tree.parents[n]
        path.reverse()
        assert any(t[i - m.length: i] == own[-m.length:] and t[i: i + len(path)] == path
                   for t in texts for i in range(m.length, len(t) - len(path) + 1))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=2, max_size=40), st.lists(st.integers(0, 3), max_size=6), st.integers(1, 6))
def test_step_wise_proposals_follow_the_drafted_chain(prompt, committed, depth):
    """What fusion sees step by step (top-k after the fused chain) is the chain `draft` proposes, with its probabilities."""
    d = SuffixDrafter(min_prob=0.05)
    d.open("r", prompt)
    chain, probs = d.draft("r", committed, depth)
    for k in range(depth):
        cands = d.propose("r", [], chain[:k], top_k=3)
        if k < len(chain):
            assert cands[0] == (chain[k], pytest.approx(probs[k]))
            assert [p for _, p in cands] == sorted((p for _, p in cands), reverse=True)
        else:
            assert not cands or len(chain) == depth
            break


def test_counts_set_branches_and_confidence():
    # after "7 8" came 1 three times and 2 once: 1 first, then 2, each with its count's share
    d = SuffixDrafter()
    d.open("r", [7, 8, 1, 5, 7, 8, 1, 6, 7, 8, 2, 5, 7, 8, 1, 9, 7, 8])
    cands = d.propose("r", [], [], top_k=3)
    assert [t for t, _ in cands] == [1, 2]
    assert cands[0][1] == pytest.approx(3 / (4 + SMOOTHING / 2)) and cands[1][1] == pytest.approx(1 / (4 + SMOOTHING / 2))
    tree = d.draft_tree("r", [], depth=2, budget=8)
    assert tree.tokens[0] == 1 and tree.parents[0] == -1
    assert set(zip(tree.tokens, tree.parents)) >= {(1, -1), (2, -1)}
    assert max(tree.depths()) == 2  # a 2-token match speculates 2 deep


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 24), st.floats(0.5, 2.0))
def test_depth_grows_with_the_match_length(length, factor):
    rng = random.Random(length)
    text = rng.sample(range(100, 1000), 60)  # no token repeats: every match is unique
    memory = SuffixMemory(1000)
    memory.add(text)
    d = SuffixDrafter(memory=memory, spec_factor=factor, min_prob=0.0, max_match=64)
    d.open("r", [1] + text[10: 10 + length])  # 1 is not in the text: the match is exactly `length` long
    chain, _ = d.draft("r", [], 32)
    assert chain == text[10 + length: 10 + length + min(32, math.ceil(factor * length))]
    tree = d.draft_tree("r", [], 32, budget=64)
    assert len(tree) == len(chain) and tree.is_chain()


def _held(index: SuffixIndex) -> list[list[int]]:
    return [index._stream[s - index._offset: e - index._offset] for s, e in index._seqs]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.integers(0, 6), min_size=1, max_size=25), min_size=1, max_size=12), st.integers(1, 40),
       st.lists(st.lists(st.integers(0, 6), min_size=1, max_size=6), min_size=1, max_size=5))
def test_memory_stays_under_its_bound_and_evicts_the_oldest(outputs, bound, queries):
    memory = SuffixMemory(bound)
    added = []
    for out in outputs:
        memory.add(out)
        added.append(out[-bound:])
        assert memory.tokens <= bound
        held = _held(memory)
        assert held == added[len(added) - len(held):]  # the newest outputs, in order: only the oldest were evicted
        assert memory.tokens == sum(map(len, held))
        assert memory.entries == sum(max(0, len(s) - n + 1) for s in held for n in KEYS)
        buckets = [b for n in KEYS for b in memory._buckets[n].values()]
        assert memory.entries == sum(1 if isinstance(b, int) else len(b) for b in buckets)  # nothing stale is kept
        assert all(isinstance(b, int) or len(b) > 1 for b in buckets)
        assert memory.evicted_tokens == sum(map(len, added)) - memory.tokens
        assert len(memory._stream) <= 2 * (memory.tokens + len(held)) + 1  # evicted text is dropped, not kept
    # it answers as an index of only what it holds
    fresh, _ = build(_held(memory))
    for q in queries:
        got, want = memory.match(q, 16, 10_000), fresh.match(q, 16, 10_000)
        assert got[0] == want[0]
        assert [memory.token_at(p) for p in got[1]] == [fresh.token_at(p) for p in want[1]]


@pytest.mark.parametrize("anchor", [0, 2, 5])
def test_release_puts_the_output_and_its_anchor_not_the_prompt_into_memory(anchor):
    memory = SuffixMemory(100)
    d = SuffixDrafter(memory=memory, anchor=anchor)
    d.open("r", [1, 2, 3])
    d.draft("r", [4, 5], 2)
    d.draft("r", [6], 0)
    assert "r" in d
    d.release("r")
    d.release("r")  # idempotent
    assert "r" not in d and _held(memory) == [[1, 2, 3][3 - min(anchor, 3):] + [4, 5, 6]]
    d.open("s", [7, 8])
    d.release("s")  # no output: nothing to remember
    assert memory.sequences == 1


def _sample(prompt: list[int], continuation: list[int]) -> Sample:
    return Sample(prompt + continuation, len(prompt), None, None)


def test_a_second_request_over_text_the_first_produced_drafts_more_accepted_tokens():
    rng = random.Random(0)
    words = [rng.sample(range(100, 5000), rng.randint(2, 5)) for _ in range(300)]  # "words" of a few tokens
    answer = [t for w in rng.sample(words, 40) for t in w]  # what the target wrote for request 1
    # request 2: another prompt, an answer that reuses long stretches of the first (a template, boilerplate)
    second = answer[:50] + [t for w in rng.sample(words, 5) for t in w] + answer[50:110]
    first, again = _sample([1, 2, 3], answer), _sample([4, 5, 6, 7], second)
    memory = SuffixMemory(4096)
    with_memory = SuffixDrafter(memory=memory)
    tau_first, _ = _model_free_tau([first], 4, with_memory)
    assert memory.tokens == len(answer) + 3  # and the prompt's last tokens as its anchor
    tau_second, agree = _model_free_tau([again], 4, with_memory)
    tau_alone, _ = _model_free_tau([again], 4, SuffixDrafter())
    tau_ngram, _ = _model_free_tau([again], 4)
    assert tau_second > 2.0 > tau_first
    assert tau_second > tau_alone + 1.0 and tau_second > tau_ngram + 1.0


def test_prompt_fit_scores_repeats_and_counts_every_position():
    d = SuffixDrafter()
    d.open("r", [1, 2, 3, 4] * 5)
    fit = d.score_prompt("r")
    assert fit.positions == 19 and fit.logprob_sum is None
    assert fit.hits == 15  # from the second "1" on, every next token was seen after the same suffix
    assert 0 < fit.confidence_sum <= fit.positions
    d.open("s", list(range(10, 40)))
    assert d.score_prompt("s").hits == 0


def test_continuations_rank_by_count_then_recency():
    index, _ = build([[5, 1, 5, 2, 5, 2, 5, 3]])
    _, positions = index.match([5], 4, 100)
    total, ranked = continuations([(index, p) for p in positions])
    assert total == 4 and [(t, len(c)) for t, c in ranked] == [(2, 2), (3, 1), (1, 1)]
