"""Drafting ahead (pipelining with one request in flight): pure tree logic.

While round k's tree is verified, fusion drafts round k+1 as if round k's main chain
``c`` will be accepted whole: it drafts after the context ``c``, so the first level
of that tree guesses the target's bonus token ``b``. If the verifier then accepts
all of ``c`` and its bonus token is one of those guesses, the part of the tree
below that guess is a valid draft for round k+1 — drafted while the verifier
worked — and the round skips drafting. Otherwise the tree is dropped. Either way
the verifier decides what is accepted, so output is unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

from cosine.engine.tree import DraftTree


def main_chain_tokens(tokens: Sequence[int], parents: Sequence[int]) -> list[int]:
    """Tokens of the first-child path from the root (the tree's main chain)."""
    tree = DraftTree(list(tokens), list(parents), [1.0] * len(tokens))
    return [tree.tokens[i] for i in tree.main_chain()]


def subtree_after(tree: DraftTree, path: Sequence[int], max_depth: int | None = None) -> DraftTree | None:
    """The nodes below the one reached by following ``path``'s tokens from the root, re-rooted (that node's
    children become roots), at most ``max_depth`` deep; None when the tree does not hold the path."""
    node = -1
    for tok in path:
        node = next((i for i, (t, p) in enumerate(zip(tree.tokens, tree.parents)) if p == node and t == tok), None)
        if node is None:
            return None
    out = DraftTree()
    index = {node: -1}  # old node -> new index
    depth = {node: 0}
    for i, (tok, parent) in enumerate(zip(tree.tokens, tree.parents)):
        if parent not in index or i in index:
            continue
        d = depth[parent] + 1
        if max_depth is not None and d > max_depth:
            continue
        index[i], depth[i] = len(out), d
        out.tokens.append(tok)
        out.parents.append(index[parent])
        out.probs.append(tree.probs[i] if i < len(tree.probs) else 1.0)
    return out
