"""Locust users for the router's Generate stream, with steady, ramp and burst profiles.

    locust -f loadtest/locustfile.py --headless -u 4 -r 2 -t 60s --host 127.0.0.1:50051 \
        --load-profile ramp --csv loadtest/results/cosine --csv-full-history
    python loadtest/summarize.py loadtest/results/cosine

Each Generate stream reports three request events (request type "grpc"):
  "Generate TTFT"            time to the first chunk with tokens,
  "Generate inter-token"     the stream's mean time per output token after the first (TPOT),
  "Generate stream"          the whole stream; it fails when the status is not OK or no final message came.
Prompts: the benchmark's mixed-domain set (cosine.bench.prompts), taken in turn.

The synchronous gRPC client under gevent, as locust documents for gRPC: locust is
imported first (it monkey-patches), then `grpc.experimental.gevent.init_gevent()`.
"""

from __future__ import annotations

import itertools
import sys
import time
from pathlib import Path

import locust  # noqa: I001 - first: gevent's monkey-patching must precede grpc
from locust import LoadTestShape, User, constant, events, task

import grpc
import grpc.experimental.gevent as grpc_gevent

grpc_gevent.init_gevent()

try:
    import cosine  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "services"))

from cosine.bench.prompts import PROMPTS  # noqa: E402
from cosine.client import GenerateOptions, build_request  # noqa: E402
from cosine.router.v1 import router_pb2_grpc  # noqa: E402
from profiles import PROFILES  # noqa: E402 - loadtest/profiles.py (locust puts this folder on the path)

_PROMPT_ORDER = itertools.count()


@events.init_command_line_parser.add_listener
def _options(parser) -> None:
    group = parser.add_argument_group("CoSine")
    group.add_argument("--load-profile", choices=["steady", "ramp", "burst"], default="steady",
                       help="steady: -u users throughout; ramp: 1 → -u users over -t; burst: -u/4 users, -u for 5 s in every 20 s")
    group.add_argument("--max-new-tokens", type=int, default=32, help="tokens asked per request")
    group.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    group.add_argument("--drafter", action="append", default=None, help="drafter to ask for (repeatable; default: the router's)")
    group.add_argument("--deadline-s", type=float, default=120.0, help="deadline of each Generate call")


def address_of(host: str) -> str:
    """--host as HOST:PORT (a grpc:// or http:// prefix is dropped)."""
    return host.split("://", 1)[-1].rstrip("/") if host else "127.0.0.1:50051"


class GenerateUser(User):
    """Streams one Generate after another, with no think time."""

    wait_time = constant(0)
    host = "127.0.0.1:50051"

    def on_start(self) -> None:
        self.channel = grpc.insecure_channel(address_of(self.host))
        self.stub = router_pb2_grpc.RouterStub(self.channel)
        o = self.environment.parsed_options
        self.options = GenerateOptions(
            max_new_tokens=getattr(o, "max_new_tokens", 32), temperature=getattr(o, "temperature", 0.0),
            drafters=getattr(o, "drafter", None) or [], timeout=getattr(o, "deadline_s", 120.0),
        )

    def on_stop(self) -> None:
        self.channel.close()

    def _fire(self, name: str, seconds: float, length: int = 0, exception: BaseException | None = None) -> None:
        self.environment.events.request.fire(request_type="grpc", name=name, response_time=seconds * 1000,
                                             response_length=length, exception=exception, context={})

    @task
    def generate(self) -> None:
        prompt = PROMPTS[next(_PROMPT_ORDER) % len(PROMPTS)]
        self.options.chat = prompt.chat
        request = build_request(prompt.text, self.options)
        started = time.perf_counter()
        first = last = None
        tokens = 0
        final = None
        try:
            for reply in self.stub.Generate(request, timeout=self.options.timeout):
                if reply.WhichOneof("kind") == "final":
                    final = reply.final
                elif reply.chunk.token_ids:
                    last = time.perf_counter()
                    if first is None:
                        first = last
                        self._fire("Generate TTFT", first - started)
                    tokens += len(reply.chunk.token_ids)
        except grpc.RpcError as exc:
            self._fire("Generate stream", time.perf_counter() - started, tokens,
                       RuntimeError(f"{exc.code().name}: {exc.details()}"))
            return
        elapsed = time.perf_counter() - started
        if final is None:
            self._fire("Generate stream", elapsed, tokens, RuntimeError("the stream ended without a final message"))
            return
        if tokens > 1:
            self._fire("Generate inter-token", (last - first) / (tokens - 1), tokens - 1)
        self._fire("Generate stream", elapsed, final.usage.completion_tokens)


class Profile(LoadTestShape):
    """The --load-profile chosen, over -u, -r and -t."""

    use_common_options = True

    def tick(self):
        o = self.runner.environment.parsed_options
        return PROFILES[o.load_profile](self.get_run_time(), o.num_users or 1, o.spawn_rate or 1, o.run_time)
