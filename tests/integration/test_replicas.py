"""Replicas share the load (issue 18): the local cluster as real processes (`cosine up --replicas`), tiny models.

Two verifier replicas and two replicas of a drafter under 16 concurrent streams: each replica takes 30-70% of
the requests, every output equals the target's own greedy output, and a verifier replica added while the load
runs takes new requests within 10 s.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
import urllib.request

import grpc
import pytest
import torch

from cosine.cluster import Cluster, ClusterSpec, DrafterSpec, free_port, parse_replicas, state_file
from cosine.common.v1 import common_pb2
from cosine.engine.models import load_causal_lm
from cosine.router.v1 import router_pb2, router_pb2_grpc

STREAMS = 16
NEW_TOKENS = 12
BASES = ["def fibonacci(n):", "The quick brown fox", "Once upon a time, in a land", "SELECT * FROM users WHERE",
         "import numpy as np", "Dear colleagues,", "The capital of France", "for i in range(10):"]


def test_replicas_option_is_checked():
    assert parse_replicas("verifier=2, drafter-suffix=3", ["suffix"]) == {"verifier": 2, "drafter-suffix": 3}
    for bad in ("verifier=0", "verifier", "router=2", "drafter-nope=2", "planner=2"):
        with pytest.raises(ValueError):
            parse_replicas(bad, ["suffix"])


@pytest.fixture(scope="module")
def reference(tiny_dirs):
    from transformers import AutoTokenizer

    model = load_causal_lm(tiny_dirs["target"])
    tok = AutoTokenizer.from_pretrained(str(tiny_dirs["target"]))
    cache = {}

    def ref(prompt: str) -> list[int]:
        if prompt not in cache:
            ids = tok(prompt)["input_ids"]
            out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                                 pad_token_id=tok.eos_token_id)
            ref_ids = out[0, len(ids):].tolist()
            cache[prompt] = ref_ids[: ref_ids.index(tok.eos_token_id) + 1] if tok.eos_token_id in ref_ids else ref_ids
        return cache[prompt]

    return ref


@pytest.fixture(scope="module")
def cluster(tiny_dirs, redis_server, tmp_path_factory):
    previous = {k: os.environ.get(k) for k in ("COSINE_RUN_DIR", "COSINE_SCHEDULER_GATE_WINDOW_S")}
    os.environ["COSINE_RUN_DIR"] = str(tmp_path_factory.mktemp("replicas-run"))
    # the speculation gate off (as in the other tests that need drafting): on tiny models at 16 streams it judges
    # drafting not to pay, and new requests then skip the prompt scoring that opens them on the drafters, so the
    # drafter replicas would see a handful of opens, too few to judge how they share the load
    os.environ["COSINE_SCHEDULER_GATE_WINDOW_S"] = "0"
    spec = ClusterSpec(router_port=free_port(), redis_url=redis_server, target=str(tiny_dirs["target"]),
                       drafters=[DrafterSpec("tiny", "lm", str(tiny_dirs["drafter"]))], verifier_threads=1,
                       log_level="WARNING", replicas={"verifier": 2, "drafter-tiny": 2, "scheduler": 2, "fusion": 2})
    started = Cluster(spec)
    try:
        started.start(timeout_s=300)
        yield started
    finally:
        started.stop()
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def metric(process, name: str) -> float:
    """A metric's value (summed over its labels) from the process's own /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{process.metrics_port}/metrics", timeout=5).read().decode()
    return sum(float(v) for v in re.findall(rf"^{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.M))


def opened(process) -> float:
    """The requests that opened a KV cache on the replica."""
    return metric(process, "cosine_requests_opened_total")


async def generate(channel, prompt: str) -> list[int]:
    ids = []
    request = router_pb2.GenerateRequest(prompt=prompt.encode(), max_new_tokens=NEW_TOKENS,
                                         sampling=common_pb2.SamplingParams(temperature=0.0),
                                         speculation=common_pb2.SpeculationParams(drafters=["tiny"]))
    async for reply in router_pb2_grpc.RouterStub(channel).Generate(request, timeout=120):
        if reply.WhichOneof("kind") == "chunk":
            ids += reply.chunk.token_ids
    return ids


async def load(address: str, prompts, results: dict, stop: asyncio.Event | None = None) -> None:
    """STREAMS concurrent streams over the prompts (again and again while `stop` is unset, when given)."""
    queue = list(prompts)

    async def worker(channel, w):
        n = 0
        while True:
            if stop is None:
                if not queue:
                    return
                prompt = queue.pop()
            else:
                if stop.is_set():
                    return
                prompt = prompts[(w + STREAMS * n) % len(prompts)]
                n += 1
            results.setdefault(prompt, []).append(await generate(channel, prompt))

    async with grpc.aio.insecure_channel(address) as channel:
        await asyncio.gather(*(worker(channel, w) for w in range(STREAMS)))


def shares(processes) -> list[float]:
    counts = [opened(p) for p in processes]
    total = sum(counts)
    assert total > 0
    return [c / total for c in counts]


async def test_two_replicas_each_take_a_fair_share_and_outputs_stay_the_targets(cluster, reference):
    state = json.loads(state_file().read_text())
    names = [p["name"] for p in state["processes"]]
    assert {"verifier-0", "verifier-1", "drafter-tiny-0", "drafter-tiny-1", "scheduler-0", "scheduler-1",
            "fusion-0", "fusion-1"} <= set(names)
    ports = [p["metrics_port"] for p in state["processes"] if p["metrics_port"]]
    assert len(ports) == len(set(ports))  # each replica its own metrics port

    prompts = [f"{BASES[i % len(BASES)]} {i}" for i in range(96)]
    results: dict[str, list[list[int]]] = {}
    started = time.monotonic()
    await load(cluster.router_address, prompts, results)
    elapsed = time.monotonic() - started
    for prompt in prompts:
        assert results[prompt] == [reference(prompt)], prompt

    by_name = {p.name: p for p in cluster.processes}
    verifiers = shares([by_name["verifier-0"], by_name["verifier-1"]])
    drafters = shares([by_name["drafter-tiny-0"], by_name["drafter-tiny-1"]])
    print(f"\n{len(prompts)} requests, {STREAMS} streams, {elapsed:.1f}s: verifier split "
          f"{[f'{s:.0%}' for s in verifiers]}, drafter-tiny split {[f'{s:.0%}' for s in drafters]}")
    assert all(0.3 <= s <= 0.7 for s in verifiers), verifiers
    assert all(0.3 <= s <= 0.7 for s in drafters), drafters
    # the router spreads streams over the schedulers (round_robin), the schedulers theirs over fusion (by load)
    assert all(metric(by_name[f"scheduler-{i}"], "cosine_scheduler_rounds_total") > 0 for i in range(2))
    assert all(metric(by_name[f"fusion-{i}"], "cosine_fusion_rounds_total") > 0 for i in range(2))


async def test_a_replica_added_under_load_takes_new_requests_within_10s(cluster, reference):
    prompts = [f"{BASES[i % len(BASES)]} again {i}" for i in range(32)]
    results: dict[str, list[list[int]]] = {}
    stop = asyncio.Event()
    running = asyncio.ensure_future(load(cluster.router_address, prompts, results, stop))
    try:
        await asyncio.sleep(2)  # the load is on
        added = await asyncio.to_thread(cluster.add_replica, "verifier")
        joined = time.monotonic()  # ready, and in the targets file the scheduler reads
        while opened(added) == 0:
            assert time.monotonic() - joined < 10, "the new verifier replica took no request within 10 s"
            assert not running.done(), running.exception()
            await asyncio.sleep(0.1)
        first = time.monotonic() - joined
        print(f"\n{added.name}: first request {first:.1f}s after it joined")
        await asyncio.sleep(2)
    finally:
        stop.set()
        await running
    for prompt, outputs in results.items():
        assert outputs == [reference(prompt)] * len(outputs), prompt
    assert opened(added) > 0
