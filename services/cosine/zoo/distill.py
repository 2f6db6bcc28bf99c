"""What the target writes: greedy continuations of domain prompts, with its top-k distribution at every position.

A drafter is judged by how often its token equals the target's, so it learns
from the target itself (sequence-level distillation): the target continues each
prompt greedily on the native engine, batched (continuous batching over a slot
KV cache), and the top-k of its next-token distribution is kept at every
position — prompt positions from the prefill, generated ones from each decode
step — so training needs no teacher forward of its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from cosine.engine.llama import NativeLlama, Seq


@dataclass
class Sample:
    """One prompt and the target's greedy continuation of it."""

    tokens: list[int]  # prompt + continuation
    prompt_len: int
    topk_ids: torch.Tensor  # [len(tokens) - 1, k] int32: row p = the target's top-k for the token at p + 1
    topk_logprobs: torch.Tensor  # [len(tokens) - 1, k] float16, log-probabilities over the whole vocabulary
    # [len(tokens) - 1, hidden] bfloat16: row p = the target's final hidden state (normed, as its head reads it) that
    # chose the token at p + 1 — the feature head's training data (`cosine.zoo.head`); None where not kept
    features: torch.Tensor | None = None

    @property
    def continuation(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    def to_dict(self) -> dict:
        d = {"tokens": self.tokens, "prompt_len": self.prompt_len, "topk_ids": self.topk_ids, "topk_logprobs": self.topk_logprobs}
        return d if self.features is None else d | {"features": self.features}

    @classmethod
    def from_dict(cls, d: dict) -> "Sample":
        return cls(d["tokens"], d["prompt_len"], d["topk_ids"], d["topk_logprobs"], d.get("features"))


@dataclass
class _Live:
    index: int
    slot: int
    tokens: list[int]
    prompt_len: int
    ids: list[torch.Tensor]
    logprobs: list[torch.Tensor]
    features: list[torch.Tensor]


@torch.inference_mode()
def generate(
    model: NativeLlama,
    prompts: list[list[int]],
    max_new_tokens: int,
    stop_ids: set[int],
    batch: int = 16,
    topk: int = 32,
    deadline: float | None = None,
    on_tokens: Callable[[int], None] | None = None,
    features: bool = False,
) -> list[Sample]:
    """Greedy continuations of `prompts`, in order; prompts not started by `deadline` (time.monotonic) are skipped.

    Up to `batch` requests decode together; a finished one frees its slot for the next prompt
    at once. A continuation ends at a stop token (kept) or after `max_new_tokens`. With ``features``, each
    sample keeps the target's final hidden state of every row too (`Sample.features`): the forward computes
    them anyway, so they cost memory, not time.
    """
    if not prompts:
        return []
    longest = max(len(p) for p in prompts) + max_new_tokens + 1
    kv = model.new_cache(min(batch, len(prompts)), longest)
    pending = list(range(len(prompts)))
    live: dict[int, _Live] = {}
    done: dict[int, Sample] = {}
    next_tok: dict[int, int] = {}

    def keep(state: _Live, out) -> None:  # logits [n, vocab], or (logits, hidden [n, hidden]) with features
        logits = out
        if features:
            logits, hidden = out
            state.features.append(hidden.to(torch.bfloat16))
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        values, ids = logprobs.topk(topk, dim=-1)
        state.ids.append(ids.to(torch.int32))
        state.logprobs.append(values.to(torch.float16))
        next_tok[state.index] = int(ids[-1, 0])

    def finish(state: _Live) -> None:
        kv.release(state.slot)
        done[state.index] = Sample(state.tokens, state.prompt_len, torch.cat(state.ids), torch.cat(state.logprobs),
                                   torch.cat(state.features) if features else None)
        del live[state.index]

    while pending or live:
        started = []
        while pending and len(live) + len(started) < kv.n_slots and (deadline is None or time.monotonic() < deadline):
            i = pending.pop(0)
            started.append(_Live(i, kv.allocate(), list(prompts[i]), len(prompts[i]), [], [], []))
        for chunk in range(0, len(started), 4):  # prefill a few at a time: all-position logits are large
            group = started[chunk: chunk + 4]
            outs = model.forward([Seq(s.slot, s.tokens, list(range(len(s.tokens))), logits="all") for s in group], kv,
                                 hidden=features)
            for state, logits in zip(group, outs):
                live[state.index] = state
                keep(state, logits)
        if deadline is not None and time.monotonic() >= deadline:
            pending.clear()
        if not live:
            break
        states = list(live.values())
        for state in states:
            state.tokens.append(next_tok[state.index])
        if on_tokens:
            on_tokens(len(states))
        stepping = []
        for state in states:
            generated = len(state.tokens) - state.prompt_len
            if state.tokens[-1] in stop_ids or generated >= max_new_tokens:
                finish(state)
            else:
                stepping.append(state)
        if not stepping:
            continue
        outs = model.forward([Seq(s.slot, [s.tokens[-1]], [len(s.tokens) - 1], logits="last") for s in stepping], kv,
                             hidden=features)
        for state, out in zip(stepping, outs):
            keep(state, out)
    return [done[i] for i in sorted(done)]
