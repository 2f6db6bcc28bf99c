"""Load generation against the cluster's router (closed loop and Poisson), and Prometheus scrapes."""

from __future__ import annotations

import re
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc

from cosine.bench.stats import RequestRecord
from cosine.router.v1 import router_pb2, router_pb2_grpc

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def parse_metrics(body: str) -> dict[str, float]:
    """Prometheus text → {"name{labels}": value} (comments skipped)."""
    out = {}
    for line in body.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m:
            try:
                out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
            except ValueError:
                pass
    return out


def scrape(port: int | None) -> dict[str, float]:
    if port is None:
        return {}
    try:
        return parse_metrics(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode())
    except OSError:
        return {}


def metric_sum(samples: dict[str, float], name: str, **labels: str) -> float:
    """Sum of every sample of `name` whose labels include `labels` (all label sets where none are given)."""
    want = [f'{k}="{v}"' for k, v in labels.items()]

    def has(key: str) -> bool:
        if key == name:
            return not want
        if not key.startswith(name + "{"):
            return False
        have = key[len(name) + 1:-1].split(",")
        return all(w in have for w in want)

    return sum(v for k, v in samples.items() if has(k))


def generate(stub, prompt, speculation: dict, max_new: int, prompt_index: int, arrival: float, t0: float,
             timeout: float = 900) -> RequestRecord:
    """One streamed Generate; times on the clock of t0 (perf_counter)."""
    rec = RequestRecord(prompt_index=prompt_index, domain=prompt.domain, arrival_s=arrival - t0)
    request = router_pb2.GenerateRequest(**prompt.request_fields(max_new), speculation=speculation)
    try:
        for reply in stub.Generate(request, timeout=timeout):
            now = time.perf_counter() - t0
            if reply.WhichOneof("kind") == "chunk":
                ids = list(reply.chunk.token_ids)
                rec.token_ids += ids
                rec.token_times_s += [now] * len(ids)
            else:
                stats = reply.final.stats
                # the drafters' and the verifier's lookup's together: both are draft tokens the target checked
                rec.rounds = stats.rounds
                rec.drafted = stats.drafted_tokens + stats.lookup_drafted_tokens
                rec.accepted = stats.accepted_tokens + stats.lookup_accepted_tokens
                rec.drafters = list(stats.drafters)
        rec.end_s = time.perf_counter() - t0
    except grpc.RpcError as exc:
        rec.error = f"{exc.code().name}: {exc.details()}"
        rec.end_s = time.perf_counter() - t0
    return rec


def run_closed_loop(order: list[int], concurrency: int, send: Callable[[int, float], RequestRecord],
                    bar=None) -> tuple[list[RequestRecord], float]:
    """`concurrency` client threads, each sending its next request (`send(prompt_index, t0)`) as soon as its last
    one finished; the records and the wall time. Every system's closed loop (the cluster's, llama.cpp's) is this."""
    records: list[RequestRecord] = []
    lock = threading.Lock()
    queue = list(order)
    t0 = time.perf_counter()

    def client():
        while True:
            with lock:
                if not queue:
                    return
                p = queue.pop(0)
            rec = send(p, t0)
            with lock:
                records.append(rec)
            if bar is not None:
                bar.update(1)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(max(1, concurrency))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return records, time.perf_counter() - t0


def closed_loop(address: str, workload, order: list[int], speculation: dict, concurrency: int, max_new: int,
                bar=None) -> tuple[list[RequestRecord], float]:
    """`concurrency` clients, each sending its next request as soon as its last one finished."""
    with grpc.insecure_channel(address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        return run_closed_loop(
            order, concurrency, lambda p, t0: generate(stub, workload[p], speculation, max_new, p, time.perf_counter(), t0), bar)


def poisson(address: str, workload, order: list[int], arrivals: list[float], speculation: dict, max_new: int,
            bar=None) -> tuple[list[RequestRecord], float]:
    """Request i is sent at arrivals[i] seconds after the start, whatever is still running (open loop)."""
    t0 = time.perf_counter()
    with grpc.insecure_channel(address) as channel, ThreadPoolExecutor(max_workers=max(1, len(order))) as pool:
        stub = router_pb2_grpc.RouterStub(channel)

        def one(i, p):
            delay = t0 + arrivals[i] - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            rec = generate(stub, workload[p], speculation, max_new, p, t0 + arrivals[i], t0)
            if bar is not None:
                bar.update(1)
            return rec

        records = list(pool.map(lambda ip: one(*ip), enumerate(order)))
    return records, time.perf_counter() - t0
