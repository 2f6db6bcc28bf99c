"""The fused decode step (fp32 still token-identical to `transformers`), bf16 detection and `--dtype`."""

from __future__ import annotations

import random

import pytest
import torch

from cosine.engine import kernels, layers
from cosine.engine.llama import NativeLlama, Seq, _mkldnn_linear_works
from cosine.engine.models import cpu_bf16_flags, fast_bf16, resolve_dtype
from cosine.engine.native_target import NativeTarget
from cosine.engine.sampling import Sampling
from cosine.engine.tree import DraftTree

from .helpers import hf_greedy

pytestmark = pytest.mark.unit
needs_kernel_bf16 = pytest.mark.skipif(not kernels.available(torch.device("cpu"), torch.bfloat16),
                                       reason="CoSine's kernels need AVX512-BF16 and a C++ compiler")

N_NEW = 10


def test_auto_uses_a_fused_residual_add_on_cpu(tiny_models):
    """`linear="auto"` takes CoSine's kernel where it runs, else oneDNN's prepacked linear where that works;
    both add the residual inside the matmul call (the fused path these tests cover), and equal r + F.linear."""
    cpu = torch.device("cpu")
    onednn_works = _mkldnn_linear_works(cpu, torch.float32)
    auto = NativeLlama.from_pretrained(tiny_models["llama"])
    assert auto.kernel == kernels.available(cpu, torch.float32)
    assert auto.packed == (onednn_works and not auto.kernel)
    models = [auto]
    if onednn_works:
        onednn = NativeLlama.from_pretrained(tiny_models["llama"], linear="mkldnn")
        assert onednn.packed and not onednn.kernel
        models.append(onednn)
    assert not NativeLlama.from_pretrained(tiny_models["llama"], linear="torch").packed
    x, r = torch.randn(3, 64), torch.randn(3, 64)
    w = torch.randn(64, 64)
    for model in models:
        got = layers.linear_add(x, model._pack(w), None, r, None, 0, model.packed, 0, None, model.kernel)
        torch.testing.assert_close(got, r + torch.nn.functional.linear(x, w), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["llama", "qwen2"])
@pytest.mark.parametrize("batch", [1, 3])
def test_uniform_decode_batch_equals_transformers(tiny_models, hf_models, name, batch):
    """Equal-length rows, one token each (plain decoding of a batch) through the fused residual adds."""
    rng = random.Random(batch)
    hf = hf_models[name]
    vocab = hf.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(9)] for _ in range(batch)]
    refs = [hf_greedy(hf, p, N_NEW) for p in prompts]
    target = NativeTarget.from_pretrained(tiny_models[name], n_slots=batch, max_context=64)
    target.open_batch([(f"r{i}", p, len(p)) for i, p in enumerate(prompts)])
    got = [[] for _ in prompts]
    for _ in range(N_NEW):
        outs = target.verify_batch([(f"r{i}", DraftTree(), Sampling()) for i in range(batch)])
        for g, o in zip(got, outs):
            g.extend(o.token_ids)
    assert got == refs


def test_fused_and_unfused_logits_agree(tiny_models):
    """The post-op paths (residual adds inside the matmuls: CoSine's kernel, oneDNN's) against the separate ops."""
    ids = torch.randint(0, 96, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    outs = []
    for linear in ("auto", "mkldnn", "torch"):
        if linear == "mkldnn" and not _mkldnn_linear_works(torch.device("cpu"), torch.float32):
            continue
        model = NativeLlama.from_pretrained(tiny_models["llama"], linear=linear)
        cache = model.new_cache(1, 32)
        slot = cache.allocate()
        outs.append(model.forward([Seq(slot, ids, list(range(20)))], cache)[0])
    torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=1e-4)


def test_cpu_bf16_detection_reads_the_flags():
    amx = "processor\t: 0\nflags\t\t: fpu sse2 avx512f amx_bf16 amx_tile\n"
    zen = "processor\t: 0\nflags\t\t: fpu sse2 avx512f avx512_bf16\n"
    old = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f\n"
    assert cpu_bf16_flags(amx) == ["amx_bf16"]
    assert cpu_bf16_flags(zen) == ["avx512_bf16"]
    assert cpu_bf16_flags(old) == [] and not fast_bf16("cpu", old)
    assert fast_bf16("cpu", zen) and fast_bf16("cuda:0", old)


