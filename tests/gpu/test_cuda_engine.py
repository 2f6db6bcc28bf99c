"""The native engine on a CUDA GPU: the same losslessness the CPU tests prove, on the device the services
run with `--device cuda`. Skipped without a GPU (CI has none); run them on one with
`pytest -m gpu tests/gpu` (tools/gpu_check.sh runs them and the engine benchmark)."""

from __future__ import annotations

import random

import pytest
import torch

from cosine.engine.hf_target import HFTarget
from cosine.engine.llama import NativeLlama, Seq
from cosine.engine.native_target import NativeTarget
from cosine.engine.sampling import Sampling
from cosine.engine.tree import DraftTree

from tests.unit.engine.helpers import hf_greedy, speculative_greedy

pytestmark = pytest.mark.gpu

N_NEW = 12


@pytest.fixture(autouse=True)
def _exact_fp32():
    """TF32 matmuls would make fp32 on the GPU a different arithmetic from fp32 on the CPU."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_logits_match_transformers_on_cuda(tiny_models, hf_models, name):
    model = NativeLlama.from_pretrained(tiny_models[name], device="cuda", dtype="float32")
    assert model.device.type == "cuda" and not model.packed  # oneDNN packing is a CPU path
    cache = model.new_cache(2, 64)
    assert cache.k.device.type == "cuda"
    ids = torch.randint(0, model.spec.vocab_size, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        ref = hf_models[name].to("cuda")(torch.tensor([ids], device="cuda")).logits[0]
    slot = cache.allocate()
    model.forward([Seq(slot, ids[:12], list(range(12)), logits="none")], cache)
    out = model.forward([Seq(slot, ids[12:], list(range(12, 30)))], cache)[0]
    torch.testing.assert_close(out, ref[12:], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["llama", "qwen2"])
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_greedy_token_identical_on_cuda(tiny_models, hf_models, name, batch, shape):
    rng = random.Random(hash((name, batch, shape, "cuda")) % 10_000)
    hf = hf_models[name].to("cpu")  # the reference: transformers fp32 on the CPU
    vocab = hf.config.vocab_size
    prompts = {f"r{i}": [rng.randrange(vocab) for _ in range(rng.randint(1, 40))] for i in range(batch)}
    refs = {rid: hf_greedy(hf, p, N_NEW + 12) for rid, p in prompts.items()}
    target = NativeTarget.from_pretrained(tiny_models[name], device="cuda", dtype="float32", n_slots=batch + 2,
                                          max_context=128)
    got = speculative_greedy(target, prompts, refs, N_NEW, rng, chain=(shape == "chain"))
    for rid in prompts:
        assert got[rid] == refs[rid][:N_NEW], rid


def _plain(target, rid, prompt, n):
    target.open(rid, prompt, len(prompt))
    out: list[int] = []
    while len(out) < n:
        out += target.verify(rid, DraftTree.chain([]), Sampling()).token_ids
    target.release(rid)
    return out[:n]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_speculation_equals_own_plain_decoding_on_cuda(tiny_models, dtype):
    """The rule the services hold on every device: speculative output = the same engine's plain decoding,
    in the same dtype (greedy). bf16 is what `--dtype auto` picks on CUDA."""
    rng = random.Random(11)
    target = NativeTarget.from_pretrained(tiny_models["llama"], device="cuda", dtype=dtype, n_slots=8, max_context=128)
    prompts = {f"r{i}": [rng.randrange(96) for _ in range(rng.randint(3, 30))] for i in range(4)}
    plain = {rid: _plain(target, rid, p, N_NEW + 12) for rid, p in prompts.items()}
    for chain in (True, False):
        got = speculative_greedy(target, prompts, plain, N_NEW, rng, chain=chain)
        for rid in prompts:
            target.release(rid)
        assert got == {rid: t[:N_NEW] for rid, t in plain.items()}, (dtype, chain)


def test_seeded_sampling_same_on_or_off_on_cuda(tiny_models):
    """Seeded sampling on the GPU: a request's tokens do not depend on what was drafted."""
    target = NativeTarget.from_pretrained(tiny_models["llama"], device="cuda", dtype="float32", n_slots=4,
                                          max_context=128)
    s = Sampling(temperature=0.9, top_p=0.95, top_k=0, seed=1234)
    prompt = [5, 17, 3, 44, 8]

    def run(drafted: bool) -> list[int]:
        target.open("a", prompt, len(prompt))
        out: list[int] = []
        rng = random.Random(3)
        while len(out) < N_NEW:
            toks = [rng.randrange(96) for _ in range(3)] if drafted else []
            out += target.verify("a", DraftTree.chain(toks), s).token_ids
        target.release("a")
        return out[:N_NEW]

    assert run(False) == run(True)


def test_hf_target_verifies_on_cuda(tiny_models, hf_models):
    """The transformers fallback engine on the GPU, against generate on the CPU."""
    from cosine.engine.models import load_causal_lm

    target = HFTarget(load_causal_lm(tiny_models["llama"], "cuda", "float32"))
    prompt = [4, 9, 33, 2, 71]
    ref = hf_greedy(hf_models["llama"].to("cpu"), prompt, N_NEW)
    target.open("h", prompt, len(prompt))
    out: list[int] = []
    while len(out) < N_NEW:
        out += target.verify("h", DraftTree.chain(ref[len(out):len(out) + 2] + [0]), Sampling()).token_ids
    assert out[:N_NEW] == ref
