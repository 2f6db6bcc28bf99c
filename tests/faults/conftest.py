"""Fault tests: real processes killed, stopped and restarted with real signals; a real Redis stopped and restarted.

Drafters (and Redis) run as their own processes so a test can SIGKILL / SIGSTOP them; verifier,
fusion, scheduler and router run in the test's process on port 0, on tiny random models."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cosine.cluster import free_port, is_serving

ROOT = Path(__file__).resolve().parents[2]


def pytest_collection_modifyitems(config, items):
    for item in items:
        if Path(str(item.fspath)).parent == Path(__file__).parent:
            item.add_marker(pytest.mark.faults)


class Proc:
    """One service process on a fixed loopback port, stopped by its own handle (never by name)."""

    def __init__(self, name: str, argv: list[str], port: int, grpc_service: bool = True):
        self.name, self.argv, self.port, self.grpc_service = name, argv, port, grpc_service
        self.popen: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60) -> "Proc":
        env = dict(os.environ, PYTHONPATH=str(ROOT / "services"), TOKENIZERS_PARALLELISM="false")
        self.popen = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        deadline = time.monotonic() + timeout_s
        while not self._up():
            if self.popen.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"{self.name} did not start")
            time.sleep(0.1)
        return self

    def _up(self) -> bool:
        if self.grpc_service:
            return is_serving(self.address)
        import socket
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                return True
        except OSError:
            return False

    def signal(self, sig: int) -> None:
        if self.popen is not None and self.popen.poll() is None:
            os.kill(self.popen.pid, sig)

    def kill(self) -> None:
        """SIGKILL, then reap."""
        if self.popen is not None:
            if self.popen.poll() is None:
                self.signal(signal.SIGCONT)
                self.popen.kill()
            self.popen.wait(timeout=10)


def drafter_proc(name: str, kind: str, model: Path | None = None) -> Proc:
    port = free_port()
    argv = [sys.executable, "-m", "cosine.drafter", "--port", str(port), "--name", name, "--kind", kind, "--threads", "1",
            "--log-level", "WARNING", "--drain-timeout-s", "0"]
    if model is not None:
        argv += ["--model", str(model)]
    return Proc(f"drafter-{name}", argv, port)


def redis_proc(port: int | None = None, maxmemory: str = "0", policy: str = "noeviction") -> Proc:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed")
    port = port or free_port()
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--maxmemory", maxmemory, "--maxmemory-policy", policy]
    return Proc("redis", argv, port, grpc_service=False)


@pytest.fixture(scope="session")
def greedy(tiny_dirs):
    """The tiny target's own greedy continuation (transformers alone), cut after the first EOS."""
    import torch
    from transformers import AutoTokenizer

    from cosine.engine.models import load_causal_lm

    model = load_causal_lm(tiny_dirs["target"])
    tok = AutoTokenizer.from_pretrained(str(tiny_dirs["target"]))
    cache: dict = {}

    def ref(prompt: str, n: int) -> list[int]:
        if (prompt, n) not in cache:
            ids = tok(prompt)["input_ids"]
            out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=tok.eos_token_id)
            gen = out[0, len(ids):].tolist()
            eos = tok.eos_token_id
            cache[(prompt, n)] = gen[: gen.index(eos) + 1] if eos in gen else gen
        return cache[(prompt, n)]

    return ref


async def generate(address: str, prompt: str, n: int, timeout: float = 60, on_first=None, **fields):
    """One Generate stream: (token ids, final, None) or (token ids so far, None, the AioRpcError)."""
    import grpc

    from cosine.router.v1 import router_pb2, router_pb2_grpc

    ids, final = [], None
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            async for reply in router_pb2_grpc.RouterStub(channel).Generate(
                    router_pb2.GenerateRequest(prompt=prompt.encode(), max_new_tokens=n, **fields), timeout=timeout):
                if reply.WhichOneof("kind") == "chunk":
                    if not ids and on_first is not None:
                        on_first()
                    ids += reply.chunk.token_ids
                else:
                    final = reply.final
        except grpc.aio.AioRpcError as exc:
            return ids, None, exc
    return ids, final, None


ADDRESS = __import__("re").compile(r"(ipv[46]:|unix:|\b\d{1,3}(\.\d{1,3}){3}(:\d+)?\b|\[[0-9a-f:]+\]:\d+|localhost:\d+)", __import__("re").I)


def assert_no_address(message: str) -> None:
    assert not ADDRESS.search(message or ""), f"an internal address leaked: {message!r}"


def holding(procs: list[Proc]) -> list[Proc]:
    """The processes (verifiers, fusions) whose own load report says they hold a request now."""
    import grpc

    from cosine.common.v1 import common_pb2, common_pb2_grpc

    out = []
    for p in procs:
        with grpc.insecure_channel(p.address) as channel:
            if common_pb2_grpc.LoadStub(channel).Report(common_pb2.LoadRequest(), timeout=2).live_requests:
                out.append(p)
    return out


def on_first(proc: Proc, sig: int):
    """(a generate() on_first callback that sends `sig` to `proc` once, on the first token, the list that gets
    when it did)."""
    sent: list[float] = []

    def callback():
        if not sent:
            sent.append(time.perf_counter())
            proc.signal(sig)
    return callback, sent