def test_auto_dtype_is_fp32_on_cpu_and_bf16_on_cuda():
    """auto stays fp32 on CPU even where bf16 is faster (see resolve_dtype: bf16 is lossless against its
    own plain decoding, but a different model from fp32's); bfloat16 is there by name."""
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("auto", "cuda") == torch.bfloat16 and resolve_dtype("auto", "cuda:1") == torch.bfloat16
    assert resolve_dtype("bfloat16", "cpu") == torch.bfloat16


def test_services_dtype_reaches_the_native_engine(tiny_models, tiny_dirs):
    """The verifier's and an LM drafter's --dtype reach the native engine (auto: fp32 on CPU)."""
    from cosine.drafter.__main__ import DrafterSettings, build
    from cosine.engine.native_target import make_target

    assert make_target(tiny_models["llama"], dtype="auto", n_slots=1, max_context=32).model.dtype == torch.float32
    assert make_target(tiny_models["llama"], dtype="bfloat16", n_slots=1, max_context=32).model.dtype == torch.bfloat16
    drafter, _ = build(DrafterSettings(name="tiny", kind="lm", model=str(tiny_dirs["drafter"]), dtype="bfloat16",
                                       threads=1))
    assert drafter.model.dtype == torch.bfloat16


def _side_branch_round(target: NativeTarget) -> tuple[int, object]:
    """A round whose target path runs off the tree's main chain: the target's token on a side branch (node 1),
    the main chain (node 0) wrong, and the side branch's child (node 2) wrong too, so that exactly one draft
    token is the target's. Returns (the target's token, the outcome)."""
    prompt = [5, 17, 3, 9]
    target.open("r", prompt, len(prompt))
    first, second = (target.verify("r", DraftTree(), Sampling()).token_ids[0] for _ in range(2))
    target.truncate("r", len(prompt))
    wrong, wrong_child = (first + 1) % target.vocab_size, (second + 1) % target.vocab_size
    return first, target.verify("r", DraftTree([wrong, first, wrong_child], [-1, -1, 1]), Sampling())


def test_bf16_with_sdpa_on_cpu_verifies_a_tree_along_its_main_chain(tiny_models):
    """With SDPA, off the main chain a node's ancestors sit at other cache positions than plain decoding gives
    them (bf16 rounds the different order into different tokens): bf16 on a CPU then verifies the main chain
    only, fp32 the whole tree. A tree whose target path runs off the main chain commits as a chain would."""
    fp32 = NativeTarget(NativeLlama.from_pretrained(tiny_models["llama"], attention="sdpa"), n_slots=1, max_context=64)
    bf16 = NativeTarget(NativeLlama.from_pretrained(tiny_models["llama"], dtype="bfloat16", attention="sdpa"),
                        n_slots=1, max_context=64)
    assert fp32.verifies_trees and not bf16.verifies_trees
    first, out = _side_branch_round(bf16)
    assert out.token_ids == [first] and out.accepted_draft == 0
    first32, out32 = _side_branch_round(fp32)
    assert out32.token_ids[0] == first32 and out32.accepted_draft == 1


@needs_kernel_bf16
def test_bf16_with_the_attention_kernel_verifies_the_whole_tree(tiny_models):
    """CoSine's attention kernel reads a node's keys in the order plain decoding has them: bf16 verifies
    whole trees, and a side branch the target agrees with is accepted."""
    bf16 = NativeTarget.from_pretrained(tiny_models["llama"], dtype="bfloat16", n_slots=1, max_context=64)
    assert bf16.model.attention_kernel and bf16.verifies_trees
    first, out = _side_branch_round(bf16)
    assert out.token_ids[0] == first and out.accepted_draft == 1


def test_caches_hold_a_whole_number_of_key_blocks(tiny_models):
    """The attention reads keys in blocks of KEY_BLOCK, so a cache's length is rounded up to one."""
    from cosine.engine.llama import KEY_BLOCK

    model = NativeLlama.from_pretrained(tiny_models["llama"])
    assert model.new_cache(1, 2 * KEY_BLOCK + 1).max_len == 3 * KEY_BLOCK
    assert model.new_cache(1, 2 * KEY_BLOCK).max_len == 2 * KEY_BLOCK
