"""Drafters: propose the next tokens of a request from what is committed so far.

Every drafter keeps per-request state between rounds (`open` → `draft`* →
`release`) and sees only committed tokens: what it drafted last round and the
target rejected is forgotten (caches are cut back to the committed prefix).
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from cosine.engine.prompt_fit import PromptFit
from cosine.engine.vocab import DraftVocab

# Prompt positions a drafter scores for expertise routing's prior (the last ones of a long prompt).
SCORED_POSITIONS = 256


class Drafter(abc.ABC):
    """The contract every drafter kind fulfils."""

    name: str
    kind: str
    domain: str = "general"

    @property
    def vocab_size(self) -> int:
        """Size of the output vocabulary (0: works on any token ids)."""
        return 0

    @abc.abstractmethod
    def open(self, request_id: str, prompt: list[int]) -> None:
        """Start a request with its prompt tokens."""

    @abc.abstractmethod
    def draft(self, request_id: str, committed: list[int], depth: int, context: Sequence[int] = ()) -> tuple[list[int], list[float]]:
        """Append newly committed tokens, then propose up to `depth` tokens with their probabilities.

        `context`: speculative tokens after the committed ones (confidence fusion's fused chain):
        the proposal continues from them, but they are not committed."""

    def propose(self, request_id: str, committed: list[int], context: Sequence[int], top_k: int) -> list[tuple[int, float]]:
        """Append newly committed tokens; the up to `top_k` most probable tokens after committed + `context`,
        as (token, probability), most probable first. Default: the one token `draft` proposes."""
        tokens, probs = self.draft(request_id, committed, 1 if top_k > 0 else 0, context)
        return list(zip(tokens, probs))

    def score_prompt(self, request_id: str) -> PromptFit:
        """Right after `open`: how well this drafter predicts the prompt's next token at each of its
        last SCORED_POSITIONS positions (expertise routing's prior). LM drafters prefill the prompt
        into the request's cache while they score it. Default: nothing scored."""
        return PromptFit(0, 0, 0.0)

    @abc.abstractmethod
    def release(self, request_id: str) -> None:
        """Forget a request (idempotent)."""

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests()

    @abc.abstractmethod
    def _requests(self) -> dict: ...


class NgramDrafter(Drafter):
    """Prompt lookup: find the latest earlier occurrence of the last n tokens and propose what followed.

    Costs microseconds; pays off because models repeat their prompt and themselves.
    """

    kind = "ngram"

    def __init__(self, name: str = "ngram", max_ngram: int = 4, min_ngram: int = 1):
        self.name = name
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self._tokens: dict[str, list[int]] = {}

    def _requests(self) -> dict:
        return self._tokens

    def open(self, request_id: str, prompt: list[int]) -> None:
        self._tokens[request_id] = list(prompt)

    def draft(self, request_id: str, committed: list[int], depth: int, context: Sequence[int] = ()) -> tuple[list[int], list[float]]:
        tokens = self._tokens[request_id]
        tokens.extend(committed)
        if context:
            tokens = tokens + list(context)  # looked up in, not kept
        if depth <= 0:
            return [], []
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            tail = tokens[-n:]
            # latest earlier match first: recent context predicts best
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start : start + n] == tail:
                    proposal = tokens[start + n : start + n + depth]
                    confidence = n / (self.max_ngram + 1)
                    return proposal, [confidence] * len(proposal)
        return [], []

    def score_prompt(self, request_id: str) -> PromptFit:
        """At every prompt position, what `draft` would have proposed after the prompt so far
        (one pass: the latest start of every n-gram is kept in a table as the scan moves on)."""
        tokens = self._tokens[request_id]
        first = max(1, len(tokens) - SCORED_POSITIONS)
        latest: list[dict[tuple[int, ...], int]] = [{} for _ in range(self.max_ngram + 1)]
        hits = positions = 0
        confidence = 0.0
        for i in range(1, len(tokens)):
            # predict tokens[i] from tokens[:i]: the longest tail with an earlier occurrence wins
            if i >= first:
                positions += 1
                for n in range(min(self.max_ngram, i - 1), self.min_ngram - 1, -1):
                    start = latest[n].get(tuple(tokens[i - n : i]))
                    if start is not None:
                        hits += tokens[start + n] == tokens[i]
                        confidence += n / (self.max_ngram + 1)
                        break
            # the n-grams ending at i become earlier occurrences for the positions after i
            for n in range(self.min_ngram, min(self.max_ngram, i) + 1):
                latest[n][tuple(tokens[i - n : i])] = i - n
        return PromptFit(positions, hits, confidence, None)

    def release(self, request_id: str) -> None:
        self._tokens.pop(request_id, None)


@dataclass
class _LMSlot:
    cache: object  # a transformers DynamicCache, or the native cache's slot index
    committed: list[int]
    cached: list[int] = field(default_factory=list)  # tokens whose KV is in the cache


class _CachedLMDrafter(Drafter):
    """Greedy chain drafting with a KV cache per request, kept across rounds and cut back to the
    longest prefix that is still committed. Subclasses say how to forward and how to cut."""

    kind = "lm"
    _slots: dict[str, _LMSlot]
    # A reduced drafting vocabulary (draft_vocab.json beside the checkpoint): the model's input and
    # output indices are positions in `vocab`; everything outside this class speaks target token ids.
    vocab: DraftVocab | None = None
    target_vocab_size: int = 0  # with `vocab`: the size of the target's (tokenizer's) vocabulary

    def _to_target(self, index: int) -> int:
        return self.vocab.token_ids[index] if self.vocab is not None else index

    def _requests(self) -> dict:
        return self._slots

    @abc.abstractmethod
    def _run(self, slot: _LMSlot, ids: list[int], start: int) -> torch.Tensor:
        """Forward `ids` at positions start.. on the slot's cache; logits of the last one, [vocab]."""

    @abc.abstractmethod
    def _cut(self, slot: _LMSlot, keep: int) -> None:
        """Cut the slot's cache back to its first `keep` tokens."""

    def _max_len(self) -> int | None:
        return None

    @abc.abstractmethod
    def _run_all(self, slot: _LMSlot, ids: list[int], start: int) -> torch.Tensor:
        """Like `_run`, but the logits of every token fed, [len(ids), vocab]."""

    @torch.inference_mode()
    def score_prompt(self, request_id: str) -> PromptFit:
        """Prefill the prompt (the cache keeps it for the first draft), scoring its last positions."""
        slot = self._slots[request_id]
        prompt = list(slot.committed)
        limit_len = self._max_len()
        if limit_len is not None:
            prompt = prompt[: limit_len - 1]
        if slot.cached or len(prompt) < 2:
            return PromptFit(0, 0, 0.0)
        ids = self.vocab.to_draft(prompt) if self.vocab is not None else prompt
        split = max(0, len(prompt) - 1 - SCORED_POSITIONS)  # rows from `split` on predict a scored token
        if split > 0:
            self._run(slot, ids[:split], 0)
        logits = self._run_all(slot, ids[split:], split)[:-1].float()  # row j predicts prompt[split + j + 1]
        slot.cached.extend(prompt)
        logp = torch.log_softmax(logits, dim=-1)
        top_logp, top = logp.max(dim=-1)
        targets = prompt[split + 1 :]
        index = torch.tensor(ids[split + 1 :])
        known = torch.tensor([t in self.vocab for t in targets]) if self.vocab is not None else torch.ones(len(targets), dtype=torch.bool)
        # a token outside a reduced vocabulary has probability 0 here: count it as uniform over the target's
        floor = -math.log(max(self.vocab_size, 2))
        target_logp = torch.where(known, logp.gather(1, index[:, None])[:, 0], torch.tensor(floor))
        hits = int(((top == index) & known).sum())
        return PromptFit(len(targets), hits, float(top_logp.exp().sum()), float(target_logp.sum()))

    def _forward(self, slot: _LMSlot, ids: list[int]) -> torch.Tensor:
        logits = self._run(slot, self.vocab.to_draft(ids) if self.vocab is not None else ids, len(slot.cached))
        slot.cached.extend(ids)
        return logits.float()

    def _logits_after(self, slot: _LMSlot, seq: list[int]) -> torch.Tensor:
        """Logits of the token after `seq` (committed + speculative context), reusing the cached prefix."""
        # keep the cached prefix that still matches, but always re-feed the last token for its logits
        keep = 0
        limit = min(len(slot.cached), len(seq) - 1)
        while keep < limit and slot.cached[keep] == seq[keep]:
            keep += 1
        if keep < len(slot.cached):
            self._cut(slot, keep)
            del slot.cached[keep:]
        return self._forward(slot, seq[keep:])

    @torch.inference_mode()
    def propose(self, request_id: str, committed: list[int], context: Sequence[int], top_k: int) -> list[tuple[int, float]]:
        slot = self._slots[request_id]
        slot.committed.extend(committed)
        seq = slot.committed + list(context)
        limit_len = self._max_len()
        if top_k <= 0 or (limit_len is not None and len(seq) >= limit_len):
            return []
        p = torch.softmax(self._logits_after(slot, seq), dim=-1)
        top = torch.topk(p, min(top_k, p.numel()))
        return [(self._to_target(int(t)), float(q)) for t, q in zip(top.indices, top.values)]

    @torch.inference_mode()
    def draft(self, request_id: str, committed: list[int], depth: int, context: Sequence[int] = ()) -> tuple[list[int], list[float]]:
        slot = self._slots[request_id]
        slot.committed.extend(committed)
        seq = slot.committed + list(context)
        limit_len = self._max_len()
        if limit_len is not None:
            depth = min(depth, limit_len - len(seq))
        if depth <= 0:
            return [], []
        logits = self._logits_after(slot, seq)
        tokens: list[int] = []
        probs: list[float] = []
        for step in range(depth):
            p = torch.softmax(logits, dim=-1)
            index = int(p.argmax())
            tok = self._to_target(index)
            tokens.append(tok)
            probs.append(float(p[index]))
            if step + 1 < depth:
                logits = self._forward(slot, [tok])
        return tokens, probs


class LMDrafter(_CachedLMDrafter):
    """A small causal LM through `transformers` (any architecture), one DynamicCache per request."""

    def __init__(self, name: str, model, domain: str = "general", vocab: DraftVocab | None = None, target_vocab_size: int = 0):
        self.name = name
        self.model = model
        self.domain = domain
        self.vocab, self.target_vocab_size = vocab, target_vocab_size
        self.device = next(model.parameters()).device
        self._slots = {}

    @property
    def vocab_size(self) -> int:
        return self.target_vocab_size or int(self.model.config.vocab_size)

    def open(self, request_id: str, prompt: list[int]) -> None:
        from transformers import DynamicCache

        self._slots[request_id] = _LMSlot(DynamicCache(config=self.model.config), list(prompt))

    def _run(self, slot: _LMSlot, ids: list[int], start: int) -> torch.Tensor:
        x = torch.tensor([ids], device=self.device)
        return self.model(input_ids=x, cache=slot.cache, use_cache=True, logits_to_keep=1).logits[0, -1]

    def _run_all(self, slot: _LMSlot, ids: list[int], start: int) -> torch.Tensor:
        x = torch.tensor([ids], device=self.device)
        return self.model(input_ids=x, cache=slot.cache, use_cache=True).logits[0]

    def _cut(self, slot: _LMSlot, keep: int) -> None:
        slot.cache.crop(-(len(slot.cached) - keep))

    def release(self, request_id: str) -> None:
        self._slots.pop(request_id, None)


class NativeLMDrafter(_CachedLMDrafter):
    """A Llama-family drafter on the native engine: one preallocated KV slot per request, cut back by bookkeeping."""

    def __init__(self, name: str, model, domain: str = "general", n_slots: int = 16, max_len: int = 4096,
                 vocab: DraftVocab | None = None, target_vocab_size: int = 0):
        self.name = name
        self.model = model  # cosine.engine.llama.NativeLlama
        self.domain = domain
        self.vocab, self.target_vocab_size = vocab, target_vocab_size
        self.kv = model.new_cache(n_slots, min(max_len, model.max_positions))
        self._slots = {}

    @property
    def vocab_size(self) -> int:
        return self.target_vocab_size or int(self.model.spec.vocab_size)

    def open(self, request_id: str, prompt: list[int]) -> None:
        self.release(request_id)
        self._slots[request_id] = _LMSlot(self.kv.allocate(), list(prompt))

    def _max_len(self) -> int:
        return self.kv.max_len

    def _run(self, slot: _LMSlot, ids: list[int], start: int) -> torch.Tensor:
        from cosine.engine.llama import Seq

        seq = Seq(slot.cache, ids, list(range(start, start + len(ids))), logits="last")
        return self.model.forward([seq], self.kv)[0][-1]

    def _run_all(self, slot: _LMSlot, ids: list[int], start: int) -> torch.Tensor:
        from cosine.engine.llama import Seq

        return self.model.forward([Seq(slot.cache, ids, list(range(start, start + len(ids))), logits="all")], self.kv)[0]

    def _cut(self, slot: _LMSlot, keep: int) -> None:
        self.kv.truncate(slot.cache, keep)

    def release(self, request_id: str) -> None:
        slot = self._slots.pop(request_id, None)
        if slot is not None:
            self.kv.release(slot.cache)
