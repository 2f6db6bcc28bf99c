"""Fusion policy: turn the drafters' proposals into one draft tree (pure logic).

This first version merges whole chains: the chain with the highest mean
confidence becomes the main chain (nodes first, in order), the others are merged
into the same prefix tree as side branches, and the tree is cut to a node budget.
Step-wise confidence fusion (each step's most confident token fed back to every
drafter) builds on the same tree.
"""

from __future__ import annotations

from cosine.engine.tree import DraftTree


def merge_chains(chains: list[tuple[list[int], list[float]]], budget: int) -> DraftTree:
    """Prefix-merge (tokens, probs) chains into a tree of at most `budget` nodes, most confident chain first."""
    def confidence(chain: tuple[list[int], list[float]]) -> float:
        return sum(chain[1]) / len(chain[1]) if chain[1] else 0.0

    tree = DraftTree()
    index: dict[tuple[int, int], int] = {}  # (parent, token) → node
    for tokens, probs in sorted(chains, key=confidence, reverse=True):
        parent = -1
        for tok, prob in zip(tokens, probs):
            node = index.get((parent, tok))
            if node is None:
                if len(tree) >= budget:
                    break
                node = len(tree)
                index[(parent, tok)] = node
                tree.tokens.append(tok)
                tree.parents.append(parent)
                tree.probs.append(prob)
            else:
                tree.probs[node] = max(tree.probs[node], prob)
            parent = node
    return tree
