"""CoSine's bf16 kernel (`cosine.engine.kernels`, `csrc/bf16_linear.cpp`): the numbers of a bf16 matmul, every
row's bits independent of the rows that share its call, and the engine taking it where it should."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch

from cosine.engine import kernels, layers
from cosine.engine.llama import NativeLlama, Seq

pytestmark = pytest.mark.unit

needs_kernel = pytest.mark.skipif(not kernels.load(), reason="CoSine's bf16 kernel does not run here (no AVX512-BF16 "
                                                             "on this CPU, or no C++ compiler to build it)")


def _bf16(*shape, gen):
    return torch.randn(*shape, generator=gen).bfloat16()


@needs_kernel
@pytest.mark.parametrize("n,k", [(960, 576), (48, 38), (16, 2), (64, 1536)])
def test_bf16_linear_equals_the_product_rounded_once(n, k):
    """x @ w.T + bias + residual, accumulated in fp32 and rounded to bf16 once: within one bf16 rounding of
    the fp32 product (each side rounds once; the sums' order differs)."""
    gen = torch.Generator().manual_seed(n + k)
    w, b, x, r = _bf16(n, k, gen=gen), _bf16(n, gen=gen), _bf16(9, k, gen=gen), _bf16(9, n, gen=gen)
    wp = torch.ops.cosine.bf16_pack(w)
    exact = r.float() + (x.float() @ w.float().T + b.float())
    got = torch.ops.cosine.bf16_linear(x, wp, b, r).float()
    ulp = exact.abs().clamp(min=1e-3) * 2.0 ** -7  # one bf16 rounding of the result (8 significant bits)
    assert ((got - exact).abs() <= ulp + 1e-3).all()
    plain = (x.float() @ w.float().T).bfloat16()
    assert torch.allclose(torch.ops.cosine.bf16_linear(x, wp).float(), plain.float(), rtol=2 ** -7, atol=1e-3)


@needs_kernel
@pytest.mark.parametrize("n,k", [(3072, 576), (576, 1536)])
def test_bf16_linear_rows_do_not_depend_on_their_call(n, k):
    """Bitwise: each row of a call of 1-300 rows (the 4-row tiles, their tails, several column runs per
    thread) equals that row multiplied alone. oneDNN's bf16 kernel does not promise this: on an AMD EPYC
    (AVX512-BF16) the target's down projection (576 x 1536) gave 2-4 of 64 rows other bits from 8 rows up."""
    gen = torch.Generator().manual_seed(0)
    w, b = _bf16(n, k, gen=gen), _bf16(n, gen=gen)
    wp = torch.ops.cosine.bf16_pack(w)
    x, r = _bf16(300, k, gen=gen), _bf16(300, n, gen=gen)
    whole = torch.ops.cosine.bf16_linear(x, wp, b, r)
    alone = torch.cat([torch.ops.cosine.bf16_linear(x[i:i + 1], wp, b, r[i:i + 1]) for i in range(40)])
    assert torch.equal(whole[:40], alone)
    for lo, m in [(0, 2), (3, 5), (7, 17), (1, 33), (11, 289)]:
        assert torch.equal(torch.ops.cosine.bf16_linear(x[lo:lo + m], wp, b, r[lo:lo + m]), whole[lo:lo + m]), (lo, m)


@needs_kernel
def test_bf16_pack_refuses_shapes_it_cannot_hold():
    with pytest.raises(RuntimeError, match="multiple of 16"):
        torch.ops.cosine.bf16_pack(torch.zeros(24, 8, dtype=torch.bfloat16))


@needs_kernel
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_a_bf16_engine_on_the_kernel_gives_each_row_the_bits_of_the_token_decoded_alone(tiny_models, name):
    """The whole forward in bf16 on the kernel (qwen2: q/k/v biases): each row of a 4-request step of 3, 17
    or 33 new tokens has the logits of the same token decoded alone, bitwise, so a bf16 draft tree or chain
    is verified with plain decoding's numbers."""
    model = NativeLlama.from_pretrained(tiny_models[name], dtype=torch.bfloat16, linear="kernel")
    assert model.kernel and not model.packed and model.row_invariant
    rng = random.Random(1)
    vocab = model.spec.vocab_size
    differing = []
    for n_rows in (3, 17, 33):
        ctxs = [[rng.randrange(vocab) for _ in range(rng.randint(4, 30))] for _ in range(4)]
        new = [[rng.randrange(vocab) for _ in range(n_rows)] for _ in range(4)]
        cache = model.new_cache(4, 96)
        model.forward([Seq(i, c, list(range(len(c))), logits="none") for i, c in enumerate(ctxs)], cache)
        step = model.forward([Seq(i, t, list(range(len(c), len(c) + n_rows))) for i, (c, t) in enumerate(zip(ctxs, new))],
                             cache)
        for i, c in enumerate(ctxs):
            cache.truncate(i, len(c))
        for j in range(n_rows):
            alone = model.forward([Seq(i, [new[i][j]], [len(c) + j]) for i, c in enumerate(ctxs)], cache)
            differing += [(n_rows, i, j) for i in range(4) if not torch.equal(alone[i][0], step[i][j])]
    assert differing == []


@needs_kernel
def test_auto_takes_the_kernel_in_bf16_only_where_onednn_is_not_row_invariant(tiny_models):
    """linear="auto": the kernel in bf16 exactly where oneDNN's bf16 matmuls failed the row-invariance check
    (row_chunk 0), never in fp32; "mkldnn" never."""
    auto = NativeLlama.from_pretrained(tiny_models["llama"], dtype=torch.bfloat16)
    onednn = NativeLlama.from_pretrained(tiny_models["llama"], dtype=torch.bfloat16, linear="mkldnn")
    assert auto.kernel == (onednn.packed and onednn.row_chunk == 0)
    assert auto.row_invariant and not onednn.kernel
    assert not NativeLlama.from_pretrained(tiny_models["llama"], dtype=torch.float32).kernel
    with pytest.raises(RuntimeError, match="bf16 kernel is not available"):
        NativeLlama.from_pretrained(tiny_models["llama"], dtype=torch.float32, linear="kernel")


def test_the_layers_compile_and_the_engine_runs_without_the_kernels(tiny_models):
    """COSINE_KERNELS=0 (as on a machine without a compiler or AVX512-BF16): the ops' schemas alone are
    defined, TorchScript still compiles the layers, a bf16 engine takes oneDNN, and asking for the kernel
    says why it cannot have it. A fresh interpreter: the kernels load once per process."""
    code = (
        "import torch\n"
        "from cosine.engine import kernels, layers\n"
        "from cosine.engine.llama import NativeLlama\n"
        "assert not kernels.load()\n"
        "assert isinstance(layers.scripted_decoder_layers, torch.jit.ScriptFunction)\n"
        f"m = NativeLlama.from_pretrained({str(tiny_models['llama'])!r}, dtype=torch.bfloat16)\n"
        "assert not m.kernel\n"
        "try:\n"
        f"    NativeLlama.from_pretrained({str(tiny_models['llama'])!r}, dtype=torch.bfloat16, linear='kernel')\n"
        "except RuntimeError as e:\n"
        "    assert 'not available' in str(e)\n"
        "else:\n"
        "    raise AssertionError('linear=kernel without the kernels loaded')\n"
        "print('ok')\n"
    )
    env = {**os.environ, "COSINE_KERNELS": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_the_layers_are_torchscript_with_the_kernels_named():
    assert isinstance(layers.scripted_decoder_layers, torch.jit.ScriptFunction)
