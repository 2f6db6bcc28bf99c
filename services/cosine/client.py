"""A small synchronous client of the router's Generate stream (used by `cosine generate` and tests)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from cosine.common.v1 import common_pb2
from cosine.router.v1 import router_pb2, router_pb2_grpc


@dataclass
class GenerateOptions:
    max_new_tokens: int | None = None
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    drafters: list[str] = field(default_factory=list)
    no_speculation: bool = False
    max_depth: int | None = None
    chat: bool = False
    timeout: float = 600.0
    api_key: str = ""  # sent as 'authorization: Bearer <key>' when set (the chart's router requires one)


def target_passes(tokens: int, accepted: int) -> int:
    """Forward passes of the target an output took: each commits its accepted draft tokens and one of its own."""
    return max(1, tokens - accepted) if tokens else 0


def build_request(prompt: str, options: GenerateOptions) -> router_pb2.GenerateRequest:
    request = router_pb2.GenerateRequest(stop=options.stop)
    if options.chat:
        request.messages.append(router_pb2.ChatMessage(role="user", content=prompt))
    else:
        request.prompt = prompt.encode("utf-8")
    if options.max_new_tokens is not None:
        request.max_new_tokens = options.max_new_tokens
    request.sampling.temperature = options.temperature
    request.sampling.top_k = options.top_k
    if options.top_p is not None:
        request.sampling.top_p = options.top_p
    if options.seed is not None:
        request.sampling.seed = options.seed
    request.speculation.disabled = options.no_speculation
    request.speculation.drafters.extend(options.drafters)
    if options.max_depth is not None:
        request.speculation.max_depth = options.max_depth
    return request


def generate(address: str, prompt: str, options: GenerateOptions, on_text: Callable[[str], None] | None = None) -> dict:
    """Stream one generation; returns text, token_ids, finish_reason, usage, stats and timings."""
    request = build_request(prompt, options)
    started = time.perf_counter()
    first = None
    text, token_ids, final = [], [], None
    with grpc.insecure_channel(address) as channel:
        metadata = [("authorization", f"Bearer {options.api_key}")] if options.api_key else None
        for reply in router_pb2_grpc.RouterStub(channel).Generate(request, timeout=options.timeout, metadata=metadata):
            if reply.WhichOneof("kind") == "chunk":
                first = first or time.perf_counter()
                token_ids += reply.chunk.token_ids
                text.append(reply.chunk.text)
                if on_text is not None and reply.chunk.text:
                    on_text(reply.chunk.text)
            else:
                final = reply.final
    elapsed = time.perf_counter() - started
    if final is None:
        raise RuntimeError("the stream ended without a final message")
    reason = common_pb2.FinishReason.Name(final.finish_reason).removeprefix("FINISH_REASON_").lower()
    passes = target_passes(len(token_ids), final.stats.accepted_tokens + final.stats.lookup_accepted_tokens)
    return {
        "request_id": reply.request_id,
        "text": "".join(text),
        "token_ids": token_ids,
        "finish_reason": reason,
        "usage": {"prompt_tokens": final.usage.prompt_tokens, "completion_tokens": final.usage.completion_tokens},
        "stats": {
            "rounds": final.stats.rounds,
            "drafted_tokens": final.stats.drafted_tokens,
            "accepted_tokens": final.stats.accepted_tokens,
            "lookup_drafted_tokens": final.stats.lookup_drafted_tokens,
            "lookup_accepted_tokens": final.stats.lookup_accepted_tokens,
            "drafters": list(final.stats.drafters),
            # a forward pass of the target commits its accepted draft tokens and one of its own (a round is one pass,
            # or, decoding plainly, a decode run of several): plain decoding makes one token per pass
            "target_passes": passes,
            "tokens_per_target_pass": len(token_ids) / passes if passes else 0.0,
        },
        "ttft_s": (first - started) if first else None,
        "elapsed_s": elapsed,
        "tokens_per_s": len(token_ids) / elapsed if elapsed > 0 else 0.0,
    }
