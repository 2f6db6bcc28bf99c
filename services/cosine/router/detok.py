"""Incremental detokenizing with stop strings: emit only text that is final."""

from __future__ import annotations


class StreamText:
    """Turns a growing list of token ids into text deltas.

    Text is held back while it could still change: a trailing incomplete UTF-8
    character (decoded as U+FFFD), or a suffix that could be the start of a stop
    string. When a stop string appears, the text is cut before it.

    Each new token decodes a short window, not the whole output (the incremental
    detokenizing of TGI and vLLM): the window starts at the previous text boundary,
    so a tokenizer's treatment of a sequence's first token (a leading space dropped)
    falls on both the window and its prefix alike, and the text grows by their
    difference once it ends in a whole character. Decoding all of a 2,048-token
    output again for every token cost the router 0.35 ms a token at its end.
    """

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = stop
        self.token_ids: list[int] = []
        self.text = ""  # the tokens' text up to `_read`, whole characters
        self._prefix = 0  # the window's first token: where the text before `_read` began to be decoded
        self._read = 0  # tokens whose text is in `text`
        self._before: str | None = None  # the text of tokens _prefix.._read, decoded on their own
        self.sent = 0  # characters of the text already emitted
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _pending(self) -> str:
        """The text of the tokens past `_read` (it may end in a half character)."""
        if self._read == len(self.token_ids):
            return ""
        if self._before is None:
            self._before = self._decode(self.token_ids[self._prefix:self._read])
        return self._decode(self.token_ids[self._prefix:])[len(self._before):]

    def _visible(self) -> str:
        """The text so far without a trailing half character; moves the window on once it ends whole."""
        new = self._pending()
        if new and not new.endswith("\ufffd"):  # (tokens without text, say special ones, widen the window)
            self.text += new
            self._prefix, self._read, self._before = self._read, len(self.token_ids), None
            return self.text
        return self.text + new.rstrip("\ufffd")

    def add(self, token_ids: list[int]) -> tuple[list[int], str]:
        """Add one round's tokens; returns (the tokens to report, the new final text)."""
        if self.stopped:
            return [], ""
        kept = list(token_ids)
        for i, tok in enumerate(token_ids):
            self.token_ids.append(tok)
            if self.stop:
                text = self._visible()
                hit = self._find_stop(text)
                if hit is not None:
                    self.stopped = True
                    kept = token_ids[: i + 1]
                    delta = text[self.sent : hit]
                    self.sent = hit
                    return kept, delta
        text = self._visible()
        end = min(len(text), self._safe_end(text))
        delta = text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return kept, delta

    def flush(self) -> str:
        """At the end of the stream: whatever is still held back (not after a stop)."""
        if self.stopped:
            return ""
        text = self.text + self._pending()
        delta = text[self.sent :]
        self.sent = len(text)
        return delta

    def _find_stop(self, text: str) -> int | None:
        start = max(0, self.sent - max(len(s) for s in self.stop))
        hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _safe_end(self, text: str) -> int:
        """End of the text that cannot be the beginning of a stop string."""
        end = len(text)
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    end = min(end, len(text) - k)
                    break
        return end
