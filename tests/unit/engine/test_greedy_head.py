"""`GreedyHead`: the greedy token of fp32 logits from a bf16 screen, a bound, and the close candidates exact —
always the full fp32 head's argmax (ties to the first index), and the engine taking it for greedy rows only."""

from __future__ import annotations

import random

import pytest
import torch

from cosine.engine.greedy_head import GreedyHead
from cosine.engine.llama import NativeLlama, Seq
from cosine.engine.native_target import NativeTarget
from cosine.engine.sampling import Sampling
from cosine.engine.tree import DraftTree

from .helpers import hf_greedy, speculative_greedy

pytestmark = [pytest.mark.unit,
              pytest.mark.skipif(not GreedyHead.supported(torch.device("cpu")),
                                 reason="CoSine's fp32 and bf16 kernels do not both run here (AVX-512 with "
                                        "AVX512-BF16, and a C++ compiler)")]


def _full(packed):
    return lambda x: torch.ops.cosine.packed_linear(x, packed)


def _head(w: torch.Tensor) -> tuple[GreedyHead, torch.Tensor]:
    packed = torch.ops.cosine.pack_weight(w.contiguous())
    return GreedyHead(packed), packed


@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("scale", [0.3, 3.0, 30.0])
def test_tokens_are_the_full_heads_argmax(rows, scale):
    gen = torch.Generator().manual_seed(rows)
    head, packed = _head(torch.randn(4096, 96, generator=gen) * 0.05)
    x = torch.randn(rows, 96, generator=gen) * scale
    assert torch.equal(head.tokens(x), _full(packed)(x).argmax(dim=1))


def test_the_bound_holds_for_every_logit():
    """|exact - screened| <= bound for every vocabulary row: what makes dropping a row safe."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(2048, 576, generator=gen) * torch.rand(2048, 1, generator=gen)  # rows of many norms
    head, packed = _head(w)
    for scale in (0.01, 1.0, 100.0):
        x = torch.randn(8, 576, generator=gen) * scale
        approx = torch.ops.cosine.packed_linear(x.bfloat16(), head.screen).double()
        exact = _full(packed)(x).double()
        tokens, bound = head.screened(x)
        assert ((exact - approx).abs() <= bound[:, None]).all()
        assert torch.equal(tokens, exact.argmax(dim=1))
        # and it is no formality: the screen is off by more than a rounding of the exact logits
        assert ((exact - approx).abs() > exact.abs() * 2.0 ** -20).any()


def test_near_ties_and_exact_ties_go_where_the_full_head_puts_them():
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(512, 64, generator=gen) * 0.1
    w[300] = w[40]  # an exact tie with an earlier row: the first index wins
    w[41] = w[40]
    w[41, 5] = torch.nextafter(w[41, 5], torch.tensor(float("inf")))  # one ulp apart
    w[450] = w[40] * (1 + 2.0 ** -22)
    w[400:500] = w[40] + torch.randn(100, 64, generator=gen) * 1e-4  # closer than bf16 can tell apart
    head, packed = _head(w)
    screen_wrong = 0
    for sign in (1.0, -1.0):
        for r in range(20):
            x = w[40:41] * 5 + sign * torch.randn(1, 64, generator=gen) * 1e-3 * r
            x[0, 5] = x[0, 5].abs() * sign
            full = _full(packed)(x)
            assert torch.equal(head.tokens(x), full.argmax(dim=1))
            screen = torch.ops.cosine.packed_linear(x.bfloat16(), head.screen)
            screen_wrong += int(screen.argmax()) != int(full.argmax())
    assert screen_wrong > 0  # the screen alone would have picked another token: the exact pass decided
    x = w[40:41] * 5
    assert int(head.tokens(x)) == int(_full(packed)(x).argmax())


def test_rows_it_cannot_screen_take_the_full_head_or_raise():
    head, packed = _head(torch.randn(256, 32, generator=torch.Generator().manual_seed(5)))
    x = torch.randn(2, 32)
    x[1, 3] = float("nan")
    full = _full(packed)
    assert torch.equal(head.tokens(x, full), full(x).argmax(dim=1))
    with pytest.raises(ValueError, match="no full head"):
        head.tokens(x)
    tokens, _ = head.screened(x)
    assert tokens[1] == -1 and tokens[0] == full(x[:1]).argmax()
    few, _ = torch.ops.cosine.greedy_tokens(x[:1], head.screen, packed, head.w_norm, head.wb_norm, head.d_norm, 0)
    assert few.tolist() == [-1]  # more candidates than allowed: the caller's full head


def test_the_engine_uses_it_for_greedy_rows_and_logits_elsewhere(tiny_models):
    model = NativeLlama.from_pretrained(tiny_models["llama"])
    assert model.greedy_head is not None and model.kernel
    assert NativeLlama.from_pretrained(tiny_models["llama"], greedy_head=False).greedy_head is None
    assert NativeLlama.from_pretrained(tiny_models["llama"], dtype=torch.bfloat16).greedy_head is None
    cache = model.new_cache(3, 64)
    ids = torch.randint(0, model.spec.vocab_size, (24,), generator=torch.Generator().manual_seed(6)).tolist()
    slots = [cache.allocate() for _ in range(3)]
    for s in slots:
        model.forward([Seq(s, ids[:16], list(range(16)), logits="none")], cache)
    new = list(range(16, 24))
    out = model.forward([Seq(slots[0], ids[16:], new, logits="greedy"), Seq(slots[1], ids[16:], new),
                         Seq(slots[2], ids[16:], new, logits="greedy")], cache, hidden=True)
    (t0, h0), (lg, h1), (t2, _) = out
    assert t0.dtype == torch.long and t0.shape == (8,) and lg.shape == (8, model.spec.vocab_size)
    assert torch.equal(t0, lg.argmax(dim=1)) and torch.equal(t2, t0) and torch.equal(h0, h1)


@pytest.mark.parametrize("chain", [True, False])
def test_speculative_greedy_on_it_equals_transformers(tiny_models, hf_models, chain):
    target = NativeTarget(NativeLlama.from_pretrained(tiny_models["llama"]), n_slots=4)
    assert target.model.greedy_head is not None
    rng = random.Random(7)
    prompts = {f"r{i}": [rng.randrange(target.vocab_size) for _ in range(5 + 3 * i)] for i in range(3)}
    refs = {rid: hf_greedy(hf_models["llama"], p, 12) for rid, p in prompts.items()}
    assert speculative_greedy(target, prompts, refs, 12, rng, chain=chain) == refs
    tree = DraftTree([3, 4], [-1, 0], [0.5, 0.5])
    out = target.verify_batch([("r0", tree, Sampling(temperature=1.0, seed=1))])  # sampled rows: logits
    assert len(out[0].token_ids) >= 1
