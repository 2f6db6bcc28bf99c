"""The whole data path through real gRPC servers and Redis, on tiny random models."""

from __future__ import annotations

import asyncio
import math
import time

import grpc
import pytest
import redis.asyncio as aioredis
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cosine.common.v1 import common_pb2
from cosine.engine.models import load_causal_lm
from cosine.router.v1 import router_pb2, router_pb2_grpc

PROMPTS = ["def fibonacci(n):", "The quick brown fox", "Once upon a time, in a land", "SELECT * FROM users WHERE"]


@pytest.fixture(scope="module")
def reference(tiny_dirs):
    from transformers import AutoTokenizer

    model = load_causal_lm(tiny_dirs["target"])
    tok = AutoTokenizer.from_pretrained(str(tiny_dirs["target"]))
    cache = {}

    def ref(prompt: str, n: int) -> list[int]:
        if (prompt, n) not in cache:
            ids = tok(prompt)["input_ids"]
            out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                                 pad_token_id=tok.eos_token_id)
            cache[(prompt, n)] = out[0, len(ids):].tolist()
        return cache[(prompt, n)]

    return ref


async def generate(address: str, timeout: float = 60, **fields) -> tuple[list[int], str, router_pb2.Final]:
    async with grpc.aio.insecure_channel(address) as channel:
        ids, text, final = [], [], None
        async for reply in router_pb2_grpc.RouterStub(channel).Generate(router_pb2.GenerateRequest(**fields), timeout=timeout):
            if reply.WhichOneof("kind") == "chunk":
                ids += reply.chunk.token_ids
                text.append(reply.chunk.text)
            else:
                final = reply.final
        return ids, "".join(text), final


def no_eos(ids: list[int], eos: int = 2) -> list[int]:
    return ids[: ids.index(eos) + 1] if eos in ids else ids


