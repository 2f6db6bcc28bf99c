"""Scheduling policy (pure logic): how far a request speculates this round, and when it is done."""

from __future__ import annotations

from dataclasses import dataclass

from cosine.common.v1 import common_pb2


def round_depth(requested: int, generated: int, max_new_tokens: int, context_used: int, max_context: int) -> int:
    """Draft depth for the next round: never draft past max_new_tokens or the context.

    A round emits at most depth + 1 tokens (accepted drafts plus the target's
    own), and verifying needs depth + 1 positions of context.
    """
    room_out = max_new_tokens - generated - 1
    room_ctx = max_context - context_used - 1
    return max(0, min(requested, room_out, room_ctx))


@dataclass
class RoundCut:
    token_ids: list[int]
    finish_reason: int  # a common_pb2.FinishReason; UNSPECIFIED while the request goes on


def cut_round(
    token_ids: list[int], generated: int, max_new_tokens: int, stop_token_ids: set[int], context_used: int, max_context: int
) -> RoundCut:
    """Apply the end conditions to one round's tokens: an end-of-sequence token, the length, the context."""
    for i, tok in enumerate(token_ids):
        if tok in stop_token_ids:
            return RoundCut(token_ids[: i + 1], common_pb2.FINISH_REASON_EOS)
    room = max_new_tokens - generated
    if len(token_ids) >= room:
        return RoundCut(token_ids[:room], common_pb2.FINISH_REASON_LENGTH)
    if context_used + len(token_ids) >= max_context:
        return RoundCut(token_ids[: max_context - context_used], common_pb2.FINISH_REASON_CONTEXT)
    return RoundCut(token_ids, common_pb2.FINISH_REASON_UNSPECIFIED)
