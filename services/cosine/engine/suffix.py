"""Suffix decoding with memory: a model-free drafter over what was already written (pure engine code).

Two indexes of token sequences, both searched for the longest suffix of the request's latest
tokens (the anchor is SuffixDecoding in Snowflake's ArcticInference; this is our own, simpler
structure):

* the request's own index: its prompt and everything committed since;
* a bounded global index of earlier requests' outputs, shared by every request of the drafter
  (`SuffixMemory`): a request's output enters it when the request is released; the oldest
  outputs are evicted whole once the index holds more than ``max_tokens`` tokens.

`SuffixIndex` keeps each index as one token stream (sequences separated by `SEP`) and, for each
n-gram length in `KEYS`, where every n-gram ends. A lookup takes the bucket of the query's last
n tokens (longest n first), extends each candidate backwards against the query, and keeps the
occurrences of the longest match: the continuations that followed them, counted, are the
proposal. A continuation's confidence is its count over the occurrences that reached its parent,
smoothed by the match length (``count / (total + SMOOTHING / L)``: one occurrence after a 1-token match
0.2, after a 16-token match 0.8), an estimate of the chance the target accepts it, so fusion can weigh it
against an LM's softmax. Drafting goes deeper the longer the match: at most ``spec_factor · L`` tokens.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import islice

from cosine.engine.drafters import SCORED_POSITIONS, Drafter
from cosine.engine.tree import DraftTree
from cosine.engine.prompt_fit import PromptFit

SEP = -1  # between sequences in a stream: no token equals it, so no match or continuation crosses it
KEYS = (4, 2, 1)  # n-gram lengths indexed, longest first
SMOOTHING = 4.0  # pseudo-occurrences over the match length: the best-calibrated (Brier score) on the tune prompts


def _key(tokens: Sequence[int]) -> int:
    """One int per n-gram (smaller than a tuple): the tokens' bits side by side, 32 per token."""
    key = 0
    for tok in tokens:
        key = (key << 32) | tok
    return key


