"""CoSine's kernels (`cosine.engine.kernels`): the matmul (`csrc/packed_linear.cpp`) — the numbers of an fp32 and
a bf16 matmul, every row's bits independent of the rows that share its call, and the engine taking it where it
should — and the attention (`csrc/attention_rows.cpp`) — its numbers, a row's bits a function of the keys it
sees in their logical order alone, and a bf16 draft tree's every node given plain decoding's logits — and the
fused decoder step (`csrc/decoder_step.cpp`) against the TorchScript layers."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch

from cosine.engine import kernels, layers
from cosine.engine.llama import NativeLlama

from .helpers import rows_differing_from_alone, tree_nodes_differing_from_plain

pytestmark = pytest.mark.unit

CPU = torch.device("cpu")
needs_kernel = pytest.mark.skipif(not kernels.available(CPU, torch.bfloat16),
                                  reason="CoSine's bf16 kernel does not run here (no AVX512-BF16 on this CPU, or "
                                         "no C++ compiler to build it)")
needs_fp32_kernel = pytest.mark.skipif(not kernels.available(CPU, torch.float32),
                                       reason="CoSine's fp32 kernel does not run here (no AVX-512, or no C++ "
                                              "compiler)")
pack, packed_linear = (torch.ops.cosine.pack_weight, torch.ops.cosine.packed_linear)


def _bf16(*shape, gen):
    return torch.randn(*shape, generator=gen).bfloat16()


@needs_kernel
@pytest.mark.parametrize("n,k", [(960, 576), (48, 38), (16, 2), (64, 1536)])
def test_bf16_linear_equals_the_product_rounded_once(n, k):
    """x @ w.T + bias + residual, accumulated in fp32 and rounded to bf16 once: within one bf16 rounding of
    the fp32 product (each side rounds once; the sums' order differs)."""
    gen = torch.Generator().manual_seed(n + k)
    w, b, x, r = _bf16(n, k, gen=gen), _bf16(n, gen=gen), _bf16(9, k, gen=gen), _bf16(9, n, gen=gen)
    wp = pack(w)
    exact = r.float() + (x.float() @ w.float().T + b.float())
    got = packed_linear(x, wp, b, r).float()
    ulp = exact.abs().clamp(min=1e-3) * 2.0 ** -7  # one bf16 rounding of the result (8 significant bits)
    assert ((got - exact).abs() <= ulp + 1e-3).all()
    plain = (x.float() @ w.float().T).bfloat16()
    assert torch.allclose(packed_linear(x, wp).float(), plain.float(), rtol=2 ** -7, atol=1e-3)


@needs_fp32_kernel
@pytest.mark.parametrize("n,k", [(960, 576), (48, 37), (16, 1), (64, 1536)])
def test_fp32_linear_equals_the_product(n, k):
    """fp32: x @ w.T + bias + residual to fp32 rounding (float64 reference); any K, 1-13 rows (6-row tiles)."""
    gen = torch.Generator().manual_seed(n + k)
    w, b, x, r = (torch.randn(*sh, generator=gen) for sh in ((n, k), (n,), (13, k), (13, n)))
    exact = r.double() + x.double() @ w.double().T + b.double()
    for m in (1, 6, 13):
        got = packed_linear(x[:m], pack(w), b, r[:m]).double()
        assert torch.allclose(got, exact[:m], rtol=1e-5, atol=1e-4 * k ** 0.5), m


@needs_fp32_kernel
def test_fp32_linear_rows_do_not_depend_on_their_call():
    """Bitwise, fp32: each row of a call of 1-300 rows equals that row multiplied alone."""
    gen = torch.Generator().manual_seed(3)
    w, x = torch.randn(576, 1536, generator=gen), torch.randn(300, 1536, generator=gen)
    wp = pack(w)
    whole = packed_linear(x, wp)
    assert torch.equal(torch.cat([packed_linear(x[i:i + 1], wp) for i in range(40)]), whole[:40])
    for lo, m in [(0, 2), (3, 5), (7, 17), (1, 33), (11, 289)]:
        assert torch.equal(packed_linear(x[lo:lo + m], wp), whole[lo:lo + m]), (lo, m)


@needs_kernel
@pytest.mark.parametrize("n,k", [(3072, 576), (576, 1536)])
def test_bf16_linear_rows_do_not_depend_on_their_call(n, k):
    """Bitwise: each row of a call of 1-300 rows (6-row tiles up to 24 rows and 4-row tiles past them, their
    tails, several column runs per thread) equals that row multiplied alone. oneDNN's bf16 kernel does not
    promise this: on an AMD EPYC (AVX512-BF16) the target's down projection (576 x 1536) gave 2-4 of 64 rows
    other bits from 8 rows up."""
    gen = torch.Generator().manual_seed(0)
    w, b = _bf16(n, k, gen=gen), _bf16(n, gen=gen)
    wp = pack(w)
    x, r = _bf16(300, k, gen=gen), _bf16(300, n, gen=gen)
    whole = packed_linear(x, wp, b, r)
    alone = torch.cat([packed_linear(x[i:i + 1], wp, b, r[i:i + 1]) for i in range(40)])
    assert torch.equal(whole[:40], alone)
    for lo, m in [(0, 2), (3, 5), (7, 17), (1, 33), (2, 24), (2, 25), (11, 289)]:
        assert torch.equal(packed_linear(x[lo:lo + m], wp, b, r[lo:lo + m]), whole[lo:lo + m]), (lo, m)


@needs_kernel
def test_pack_refuses_shapes_it_cannot_hold():
    with pytest.raises(RuntimeError, match="multiple of 16"):
        pack(torch.zeros(24, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="K even"):
        pack(torch.zeros(16, 7, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="x \\[M, 8\\]"):
        packed_linear(torch.zeros(2, 6, dtype=torch.bfloat16), pack(torch.zeros(16, 8, dtype=torch.bfloat16)))


@needs_kernel
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_a_bf16_engine_on_the_kernel_gives_each_row_the_bits_of_the_token_decoded_alone(tiny_models, name):
    """The whole forward in bf16 on the kernel (qwen2: q/k/v biases): each row of a 4-request step of 3, 17
    or 33 new tokens has the logits of the same token decoded alone, bitwise, so a bf16 draft tree or chain
    is verified with plain decoding's numbers."""
    model = NativeLlama.from_pretrained(tiny_models[name], dtype=torch.bfloat16, linear="kernel")
    assert model.kernel and not model.packed and model.row_invariant
    assert rows_differing_from_alone(model, random.Random(1), (3, 17, 33), (4, 30), 96) == []


@needs_kernel
@needs_fp32_kernel
def test_auto_takes_the_kernel_in_fp32_and_in_bf16_where_onednn_is_not_row_invariant(tiny_models):
    """linear="auto": the kernel in fp32 wherever it runs, in bf16 exactly where oneDNN's bf16 matmuls failed
    the row-invariance check (row_chunk 0); "mkldnn" and "torch" never; fp16 has none."""
    auto = NativeLlama.from_pretrained(tiny_models["llama"], dtype=torch.bfloat16)
    onednn = NativeLlama.from_pretrained(tiny_models["llama"], dtype=torch.bfloat16, linear="mkldnn")
    assert auto.kernel == (onednn.packed and onednn.row_chunk == 0)
    assert auto.row_invariant and not onednn.kernel
    fp32 = NativeLlama.from_pretrained(tiny_models["llama"], dtype=torch.float32)
    assert fp32.kernel and not fp32.packed and fp32.head_plain is None  # no second copy of the weights
    assert not NativeLlama.from_pretrained(tiny_models["llama"], dtype=torch.float32, linear="mkldnn").kernel
    assert not NativeLlama.from_pretrained(tiny_models["llama"], dtype=torch.float32, linear="torch").kernel
    with pytest.raises(RuntimeError, match="kernel is not available"):
        NativeLlama.from_pretrained(tiny_models["llama"], dtype=torch.float16, linear="kernel")


def test_the_layers_compile_and_the_engine_runs_without_the_kernels(tiny_models):
    """COSINE_KERNELS=0 (as on a machine without a compiler or AVX-512): the ops' schemas alone are defined,
    TorchScript still compiles the layers, bf16 and fp32 engines take oneDNN, and asking for the kernel says
    why it cannot have it. A fresh interpreter: the kernels load once per process."""
    code = (
        "import torch\n"
        "from cosine.engine import kernels, layers\n"
        "from cosine.engine.llama import NativeLlama\n"
        "assert not kernels.load()\n"
        "assert isinstance(layers.scripted_decoder_layers, torch.jit.ScriptFunction)\n"
        f"m = NativeLlama.from_pretrained({str(tiny_models['llama'])!r}, dtype=torch.bfloat16)\n"
        "assert not m.kernel and not m.attention_kernel and not m.fused_step\n"
        f"assert not NativeLlama.from_pretrained({str(tiny_models['llama'])!r}).kernel\n"
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


def _attend(q, k, v, slots, prefix, offsets, index, scale=0.25):
    t = torch.tensor
    return torch.ops.cosine.attention_rows(q, k, v, t(slots), t(prefix), t(offsets), t(index, dtype=torch.long), scale)


@needs_kernel
@needs_fp32_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_rows_equal_softmax_attention_over_the_keys_each_row_sees(dtype):
    """Each row (grouped-query: 12 heads over 3 kv heads) against float64 softmax attention over its keys: the
    first `prefix` of its slot, then its listed positions in that order; within fp32 rounding, or one bf16
    rounding of the output."""
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(3, 3, 80, 32, generator=gen).to(dtype)
    v = torch.randn(3, 3, 80, 32, generator=gen).to(dtype)
    q = torch.randn(6, 12 + 6, 32, generator=gen).to(dtype)[:, :12]  # a view, as the layers pass it
    slots, prefix = [0, 1, 1, 2, 2, 0], [1, 40, 41, 3, 0, 79]
    extra = [[], [], [], [60, 7], [75, 4, 9], [79]]
    offsets = [0]
    for e in extra:
        offsets.append(offsets[-1] + len(e))
    out = _attend(q, k, v, slots, prefix, offsets, [i for e in extra for i in e])
    assert out.shape == (6, 12 * 32) and out.dtype == dtype
    for n in range(6):
        keys = list(range(prefix[n])) + extra[n]
        kk, vv = k[slots[n], :, keys].double(), v[slots[n], :, keys].double()  # [3, L, 32]
        qq = q[n].double().view(3, 4, 32)
        ref = torch.softmax(qq @ kk.transpose(1, 2) * 0.25, -1) @ vv
        tol = 1e-5 if dtype == torch.float32 else 2 ** -7
        torch.testing.assert_close(out[n].double(), ref.reshape(-1), atol=tol, rtol=tol)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_rows_bits_depend_on_the_logical_keys_alone(dtype):
    """A row's bits are the same alone or among others, from any slot, with its keys as a prefix or listed at
    other cache positions: what lets a tree's node, stored after its siblings, compute what plain decoding
    computes."""
    gen = torch.Generator().manual_seed(4)
    k = torch.randn(2, 2, 64, 16, generator=gen).to(dtype)
    v = torch.randn(2, 2, 64, 16, generator=gen).to(dtype)
    q = torch.randn(5, 4, 16, generator=gen).to(dtype)
    k[1, :, 50], v[1, :, 50] = k[0, :, 20], v[0, :, 20]  # slot 1 holds slot 0's keys 0..19, then key 20 at 50
    k[1, :, :20], v[1, :, :20] = k[0, :, :20], v[0, :, :20]
    alone = _attend(q[2:3], k, v, [0], [21], [0, 0], [])
    company = _attend(q, k, v, [0, 1, 0, 1, 0], [5, 33, 21, 0, 63], [0, 0, 0, 0, 2, 2], [3, 4])
    listed = _attend(q[2:3], k, v, [1], [20], [0, 1], [50])
    assert torch.equal(alone[0], company[2]) and torch.equal(alone, listed)


@needs_kernel
def test_attention_rows_refuses_what_it_cannot_read():
    q = torch.zeros(1, 4, 16)
    k = torch.zeros(1, 2, 8, 16)
    with pytest.raises(RuntimeError, match="key index out of range"):
        _attend(q, k, k, [0], [2], [0, 1], [8])
    with pytest.raises(RuntimeError, match="at least one key"):
        _attend(q, k, k, [0], [0], [0, 0], [])
    with pytest.raises(RuntimeError, match="slot out of range"):
        _attend(q, k, k, [1], [2], [0, 0], [])
    with pytest.raises(RuntimeError, match="head_dim"):
        _attend(torch.zeros(1, 4, 8), torch.zeros(1, 2, 8, 8), torch.zeros(1, 2, 8, 8), [0], [2], [0, 0], [])


@needs_kernel
@pytest.mark.parametrize("name", ["llama", "qwen2"])
@pytest.mark.parametrize("linear", ["auto", "kernel"])
def test_a_bf16_tree_gives_every_node_the_logits_of_plain_decoding(tiny_models, name, linear):
    """bf16 with the attention kernel: every node of 12-node trees with side branches, two requests to a step,
    has, bitwise, the logits plain decoding gives the same token after the same path (one token per step):
    through the TorchScript layers (oneDNN's matmuls, where they are row-invariant at these shapes) and through
    the fused decoder step on the matmul kernel.
    (These tiny models agree under SDPA too; the real target's test in test_real_target shows where SDPA
    does not.)"""
    model = NativeLlama.from_pretrained(tiny_models[name], dtype=torch.bfloat16, linear=linear)
    assert model.attention_kernel and model.row_invariant
    assert model.fused_step == model.kernel and (model.kernel or linear == "auto")  # kernel: the fused step
    assert tree_nodes_differing_from_plain(model, random.Random(5), (23, 9), trials=2) == []


@needs_kernel
@needs_fp32_kernel
@pytest.mark.parametrize("name", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_decoder_step_computes_what_the_layers_compute(tiny_models, name, dtype):
    """`decoder_step` (every layer of a decode or tree step in one C++ call) against the same model's TorchScript
    layers over the same kernels, after the same prefill: a 2-request step of a chain and a tree, logits within
    fp32 rounding (fp32) or a few bf16 roundings (bf16), and the next tokens the same."""
    from cosine.engine.llama import Seq

    fused = NativeLlama.from_pretrained(tiny_models[name], dtype=dtype, linear="kernel")
    layers_ = NativeLlama.from_pretrained(tiny_models[name], dtype=dtype, linear="kernel", fused_step=False)
    assert fused.fused_step and not layers_.fused_step and layers_.attention_kernel
    rng = random.Random(2)
    vocab = fused.spec.vocab_size
    ctx = [[rng.randrange(vocab) for _ in range(n)] for n in (19, 33)]
    outs = []
    for model in (fused, layers_):
        cache = model.new_cache(2, 64)
        model.forward([Seq(i, c[:-1], list(range(len(c) - 1)), logits="none", prompt=True)
                       for i, c in enumerate(ctx)], cache)
        chain = Seq(0, [ctx[0][-1], 5, 9, 2], list(range(18, 22)))
        tree = Seq(1, [ctx[1][-1], 4, 7, 8, 1], [32, 33, 33, 34, 34], [-1, 0, 0, 1, 2])
        outs.append(model.forward([chain, tree], cache))
    for a, b in zip(*outs):
        tol = 1e-4 if dtype == torch.float32 else 0.1
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)
        if dtype == torch.float32:
            assert torch.equal(a.argmax(-1), b.argmax(-1))


@needs_kernel
def test_a_step_on_the_attention_kernel_takes_its_requests_in_any_slot_order(tiny_models):
    """Only SDPA needs a step's requests in slot order (it views the cache in place); the attention kernel reads
    each row's keys where they are, so the step runs in the order given, with the same bits."""
    from cosine.engine.llama import Seq

    model = NativeLlama.from_pretrained(tiny_models["llama"], dtype=torch.bfloat16, linear="kernel")
    ctx = [[3, 9, 4, 1, 7], [8, 2, 6]]
    outs = []
    for order in ((0, 1), (1, 0)):
        cache = model.new_cache(2, 32)
        model.forward([Seq(i, c[:-1], list(range(len(c) - 1)), logits="none", prompt=True)
                       for i, c in enumerate(ctx)], cache)
        steps = {0: Seq(0, [ctx[0][-1], 5], [4, 5]), 1: Seq(1, [ctx[1][-1], 4, 7], [2, 3, 3], [-1, 0, 0])}
        got = model.forward([steps[i] for i in order], cache)
        outs.append({i: g for i, g in zip(order, got)})
    assert all(torch.equal(outs[0][i], outs[1][i]) for i in (0, 1))
