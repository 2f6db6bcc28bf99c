"""Reduced drafting vocabularies: a drafter's head covers a few thousand token ids, not all 49,152.

On disk a drafter with a reduced head carries `draft_vocab.json` beside its
checkpoint: a JSON list whose entry i is the target token id of output index i.
The drafter's input ids use the same index space; a target token outside the
list maps to the fallback index (the first special token kept, else index 0).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

FILE = "draft_vocab.json"


@dataclass
class DraftVocab:
    token_ids: list[int]  # output index -> target token id
    fallback: int = 0  # draft index used for target tokens outside the vocabulary
    _index: dict[int, int] = field(init=False, repr=False)

    def __post_init__(self):
        if len(set(self.token_ids)) != len(self.token_ids):
            raise ValueError("draft vocabulary lists a token id twice")
        if not 0 <= self.fallback < len(self.token_ids):
            raise ValueError(f"fallback index {self.fallback} outside a vocabulary of {len(self.token_ids)}")
        self._index = {t: i for i, t in enumerate(self.token_ids)}

    def __len__(self) -> int:
        return len(self.token_ids)

    def __contains__(self, token_id: int) -> bool:
        return token_id in self._index

    def to_draft(self, token_ids: Iterable[int]) -> list[int]:
        """Target token ids -> draft indices (outside the vocabulary: the fallback)."""
        return [self._index.get(t, self.fallback) for t in token_ids]

    def to_target(self, indices: Iterable[int]) -> list[int]:
        return [self.token_ids[i] for i in indices]

    def coverage(self, counts: Counter) -> float:
        """Share of the token occurrences in `counts` that the vocabulary covers."""
        total = sum(counts.values())
        return sum(n for t, n in counts.items() if t in self._index) / total if total else 0.0

    def save(self, directory: Path) -> Path:
        path = Path(directory) / FILE
        path.write_text(json.dumps(self.token_ids))
        return path

    @classmethod
    def load(cls, directory: Path, fallback: int = 0) -> "DraftVocab | None":
        path = Path(directory) / FILE
        if not path.exists():
            return None
        ids = json.loads(path.read_text())
        if not isinstance(ids, list) or not all(isinstance(t, int) and t >= 0 for t in ids):
            raise ValueError(f"{path} must be a JSON list of token ids")
        return cls(ids, fallback)


def select_vocab(counts: Counter, size: int, always: Iterable[int] = ()) -> DraftVocab:
    """The `size` most frequent token ids, with the `always` ids (special tokens) first; ties by id."""
    keep = list(dict.fromkeys(always))
    if len(keep) > size:
        raise ValueError(f"{len(keep)} tokens must be kept but the vocabulary holds {size}")
    chosen = set(keep)
    for token, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(keep) >= size:
            break
        if token not in chosen:
            keep.append(token)
            chosen.add(token)
    return DraftVocab(keep, 0)
