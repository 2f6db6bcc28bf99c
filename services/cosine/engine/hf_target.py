"""The target through plain `transformers`: one DynamicCache per request, kept between rounds.

This is the generic backend (any causal LM transformers can load) and the
reference in tests. Each request's cache holds the KV of every committed token
but the last; a round feeds [last committed] + the draft chain in one forward,
takes the target's choice at every position, accepts the agreeing prefix and
crops the cache back to it — the prefix is never recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cosine.engine.sampling import RowChoices, Sampling
from cosine.engine.tree import DraftTree, walk


@dataclass
class VerifyOutcome:
    token_ids: list[int]  # accepted draft tokens, then the target's own next token
    accepted_draft: int


@dataclass
class _Slot:
    cache: object  # transformers DynamicCache: KV of tokens[:-1]
    tokens: list[int]
    prompt_len: int


class HFTarget:
    """Verifies draft chains for many requests, one cache each (batch 1 per forward). A `TargetEngine`."""

    verifies_trees = False  # a tree's main chain only
    kv_bytes_per_token = 0  # transformers' caches grow as they go: no preallocated slots to count

    def __init__(self, model, max_context: int | None = None):
        self.model = model
        self.device = next(model.parameters()).device
        self.vocab_size = int(model.config.vocab_size)
        self.max_context = int(max_context or getattr(model.config, "max_position_embeddings", 2048))
        self._slots: dict[str, _Slot] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    @torch.inference_mode()
    def open(self, request_id: str, committed: list[int], prompt_len: int) -> None:
        """Prefill every committed token but the last."""
        from transformers import DynamicCache

        if not committed:
            raise ValueError("a request needs at least one committed token")
        cache = DynamicCache(config=self.model.config)
        if len(committed) > 1:
            ids = torch.tensor([committed[:-1]], device=self.device)
            self.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        self._slots[request_id] = _Slot(cache, list(committed), prompt_len)

    def open_batch(self, items: list[tuple[str, list[int], int]]) -> None:
        """Open each in turn (transformers' cache is per request here)."""
        for request_id, committed, prompt_len in items:
            self.open(request_id, committed, prompt_len)

    def committed(self, request_id: str) -> list[int]:
        return list(self._slots[request_id].tokens)

    def hidden(self, request_id: str):
        """Not kept by this backend: None (see `TargetEngine.hidden`)."""
        if request_id not in self._slots:
            raise KeyError(request_id)
        return None

    def context_len(self, request_id: str) -> int:
        """Committed tokens of a request (what its next verification attends over)."""
        return len(self._slots[request_id].tokens)

    @torch.inference_mode()
    def verify(self, request_id: str, tree: DraftTree, sampling: Sampling) -> VerifyOutcome:
        """One forward over the tree's main chain; returns what the target accepts plus its next token."""
        slot = self._slots[request_id]
        chain = tree.main_chain_tree()
        n_ctx = len(slot.tokens)
        ids = torch.tensor([[slot.tokens[-1], *chain.tokens]], device=self.device)
        logits = self.model(input_ids=ids, cache=slot.cache, use_cache=True).logits[0]  # [k+1, vocab]
        choice = RowChoices(logits.float(), sampling, [n_ctx + j for j in range(len(chain) + 1)])  # rows the walk reads
        path, bonus = walk(chain, choice)
        accepted = [chain.tokens[i] for i in path]
        rejected = len(chain) - len(path)
        if rejected:
            slot.cache.crop(-rejected)  # keep the KV of [last committed] + accepted draft tokens
        slot.tokens.extend(accepted)
        slot.tokens.append(bonus)
        return VerifyOutcome(accepted + [bonus], len(accepted))

    def verify_batch(self, items) -> list[VerifyOutcome]:
        """One forward per request: transformers' caches of different lengths do not batch."""
        return [self.verify(*item) for item in items]

    def release(self, request_id: str) -> None:
        self._slots.pop(request_id, None)