class SuffixIndex:
    """Token sequences with the end position of every n-gram (n in `KEYS`), for longest-suffix lookups.

    Positions are global: they keep counting when old sequences are evicted from the front.
    ``max_tokens``: evict the oldest whole sequences beyond this many tokens (None: unbounded)."""

    def __init__(self, max_tokens: int | None = None):
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.max_tokens = max_tokens
        self._stream: list[int] = []  # tokens from global position _offset on, sequences separated by SEP
        self._offset = 0  # global position of _stream[0]
        self._floor = 0  # positions below are evicted
        self._seqs: deque[tuple[int, int]] = deque()  # (start, end) global positions of each sequence
        self._open = False  # the last sequence still grows
        # n → n-gram key → its end positions, ascending: one int while there is one (most n-grams), else a list
        self._buckets: dict[int, dict[int, int | list[int]]] = {n: {} for n in KEYS}
        self.tokens = 0  # tokens held (separators not counted)
        self.entries = 0  # positions held in buckets
        self.evicted_tokens = 0
        self.evicted_sequences = 0

    @property
    def sequences(self) -> int:
        return len(self._seqs)

    @property
    def end(self) -> int:
        """Global position after the last token."""
        return self._offset + len(self._stream)

    def token_at(self, pos: int) -> int | None:
        """The token at a global position; None past the end, at a separator or evicted."""
        if pos < self._floor:
            return None
        i = pos - self._offset
        if i >= len(self._stream):
            return None
        tok = self._stream[i]
        return None if tok == SEP else tok

    def tail(self, n: int) -> list[int]:
        """The last up to n tokens of the open sequence."""
        if not self._open:
            return []
        start = max(self._seqs[-1][0], self.end - n) - self._offset
        return self._stream[start:]

    def begin(self) -> None:
        """Start a new sequence (closing the open one)."""
        if self._stream:
            self._stream.append(SEP)
        self._seqs.append((self.end, self.end))
        self._open = True

    def extend(self, tokens: Iterable[int]) -> None:
        """Append tokens to the open sequence, indexing every n-gram they complete."""
        if not self._open:
            self.begin()
        stream, buckets = self._stream, self._buckets
        start = self._seqs[-1][0] - self._offset
        for tok in tokens:
            tok = int(tok)
            if not 0 <= tok < 1 << 32:
                raise ValueError(f"token ids must be in [0, 2**32), got {tok}")
            stream.append(tok)
            end = self._offset + len(stream)  # continuations of the n-grams ending here start at `end`
            length = len(stream) - start
            for n in KEYS:
                if n <= length:
                    bucket_of, key = buckets[n], _key(stream[-n:])
                    held = bucket_of.get(key)
                    if held is None:
                        bucket_of[key] = end
                    elif isinstance(held, int):
                        bucket_of[key] = [held, end]
                    else:
                        held.append(end)
                    self.entries += 1
            self.tokens += 1
        self._seqs[-1] = (self._seqs[-1][0], self.end)

    def add(self, tokens: Sequence[int]) -> None:
        """Index one whole sequence (its last max_tokens tokens at most), then evict beyond the bound."""
        if self.max_tokens is not None:
            tokens = tokens[-self.max_tokens:]
        if not tokens:
            return
        self.begin()
        self.extend(tokens)
        self._open = False
        self._evict()

    def _evict(self) -> None:
        if self.max_tokens is None:
            return
        while self.tokens > self.max_tokens and self._seqs:
            start, end = self._seqs.popleft()
            seq = self._stream[start - self._offset: end - self._offset]
            # the sequence's n-grams are the oldest of their buckets: drop them from the front
            for n in KEYS:
                bucket_of = self._buckets[n]
                for i in range(n, len(seq) + 1):
                    key = _key(seq[i - n: i])
                    bucket = bucket_of.get(key)
                    if bucket is None:
                        continue
                    if isinstance(bucket, int):
                        if bucket <= end:
                            del bucket_of[key]
                            self.entries -= 1
                        continue
                    cut = 0
                    while cut < len(bucket) and bucket[cut] <= end:
                        cut += 1
                    if cut:
                        del bucket[:cut]
                        self.entries -= cut
                    if not bucket:
                        del bucket_of[key]
                    elif len(bucket) == 1:
                        bucket_of[key] = bucket[0]
            self.tokens -= len(seq)
            self.evicted_tokens += len(seq)
            self.evicted_sequences += 1
            self._floor = end + 1  # past the separator
        if self._floor - self._offset > len(self._stream) // 2:  # compact: drop the evicted front
            del self._stream[: self._floor - self._offset]
            self._offset = self._floor

    def match(self, query: Sequence[int], max_match: int = 64, max_candidates: int = 256) -> tuple[int, list[int]]:
        """(L, positions): the longest L ≤ max_match such that the query's last L tokens occur here followed by
        a token, and where each such occurrence's continuation starts (most recent first). (0, []) if none.

        Only the ``max_candidates`` most recent occurrences of the query's last n tokens are examined."""
        q = len(query)
        stream, offset = self._stream, self._offset
        floor = self._floor - offset
        for n in KEYS:
            if n > q or n > max_match:
                continue
            bucket = self._buckets[n].get(_key(query[-n:]))
            if bucket is None:
                continue
            if isinstance(bucket, int):
                bucket = (bucket,)
            best, found = 0, []
            limit = min(max_match, q)
            for pos in islice(reversed(bucket), max_candidates):
                i = pos - offset  # where the continuation starts in `stream`
                if i >= len(stream) or stream[i] == SEP:
                    continue  # nothing followed (yet)
                length = n
                while length < limit and i - length - 1 >= floor and stream[i - length - 1] == query[q - length - 1]:
                    length += 1
                if length > best:
                    best, found = length, [pos]
                elif length == best:
                    found.append(pos)
            if found:
                return best, found
        return 0, []


class SuffixMemory(SuffixIndex):
    """The global index: earlier requests' outputs, bounded to ``max_tokens`` tokens (oldest evicted first)."""

    def __init__(self, max_tokens: int = 131072):
        super().__init__(max_tokens)


Cursor = tuple[SuffixIndex, int]  # an occurrence: its index and where its continuation is


@dataclass
class Match:
    """The longest match of a query over the request's index and the global memory."""

    length: int = 0
    cursors: list[Cursor] = field(default_factory=list)


