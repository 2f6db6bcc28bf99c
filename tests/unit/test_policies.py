"""Pure policy code: drafters without weights, fusion merging, scheduler cuts, router admission."""

import math

import pytest

from cosine.common.v1 import common_pb2
from cosine.engine.drafters import NgramDrafter
from cosine.fusion.policy import merge_chains
from cosine.router import policy as router_policy
from cosine.router.v1 import router_pb2
from cosine.scheduler import policy as scheduler_policy


def test_ngram_proposes_what_followed_the_latest_match():
    d = NgramDrafter(max_ngram=3)
    d.open("r", [1, 2, 3, 4, 5, 9, 1, 2, 3])
    tokens, probs = d.draft("r", [], 2)
    assert tokens == [4, 5]
    assert len(probs) == 2
    tokens, _ = d.draft("r", [4, 5, 9], 3)  # context now ends ... 4 5 9 → earlier 4 5 9 was followed by 1 2 3
    assert tokens == [1, 2, 3]
    d.release("r")
    assert "r" not in d


def test_ngram_without_match_proposes_nothing():
    d = NgramDrafter()
    d.open("r", [1, 2, 3])
    assert d.draft("r", [], 4) == ([], [])


def test_merge_puts_the_most_confident_chain_first_and_shares_prefixes():
    tree = merge_chains([([1, 2, 3], [0.2, 0.2, 0.2]), ([1, 5], [0.9, 0.9])], budget=10)
    assert tree.tokens[:2] == [1, 5]
    assert tree.main_chain() == [0, 1]
    assert tree.tokens == [1, 5, 2, 3] and tree.parents == [-1, 0, 0, 2]
    assert len(merge_chains([([1, 2, 3], [0.5] * 3), ([4, 5, 6], [0.4] * 3)], budget=4)) == 4


def test_round_depth_never_overshoots():
    assert scheduler_policy.round_depth(4, generated=0, max_new_tokens=100, context_used=10, max_context=1000) == 4
    assert scheduler_policy.round_depth(4, generated=98, max_new_tokens=100, context_used=10, max_context=1000) == 1
    assert scheduler_policy.round_depth(4, generated=0, max_new_tokens=100, context_used=998, max_context=1000) == 1
    assert scheduler_policy.round_depth(4, generated=99, max_new_tokens=100, context_used=10, max_context=1000) == 0


def test_cut_round_applies_eos_length_and_context():
    eos = {2}
    cut = scheduler_policy.cut_round([5, 2, 7], 0, 100, eos, 10, 1000)
    assert cut.token_ids == [5, 2] and cut.finish_reason == common_pb2.FINISH_REASON_EOS
    cut = scheduler_policy.cut_round([5, 6, 7], 98, 100, eos, 10, 1000)
    assert cut.token_ids == [5, 6] and cut.finish_reason == common_pb2.FINISH_REASON_LENGTH
    cut = scheduler_policy.cut_round([5, 6], 0, 100, eos, 10, 1000)
    assert cut.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED


LIMITS = router_policy.Limits(max_new_tokens_default=16, max_new_tokens_limit=64, max_context=128)


def admit(**fields):
    return router_policy.admit(router_pb2.GenerateRequest(**fields), LIMITS, {"ngram", "lm"}, ["ngram"], random_seed=42)


def test_admission_defaults():
    a = admit(prompt=b"hello")
    assert a.text == "hello" and a.max_new_tokens == 16 and a.drafters == ["ngram"] and a.speculate
    assert a.sampling.greedy and a.sampling.seed == 42 and a.sampling.top_p == 1.0


@pytest.mark.parametrize(
    "fields, words",
    [
        ({}, "empty"),
        ({"prompt": b"   "}, "empty"),
        ({"prompt": b"\xff\xfe"}, "UTF-8"),
        ({"prompt": b"x", "max_new_tokens": 0}, "max_new_tokens"),
        ({"prompt": b"x", "max_new_tokens": 65}, "max_new_tokens"),
        ({"prompt": b"x", "sampling": {"temperature": -0.5}}, "temperature"),
        ({"prompt": b"x", "sampling": {"temperature": math.nan}}, "temperature"),
        ({"prompt": b"x", "sampling": {"temperature": math.inf}}, "temperature"),
        ({"prompt": b"x", "sampling": {"top_p": 0.0}}, "top_p"),
        ({"prompt": b"x", "sampling": {"top_p": 1.01}}, "top_p"),
        ({"prompt": b"x", "speculation": {"drafters": ["nope"]}}, "unknown drafter"),
        ({"prompt": b"x", "speculation": {"fusion": 9}}, "speculation.fusion"),
        ({"prompt": b"x", "messages": [{"role": "user", "content": "y"}]}, "either"),
    ],
)
def test_admission_rejects_bad_input_with_a_reason(fields, words):
    with pytest.raises(router_policy.BadRequest, match=words):
        admit(**fields)


def test_admission_hands_routing_its_candidates_and_passes_switches_on():
    a = admit(prompt=b"hello")
    assert a.drafters == ["ngram"] and a.candidates == ["ngram", "lm"]  # the default first, then the rest
    assert (a.fusion, a.routing, a.adaptive_depth) == (common_pb2.FUSION_MODE_UNSPECIFIED, None, None)
    named = admit(prompt=b"hello", speculation={"drafters": ["lm"], "fusion": common_pb2.FUSION_MODE_MERGE,
                                                 "routing": False, "adaptive_depth": True, "pipelining": False})
    assert named.drafters == ["lm"] and named.candidates == []  # named drafters are used as they are
    assert (named.fusion, named.routing, named.adaptive_depth, named.pipelining) == (common_pb2.FUSION_MODE_MERGE, False, True, False)
    assert admit(prompt=b"hello", speculation={"disabled": True}).candidates == []


def test_context_limit():
    router_policy.check_lengths(100, 28, LIMITS)
    with pytest.raises(router_policy.BadRequest, match="context limit"):
        router_policy.check_lengths(100, 29, LIMITS)
