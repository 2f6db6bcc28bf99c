"""The `transformers` baselines of `cosine bench`, in the benchmark's own process.

* ``target-only`` — `generate()`, greedy; batch 1 at concurrency 1, and for concurrency C > 1
  static batches of C requests (left-padded, one `generate()` per batch; in Poisson mode the
  requests that have arrived, up to ``max_batch``, form the next batch);
* ``hf-assisted`` — assisted generation (`assistant_model=`) with one LM drafter, transformers'
  default schedule (20 candidate tokens, cut by its 0.4 confidence threshold); batch 1 only;
* ``hf-prompt-lookup`` — `prompt_lookup_num_tokens=` (n-gram lookup in the prompt); batch 1 only.

Timing comes from a stopping criterion that stamps the clock after every step (a step of
assisted generation can add several tokens): the time of a sequence's first new token is its
TTFT as a streaming client would see it, and the step count is its number of rounds.

The zoo's LM drafters have a reduced drafting vocabulary (a few thousand of the target's
49,152 tokens, `draft_vocab.json`), which transformers' assisted generation cannot use: it
needs an assistant with the target's vocabulary. `full_vocab_assistant` builds one in memory
from the drafter: input embedding row t = the drafter's row for t, or its fallback row (the
index the drafter service maps unknown tokens to); output head row t = the drafter's head row
for the tokens of its vocabulary and zeros elsewhere (untied). So the assistant drafts exactly
what the served drafter drafts, except that a token outside the vocabulary gets logit 0 and
would win only if every in-vocabulary logit were negative. The output stays the target's
greedy output either way: only speed depends on the assistant.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from cosine.bench.stats import RequestRecord, rounds_from_steps, split_token_times


class StepClock:
    """A transformers StoppingCriteria that never stops, only records (time, new tokens) after each step."""

    def __init__(self, prompt_len: int):
        self.prompt_len = prompt_len
        self.steps: list[tuple[float, int]] = []

    def __call__(self, input_ids, scores=None, **kwargs):
        self.steps.append((time.perf_counter(), int(input_ids.shape[1]) - self.prompt_len))
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def load_target(target_dir: Path):
    from transformers import AutoTokenizer

    from cosine.engine.models import load_causal_lm

    return AutoTokenizer.from_pretrained(str(target_dir)), load_causal_lm(target_dir)


def full_vocab_assistant(drafter_dir: Path, target_dir: Path):
    """(model, note): the drafter as a transformers model over the target's whole vocabulary (see the module notes)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from cosine.engine.models import load_causal_lm
    from cosine.engine.vocab import DraftVocab

    small = load_causal_lm(drafter_dir)
    vocab = DraftVocab.load(drafter_dir)
    if vocab is None:
        return small, "the drafter has the target's full vocabulary: used as is"
    tcfg = AutoConfig.from_pretrained(str(target_dir))
    cfg = AutoConfig.from_pretrained(str(drafter_dir))
    cfg.vocab_size = tcfg.vocab_size
    cfg.tie_word_embeddings = False
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(cfg, key, getattr(tcfg, key, None))
    big = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    state = {k: v for k, v in small.state_dict().items() if k not in ("model.embed_tokens.weight", "lm_head.weight")}
    emb = small.get_input_embeddings().weight.detach()
    head = small.get_output_embeddings().weight.detach()
    index = torch.tensor(vocab.to_draft(range(tcfg.vocab_size)))
    state["model.embed_tokens.weight"] = emb[index].clone()
    full_head = torch.zeros(tcfg.vocab_size, head.shape[1], dtype=head.dtype)
    full_head[torch.tensor(vocab.token_ids)] = head
    state["lm_head.weight"] = full_head
    big.load_state_dict(state, strict=True)
    big.eval()
    note = (f"reduced head of {len(vocab)} tokens expanded to {tcfg.vocab_size}: embedding rows outside the drafting "
            f"vocabulary = the fallback row, head rows mapped, zeros elsewhere, untied")
    return big, note


def _cut_eos(ids: list[int], eos: int | None) -> list[int]:
    if eos is not None and eos in ids:
        return ids[: ids.index(eos) + 1]
    return ids


