"""The native engine on the real target (SmolLM2-135M): greedy output identical to `transformers` generate."""

from __future__ import annotations

import random

import pytest
import torch

from cosine.engine.models import load_causal_lm
from cosine.engine.native_target import NativeTarget
from cosine.engine.sampling import Sampling
from cosine.engine.tree import DraftTree

from .helpers import hf_greedy, rows_differing_from_alone, speculative_greedy, tree_nodes_differing_from_plain

pytestmark = pytest.mark.e2e


def test_real_target_greedy_batch4_trees(target_dir):
    before = torch.get_num_threads()
    torch.set_num_threads(max(before, 2))
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(target_dir))
        texts = ["The capital of France is", "def fibonacci(n):\n    ",
                 "Once upon a time, in a small village by the sea, there lived an old fisherman who",
                 "1, 2, 3, 5, 8, 13,"]
        prompts = {f"r{i}": tok(t)["input_ids"] for i, t in enumerate(texts)}
        hf = load_causal_lm(target_dir)
        n_new = 16
        refs = {rid: hf_greedy(hf, p, n_new + 12) for rid, p in prompts.items()}
        target = NativeTarget.from_pretrained(target_dir, n_slots=4, max_context=256)
        for shape in ("tree", "chain"):
            got = speculative_greedy(target, prompts, refs, n_new, random.Random(shape), chain=shape == "chain")
            for rid in prompts:
                assert got[rid] == refs[rid][:n_new], (shape, rid)
            for rid in prompts:
                target.release(rid)
    finally:
        torch.set_num_threads(before)


def test_real_target_fp32_greedy_head_gives_the_full_heads_argmax(target_dir):
    """GreedyHead on the target's own hidden states (prompts of code, prose and chat, every row of each): the
    token of each row equals the argmax of the full fp32 logits."""
    from transformers import AutoTokenizer

    from cosine.engine.llama import NativeLlama, Seq

    model = NativeLlama.from_pretrained(target_dir, dtype="float32")
    if model.greedy_head is None:
        pytest.skip("no GreedyHead here (CoSine's fp32 and bf16 kernels do not both run)")
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    texts = ["def merge(a, b):\n    out = []\n    while a and b:\n", "The committee met on Tuesday to discuss the",
             tok.apply_chat_template([{"role": "user", "content": "Why is the sky blue?"}], tokenize=False,
                                     add_generation_prompt=True) + "The sky looks blue because"]
    cache = model.new_cache(2, 256)
    for text in texts:
        ids = tok(text)["input_ids"]
        slots = [cache.allocate(), cache.allocate()]
        pos = list(range(len(ids)))
        logits = model.forward([Seq(slots[0], ids, pos)], cache)[0]
        tokens = model.forward([Seq(slots[1], ids, pos, logits="greedy")], cache)[0]
        assert torch.equal(tokens, logits.argmax(dim=1)), text
        for s in slots:
            cache.release(s)


def test_real_target_fp32_few_row_steps_on_plain_weights_equal_transformers(target_dir):
    """fp32 on oneDNN (where CoSine's kernel does not run): steps of at most small_rows rows multiply the plain
    weights, the LM head's included (MKL's GEMV, not oneDNN's prepacked kernel): one request decoded alone,
    token by token, stays transformers' greedy."""
    from transformers import AutoTokenizer

    from cosine.engine.llama import NativeLlama

    before = torch.get_num_threads()
    torch.set_num_threads(max(before, 2))
    try:
        tok = AutoTokenizer.from_pretrained(str(target_dir))
        hf = load_causal_lm(target_dir)
        model = NativeLlama.from_pretrained(target_dir, dtype="float32", small_rows=2, linear="mkldnn")
        assert model.head_plain is not None and model.head_small_rows == 2
        target = NativeTarget(model, 256, 1)
        for text in ["The capital of France is", "def fibonacci(n):\n    ", "1, 2, 3, 5, 8, 13,"]:
            prompt = tok(text)["input_ids"]
            target.open("r", prompt, len(prompt))
            got: list[int] = []
            while len(got) < 20:
                got += target.verify_batch([("r", DraftTree(), Sampling())])[0].token_ids
            target.release("r")
            assert got[:20] == hf_greedy(hf, prompt, 20), text
    finally:
        torch.set_num_threads(before)


TEXTS_BF16 = ["The capital of France is", "def fibonacci(n):\n    ",
              "Once upon a time, in a small village by the sea, there lived an old fisherman who",
              "1, 2, 3, 5, 8, 13,", "The three laws of thermodynamics are", "SELECT name, count(*) FROM users",
              "Dear hiring manager,\n\nI am writing to", "import numpy as np\nimport torch\n\ndef train(model, data):"]


def _plain(target, prompts: dict[str, list[int]], n_new: int, resume: dict[str, list[int]] | None = None):
    """Plain decoding of every request, batched; `resume`: tokens already generated, prefilled with the prompt."""
    from cosine.engine.sampling import Sampling
    from cosine.engine.tree import DraftTree

    done = {rid: list((resume or {}).get(rid, [])) for rid in prompts}
    target.open_batch([(rid, p + done[rid], len(p)) for rid, p in prompts.items()])
    while live := [rid for rid in prompts if len(done[rid]) < n_new]:
        for rid, out in zip(live, target.verify_batch([(rid, DraftTree(), Sampling()) for rid in live])):
            done[rid].extend(out.token_ids)
    for rid in prompts:
        target.release(rid)
    return {rid: toks[:n_new] for rid, toks in done.items()}


