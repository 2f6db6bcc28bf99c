"""Confidence-based token fusion (DESIGN §2): many drafters' candidates → one draft tree (pure logic).

Step-wise protocol, one `ConfidenceFusion` per request and round:

1. at each step every participating drafter proposes candidates
   ``[(token, prob), ...]`` for the *same* next position, all conditioned on
   the fused chain so far;
2. `ConfidenceFusion.step` picks the most confident token — the highest
   probability any drafter gave it; ties go to the token more drafters support
   (higher summed probability), then to the drafter listed first, then to the
   smaller token id, so the result never depends on dict or arrival order —
   and returns it; the caller sends it to every drafter so each continues from
   the fused context;
3. every other candidate of that step is kept as a side branch: a child of the
   previous fused node (a leaf — no drafter continued from it);
4. after ``depth`` steps (or when no drafter proposes anything) `tree` builds a
   `DraftTree`: the fused chain first, in order (so ``main_chain()`` returns it),
   then side nodes, pruned to ``budget`` nodes. Side nodes are kept by path
   probability — the product of the fused probabilities above them and their
   own probability, the chance the verifier reaches *and* accepts them if the
   drafters are calibrated — highest first (ties: earlier step, smaller token).
   When the budget is smaller than the chain, the chain is cut and no side
   nodes are kept.

The merge-only variant (drafters draft whole chains independently; the chains
are prefix-merged) is `merge_only`, which reuses `fusion.policy.merge_chains`;
`single_chain` is fusion switched off.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from cosine.engine.tree import DraftTree
from cosine.fusion.policy import merge_chains

Candidate = tuple[int, float]


@dataclass(frozen=True)
class FusedStep:
    """The outcome of one fusion step."""

    token: int
    prob: float  # the winning (highest) probability
    source: str  # drafter that gave it
    support: int  # how many drafters proposed the token
    side: tuple[Candidate, ...]  # the other candidates, (token, best prob), most probable first


def fuse_step(candidates: Mapping[str, Sequence[Candidate]], order: Sequence[str] | None = None) -> FusedStep | None:
    """Fuse one step's candidates (drafter → [(token, prob)]); None when nobody proposed anything.

    ``order`` ranks drafters for tie-breaks (default: sorted names). A drafter
    absent from ``order`` ranks after the listed ones, by name.
    """
    rank = {n: i for i, n in enumerate(order or ())}
    def drafter_key(name: str) -> tuple[int, str]:
        return (rank.get(name, len(rank)), name)

    best: dict[int, tuple[float, str]] = {}  # token → (max prob, drafter giving it)
    total: dict[int, float] = {}
    support: dict[int, int] = {}
    for name in sorted(candidates, key=drafter_key):
        seen: set[int] = set()
        for tok, prob in candidates[name]:
            tok, prob = int(tok), float(prob)
            if not 0.0 <= prob <= 1.0 or prob != prob:
                raise ValueError(f"drafter {name!r} gave token {tok} probability {prob}: must be in [0, 1]")
            if tok not in best or prob > best[tok][0]:
                best[tok] = (prob, name)
            if tok not in seen:  # a drafter listing a token twice supports it once
                seen.add(tok)
                support[tok] = support.get(tok, 0) + 1
                total[tok] = total.get(tok, 0.0) + prob
    if not best:
        return None

    def token_key(tok: int) -> tuple:
        prob, name = best[tok]
        return (-prob, -total[tok], drafter_key(name), tok)

    ranked = sorted(best, key=token_key)
    win = ranked[0]
    side = tuple((t, best[t][0]) for t in ranked[1:])
    return FusedStep(win, best[win][0], best[win][1], support[win], side)


@dataclass
class ConfidenceFusion:
    """State machine for one round of step-wise fusion.

    ``depth``: steps to run; ``budget``: most nodes in the tree; ``width``: most
    side candidates kept per step (None: all); ``order``: drafter tie-break order.
    """

    depth: int
    budget: int
    width: int | None = None
    order: Sequence[str] | None = None
    steps: list[FusedStep] = field(default_factory=list)
    stopped: bool = False

    def __post_init__(self) -> None:
        if self.depth < 0 or self.budget < 0:
            raise ValueError(f"depth and budget must be >= 0, got depth={self.depth}, budget={self.budget}")
        if self.width is not None and self.width < 0:
            raise ValueError(f"width must be >= 0 or None, got {self.width}")

    @property
    def done(self) -> bool:
        return self.stopped or len(self.steps) >= min(self.depth, self.budget)

    @property
    def chain(self) -> list[int]:
        """The fused tokens so far (the context every drafter continues from)."""
        return [s.token for s in self.steps]

    def step(self, candidates: Mapping[str, Sequence[Candidate]]) -> int | None:
        """Fuse one step; returns the token to send to every drafter, or None when the round is over."""
        if self.done:
            return None
        fused = fuse_step(candidates, self.order)
        if fused is None:
            self.stopped = True
            return None
        self.steps.append(fused)
        return fused.token

    def tree(self) -> DraftTree:
        """Fused chain (nodes 0..L-1) plus the most probable side nodes, at most ``budget`` nodes."""
        chain = self.steps[: self.budget]
        tree = DraftTree.chain([s.token for s in chain], [s.prob for s in chain])
        room = self.budget - len(chain)
        if room <= 0:
            return tree
        side: list[tuple[float, int, int, float]] = []  # (path prob, step, token, prob)
        reach = 1.0  # probability of reaching the parent of step j's nodes
        for j, s in enumerate(chain):
            for tok, prob in s.side[: self.width]:
                side.append((reach * prob, j, tok, prob))
            reach *= s.prob
        side.sort(key=lambda x: (-x[0], x[1], x[2]))
        for _, j, tok, prob in side[:room]:
            tree.tokens.append(tok)
            tree.parents.append(j - 1)
            tree.probs.append(prob)
        return tree


def fuse_with(
    proposers: Mapping[str, Callable[[list[int]], Sequence[Candidate]]],
    depth: int,
    budget: int,
    width: int | None = None,
) -> tuple[DraftTree, ConfidenceFusion]:
    """Run step-wise fusion to the end, asking each proposer for candidates given the fused chain.

    For simulations and tests: ``proposers[name](fused_chain)`` returns that
    drafter's candidates for the next position. Drafter order = mapping order.
    """
    fusion = ConfidenceFusion(depth, budget, width, order=list(proposers))
    while not fusion.done:
        context = fusion.chain
        if fusion.step({name: propose(context) for name, propose in proposers.items()}) is None:
            break
    return fusion.tree(), fusion


def merge_only(chains: Mapping[str, tuple[Sequence[int], Sequence[float]]], budget: int) -> DraftTree:
    """Merge-only fusion: independently drafted (tokens, probs) chains prefix-merged (`merge_chains`)."""
    return merge_chains([(list(t), list(p)) for t, p in chains.values()], budget)


def single_chain(tokens: Sequence[int], probs: Sequence[float], budget: int) -> DraftTree:
    """Fusion off: one drafter's chain, cut to the budget."""
    n = max(0, budget)
    return DraftTree.chain(list(tokens)[:n], list(probs)[:n])