@pytest.mark.parametrize("speculation", [{"drafters": ["ngram"]}, {"drafters": ["tiny"]}, {"drafters": ["ngram", "tiny"]}, {"disabled": True}])
async def test_greedy_output_equals_the_target_alone(services, reference, speculation):
    for prompt in PROMPTS[:2]:
        ids, _, final = await generate(services.router, prompt=prompt.encode(), max_new_tokens=24, speculation=speculation)
        assert ids == no_eos(reference(prompt, 24))
        assert final.usage.completion_tokens == len(ids)
        if speculation.get("disabled"):
            # decode runs: the verifier decodes up to 4 tokens (the scheduler's decode_steps) per round trip
            assert final.stats.drafted_tokens == 0 and -(-len(ids) // 4) <= final.stats.rounds < len(ids)


async def test_drafting_is_accepted_when_the_target_repeats(services, tiny_dirs):
    # a random tiny model falls into loops quickly: prompt lookup must then be accepted, the drafters' or
    # the verifier's own (which may finish a repeating request before the first draft comes back)
    ids, _, final = await generate(services.router, prompt=b"a b c a b c a b c", max_new_tokens=64)
    assert final.stats.drafted_tokens + final.stats.lookup_drafted_tokens > 0 and final.stats.rounds > 0
    assert final.stats.accepted_tokens + final.stats.lookup_accepted_tokens > 0
    assert final.stats.rounds < len(ids)


async def test_eight_concurrent_streams_are_independent(services, reference):
    prompts = [f"{PROMPTS[i % 4]} {i}" for i in range(8)]
    results = await asyncio.gather(*(generate(services.router, prompt=p.encode(), max_new_tokens=20) for p in prompts))
    for prompt, (ids, _, final) in zip(prompts, results):
        assert ids == no_eos(reference(prompt, 20))
        assert final.finish_reason in (common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_EOS)


async def test_seeded_sampling_does_not_depend_on_speculation(services):
    sampling = {"temperature": 0.9, "top_p": 0.95, "seed": 1234}
    plain, _, _ = await generate(services.router, prompt=b"The quick brown fox", max_new_tokens=30, sampling=sampling, speculation={"disabled": True})
    spec, _, _ = await generate(services.router, prompt=b"The quick brown fox", max_new_tokens=30, sampling=sampling, speculation={"drafters": ["ngram"]})
    assert spec == plain
    other, _, _ = await generate(services.router, prompt=b"The quick brown fox", max_new_tokens=30, sampling={**sampling, "seed": 99})
    assert other != plain


async def test_chat_messages_and_stop_strings(services, reference):
    ids, text, final = await generate(services.router, messages=[{"role": "user", "content": "hi"}], max_new_tokens=8)
    assert final.usage.prompt_tokens > 3 and len(ids) >= 1
    full_ids, full_text, _ = await generate(services.router, prompt=PROMPTS[0].encode(), max_new_tokens=24)
    stop = full_text[len(full_text) // 2 : len(full_text) // 2 + 3]
    if stop.strip():
        ids, text, final = await generate(services.router, prompt=PROMPTS[0].encode(), max_new_tokens=24, stop=[stop])
        assert final.finish_reason == common_pb2.FINISH_REASON_STOP
        assert stop not in text and full_text.startswith(text)
        assert ids == full_ids[: len(ids)]


BAD = [
    ({"prompt": b""}, "empty"),
    ({"prompt": b"\xc3\x28 invalid"}, "UTF-8"),
    ({"prompt": b"x", "max_new_tokens": 0}, "max_new_tokens"),
    ({"prompt": b"x", "max_new_tokens": 100000}, "max_new_tokens"),
    ({"prompt": ("word " * 300).encode(), "max_new_tokens": 250}, "context limit"),
    ({"prompt": b"x", "sampling": {"temperature": -1.0}}, "temperature"),
    ({"prompt": b"x", "sampling": {"temperature": math.nan}}, "temperature"),
    ({"prompt": b"x", "sampling": {"temperature": math.inf}}, "temperature"),
    ({"prompt": b"x", "sampling": {"top_p": 0.0}}, "top_p"),
    ({"prompt": b"x", "sampling": {"top_p": 1.5}}, "top_p"),
    ({"prompt": b"x", "speculation": {"drafters": ["no-such-drafter"]}}, "unknown drafter"),
]


@pytest.mark.parametrize("fields, words", BAD)
async def test_bad_input_is_invalid_argument_and_disturbs_nothing(services, reference, fields, words):
    healthy = asyncio.create_task(generate(services.router, prompt=PROMPTS[1].encode(), max_new_tokens=12))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(services.router, **fields)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in err.value.details()
    ids, _, _ = await healthy
    assert ids == no_eos(reference(PROMPTS[1], 12))


async def test_deadline_is_enforced(services):
    request = dict(prompt=b"slow", max_new_tokens=250, speculation={"disabled": True})
    started = time.perf_counter()
    await generate(services.router, **request)
    whole = time.perf_counter() - started  # how long the request takes here: its deadline is a third of that
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(services.router, timeout=whole / 3, **request)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


async def wait_until(predicate, timeout=10.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def test_cancel_stops_every_service_and_leaves_ttls(services, redis_server):
    async with grpc.aio.insecure_channel(services.router) as channel:
        call = router_pb2_grpc.RouterStub(channel).Generate(router_pb2.GenerateRequest(
            request_id="cancel-me", prompt=b"The quick brown fox", max_new_tokens=250, speculation={"drafters": ["ngram", "tiny"]}))
        first = await call.read()
        assert first.WhichOneof("kind") == "chunk"
        assert "cancel-me" in services["verifier"].servicer.engine
        call.cancel()
    assert await wait_until(lambda: "cancel-me" not in services["scheduler"].servicer.live)
    assert await wait_until(lambda: len(services["verifier"].servicer.engine) == 0), list(services["verifier"].servicer.engine._slots)
    assert await wait_until(lambda: "cancel-me" not in services["drafter-ngram"].servicer.drafter)
    assert await wait_until(lambda: "cancel-me" not in services["drafter-tiny"].servicer.drafter)
    client = aioredis.from_url(redis_server)
    keys = [k async for k in client.scan_iter("cosine:*")]
    assert keys
    for key in keys:
        assert await client.ttl(key) > 0, key
    assert await client.hget("cosine:{cancel-me}:req", "status") == b"cancelled"
    await client.aclose()


async def test_health_and_reflection(services):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    async with grpc.aio.insecure_channel(services.router) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("liveness", "readiness", "cosine.router.v1.Router"):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=name))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = [r async for r in stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))]
        names = {s.name for s in replies[0].list_services_response.service}
        assert "cosine.router.v1.Router" in names


async def test_metrics_endpoint_counts_rounds(services):
    import urllib.request

    await generate(services.router, prompt=b"count me", max_new_tokens=4)
    port = services["scheduler"].metrics.port
    body = await asyncio.to_thread(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode())
    rounds = [line for line in body.splitlines() if line.startswith("cosine_scheduler_rounds_total")]
    assert rounds and float(rounds[0].split()[-1]) > 0
    assert "cosine_rpc_total" in body
