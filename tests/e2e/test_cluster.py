"""The local cluster against the target alone: same tokens, drafting that is accepted, clean cancels."""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
import pytest
import redis.asyncio as aioredis
import torch

from cosine.bench.prompts import PROMPTS
from cosine.cluster import zoo_drafters
from cosine.engine.models import load_causal_lm
from cosine.router.v1 import router_pb2, router_pb2_grpc


def request_for(i: int, n: int) -> dict:
    return PROMPTS[i].request_fields(n)


@pytest.fixture(scope="module")
def reference(target_dir):
    """Greedy output of `transformers` generate() on the same weights, cut at the first EOS."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target_dir))
    model = load_causal_lm(target_dir)
    out = {}

    def ref(i: int, n: int) -> list[int]:
        if (i, n) not in out:
            ids = PROMPTS[i].token_ids(tok)
            with torch.inference_mode():
                gen = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0, len(ids):].tolist()
            if tok.eos_token_id in gen:
                gen = gen[: gen.index(tok.eos_token_id) + 1]
            out[(i, n)] = gen
        return out[(i, n)]

    return ref


async def generate(address: str, **fields):
    async with grpc.aio.insecure_channel(address) as channel:
        ids, final = [], None
        async for reply in router_pb2_grpc.RouterStub(channel).Generate(router_pb2.GenerateRequest(**fields), timeout=300):
            if reply.WhichOneof("kind") == "chunk":
                ids += reply.chunk.token_ids
            else:
                final = reply.final
        return ids, final


async def test_greedy_equals_transformers_generate_on_ten_prompts(cluster, reference):
    """Every output equals `transformers`' own greedy output, half of the requests at a fixed depth (they draft
    every round, so speculation surely runs), half under adaptive control (which drafts where it measures that
    drafting pays: with a fast target step that may be rarely)."""
    accepted = drafted = 0
    mismatches = []
    for i in range(10):
        fields = request_for(i, 128)
        if i % 2 == 0:
            fields["speculation"] = {"adaptive_depth": False}
        ids, final = await generate(cluster["address"], **fields)
        if ids != reference(i, 128):
            mismatches.append(i)
        accepted += final.stats.accepted_tokens
        drafted += final.stats.drafted_tokens
    assert not mismatches, f"prompts {mismatches} differ from the target alone"
    assert drafted > 0 and accepted > 0


async def test_eight_concurrent_streams(cluster, reference):
    results = await asyncio.gather(*(generate(cluster["address"], **request_for(i, 32)) for i in range(8)))
    for i, (ids, final) in enumerate(results):
        assert ids == reference(i, 32), f"stream {i} differs"
        assert final.usage.completion_tokens == len(ids)


def scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()


def in_flight(body: str) -> float:
    return sum(float(line.split()[-1]) for line in body.splitlines() if line.startswith("cosine_rpc_in_flight{"))


def held(name: str, body: str) -> float:
    """What a process still holds for requests: its calls in flight; for the verifier, which the scheduler's one
    long-lived VerifySteps stream reaches, the requests holding a KV cache."""
    if name == "verifier":
        return sum(float(line.split()[-1]) for line in body.splitlines() if line.startswith("cosine_verifier_kv_slots_used"))
    return in_flight(body)


async def test_cancel_mid_stream_stops_everything(cluster):
    async with grpc.aio.insecure_channel(cluster["address"]) as channel:
        call = router_pb2_grpc.RouterStub(channel).Generate(router_pb2.GenerateRequest(
            request_id="e2e-cancel", messages=[{"role": "user", "content": "Tell me a very long story about dragons."}],
            max_new_tokens=1000,
            speculation={"drafters": [d.name for d in zoo_drafters()]}), timeout=300)  # every drafter holds a slot
        chunks = 0
        async for reply in call:
            assert reply.WhichOneof("kind") == "chunk", "the story ended before the cancel"
            chunks += 1
            if chunks == 3:
                break
        call.cancel()
    processes = {p["name"]: p for p in cluster["state"]["processes"]}
    deadline = asyncio.get_running_loop().time() + 15
    while True:
        busy = {name: held(name, await asyncio.to_thread(scrape, p["metrics_port"]))
                for name, p in processes.items() if p["metrics_port"]}
        if not any(busy.values()) or asyncio.get_running_loop().time() > deadline:
            break
        await asyncio.sleep(0.2)
    assert not any(busy.values()), f"calls still in flight after the cancel: {busy}"
    client = aioredis.from_url(f"redis://{processes['redis']['address']}/0")
    keys = [k async for k in client.scan_iter("cosine:*")]
    assert any(b"e2e-cancel" in k for k in keys)
    for key in keys:
        assert await client.ttl(key) > 0, f"{key} has no TTL"
    assert await client.hget("cosine:{e2e-cancel}:req", "status") == b"cancelled"
    await client.aclose()
