"""Token trees and the lossless walk that accepts a path of one (DESIGN §3).

Node i holds token tokens[i] and parent parents[i]; -1 means the last committed
token. Nodes are in topological order (a parent before its children). A chain of
n tokens has parents [-1, 0, ..., n-2].
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class DraftTree:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)

    @classmethod
    def chain(cls, tokens: list[int], probs: list[float] | None = None) -> "DraftTree":
        return cls(list(tokens), list(range(-1, len(tokens) - 1)), list(probs or [1.0] * len(tokens)))

    @classmethod
    def chain_above(cls, tokens: list[int], probs: list[float], floor: float) -> "DraftTree":
        """The chain's prefix whose path probability (the product of ``probs`` from the root) stays at or above
        ``floor``."""
        path, keep = 1.0, 0
        for p in probs:
            path *= p
            if path < floor:
                break
            keep += 1
        return cls.chain(tokens[:keep], probs[:keep])

    def path_probs(self) -> list[float]:
        """Each node's path probability: the product of ``probs`` from the root to it."""
        paths: list[float] = []
        for p, parent in zip(self.probs, self.parents):
            paths.append(p * (paths[parent] if parent >= 0 else 1.0))
        return paths

    def __len__(self) -> int:
        return len(self.tokens)

    def validate(self, vocab_size: int) -> None:
        """Raise ValueError unless this is a well-formed tree over the vocabulary."""
        if len(self.parents) != len(self.tokens):
            raise ValueError(f"draft tree has {len(self.tokens)} tokens but {len(self.parents)} parents")
        for i, (tok, parent) in enumerate(zip(self.tokens, self.parents)):
            if not -1 <= parent < i:
                raise ValueError(f"draft tree node {i} has parent {parent}: parents must come first")
            if not 0 <= tok < vocab_size:
                raise ValueError(f"draft tree node {i} has token {tok} outside the vocabulary ({vocab_size})")

    def depths(self) -> list[int]:
        """1-based depth of each node (children of the committed prefix have depth 1)."""
        depth: list[int] = []
        for parent in self.parents:
            depth.append(1 if parent < 0 else depth[parent] + 1)
        return depth

    def main_chain(self) -> list[int]:
        """Node indices of the first-child path from the root (the fused chain)."""
        chain: list[int] = []
        for i, parent in enumerate(self.parents):
            if parent == (chain[-1] if chain else -1):
                chain.append(i)
        return chain

    def main_chain_tree(self) -> "DraftTree":
        """The main chain alone, as a chain (what a target that verifies chains only checks)."""
        nodes = self.main_chain()
        return DraftTree.chain([self.tokens[i] for i in nodes], [self.probs[i] for i in nodes] if self.probs else None)

    def is_chain(self) -> bool:
        return self.parents == list(range(-1, len(self.tokens) - 1))


def cut_tree(tree: DraftTree, n: int) -> DraftTree:
    """The tree's first n nodes: parents come before children, so a prefix is a tree again."""
    if n >= len(tree):
        return tree
    return DraftTree(tree.tokens[:n], tree.parents[:n], tree.probs[:n])


def walk(tree: DraftTree, target_choice: Sequence[int]) -> tuple[list[int], int]:
    """Accept the path the target agrees with.

    target_choice[0] is the target's token after the committed prefix and
    target_choice[i + 1] its token after node i (argmax for greedy; a sample of
    its processed distribution otherwise). Starting at the root, descend to the
    child holding the target's token; the first token that no child holds is the
    bonus token. Returns (accepted node indices, bonus token). Exact for any tree
    whose tokens are point-mass proposals. Reads target_choice only at the root and at
    accepted nodes (a `RowChoices` chooses those rows alone).
    """
    children: dict[int, dict[int, int]] = {}
    for i, (tok, parent) in enumerate(zip(tree.tokens, tree.parents)):
        children.setdefault(parent, {}).setdefault(tok, i)
    path: list[int] = []
    node = -1
    while True:
        y = target_choice[node + 1]
        nxt = children.get(node, {}).get(y)
        if nxt is None:
            return path, y
        path.append(nxt)
        node = nxt
