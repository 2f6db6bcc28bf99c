"""Prompt lookup inside the verifier's plain steps (pure code: no gRPC, no model).

A plain step reads the target's weights once to commit one token; verifying a few more positions with it
costs little next to that (the native engine's chain of 4 at batch 1: 1.2–1.3× a one-token step). So before
each plain step of a request that allows it (`VerifyRound.lookup`), the verifier looks the request's own
tokens (its prompt and what it wrote since) up for the longest earlier occurrence of what it just wrote, and
verifies the continuation found there as a chain with the step. The target accepts what it would have written
anyway, so the output is the same; only the number of steps drops where the text repeats itself (code that
echoes the prompt, lists, quoted passages).

Unlike drafting through fusion this costs no round trip and no drafter: it runs on the model thread between
steps, in microseconds, so it fits inside a decode run (several steps answered at once), where a draft from
the drafters cannot. The lookup is `cosine.engine.suffix.SuffixDrafter` over the request's own index only (no
memory of other requests: the verifier serves many clients).

How far a chain goes is a cost rule. A looked-up token's path probability (the product of the suffix
drafter's confidences along the chain, calibrated against acceptance) is the tokens it is expected to add to
the step; the position it takes costs ``row_cost`` of a one-request step. A step of b requests commits about
b tokens in 1 + (b − 1)·row_cost such units, so a position pays while its path probability is at least
``b·row_cost / (1 + (b − 1)·row_cost)``. The engine alone says a position costs 0.07–0.10 of a one-token
step (bf16, batch 1); the default 0.3 is what paid through the cluster, where a looked-up position also costs
the step's tree path for every row, and requests that commit at different speeds fall out of step with one
another (measured in the README's benchmark section). With it the floor is 0.30 alone, 0.63 at b = 4 and
0.87 at b = 16: alone a fair match is worth a position; in a full batch only a long, consistent one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from cosine.engine.suffix import SuffixDrafter
from cosine.engine.tree import DraftTree, cut_tree

if TYPE_CHECKING:
    import torch

    from cosine.engine.feature_head import FeatureHead

MAX_LOOKUP = 16  # most tokens one lookup may propose (VerifyRound.lookup)


class RunLookup:
    """Per request, a suffix index of its committed tokens, kept up to date from the engine's own record."""

    def __init__(self, row_cost: float = 0.3, max_match: int = 64, head: "FeatureHead | None" = None,
                 head_max_floor: float = 0.75, head_trees: bool = True):
        if not 0 < row_cost < 1:
            raise ValueError(f"row_cost must be in (0, 1), got {row_cost}")
        self.row_cost = row_cost
        self.head = head
        # The head runs for every ask of a step, whatever it then proposes; where a step's floor is this high
        # (8 requests and more at the default row cost) its chains would rarely pay: it does not run.
        self.head_max_floor = head_max_floor
        self.head_trees = head_trees  # False: the head's greedy chain (its trees at a floor no two siblings pass)
        self._drafter = SuffixDrafter("lookup", memory=None, max_match=max_match, min_prob=row_cost)
        self._seen: dict[str, int] = {}  # request id -> committed tokens its index holds

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._seen

    def min_path(self, batch: int) -> float:
        """The path probability at which a looked-up position pays in a step of ``batch`` requests."""
        r = self.row_cost
        return batch * r / (1 + (batch - 1) * r)

    def chain(self, request_id: str, committed: list[int], depth: int, batch: int = 1) -> DraftTree:
        """A chain of at most ``depth`` tokens continuing ``committed`` (the request's tokens so far: the index
        takes what it has not seen) for a step of ``batch`` requests; empty when nothing probable enough was
        found."""
        seen = self._seen.get(request_id)
        if seen is None or seen > len(committed):  # new here (or reopened with other tokens)
            self._drafter.open(request_id, list(committed))
            new: list[int] = []
        else:
            new = committed[seen:]
        self._seen[request_id] = len(committed)
        tokens, probs = self._drafter.draft(request_id, new, depth)
        return DraftTree.chain_above(tokens, probs, self.min_path(batch))

    def chains(self, asks: Sequence[tuple[str, list[int], int, "torch.Tensor | None"]],
               batch: int = 1) -> list[tuple[DraftTree, str]]:
        """For each (request id, committed tokens, depth, the target's feature at its last token or None), the
        chain to verify with its next step in a step of ``batch`` requests, and where it came from: "lookup"
        (the request's own tokens), "head" (the feature head, one batched call for every ask with a feature)
        or "" (nothing pays). Of the two, the chain expected to add more tokens (Σ path probabilities)."""
        found = [(self.chain(rid, committed, depth, batch), "lookup") for rid, committed, depth, _ in asks]
        with_feature = [i for i, (_, _, depth, feature) in enumerate(asks) if feature is not None and depth > 0]
        if self.head is None or not with_feature or self.min_path(batch) > self.head_max_floor:
            return [(tree, source if len(tree) else "") for tree, source in found]
        import torch

        nodes = max(asks[i][2] for i in with_feature)
        features = torch.stack([asks[i][3] for i in with_feature])
        floor = self.min_path(batch)
        trees = self.head.trees(features, [asks[i][1][-1] for i in with_feature], nodes, floor,
                                chains=not self.head_trees)
        for i, tree in zip(with_feature, trees):
            tree = cut_tree(tree, asks[i][2])  # its likeliest nodes (the head orders them so)
            if _expected(tree) > _expected(found[i][0]):
                found[i] = (tree, "head")
        return [(tree, source if len(tree) else "") for tree, source in found]

    def forget(self, keep: Callable[[str], bool] | Iterable[str]) -> None:
        """Drop the indexes of requests no longer open (``keep``: a predicate or the ids still open)."""
        test = keep if callable(keep) else set(keep).__contains__
        for rid in [rid for rid in self._seen if not test(rid)]:
            del self._seen[rid]
            self._drafter.release(rid)


def _expected(tree: DraftTree) -> float:
    """Tokens a tree is expected to add: Σ of its nodes' path probabilities."""
    return sum(tree.path_probs())
