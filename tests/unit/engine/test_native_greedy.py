"""Greedy losslessness of the native engine: token-identical to `transformers` generate."""

from __future__ import annotations

import random

import pytest
import torch

from cosine.engine.llama import NativeLlama, Seq, _mkldnn_linear_works
from cosine.engine.native_target import NativeTarget
from cosine.engine.sampling import Sampling
from cosine.engine.tree import DraftTree

from .helpers import hf_greedy, speculative_greedy

pytestmark = pytest.mark.unit

N_NEW = 10


@pytest.mark.parametrize("linear", ["auto", "torch"])
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_logits_match_transformers(tiny_models, hf_models, name, linear):
    model = NativeLlama.from_pretrained(tiny_models[name], linear=linear)
    cache = model.new_cache(2, 64)
    ids = torch.randint(0, model.spec.vocab_size, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        ref = hf_models[name](torch.tensor([ids])).logits[0]
    slot = cache.allocate()
    model.forward([Seq(slot, ids[:12], list(range(12)), logits="none")], cache)
    out = model.forward([Seq(slot, ids[12:], list(range(12, 30)))], cache)[0]
    torch.testing.assert_close(out, ref[12:], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_few_row_steps_on_plain_weights_match_transformers(tiny_models, hf_models, name):
    """small_rows: steps of one or two rows multiply the plain weights (F.linear), longer ones the prepacked
    ones; both give transformers' logits, row by row."""
    if not _mkldnn_linear_works(torch.device("cpu"), torch.float32):
        pytest.skip("no oneDNN prepacked linear here: every step uses F.linear already")
    model = NativeLlama.from_pretrained(tiny_models[name], small_rows=2, linear="mkldnn")  # not CoSine's kernel
    assert model.small_rows == 2 and all(L.down_p is not None for L in model.layers)
    cache = model.new_cache(2, 64)
    ids = torch.randint(0, model.spec.vocab_size, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.inference_mode():
        ref = hf_models[name](torch.tensor([ids])).logits[0]
    slot = cache.allocate()
    model.forward([Seq(slot, ids[:12], list(range(12)), logits="none")], cache)
    at = 12
    for n in (1, 2, 1, 3, 2, 9):  # 1-2 rows: plain weights; 3 and 9: prepacked
        out = model.forward([Seq(slot, ids[at:at + n], list(range(at, at + n)))], cache)[0]
        torch.testing.assert_close(out, ref[at:at + n], atol=1e-4, rtol=1e-4)
        at += n


def test_plain_weights_are_kept_only_when_used(tiny_models):
    assert NativeLlama.from_pretrained(tiny_models["llama"], small_rows=0).layers[0].qkv_p is None
    bf16 = NativeLlama.from_pretrained(tiny_models["llama"], dtype=torch.bfloat16)  # measured only for fp32
    assert bf16.small_rows == 0 and bf16.layers[0].qkv_p is None
    auto = NativeLlama.from_pretrained(tiny_models["llama"])  # measured: kept exactly when used
    assert (auto.layers[0].qkv_p is not None) == (auto.small_rows > 0)


@pytest.mark.parametrize("name", ["llama", "qwen2"])
@pytest.mark.parametrize("batch", [1, 4, 8])
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_greedy_token_identical(tiny_models, hf_models, name, batch, shape):
    rng = random.Random(hash((name, batch, shape)) % 10_000)
    hf = hf_models[name]
    vocab = hf.config.vocab_size
    prompts = {f"r{i}": [rng.randrange(vocab) for _ in range(rng.randint(1, 40))] for i in range(batch)}
    refs = {rid: hf_greedy(hf, p, N_NEW + 12) for rid, p in prompts.items()}
    target = NativeTarget.from_pretrained(tiny_models[name], n_slots=batch + 2, max_context=128)
    got = speculative_greedy(target, prompts, refs, N_NEW, rng, chain=(shape == "chain"))
    for rid in prompts:
        assert got[rid] == refs[rid][:N_NEW], rid
    for rid in prompts:  # the committed tokens are prompt + produced (maybe a few more)
        assert target.committed(rid)[: len(prompts[rid]) + N_NEW] == prompts[rid] + refs[rid][:N_NEW]


def test_scattered_slots_and_interleaved_opens(tiny_models, hf_models):
    """Slots far apart (the cache is gathered, not viewed), requests joining and leaving between rounds."""
    rng = random.Random(7)
    hf = hf_models["llama"]
    target = NativeTarget.from_pretrained(tiny_models["llama"], n_slots=16, max_context=128)
    fillers = [f"f{i}" for i in range(14)]
    target.open_batch([(f, [1, 2, 3], 3) for f in fillers])
    for f in fillers[:-1]:
        target.release(f)  # slots 0..12 free, 13 busy
    prompts = {f"r{i}": [rng.randrange(96) for _ in range(rng.randint(2, 30))] for i in range(3)}
    refs = {rid: hf_greedy(hf, p, N_NEW + 12) for rid, p in prompts.items()}
    target.open("r0", prompts["r0"], len(prompts["r0"]))  # slot 0
    target.cache.allocate(), target.cache.allocate()  # hold slots 1, 2 back ...
    for s in range(3, 13):
        target.cache._free.remove(s) if s in target.cache._free else None
    target.open("r1", prompts["r1"], len(prompts["r1"]))  # ... so r1 lands on slot 15
    assert target.slot_of("r1") > 6
    produced = {"r0": [], "r1": []}
    tree = lambda: DraftTree([5, 9, 11], [-1, -1, 0])  # noqa: E731
    rnd = 0
    while rnd < 3 or any(len(t) < N_NEW for t in produced.values()):
        if rnd == 3:
            target.open("r2", prompts["r2"], len(prompts["r2"]))
            produced["r2"] = []
        rnd += 1
        live = [r for r in produced if len(produced[r]) < N_NEW]
        outs = target.verify_batch([(r, tree(), Sampling()) for r in live])
        for r, o in zip(live, outs):
            produced[r].extend(o.token_ids)
    for r, toks in produced.items():
        assert toks[:N_NEW] == refs[r][:N_NEW]


def test_verify_one_by_one_equals_batch(tiny_models):
    """verify() is verify_batch() of one; empty trees are one-token decodes."""
    a = NativeTarget.from_pretrained(tiny_models["llama"], n_slots=2, max_context=64)
    a.open("x", [3, 4, 5, 6], 4)
    outs = [a.verify("x", DraftTree(), Sampling()).token_ids for _ in range(5)]
    assert all(len(o) == 1 for o in outs)
    assert len(a) == 1 and "x" in a
    a.truncate("x", 4)
    assert a.committed("x") == [3, 4, 5, 6]
    again = [a.verify("x", DraftTree(), Sampling()).token_ids for _ in range(5)]
    assert again == outs
    a.release("x")
    assert len(a) == 0 and a.cache.free_slots == 2


def test_chunked_prefill_equals_one_pass(tiny_models):
    ids = list(range(1, 90))
    a = NativeTarget.from_pretrained(tiny_models["llama"], n_slots=2, max_context=128)
    a.open_batch([("x", ids, len(ids)), ("y", ids[:20], 20)], chunk=16)
    b = NativeTarget.from_pretrained(tiny_models["llama"], n_slots=1, max_context=128)
    b.open("x", ids, len(ids))
    n = len(ids) - 1
    sa, sb = a.slot_of("x"), b.slot_of("x")
    torch.testing.assert_close(a.cache.k[:, sa, :, :n], b.cache.k[:, sb, :, :n], atol=1e-5, rtol=1e-4)
    assert a.cache.lengths[a.slot_of("y")] == 19
    assert a.verify("x", DraftTree(), Sampling()).token_ids == b.verify("x", DraftTree(), Sampling()).token_ids


def test_make_target_picks_the_backend(tiny_models, tmp_path):
    from cosine.engine.hf_target import HFTarget
    from cosine.engine.native_target import make_target

    assert isinstance(make_target(tiny_models["qwen2"], n_slots=1, max_context=32), NativeTarget)
    assert isinstance(make_target(tiny_models["llama"], backend="transformers"), HFTarget)
