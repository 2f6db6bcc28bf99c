"""The target's token choice: greedy, or sampled from its processed distribution.

Sampling is made reproducible per position: the uniform number that picks the
token at absolute position t comes from a generator seeded by (seed, t). So the
token at t is a fixed function of the target's distribution there — whatever was
drafted, however the rounds were cut — and the output of a seeded request is the
same with speculation on or off. Across seeds the numbers are independent, so
each token is an exact sample of the target's distribution.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def check(self) -> None:
        """Raise ValueError with a readable message if a parameter is out of range."""
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"sampling.temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if not math.isfinite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"sampling.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"sampling.top_k must be >= 0 (0 = off), got {self.top_k}")


def _mix(seed: int, position: int) -> int:
    """splitmix64 of (seed, position): well-spread generator seeds."""
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def uniform_at(seed: int, position: int) -> float:
    """The uniform number in [0, 1) that chooses the token at `position`."""
    gen = torch.Generator().manual_seed(_mix(seed, position))
    return float(torch.rand((), generator=gen, dtype=torch.float64))


def target_probs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Temperature, then top-k, then top-p: [n, vocab] logits → [n, vocab] float64 probabilities."""
    scaled = logits.double() / sampling.temperature  # [n, vocab]
    if sampling.top_k and sampling.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, sampling.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if sampling.top_p < 1.0:
        probs = probs.masked_fill(_top_p_drop(probs, sampling.top_p), 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


_TOP_P_MARGIN = 1e-9  # far above the rounding of a cumulative sum of probabilities in float64


def _top_p_drop(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """[n, vocab] bool: the tokens top-p removes, those whose mass before them (in descending order)
    reaches top_p; the first token is never removed.

    Usually only the head of the descending order matters, so it first tries the top 64, then the
    top 1024, and sorts the whole vocabulary (3-5 ms a row of 49k here) only when the mass before
    the last of those is not yet past top_p. The masses are those of a full sort: the same
    descending values, summed in the same order. Tokens of equal probability at the cut are ordered
    as topk orders them.
    """
    head = None
    for k in (64, 1024):
        if k * 4 > probs.shape[-1]:
            break
        values, order = torch.topk(probs, k, dim=-1)  # sorted, descending
        mass_before = torch.cumsum(values, dim=-1) - values
        if bool((mass_before[..., -1] >= top_p + _TOP_P_MARGIN).all()):  # every token past the k-th is dropped
            head = (order, mass_before)
            break
    if head is None:
        values, order = torch.sort(probs, dim=-1, descending=True)
        head = (order, torch.cumsum(values, dim=-1) - values)
    order, mass_before = head
    keep = torch.zeros(probs.shape, dtype=torch.bool, device=probs.device)
    return ~keep.scatter_(-1, order, mass_before < top_p)


def sample_from(probs: torch.Tensor, u: float) -> int:
    """Inverse-CDF sample of one [vocab] distribution with uniform u."""
    cdf = torch.cumsum(probs, dim=-1)
    index = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=cdf.dtype, device=cdf.device)).item())
    index = min(index, probs.shape[-1] - 1)
    while probs[index] == 0 and index > 0:  # u landed on the edge of a dropped token
        index -= 1
    return index


@functools.lru_cache(maxsize=16)
def _argmax_chunk(vocab: int) -> int | None:
    """A divisor of the vocabulary near its square root (the chunk width of `greedy_tokens`), or None."""
    root = math.isqrt(vocab)
    for c in sorted(range(32, 4097), key=lambda c: (abs(c - root), c)):
        if vocab % c == 0:
            return c
    return None


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """torch.argmax of each row of [n, vocab] logits (the first index of the row's maximum), fast on CPU.

    ATen's CPU argmax over a long last dimension runs element by element (~30 us a row of 49k
    here, 0.5 ms for a 16-node tree); max is vectorized. So: the max of each chunk of the row,
    the first chunk holding the row's max, the argmax within that chunk. Same answer
    as torch.argmax, ties included; rows with a NaN (where argmax picks the NaN) fall back to it.
    """
    n, vocab = logits.shape
    c = _argmax_chunk(vocab) if logits.device.type == "cpu" and n > 0 else None
    if c is None:
        return logits.argmax(dim=-1).tolist()
    x = logits.contiguous().view(n, vocab // c, c)
    chunk_max = x.amax(dim=-1)  # [n, vocab / c]
    row_max = chunk_max.amax(dim=-1, keepdim=True)  # [n, 1]
    hit = chunk_max == row_max
    if not bool(hit.any(dim=-1).all()):  # a NaN row: amax gives NaN, which equals nothing
        return logits.argmax(dim=-1).tolist()
    first_chunk = hit.to(torch.uint8).argmax(dim=-1)  # argmax returns the first of equal maxima
    in_chunk = x[torch.arange(n), first_chunk].argmax(dim=-1)  # [n, c]: short rows, argmax is cheap there
    return (first_chunk * c + in_chunk).tolist()


class RowChoices(Sequence):
    """The target's token after each row of [n, vocab] logits, chosen when first read (`choices[i]`).

    A walk over a draft reads only the rows on its accepted path and one more, and choosing by
    sampling costs a softmax over the vocabulary (plus a top-k/top-p cut) per row: for a 16-node
    tree the rows nobody reads were most of the cost. Row i is chosen exactly as `choose_tokens`
    chooses a single row, as plain decoding does.
    """

    def __init__(self, logits: torch.Tensor, sampling: Sampling, positions: list[int]):
        if logits.shape[0] != len(positions):
            raise ValueError(f"{logits.shape[0]} rows of logits but {len(positions)} positions")
        self._logits = logits
        self._sampling = sampling
        self._positions = positions
        self._chosen: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._positions)

    def __getitem__(self, i: int) -> int:
        if not 0 <= i < len(self._positions):
            raise IndexError(f"row {i} of {len(self._positions)}")
        if i not in self._chosen:
            self._chosen[i] = choose_tokens(self._logits[i:i + 1], self._sampling, [self._positions[i]])[0]
        return self._chosen[i]


def choose_tokens(logits: torch.Tensor, sampling: Sampling, positions: list[int]) -> list[int]:
    """The target's token for each row of [n, vocab] logits; row i chooses the token at positions[i]."""
    if sampling.greedy:
        return greedy_tokens(logits)
    probs = target_probs(logits, sampling)
    return [sample_from(probs[i], uniform_at(sampling.seed, pos)) for i, pos in enumerate(positions)]
