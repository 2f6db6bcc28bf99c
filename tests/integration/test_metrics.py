"""/metrics of every service, scraped over HTTP after a few requests: the named metrics exist and moved."""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
from prometheus_client.parser import text_string_to_metric_families

from cosine.router.v1 import router_pb2, router_pb2_grpc

SERVICES = ("router", "scheduler", "fusion", "drafter-ngram", "drafter-tiny", "verifier")


def _scrape(port: int) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text) for s in f.samples}


async def scrape_all(services) -> dict[str, dict]:
    return {name: await asyncio.to_thread(_scrape, services[name].metrics.port) for name in SERVICES}


def value(samples: dict, metric: str, **labels) -> float | None:
    return samples.get((metric, tuple(sorted(labels.items()))))


async def generate(address: str, **fields) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        async for _ in router_pb2_grpc.RouterStub(channel).Generate(router_pb2.GenerateRequest(**fields), timeout=60):
            pass


async def test_every_service_exports_the_named_metrics_and_they_move(services):
    before = await scrape_all(services)
    await asyncio.gather(*(generate(services.router, prompt=f"a b c a b c {i}".encode(), max_new_tokens=16,
                                    speculation={"drafters": ["ngram", "tiny"], "adaptive_depth": False}) for i in range(3)))
    # and one that lets expertise routing choose (adaptive depth may decide drafting does not pay)
    await generate(services.router, prompt=b"routed a b a b", max_new_tokens=12, speculation={"adaptive_depth": False})
    async with grpc.aio.insecure_channel(services.router) as channel:  # one bad request: an INVALID_ARGUMENT outcome
        try:
            async for _ in router_pb2_grpc.RouterStub(channel).Generate(router_pb2.GenerateRequest(prompt=b"x", max_new_tokens=10**6)):
                pass
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
    await asyncio.sleep(0.3)  # drafters and verifier release their caches just after the stream ends
    after = await scrape_all(services)

    def moved(at: str, metric: str, by: float = 0, **labels) -> None:
        new = value(after[at], metric, **labels)
        old = value(before[at], metric, **labels) or 0.0
        assert new is not None, f"{at} does not export {metric}{labels}"
        assert new - old > by, f"{at}: {metric}{labels} went from {old} to {new}"

    def exists(at: str, metric: str, **labels) -> None:
        assert value(after[at], metric, **labels) is not None, f"{at} does not export {metric}{labels}"

    # router: outcomes, by status code too, latency histograms, in-flight streams
    moved("router", "cosine_router_requests_total", 2, outcome="ok")
    moved("router", "cosine_router_requests_total", outcome="invalid")
    moved("router", "cosine_rpc_total", 2, service="router", method="Generate", code="OK")
    moved("router", "cosine_rpc_total", service="router", method="Generate", code="INVALID_ARGUMENT")
    moved("router", "cosine_router_time_to_first_token_seconds_count", 2)
    moved("router", "cosine_router_time_per_output_token_seconds_count", 2)
    moved("router", "cosine_router_output_tokens_total", 3 * 8)
    exists("router", "cosine_router_requests_in_flight")
    # every service: RPC latency and in-flight calls
    for service, method in (("router", "Generate"), ("scheduler", "Submit"), ("fusion", "Speculate"),
                            ("drafter-ngram", "Draft"), ("drafter-tiny", "Draft")):
        moved(service, "cosine_rpc_duration_seconds_count", 2, service=service, method=method)
        exists(service, "cosine_rpc_in_flight", service=service)
    # the verifier: the scheduler's one long-lived VerifySteps stream is in flight, its steps are batches
    assert value(after["verifier"], "cosine_rpc_in_flight", service="verifier") >= 1
    moved("verifier", "cosine_verifier_batch_size_count", 2)
    # speculation: rounds, accepted length, acceptance by drafter, queue depth
    moved("scheduler", "cosine_scheduler_rounds_total", 3)
    moved("scheduler", "cosine_scheduler_accepted_length_count", 3)
    moved("scheduler", "cosine_scheduler_commit_seconds_count", 3)
    exists("scheduler", "cosine_scheduler_requests_in_flight")
    for drafter in ("ngram", "tiny"):
        moved("fusion", "cosine_fusion_drafter_proposed_tokens_total", drafter=drafter)
        exists("fusion", "cosine_fusion_drafter_accepted_tokens_total", drafter=drafter)
        moved("scheduler", "cosine_scheduler_drafter_selected_total", 3, drafter=drafter)  # routing choices
    moved("fusion", "cosine_fusion_rounds_total", 3, mode="confidence")
    # calibration against acceptance: positions judged per drafter, and its error as stated and as used
    for drafter in ("ngram", "tiny"):
        moved("fusion", "cosine_fusion_drafter_calibration_observations", drafter=drafter)
        for which in ("stated", "used"):
            err = value(after["fusion"], "cosine_fusion_drafter_calibration_error", drafter=drafter, probabilities=which)
            assert err is not None and 0 <= err <= 1, (drafter, which, err)
    # chosen depths and acceptance by position (position 0: the first draft token of a round)
    moved("scheduler", "cosine_scheduler_depth_count", 4)
    moved("scheduler", "cosine_scheduler_position_drafted_total", 3, position="0")
    exists("scheduler", "cosine_scheduler_position_accepted_total", position="0")
    exists("scheduler", "cosine_scheduler_depth_cap")
    exists("scheduler", "cosine_scheduler_drafters_cap")
    # busy fractions: seconds of model work, and the model workers' queues
    for service in ("verifier", "drafter-tiny", "drafter-ngram"):
        moved(service, "cosine_worker_busy_seconds_total", service=service)
        assert value(after[service], "cosine_worker_queue_depth", service=service) == 0
    exists("verifier", "cosine_verifier_kv_slots_used")
    assert value(after["verifier"], "cosine_verifier_kv_slots_used") == 0  # every cache released


async def test_in_flight_counts_an_open_stream(services):
    async with grpc.aio.insecure_channel(services.router) as channel:
        call = router_pb2_grpc.RouterStub(channel).Generate(router_pb2.GenerateRequest(prompt=b"Once upon a time", max_new_tokens=200), timeout=60)
        await call.read()  # the first chunk: the stream is open everywhere
        samples = await scrape_all(services)
        call.cancel()
    assert value(samples["router"], "cosine_router_requests_in_flight") >= 1
    assert value(samples["router"], "cosine_rpc_in_flight", service="router") >= 1
    assert value(samples["scheduler"], "cosine_scheduler_requests_in_flight") >= 1
    assert value(samples["verifier"], "cosine_verifier_kv_slots_used") >= 1
