"""Both target engines fulfil the verifier's contract (`TargetEngine`), and the batcher needs nothing else."""

from __future__ import annotations

import asyncio

import pytest

from cosine.common.streams import ModelWorker
from cosine.engine.hf_target import HFTarget
from cosine.engine.llama import NativeLlama
from cosine.engine.models import load_causal_lm
from cosine.engine.native_target import NativeTarget
from cosine.engine.sampling import Sampling
from cosine.engine.target import TargetEngine
from cosine.engine.tree import DraftTree
from cosine.verifier.batcher import VerifyBatcher

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def engines(tiny_models):
    path = tiny_models["tinyvocab"]
    return {"native": NativeTarget(NativeLlama.from_pretrained(path), max_context=64, n_slots=2),
            "transformers": HFTarget(load_causal_lm(path), max_context=64)}


@pytest.mark.parametrize("name", ["native", "transformers"])
def test_engine_fulfils_the_contract(engines, name):
    engine = engines[name]
    assert isinstance(engine, TargetEngine)
    assert engine.verifies_trees is (name == "native")
    assert isinstance(engine.kv_bytes_per_token, int) and engine.kv_bytes_per_token >= 0
    assert (engine.kv_bytes_per_token > 0) is (name == "native")  # native preallocates slots


@pytest.mark.parametrize("name", ["native", "transformers"])
async def test_the_batcher_drives_either_engine_through_the_contract_alone(engines, name):
    engine = engines[name]
    worker = ModelWorker(f"test-{name}")
    batcher = VerifyBatcher(engine, worker, policy="objective")
    try:
        for rid in ("a", "b"):
            engine.open(rid, [1, 2, 3, 4], 4)
        tree = DraftTree([5, 6, 7], [-1, 0, 0])
        outcomes = await asyncio.gather(*(batcher.verify(rid, tree, Sampling()) for rid in ("a", "b")))
        for (outcome, _), rid in zip(outcomes, ("a", "b")):
            assert engine.committed(rid) == [1, 2, 3, 4] + outcome.token_ids
            assert engine.context_len(rid) == 4 + len(outcome.token_ids)
        assert outcomes[0][0].token_ids == outcomes[1][0].token_ids  # same context, same greedy verdict
    finally:
        await batcher.close()
        for rid in ("a", "b"):
            engine.release(rid)
