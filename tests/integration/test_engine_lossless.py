"""The transformers backend and LM drafter against plain `generate()` on tiny random models."""

import random

import pytest
import torch

from cosine.engine.drafters import LMDrafter, NgramDrafter
from cosine.engine.hf_target import HFTarget
from cosine.engine.models import load_causal_lm
from cosine.engine.sampling import Sampling, target_probs
from cosine.engine.tree import DraftTree


@pytest.fixture(scope="module")
def tiny_target(tiny_dirs):
    return load_causal_lm(tiny_dirs["target"])


def reference(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(prompt):].tolist()


def speculate(engine, drafter_fn, prompt, n, sampling=Sampling()):
    engine.open("r", prompt, len(prompt))
    out = []
    while len(out) < n:
        res = engine.verify("r", drafter_fn(prompt + out), sampling)
        out += res.token_ids
    engine.release("r")
    return out[:n]


@pytest.mark.parametrize("depth", [1, 3, 6])
def test_greedy_with_random_and_correct_drafts_equals_generate(tiny_target, depth):
    rng = random.Random(depth)
    prompt = [rng.randrange(1000) for _ in range(11)]
    ref = reference(tiny_target, prompt, 40)
    engine = HFTarget(tiny_target)
    vocab = engine.vocab_size
    # random drafts: mostly rejected
    assert speculate(engine, lambda ctx: DraftTree.chain([rng.randrange(vocab) for _ in range(depth)]), prompt, 40) == ref
    # drafts taken from the reference with an occasional wrong token: mostly accepted
    def oracle(ctx):
        start = len(ctx) - len(prompt)
        chain = ref[start:start + depth]
        if chain and rng.random() < 0.3:
            chain[-1] = (chain[-1] + 1) % vocab
        return DraftTree.chain(chain)
    assert speculate(engine, oracle, prompt, 40) == ref


def test_seeded_sampling_is_the_same_with_and_without_speculation(tiny_target):
    prompt = list(range(5, 15))
    s = Sampling(temperature=1.0, top_k=50, seed=11)
    engine = HFTarget(tiny_target)
    plain = speculate(engine, lambda ctx: DraftTree(), prompt, 30, s)
    drafts = NgramDrafter()
    drafts.open("r", prompt)
    # an oracle that drafts the plain output: everything is accepted, so rounds are long
    spec = speculate(engine, lambda ctx: DraftTree.chain(plain[len(ctx) - len(prompt):][:4]), prompt, 30, s)
    assert spec == plain


def test_sampled_first_token_follows_the_target_distribution():
    """Point-mass verification of a draft chain: the first emitted token is distributed as the target's."""
    torch.manual_seed(0)
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=8, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, max_position_embeddings=64)
    model = LlamaForCausalLM(config).eval()
    prompt = [1, 2, 3]
    s = Sampling(temperature=1.0)
    with torch.no_grad():
        exact = target_probs(model(torch.tensor([prompt])).logits[0, -1:].float(), s)[0]
    engine = HFTarget(model)

    def tv(samples):
        counts = torch.bincount(torch.tensor(samples), minlength=8).double()
        return 0.5 * float((counts / counts.sum() - exact).abs().sum())

    drafted = int(exact.argmin())  # a draft the target rarely agrees with
    distances = {}
    for n in (200, 3200):
        samples = []
        for seed in range(n):
            engine.open("r", prompt, 3)
            samples.append(engine.verify("r", DraftTree.chain([drafted, 0]), Sampling(temperature=1.0, seed=seed)).token_ids[0])
            engine.release("r")
        distances[n] = tv(samples)
    draft_distance = 1 - float(exact[drafted])  # TV between the target and the point mass on the draft
    assert distances[3200] < distances[200] or distances[3200] < 0.02
    assert distances[3200] < 0.05 < draft_distance


@pytest.mark.parametrize("native", [False, True], ids=["transformers", "native"])
def test_lm_drafter_cache_matches_recomputation(tiny_dirs, native):
    from cosine.engine.drafters import NativeLMDrafter
    from cosine.engine.llama import NativeLlama

    model = load_causal_lm(tiny_dirs["drafter"])
    drafter = (NativeLMDrafter("tiny", NativeLlama.from_pretrained(tiny_dirs["drafter"]), n_slots=2, max_len=256)
               if native else LMDrafter("tiny", model))
    rng = random.Random(3)
    prompt = [rng.randrange(1000) for _ in range(9)]
    drafter.open("r", prompt)
    committed = list(prompt)
    new: list[int] = []
    for _ in range(6):
        tokens, probs = drafter.draft("r", new, 4)
        fresh = LMDrafter("fresh", model)  # transformers, no cache reuse: the reference
        fresh.open("f", committed)
        assert fresh.draft("f", [], 4)[0] == tokens
        assert all(0 < p <= 1 for p in probs)
        # the target accepts a random prefix, then a token of its own
        keep = rng.randrange(len(tokens) + 1)
        new = tokens[:keep] + [rng.randrange(1000)]
        committed += new
    drafter.release("r")
    assert "r" not in drafter