def continuations(cursors: Sequence[Cursor]) -> tuple[int, list[tuple[int, list[Cursor]]]]:
    """(total, [(token, cursors one step further)]): the next token of every occurrence, grouped, most frequent
    first (ties: the token seen in the most recent occurrence first). total: occurrences that continue."""
    groups: dict[int, list[Cursor]] = {}
    total = 0
    for index, pos in cursors:
        tok = index.token_at(pos)
        if tok is None:
            continue
        total += 1
        groups.setdefault(tok, []).append((index, pos + 1))
    ranked = sorted(groups.items(), key=lambda kv: -len(kv[1]))  # stable: recency breaks ties
    return total, ranked


def confidence(count: int, total: int, match_len: int) -> float:
    """A continuation's probability: its share of the occurrences, smoothed by how long the match is."""
    return count / (total + SMOOTHING / max(match_len, 1))


@dataclass
class _Request:
    index: SuffixIndex
    prompt_len: int


class SuffixDrafter(Drafter):
    """Suffix decoding over the request's own tokens and a bounded memory of earlier outputs.

    ``memory``: the global index (shared; a request's output enters it at `release`), None for none.
    ``spec_factor``: draft at most ``ceil(spec_factor · L)`` tokens after a match of L tokens.
    ``min_prob``: stop a chain at a continuation less probable than this (trees: by path probability).
    ``anchor``: prompt tokens stored in the memory before each output (the chat template's assistant header),
        so an output's first tokens can be matched from the next request's prompt.
    """

    kind = "suffix"

    def __init__(self, name: str = "suffix", memory: SuffixMemory | None = None, max_match: int = 64,
                 spec_factor: float = 2.0, min_prob: float = 0.1, max_candidates: int = 256, anchor: int = 4):
        self.name = name
        self.memory = memory
        self.max_match = max_match
        self.spec_factor = spec_factor
        self.min_prob = min_prob
        self.max_candidates = max_candidates
        self.anchor = anchor
        self._reqs: dict[str, _Request] = {}

    def _requests(self) -> dict:
        return self._reqs

    def open(self, request_id: str, prompt: list[int]) -> None:
        index = SuffixIndex()
        index.begin()
        index.extend(prompt)
        self._reqs[request_id] = _Request(index, len(prompt))

    def release(self, request_id: str) -> None:
        req = self._reqs.pop(request_id, None)
        if req is not None and self.memory is not None:
            tokens = req.index.tail(req.index.tokens)
            if len(tokens) > req.prompt_len:
                self.memory.add(tokens[max(0, req.prompt_len - self.anchor):])

    def max_spec(self, match_len: int) -> int:
        return math.ceil(self.spec_factor * match_len) if match_len > 0 else 0

    def match(self, query: Sequence[int], own: SuffixIndex | None) -> Match:
        """The longest match over the request's index and the memory; equal lengths pool their occurrences."""
        best = Match()
        for index in (own, self.memory):
            if index is None:
                continue
            length, positions = index.match(query, self.max_match, self.max_candidates)
            if length > best.length:
                best = Match(length, [(index, p) for p in positions])
            elif length == best.length and length > 0:
                best.cursors += [(index, p) for p in positions]
        return best

    def _query(self, req: _Request, committed: Sequence[int], context: Sequence[int]) -> list[int]:
        req.index.extend(committed)
        return req.index.tail(self.max_match + 1) + list(context)

    def draft(self, request_id: str, committed: list[int], depth: int, context: Sequence[int] = ()) -> tuple[list[int], list[float]]:
        """The most frequent continuation of the longest match, token by token, while the match allows
        (at most ``spec_factor · L`` tokens after an L-token match) and each token's confidence reaches min_prob.
        When the matched occurrences run out (one ran into the present), the chain so far is matched again:
        the chain is what `propose` gives step by step with the chain as context."""
        req = self._reqs[request_id]
        query = self._query(req, committed, context)
        if depth <= 0:
            return [], []
        m = self.match(query, req.index)
        tokens: list[int] = []
        probs: list[float] = []
        cursors, length = m.cursors, m.length  # length: the match of query + tokens
        for step in range(depth):
            total, ranked = continuations(cursors)
            if not ranked and step:
                m = self.match(query + tokens, req.index)
                cursors, length = m.cursors, m.length
                total, ranked = continuations(cursors)
            if not ranked or step >= self.max_spec(length - step):
                break
            tok, nxt = ranked[0]
            p = confidence(len(nxt), total, length)
            if p < self.min_prob:
                break
            tokens.append(tok)
            probs.append(p)
            cursors, length = nxt, length + 1
        return tokens, probs

    def propose(self, request_id: str, committed: list[int], context: Sequence[int], top_k: int) -> list[tuple[int, float]]:
        """The most frequent continuations after committed + context; none once `context` is as deep as the
        match of the committed tokens allows (the match minus the context's tokens)."""
        req = self._reqs[request_id]
        query = self._query(req, committed, context)
        if top_k <= 0:
            return []
        m = self.match(query, req.index)
        ahead = len(context)
        if ahead >= self.max_spec(m.length - ahead):
            return []
        total, ranked = continuations(m.cursors)
        out = [(tok, confidence(len(nxt), total, m.length)) for tok, nxt in ranked[:top_k]]
        return [(t, p) for t, p in out if p >= self.min_prob]

    def draft_tree(self, request_id: str, committed: list[int], depth: int, budget: int,
                   context: Sequence[int] = ()) -> DraftTree:
        """A tree of up to `budget` nodes, at most min(depth, spec_factor · L) deep: the most probable paths
        first (best-first by path probability, none below min_prob), each node's probability its own
        continuation's `confidence`; parents come first and each node's first child is its most frequent
        continuation, so `DraftTree.main_chain` is the most frequent path. Unlike `draft`, the tree grows from the
        root match only (no matching again where its occurrences run out)."""
        req = self._reqs[request_id]
        query = self._query(req, committed, context)
        tree = DraftTree()
        m = self.match(query, req.index)
        limit = min(depth, self.max_spec(m.length))
        if limit <= 0 or budget <= 0:
            return tree
        heap: list[tuple[float, int, int, int, float, list[Cursor]]] = []  # (-path p, order, parent, token, p, cursors)
        order = 0

        def push(parent: int, level: int, path: float, cursors: list[Cursor]) -> None:
            nonlocal order
            total, ranked = continuations(cursors)
            for tok, nxt in ranked:
                p = confidence(len(nxt), total, m.length + level)
                if path * p < self.min_prob:
                    break  # ranked by count: the rest are less probable
                heapq.heappush(heap, (-path * p, order, parent, tok, p, nxt))
                order += 1

        push(-1, 0, 1.0, m.cursors)
        depth_of: list[int] = []
        while heap and len(tree) < budget:
            neg_path, _, parent, tok, p, nxt = heapq.heappop(heap)
            node = len(tree)
            tree.tokens.append(tok)
            tree.parents.append(parent)
            tree.probs.append(p)
            depth_of.append(1 if parent < 0 else depth_of[parent] + 1)
            if depth_of[node] < limit:
                push(node, depth_of[node], -neg_path, nxt)
        return tree

    def score_prompt(self, request_id: str) -> PromptFit:
        """At each of the prompt's last SCORED_POSITIONS positions, what `draft` would have proposed first after
        the prompt so far (over the prompt so far and the memory) against the prompt's next token."""
        req = self._reqs[request_id]
        prompt = req.index.tail(req.prompt_len)
        first = max(1, len(prompt) - SCORED_POSITIONS)
        seen = SuffixIndex()
        seen.begin()
        seen.extend(prompt[:first])
        hits = positions = 0
        conf = 0.0
        for i in range(first, len(prompt)):
            positions += 1
            m = self.match(prompt[max(0, i - self.max_match - 1): i], seen)
            total, ranked = continuations(m.cursors)
            if ranked:
                tok, nxt = ranked[0]
                p = confidence(len(nxt), total, m.length)
                if p >= self.min_prob:
                    hits += tok == prompt[i]
                    conf += p
            seen.extend([prompt[i]])
        return PromptFit(positions, hits, conf, None)