@pytest.fixture
def bf16_model(target_dir):
    """The real target on the native engine in bf16, 2 threads at least; skipped where this CPU's bf16
    matmuls are not row-invariant (neither oneDNN's, checked at load, nor CoSine's kernel, which needs
    AVX512-BF16)."""
    from cosine.engine.llama import NativeLlama

    before = torch.get_num_threads()
    torch.set_num_threads(max(before, 2))
    try:
        model = NativeLlama.from_pretrained(target_dir, dtype=torch.bfloat16)
        if not model.row_invariant:
            pytest.skip("bf16 matmuls on this CPU are not row-invariant (oneDNN's are not here, and CoSine's bf16 "
                        "kernel does not run here)")
        yield model
    finally:
        torch.set_num_threads(before)


def test_real_target_bf16_speculation_and_resume_equal_plain_decoding(bf16_model, target_dir):
    """bf16 on a CPU: a row's logits do not depend on the rows that share its step (matmuls in calls of
    at most row_chunk rows or CoSine's kernel, each new token its own attention problem), and a tree is
    verified whole where CoSine's attention kernel runs (each node over its keys in plain decoding's order),
    else along its main chain. So speculative output, with trees or chains, and a request resumed from its
    committed tokens (a failover's prefill) equal the same engine's own plain bf16 decoding on the real
    target, token for token. Before: 2 of 8 requests equal within 48 tokens (Intel Xeon with AMX)."""
    from transformers import AutoTokenizer

    model = bf16_model
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    prompts = {f"r{i}": tok(t)["input_ids"] for i, t in enumerate(TEXTS_BF16)}
    target = NativeTarget(model, max_context=256, n_slots=len(prompts))
    assert target.verifies_trees == model.attention_kernel
    n_new = 48
    plain = _plain(target, prompts, n_new + 12)
    for shape in ("tree", "chain"):
        got = speculative_greedy(target, prompts, plain, n_new, random.Random(shape), chain=shape == "chain")
        for rid in prompts:
            target.release(rid)
        assert got == {rid: toks[:n_new] for rid, toks in plain.items()}, shape
    resumed = _plain(target, prompts, n_new, resume={rid: toks[:13] for rid, toks in plain.items()})
    assert resumed == {rid: toks[:n_new] for rid, toks in plain.items()}


def test_real_target_bf16_rows_do_not_depend_on_their_step(bf16_model):
    """bf16 on a CPU, bitwise: each row of a many-row step (4 requests x 11, 17 or 33 new tokens: SDPA's
    query blocks, matmuls of more than 32 rows) has the logits of the same token decoded alone, one token
    per request per step. Without each token as its own attention problem, 79 of 244 rows differed."""
    assert rows_differing_from_alone(bf16_model, random.Random(0), (11, 17, 33), (8, 40), 128) == []


def test_real_target_bf16_tree_nodes_get_plain_decodings_logits(bf16_model):
    """bf16 on a CPU with CoSine's attention kernel, bitwise: every node of 12-node trees with side branches
    (two requests a step, 3 steps) has the logits plain decoding gives the same token after the same path.
    With SDPA, 5 of these 72 nodes differed (their ancestors stored after siblings: the same terms summed
    in another grouping), which is why trees were verified along their main chain only."""
    if not bf16_model.attention_kernel:
        pytest.skip("CoSine's attention kernel does not run here: bf16 trees are verified along their main chain")
    assert tree_nodes_differing_from_plain(bf16_model, random.Random(5), (83, 41), trials=3) == []


def test_real_target_bf16_prompt_prefill_does_not_depend_on_its_company(bf16_model):
    """bf16 on a CPU: prompts prefilled together (one forward, `Seq.prompt` rows: one attention problem per
    request, and a long prompt's rows multiplied in calls of their own) leave each request's cache bitwise
    what prefilling it alone leaves, so the verifier may batch the prefills of a step's new requests without
    changing any request's output. The company is longer and shorter and comes first (shifting where the
    shared 32-row matmul calls start), and the request's first plain steps after it are equal too."""
    model = bf16_model
    rng = random.Random(7)
    vocab = model.spec.vocab_size
    for length in (37, 100):
        prompt = [rng.randrange(vocab) for _ in range(length)]
        company = [[rng.randrange(vocab) for _ in range(n)] for n in (13, 90, 12, 55)]
        alone = NativeTarget(model, max_context=256, n_slots=5)
        alone.open_batch([("a", prompt, len(prompt))])
        shared = NativeTarget(model, max_context=256, n_slots=5)
        shared.open_batch([(f"b{i}", c, len(c)) for i, c in enumerate(company[:2])] + [("a", prompt, len(prompt))]
                          + [(f"b{i}", c, len(c)) for i, c in enumerate(company[2:], 2)])
        n = len(prompt) - 1
        sa, ss = alone.slot_of("a"), shared.slot_of("a")
        assert torch.equal(alone.cache.k[:, sa, :, :n], shared.cache.k[:, ss, :, :n]), length
        assert torch.equal(alone.cache.v[:, sa, :, :n], shared.cache.v[:, ss, :, :n]), length
        for _ in range(6):
            got = [t.verify_batch([("a", DraftTree(), Sampling())])[0].token_ids for t in (alone, shared)]
            assert got[0] == got[1], length