def generate_batch(model, tokenizer, prompts_ids: list[list[int]], max_new_tokens: int, **kwargs) -> tuple[list[dict], float]:
    """One generate() over the prompts (left-padded when more than one), greedy.

    Returns per sequence {token_ids, token_times_s, rounds} and the time generate() returned."""
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    width = max(len(p) for p in prompts_ids)
    ids = torch.full((len(prompts_ids), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts_ids), width), dtype=torch.long)
    for i, p in enumerate(prompts_ids):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    clock = StepClock(width)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=pad, stopping_criteria=[clock], **kwargs)
    returned = time.perf_counter()
    seqs = []
    for i in range(len(prompts_ids)):
        new = _cut_eos(out[i, width:].tolist(), eos)
        seqs.append({"token_ids": new, "token_times_s": split_token_times(clock.steps, len(new)),
                     "rounds": rounds_from_steps(clock.steps, len(new))})
    return seqs, returned


class HFSystem:
    """One transformers baseline: how it generates (kwargs) and the largest batch it takes."""

    def __init__(self, name: str, model, tokenizer, max_batch: int, **generate_kwargs):
        self.name, self.model, self.tokenizer = name, model, tokenizer
        self.max_batch = max_batch
        self.kwargs = generate_kwargs

    def warm_up(self, prompt_ids: list[int]) -> None:
        generate_batch(self.model, self.tokenizer, [prompt_ids], 4, **self.kwargs)

    def _records(self, batch, seqs, arrivals, t0, returned, workload) -> list[RequestRecord]:
        out = []
        for (index, prompt_index), seq in zip(batch, seqs):
            speculative = "assistant_model" in self.kwargs or "prompt_lookup_num_tokens" in self.kwargs
            n = len(seq["token_ids"])
            out.append(RequestRecord(
                prompt_index=prompt_index, domain=workload[prompt_index].domain, arrival_s=arrivals[index] - t0,
                token_times_s=[t - t0 for t in seq["token_times_s"]], token_ids=seq["token_ids"], end_s=returned - t0,
                rounds=seq["rounds"], accepted=(n - seq["rounds"]) if speculative else None))
        return out

    def closed_loop(self, workload, order: list[int], concurrency: int, max_new: int, bar=None) -> tuple[list[RequestRecord], float]:
        """C clients, each sending its next request when the last returns: static batches of C."""
        b = max(1, min(concurrency, self.max_batch))
        t0 = time.perf_counter()
        records: list[RequestRecord] = []
        ids = {i: workload[i].token_ids(self.tokenizer) for i in set(order)}
        for start in range(0, len(order), b):
            batch = list(enumerate(order))[start: start + b]
            sent = time.perf_counter()
            seqs, returned = generate_batch(self.model, self.tokenizer, [ids[p] for _, p in batch], max_new, **self.kwargs)
            records += self._records(batch, seqs, {i: sent for i, _ in batch}, t0, returned, workload)
            if bar is not None:
                bar.update(len(batch))
        return records, time.perf_counter() - t0

    def poisson(self, workload, order: list[int], arrivals: list[float], max_new: int, bar=None) -> tuple[list[RequestRecord], float]:
        """A FIFO server: the next batch is every request that has arrived (up to max_batch)."""
        t0 = time.perf_counter()
        due = {i: t0 + a for i, a in enumerate(arrivals)}
        ids = {i: workload[i].token_ids(self.tokenizer) for i in set(order)}
        records: list[RequestRecord] = []
        pending = list(enumerate(order))
        while pending:
            now = time.perf_counter()
            if due[pending[0][0]] > now:
                time.sleep(due[pending[0][0]] - now)
                now = time.perf_counter()
            batch = [r for r in pending if due[r[0]] <= now][: self.max_batch]
            pending = pending[len(batch):]
            seqs, returned = generate_batch(self.model, self.tokenizer, [ids[p] for _, p in batch], max_new, **self.kwargs)
            records += self._records(batch, seqs, due, t0, returned, workload)
            if bar is not None:
                bar.update(len(batch))
        return records, time.perf_counter() - t0
