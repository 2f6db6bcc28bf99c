"""The contract between the verifier and a target engine (`NativeTarget`, `HFTarget`).

The verifier's service and batcher drive the engine only through this: they never probe
what an engine can do (no ``hasattr``), so a new backend states its abilities here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from cosine.engine.hf_target import VerifyOutcome
from cosine.engine.sampling import Sampling
from cosine.engine.tree import DraftTree


@runtime_checkable
class TargetEngine(Protocol):
    """The target model with a KV cache per open request. Called on one model thread only."""

    vocab_size: int
    max_context: int  # most tokens (prompt + output) a request may hold
    verifies_trees: bool  # False: verifies a tree's main chain only (drafts off it are never accepted)

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes one token of one request takes (0: unknown)."""

    def __contains__(self, request_id: object) -> bool:
        """Whether the request is open (holds a cache)."""

    def __len__(self) -> int:
        """Requests open now."""

    def open(self, request_id: str, committed: list[int], prompt_len: int) -> None:
        """Open a request with its committed tokens (prompt, and output so far on a resume); raises when full."""

    def open_batch(self, items: Sequence[tuple[str, list[int], int]]) -> None:
        """Open several (request id, committed, prompt_len) at once, prefilled together where the engine can;
        a request's cache is the same whichever requests share its prefill. Raises as `open` does."""

    def release(self, request_id: str) -> None:
        """Free the request's cache (no error when it is not open)."""

    def committed(self, request_id: str) -> list[int]:
        """The request's committed tokens (KeyError when not open)."""

    def hidden(self, request_id: str):
        """The final hidden state (a [hidden_size] tensor, normed as the head reads it) of the row that chose the
        request's last committed token, for a drafter conditioned on the target's features; None where the
        engine does not keep it or before the request's first step (KeyError when not open)."""

    def context_len(self, request_id: str) -> int:
        """How many tokens the request's next verification attends over (KeyError when not open)."""

    def verify_batch(self, items: Sequence[tuple[str, DraftTree, Sampling]]) -> list[VerifyOutcome]:
        """Verify each (request id, tree, sampling) losslessly, all in as few forwards as the engine can;
        commits the accepted tokens and the target's next one; one outcome per item, in order."""
