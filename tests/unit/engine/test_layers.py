"""The decoder layers run by TorchScript give the bits the same functions give as Python, on every path of a
pass: decode steps, trees (per-row attention in bf16), prompt prefills (per-request attention and whole
calls), rows gathered from scattered slots, and steps over the fp32 few-row weights."""

from __future__ import annotations

import random

import pytest
import torch

from cosine.engine import layers
from cosine.engine.llama import NativeLlama, Seq, _mkldnn_linear_works

pytestmark = pytest.mark.unit


def test_the_layers_are_compiled_by_torchscript_on_cpu(tiny_models):
    assert isinstance(layers.scripted_decoder_layers, torch.jit.ScriptFunction)
    assert NativeLlama.from_pretrained(tiny_models["llama"])._decoder is layers.scripted_decoder_layers


def _passes(vocab: int, rng: random.Random) -> list[list[Seq]]:
    """A prefill of prompts (one long enough for calls of its own), decode steps, a tree and a chain,
    then a step whose slots are scattered (gathered attention rows)."""
    def toks(n):
        return [rng.randrange(vocab) for _ in range(n)]

    lengths = [5, 70, 9]
    prefill = [Seq(slot, toks(n), list(range(n)), logits="all", prompt=True) for slot, n in enumerate(lengths)]
    decode = [Seq(slot, toks(1), [n], logits="all") for slot, n in enumerate(lengths)]
    tree = [Seq(0, toks(4), [6, 7, 7, 8], parents=[-1, 0, 0, 1]), Seq(1, toks(3), [71, 72, 73]),
            Seq(2, toks(1), [10])]
    scattered = [Seq(0, toks(1), [10]), Seq(7, toks(2), [0, 1])]  # slots far apart: gathered
    return [prefill, decode, tree, scattered]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("small_rows", [0, 2])
def test_scripted_layers_give_the_python_bits(tiny_models, dtype, small_rows):
    if dtype == torch.bfloat16 and small_rows:
        pytest.skip("few-row plain weights are an fp32 path")
    # few-row plain weights are oneDNN's companion (linear="mkldnn"); "auto" takes CoSine's kernel where it runs
    linear = "mkldnn" if small_rows else "auto"
    if linear == "mkldnn" and not _mkldnn_linear_works(torch.device("cpu"), dtype):
        pytest.skip("no oneDNN prepacked linear here")
    logits = {}
    for mode in ("script", "python"):
        model = NativeLlama.from_pretrained(tiny_models["llama"], dtype=dtype, small_rows=small_rows, linear=linear)
        if mode == "python":
            model._decoder = layers.decoder_layers
        cache = model.new_cache(8, 128)
        for _ in range(8):
            cache.allocate()
        rng = random.Random(0)
        outs = []
        for batch in _passes(model.spec.vocab_size, rng):
            # the tree pass and the scattered pass start where the earlier passes left their slots
            for q in batch:
                q.positions = [cache.lengths[q.slot] + p - min(q.positions) for p in q.positions]
            outs.extend(o for o in model.forward(batch, cache) if o is not None)
        logits[mode] = outs
    assert len(logits["script"]) == len(logits["python"]) == 11
    for a, b in zip(logits["script"], logits["python"]):
        assert torch.equal(a, b)
