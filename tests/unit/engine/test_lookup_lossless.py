"""The verifier's lookup on the real (tiny) native target: the same tokens with it on and off, greedy and seeded
sampling (each position's draw is seeded by its place, so a looked-up token is accepted only where the target's own
draw is that token)."""

from __future__ import annotations

import pytest

from cosine.engine.native_target import make_target
from cosine.engine.sampling import Sampling
from tests.unit.verifier.test_lookup import run_rounds

pytestmark = pytest.mark.unit

PROMPT = [3, 1, 4, 1, 5, 2, 6, 5, 3, 5]


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=0.9, top_p=0.95, seed=7)], ids=["greedy", "seeded"])
def test_the_target_writes_the_same_tokens_with_lookup_on_and_off(tiny_models, sampling):
    outs = {}
    for k in (0, 8):  # an 8-token vocabulary repeats itself soon, sampled too: the lookup finds plenty
        target = make_target(tiny_models["tinyvocab"], "cpu", "float32", n_slots=2, max_context=128, backend="native")
        target.open("r", PROMPT, len(PROMPT))
        (o,), _ = run_rounds(target, [("r", 64, k)], sampling=sampling)
        outs[k] = o
        assert target.committed("r") == PROMPT + o.token_ids
    # 64 steps write at least 64 tokens (or fill the context, 118 tokens after the prompt)
    assert len(outs[0].token_ids) == 64 and outs[8].token_ids[:64] == outs[0].token_ids
    assert outs[0].lookup_drafted == 0 and 0 < outs[8].lookup_accepted <= outs[8].lookup_drafted
