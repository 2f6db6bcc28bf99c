"""Incremental detokenizing with stop strings: emit only text that is final."""

from __future__ import annotations


class StreamText:
    """Turns a growing list of token ids into text deltas.

    Text is held back while it could still change: a trailing incomplete UTF-8
    character (decoded as U+FFFD), or a suffix that could be the start of a stop
    string. When a stop string appears, the text is cut before it.
    """

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = stop
        self.token_ids: list[int] = []
        self.sent = 0  # characters of the decoded text already emitted
        self.stopped = False

    def _decode(self) -> str:
        return self.tokenizer.decode(self.token_ids, skip_special_tokens=True)

    def add(self, token_ids: list[int]) -> tuple[list[int], str]:
        """Add one round's tokens; returns (the tokens to report, the new final text)."""
        if self.stopped:
            return [], ""
        kept = list(token_ids)
        for i, tok in enumerate(token_ids):
            self.token_ids.append(tok)
            if self.stop:
                text = self._decode()
                hit = self._find_stop(text)
                if hit is not None:
                    self.stopped = True
                    kept = token_ids[: i + 1]
                    delta = text[self.sent : hit]
                    self.sent = hit
                    return kept, delta
        text = self._decode()
        end = len(text)
        while end > self.sent and text[end - 1] == "\ufffd":
            end -= 1
        end = min(end, self._safe_end(text))
        delta = text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return kept, delta

    def flush(self) -> str:
        """At the end of the stream: whatever is still held back (not after a stop)."""
        if self.stopped:
            return ""
        text = self._decode()
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
