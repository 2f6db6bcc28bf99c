"""A slot-based KV cache: one preallocated tensor pair, one slot per live request.

Layout: keys and values are each [layers, slots, kv_heads, max_len, head_dim].
A slot's first `length` positions hold the KV of its tokens, in order. Taking
a slot, cutting it back to a length and giving it back only change integers
here: no tensor is touched, and no other slot's memory ever is.

The storage comes from `torch.empty`, so pages are only committed when first
written. Attention over a batch reads a window [0, L) of every slot in it,
masking what lies past each slot's own length; masked positions get weight 0,
but 0 * NaN is NaN, so every position a slot will expose must hold finite
numbers. `expose(slot, L)` zeroes, once, the part of [0, L) this slot has never
written (its own memory only) and remembers how far it got.
"""

from __future__ import annotations

import torch


class SlotsFull(RuntimeError):
    """Every slot is taken: the caller should refuse the request (a retry later may find one free)."""


class SlotKVCache:
    def __init__(
        self,
        n_layers: int,
        n_slots: int,
        n_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ):
        shape = (n_layers, n_slots, n_kv_heads, max_len, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.n_layers = n_layers
        self.n_slots = n_slots
        self.max_len = max_len
        self.lengths = [0] * n_slots
        self._finite_upto = [0] * n_slots  # positions [0, x) of the slot hold finite numbers
        self._free = list(range(n_slots - 1, -1, -1))  # pop() gives the lowest free slot
        self._used: set[int] = set()

    # -- bookkeeping (integers only) -------------------------------------------------

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise SlotsFull(f"all {self.n_slots} KV cache slots are in use")
        slot = self._free.pop()
        self._used.add(slot)
        self.lengths[slot] = 0
        return slot

    def release(self, slot: int) -> None:
        if slot in self._used:
            self._used.remove(slot)
            self.lengths[slot] = 0
            self._free.append(slot)
            self._free.sort(reverse=True)

    def truncate(self, slot: int, length: int) -> None:
        """Cut the slot back to its first `length` positions."""
        if not 0 <= length <= self.lengths[slot]:
            raise ValueError(f"cannot cut slot {slot} of length {self.lengths[slot]} to {length}")
        self.lengths[slot] = length

    def set_length(self, slot: int, length: int) -> None:
        if not 0 <= length <= self.max_len:
            raise ValueError(f"slot length {length} outside [0, {self.max_len}]")
        self.lengths[slot] = length

    # -- tensor work on one slot's own memory ----------------------------------------

    def expose(self, slot: int, upto: int) -> None:
        """Make positions [0, upto) of `slot` finite (zero what was never written)."""
        if upto > self.max_len:
            raise ValueError(f"a request needs {upto} cache positions; the cache holds {self.max_len}")
        done = self._finite_upto[slot]
        if done < upto:
            self.k[:, slot, :, done:upto].zero_()
            self.v[:, slot, :, done:upto].zero_()
            self._finite_upto[slot] = upto

    def move(self, slot: int, src: list[int], dst: list[int]) -> None:
        """Copy positions src → dst within one slot, all layers (src positions are read before any write)."""
        pairs = [(s, d) for s, d in zip(src, dst) if s != d]
        if not pairs:
            return
        s_idx = torch.tensor([s for s, _ in pairs], device=self.k.device)
        d_idx = torch.tensor([d for _, d in pairs], device=self.k.device)
        for cache in (self.k, self.v):
            view = cache[:, slot]  # [layers, kv_heads, max_len, head_dim], a view
            view[:, :, d_idx] = view[:, :, s_idx]
