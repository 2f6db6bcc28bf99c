"""The target on the native Llama engine: a cache slot per request, ragged batches, token trees.

Same interface as HFTarget (open / verify / release / committed, vocab_size,
max_context, len, in) so the verifier can switch, plus `verify_batch`, which
verifies the trees of many requests in ONE forward pass, and `open_batch`,
`truncate`.

Invariant (as in HFTarget): a request's slot holds the KV of every committed
token but the last. A round feeds [last committed] + the tree's nodes, written
at the slot's next positions in node order, with RoPE positions by depth and a
mask that lets each node see the committed prefix and its own ancestors only.
After the walk, the accepted nodes' KV is moved into place (a copy within that
slot only, none when the accepted path is already contiguous, as for chains) and
the slot's length is set: rejected nodes are forgotten by bookkeeping.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from cosine.engine.acceptance import rejection_sample
from cosine.engine.hf_target import VerifyOutcome
from cosine.engine.llama import NativeLlama, Seq
from cosine.engine.sampling import RowChoices, Sampling, target_probs, uniform_at
from cosine.engine.tree import DraftTree, walk

_ACCEPT_SALT = 0x5DEECE66D  # accept/reject uniforms: a stream apart from the sampling one


@dataclass
class _Request:
    slot: int
    tokens: list[int]
    prompt_len: int
    hidden: torch.Tensor | None = None  # the final hidden state [hidden_size] of the row that chose tokens[-1]


class NativeTarget:
    """Verifies draft trees for many requests, batched, over one slot-based KV cache. A `TargetEngine`."""

    verifies_trees = True

    def __init__(self, model: NativeLlama, max_context: int | None = None, n_slots: int = 8):
        self.model = model
        self.device = model.device
        self.vocab_size = int(model.spec.vocab_size)
        self.max_context = int(max_context or min(model.max_positions, 4096))
        if self.max_context > model.max_positions:
            raise ValueError(f"max_context {self.max_context} beyond the model's {model.max_positions} positions")
        self.cache = model.new_cache(n_slots, self.max_context)
        self._reqs: dict[str, _Request] = {}
        # With SDPA, a tree step gives a node the same logits as plain decoding would only where its ancestors
        # sit at the cache positions plain decoding gives them: on the tree's main chain (drafted first, so
        # stored contiguously). Off it the attention sums the same terms at other positions, in another order.
        # fp32 absorbs that (speculative == plain on the real target), bf16 on a CPU does not: there, without
        # CoSine's attention kernel, a tree is verified along its main chain only, which accepts as many tokens
        # per round for greedy decoding and for sampling alike (a sibling's token is the one the bonus would
        # be). The kernel reads each node's keys in the order plain decoding has them: the whole tree is exact.
        # CUDA is left as it was.
        self.verifies_trees = (model.dtype == torch.float32 or model.device.type != "cpu"
                               or model.attention_kernel)

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str = "cpu", dtype: str = "auto",
                        n_slots: int = 8, max_context: int | None = None) -> "NativeTarget":
        return cls(NativeLlama.from_pretrained(path, device=device, dtype=dtype), max_context, n_slots)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._reqs

    def __len__(self) -> int:
        return len(self._reqs)

    def committed(self, request_id: str) -> list[int]:
        return list(self._reqs[request_id].tokens)

    def hidden(self, request_id: str) -> torch.Tensor | None:
        """The final hidden state [hidden_size] (normed, as the head reads it) of the row that chose the request's
        last committed token; None before its first step (KeyError when not open)."""
        return self._reqs[request_id].hidden

    def context_len(self, request_id: str) -> int:
        """Committed tokens of a request (what its next verification attends over)."""
        return len(self._reqs[request_id].tokens)

    @property
    def kv_bytes_per_token(self) -> int:
        """KV memory of one position of one request: keys and values, every layer."""
        k = self.cache.k  # [layers, slots, kv_heads, max_len, head_dim]
        return 2 * k.shape[0] * k.shape[2] * k.shape[4] * k.element_size()

    def slot_of(self, request_id: str) -> int:
        return self._reqs[request_id].slot

    # -- lifecycle ----------------------------------------------------------------------

    def open(self, request_id: str, committed: list[int], prompt_len: int) -> None:
        """Prefill every committed token but the last."""
        self.open_batch([(request_id, committed, prompt_len)])

    def open_batch(self, items: list[tuple[str, list[int], int]], chunk: int = 512) -> None:
        """Prefill several requests together, `chunk` tokens of each per forward pass.

        The prompt's rows (all but its last token) go as prompt rows (`Seq.prompt`): the same prompt gets
        the same cache whichever requests share its prefill. The rest (a resume's output so far, and the
        prompt's last token, which a fresh request's first round feeds) go as ordinary rows, which a
        row-invariant engine computes exactly as the rounds that first committed them: a resumed request
        continues as it would have.
        """
        prompts: list[tuple[int, list[int], int]] = []  # (slot, tokens, first position)
        rest: list[tuple[int, list[int], int]] = []
        for request_id, committed, prompt_len in items:
            if not committed:
                raise ValueError("a request needs at least one committed token")
            if len(committed) > self.max_context:
                raise ValueError(f"{len(committed)} tokens exceed max_context {self.max_context}")
            self.release(request_id)
            slot = self.cache.allocate()
            self._reqs[request_id] = _Request(slot, list(committed), prompt_len)
            head = min(max(prompt_len - 1, 0), len(committed) - 1)
            if head:
                prompts.append((slot, list(committed[:head]), 0))
            if len(committed) - 1 > head:
                rest.append((slot, list(committed[head:-1]), head))
        self._prefill(prompts, chunk, prompt=True)
        self._prefill(rest, chunk, prompt=False)

    def _prefill(self, parts: list[tuple[int, list[int], int]], chunk: int, prompt: bool) -> None:
        done = 0
        while parts:
            self.model.forward([Seq(slot, toks[done:done + chunk], list(range(at + done, at + min(done + chunk, len(toks)))),
                                    logits="none", prompt=prompt) for slot, toks, at in parts], self.cache)
            done += chunk
            parts = [part for part in parts if len(part[1]) > done]

    def truncate(self, request_id: str, n_tokens: int) -> None:
        """Cut a request back to its first n_tokens committed tokens (bookkeeping only)."""
        req = self._reqs[request_id]
        if not 1 <= n_tokens <= len(req.tokens):
            raise ValueError(f"cannot cut {len(req.tokens)} committed tokens to {n_tokens}")
        del req.tokens[n_tokens:]
        req.hidden = None
        self.cache.truncate(req.slot, n_tokens - 1)

    def release(self, request_id: str) -> None:
        req = self._reqs.pop(request_id, None)
        if req is not None:
            self.cache.release(req.slot)

    # -- verification -------------------------------------------------------------------

    def verify(self, request_id: str, tree: DraftTree, sampling: Sampling) -> VerifyOutcome:
        return self.verify_batch([(request_id, tree, sampling)])[0]

    def verify_batch(self, items: list[tuple]) -> list[VerifyOutcome]:
        """ONE forward for all items: (request_id, tree, sampling) or (request_id, chain, sampling, q).

        With q (a [len(chain), vocab] tensor: the drafter's distribution each
        chain token was sampled from) and sampling on, the chain is accepted by
        rejection sampling; otherwise by the point-mass walk.
        """
        batch: list[Seq] = []
        metas = []
        for item in items:
            request_id, tree, sampling = item[0], item[1], item[2]
            q = item[3] if len(item) > 3 else None
            req = self._reqs[request_id]
            n_ctx = len(req.tokens)
            if n_ctx + len(tree) > self.max_context:
                raise ValueError(f"request {request_id}: {n_ctx} + {len(tree)} tokens exceed max_context {self.max_context}")
            if self.cache.lengths[req.slot] != n_ctx - 1:
                raise RuntimeError(f"request {request_id}: cache holds {self.cache.lengths[req.slot]} tokens, expected {n_ctx - 1}")
            if not self.verifies_trees and not tree.is_chain():
                tree = tree.main_chain_tree()
            depths = tree.depths()
            positions = [n_ctx - 1] + [n_ctx - 1 + d for d in depths]
            chain = tree.is_chain()
            parents = None if chain else [-1] + [p + 1 for p in tree.parents]
            # greedy rows need their argmax alone: the model may read a cheaper head for it (GreedyHead)
            batch.append(Seq(req.slot, [req.tokens[-1], *tree.tokens], positions, parents,
                             logits="greedy" if sampling.greedy else "all"))
            metas.append((req, tree, sampling, q, n_ctx, depths))
        out = self.model.forward(batch, self.cache, hidden=True)
        logits_list = [lg for lg, _ in out]  # greedy items: tokens

        rejected = self._reject_batch([(m, lg) for m, lg in zip(metas, logits_list) if self._uses_q(m)])
        outcomes: list[VerifyOutcome] = []
        for (req, tree, sampling, q, n_ctx, depths), (logits, hidden) in zip(metas, out):
            start = n_ctx - 1  # storage index of the last committed token
            if self._uses_q((req, tree, sampling, q, n_ctx, depths)):
                accepted, bonus = rejected.pop(0)
                path = list(range(len(accepted)))
            else:  # greedy: the rows' tokens (int64 [rows]); else logits, chosen as the walk reads them
                choice = (logits.tolist() if sampling.greedy
                          else RowChoices(logits, sampling, [n_ctx] + [n_ctx + d for d in depths]))
                path, bonus = walk(tree, choice)
                accepted = [tree.tokens[i] for i in path]
            self.cache.move(req.slot, [start + 1 + i for i in path], [start + 1 + j for j in range(len(path))])
            self.cache.set_length(req.slot, start + 1 + len(path))
            req.tokens.extend(accepted)
            req.tokens.append(bonus)
            req.hidden = hidden[1 + path[-1] if path else 0]  # row 0: the last committed token; 1 + i: tree node i
            outcomes.append(VerifyOutcome(accepted + [bonus], len(accepted)))
        return outcomes

    @staticmethod
    def _uses_q(meta) -> bool:
        _, tree, sampling, q, _, _ = meta
        return q is not None and not sampling.greedy and tree.is_chain() and len(tree) > 0

    def _reject_batch(self, entries) -> list[tuple[list[int], int]]:
        """Rejection sampling for every q-chain of a round in one call (ragged chains padded)."""
        if not entries:
            return []
        k = max(len(meta[1]) for meta, _ in entries)
        V = self.vocab_size
        B = len(entries)
        toks = torch.zeros(B, k, dtype=torch.long)
        qs = torch.full((B, k, V), 1.0 / V, dtype=torch.float64)
        ps = torch.zeros(B, k + 1, V, dtype=torch.float64)
        u_acc = torch.zeros(B, k, dtype=torch.float64)
        u_smp = torch.zeros(B, k + 1, dtype=torch.float64)
        lens = torch.zeros(B, dtype=torch.long)
        for b, ((_, tree, sampling, q, n_ctx, _), logits) in enumerate(entries):
            n = len(tree)
            lens[b] = n
            toks[b, :n] = torch.tensor(tree.tokens)
            qs[b, :n] = q.double().cpu()
            ps[b, : n + 1] = target_probs(logits, sampling).cpu()
            u_acc[b, :n] = torch.tensor([uniform_at(sampling.seed ^ _ACCEPT_SALT, n_ctx + j) for j in range(n)], dtype=torch.float64)
            u_smp[b, : n + 1] = torch.tensor([uniform_at(sampling.seed, n_ctx + j) for j in range(n + 1)], dtype=torch.float64)
        out, n_acc = rejection_sample(toks, qs, ps, u_acc, u_smp, lens)
        result = []
        for b, ((_, tree, _, _, _, _), _) in enumerate(entries):
            n = int(n_acc[b])
            result.append((tree.tokens[:n], int(out[b, n])))
        return result


def make_target(path: str | Path, device: str = "cpu", dtype: str = "auto", n_slots: int = 8,
                max_context: int | None = None, backend: str = "auto"):
    """The target engine for a checkpoint: NativeTarget for Llama-family models, HFTarget otherwise.

    backend: "auto", "native" or "transformers".
    """
    if backend == "native" or (backend == "auto" and NativeLlama.supports(path)):
        return NativeTarget.from_pretrained(path, device=device, dtype=dtype, n_slots=n_slots, max_context=max_context)
    from cosine.engine.hf_target import HFTarget
    from cosine.engine.models import load_causal_lm

    return HFTarget(load_causal_lm(path, device, dtype), max_context=max_context)
