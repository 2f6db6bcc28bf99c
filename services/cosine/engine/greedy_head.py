"""The greedy token of an fp32 LM head from half its bytes: a bf16 screen, a proven bound, the few close rows exact.

Why: at one row a decode step is memory-bound, and the head of the 135M target is 113 MB of its 538 MB in fp32
(49,152 x 576). A greedy row needs only the argmax of its logits. The screen multiplies the row by a bf16 copy of
the head (56 MB, CoSine's bf16 kernel) and bounds, for every vocabulary row t at once, how far that approximate
logit A_t can be from the exact one E_t (what the fp32 head, CoSine's fp32 kernel, gives that row): |E_t - A_t| <= B.
A row t with A_t < max(A) - 2B cannot be the argmax (E_t <= A_t + B < max(A) - B <= E_t* for t* = argmax A),
so the argmax of E over the vocabulary is the argmax over the candidates left, whose exact logits are recomputed
from the packed fp32 panel that holds each, with the fp32 kernel's sequence of fused multiply-adds (each output
lane adds its products in increasing k from +0, whatever the other columns and rows of a call): bitwise the full
head's logits. The tie rule (the first index of the maximum, as torch.argmax) is kept by taking candidates in
index order. On the target's final hidden states the cut leaves a median of 2 candidates (90th percentile 7, at
most 28 in 193 rows).

The bound B for a row x (fp32, K elements), with xb = bf16(x), e = x - xb, and over the head's rows w (fp32),
wb = bf16(w), d = w - wb, u = 2^-24, g = K u / (1 - K u):
  |E - sum x w|       <= g |x| |w|            (K fused multiply-adds in fp32, one rounding each)
  |sum x w - sum xb wb| <= |x| |d| + |e| |wb|   (x w - xb wb = x d + e wb; Cauchy-Schwarz)
  |sum xb wb - A'|    <= 2 g |xb| |wb|        (VDPBF16PS: exact products, at most 2 roundings a pair of k)
  |A' - A|            <= 2^-8 |A|             (the kernel's one rounding of its fp32 sum to bf16 output)
with |w|, |wb|, |d| the largest row norms of the head (one bound for the whole row of logits) and |A| the row's
largest magnitude; B takes 0.1 % and 1e-5 more for the rounding of the norms and of the bound itself. bf16's
inputs below the normal range are flushed by VDPBF16PS: a product of magnitude under 2^-126 each, which the 1e-5
covers many times over. A row with anything not finite takes the full head.
"""

from __future__ import annotations

import torch

from cosine.engine import kernels
from cosine.engine.hugepages import on_huge_pages
from cosine.engine.sampling import greedy_tokens

# More candidates than this in one call (never seen on the target) and the full head is cheaper.
MAX_CANDIDATES = 1024


class GreedyHead:
    """The argmax of x @ w.T for fp32 rows x, bitwise the fp32 kernel's, reading a bf16 copy of w."""

    def __init__(self, packed: torch.Tensor):
        """packed: the head as `cosine::pack_weight` packs fp32 weights ([V/16, K, 16])."""
        if packed.dtype != torch.float32 or packed.dim() != 3 or packed.size(2) != 16:
            raise ValueError("GreedyHead takes an fp32 head packed by cosine::pack_weight")
        self.packed = packed
        v16, k, _ = packed.shape
        self.vocab, self.k = v16 * 16, k
        w = packed.permute(0, 2, 1).reshape(self.vocab, k)  # rows in vocabulary order (a copy, freed below)
        wb = w.to(torch.bfloat16)
        d = w - wb.float()
        self.screen = on_huge_pages([torch.ops.cosine.pack_weight(wb)])[0]
        self.w_norm = float(w.double().norm(dim=1).max())
        self.wb_norm = float(wb.double().norm(dim=1).max())
        self.d_norm = float(d.double().norm(dim=1).max())

    @staticmethod
    def supported(device: torch.device) -> bool:
        """CoSine's kernels run here in both fp32 (the exact logits) and bf16 (the screen)."""
        return kernels.available(device, torch.float32) and kernels.available(device, torch.bfloat16)

    @torch.inference_mode()
    def tokens(self, x: torch.Tensor, full=None) -> torch.Tensor:
        """The greedy token (int64 [R]) of each row of x [R, K] fp32 (`cosine::greedy_tokens`, one call). `full`
        (x -> [R, V] fp32 logits) serves rows the screen cannot (anything not finite, or too many candidates);
        without it they raise."""
        tokens, _ = self.screened(x)
        miss = tokens < 0
        if bool(miss.any()):
            tokens[miss] = self._full(x[miss], full)
        return tokens

    def screened(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens int64 [R], -1 where the screen cannot serve the row; bounds float64 [R])."""
        return torch.ops.cosine.greedy_tokens(x.float(), self.screen, self.packed, self.w_norm, self.wb_norm,
                                              self.d_norm, MAX_CANDIDATES)

    @staticmethod
    def _full(x: torch.Tensor, full) -> torch.Tensor:
        if full is None:
            raise ValueError("GreedyHead: a row the screen cannot serve, and no full head to fall back on")
        return torch.tensor(greedy_tokens(full(x)), dtype=torch.long, device=x.device)
