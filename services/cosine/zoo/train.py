"""Train a small LM drafter on what the target writes (sequence-level distillation, reduced vocabulary).

The student is an ordinary `LlamaForCausalLM` with the target's width, a few
decoder layers initialised from the target's first layers, the target's final
norm, and a tied embedding/head over a reduced drafting vocabulary (`DraftVocab`)
whose rows start as the target's embedding rows of those tokens. Its loss is
the cross-entropy against the target's own next-token distribution (its top-k,
restricted to the drafting vocabulary and renormalised) at every position of
the target's continuations of domain prompts (`distill.generate`), which is the
KL divergence up to a constant: the student learns to rank tokens as the target
does, and its top-1 is what verification accepts.

Training runs for a wall-clock budget with a cosine learning-rate schedule over
that budget, bf16 autocast on CPUs that have it, fixed seeds, and a checkpoint
(weights, optimiser, elapsed time, step) every `save_every_s` seconds, from which
an interrupted build resumes.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from cosine.engine.vocab import DraftVocab
from cosine.zoo.distill import Sample


@dataclass
class TrainConfig:
    layers: tuple[int, ...] = (0, 1)  # target layers the student starts from
    vocab_size: int = 8192
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 20
    batch_tokens: int = 2048
    max_len: int = 320
    seed: int = 0
    save_every_s: float = 60.0
    bf16: bool = True  # bf16 autocast where the CPU supports it (forward/backward only; weights stay fp32)


def make_student(target_dir: Path, vocab: DraftVocab, layers: tuple[int, ...]):
    """A LlamaForCausalLM: target layers `layers`, target norm, tied head over `vocab`'s rows of the target's embeddings."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from cosine.engine.llama import _load_state_dict

    config = AutoConfig.from_pretrained(str(target_dir))
    config.num_hidden_layers = len(layers)
    config.vocab_size = len(vocab)
    config.tie_word_embeddings = True
    # token ids of the special tokens as draft indices, so generate() and friends work on the checkpoint
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(config, key, None)
        if isinstance(value, int):
            setattr(config, key, vocab.to_draft([value])[0])
    if hasattr(config, "layer_types") and config.layer_types is not None:
        config.layer_types = config.layer_types[: len(layers)]
    torch.manual_seed(0)
    student = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    target = _load_state_dict(target_dir)
    rows = torch.tensor(vocab.token_ids)
    state = {"model.embed_tokens.weight": target["model.embed_tokens.weight"][rows].clone(), "model.norm.weight": target["model.norm.weight"]}
    for new, old in enumerate(layers):
        for key, value in target.items():
            if key.startswith(f"model.layers.{old}."):
                state[key.replace(f"model.layers.{old}.", f"model.layers.{new}.", 1)] = value
    missing, unexpected = student.load_state_dict(state, strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"student initialisation: missing {missing}, unexpected {unexpected}")
    student.tie_weights()
    return student


@dataclass
class Example:
    """One training sequence in the drafting vocabulary, with soft targets."""

    inputs: torch.Tensor  # [n] int64 draft indices
    target_idx: torch.Tensor  # [n, k] int64 draft indices of the teacher's top-k (0 where outside the vocabulary)
    target_p: torch.Tensor  # [n, k] float32 teacher probabilities renormalised over the vocabulary (0 outside)
    top1: torch.Tensor  # [n] int64 draft index of the teacher's top-1, -1 when outside the vocabulary


def examples(samples: list[Sample], vocab: DraftVocab, max_len: int) -> list[Example]:
    lut = torch.full((max(max(vocab.token_ids), int(max(int(s.topk_ids.max()) for s in samples))) + 1,), -1, dtype=torch.int64)
    lut[torch.tensor(vocab.token_ids)] = torch.arange(len(vocab))
    out = []
    for s in samples:
        n = min(len(s.tokens) - 1, max_len)
        start = max(0, len(s.tokens) - 1 - n)  # keep the end: the continuation is what matters most
        ids = torch.tensor(vocab.to_draft(s.tokens[start: start + n]))
        idx = lut[s.topk_ids[start: start + n].long()]
        p = s.topk_logprobs[start: start + n].float().exp() * (idx >= 0)
        total = p.sum(-1, keepdim=True)
        p = torch.where(total > 0, p / total.clamp_min(1e-12), p)
        out.append(Example(ids, idx.clamp_min(0), p, idx[:, 0]))
    return out


def _batches(data: list[Example], batch_tokens: int, rng: random.Random):
    """Endless shuffled batches of whole sequences, about `batch_tokens` tokens each."""
    while True:
        order = list(range(len(data)))
        rng.shuffle(order)
        batch: list[Example] = []
        tokens = 0
        for i in order:
            batch.append(data[i])
            tokens += len(data[i].inputs)
            if tokens >= batch_tokens:
                yield batch
                batch, tokens = [], 0
        if batch:
            yield batch


def _collate(batch: list[Example]):
    n = max(len(e.inputs) for e in batch)
    k = batch[0].target_idx.shape[1]
    B = len(batch)
    inputs = torch.zeros(B, n, dtype=torch.int64)
    mask = torch.zeros(B, n, dtype=torch.int64)
    tidx = torch.zeros(B, n, k, dtype=torch.int64)
    tp = torch.zeros(B, n, k)
    top1 = torch.full((B, n), -1, dtype=torch.int64)
    for b, e in enumerate(batch):
        m = len(e.inputs)
        inputs[b, :m] = e.inputs
        mask[b, :m] = 1
        tidx[b, :m] = e.target_idx
        tp[b, :m] = e.target_p
        top1[b, :m] = e.top1
    return inputs, mask, tidx, tp, top1


def soft_loss(logits: torch.Tensor, tidx: torch.Tensor, tp: torch.Tensor) -> torch.Tensor:
    """Mean over positions with teacher mass of -Σ_j p_j log q(j). logits [B, n, V]; tidx, tp [B, n, k]."""
    logq = torch.log_softmax(logits.float(), dim=-1).gather(-1, tidx)
    per_pos = -(tp * logq).sum(-1)  # [B, n]
    weight = (tp.sum(-1) > 0).float()
    return (per_pos * weight).sum() / weight.sum().clamp_min(1.0)


def bf16_autocast_ok() -> bool:
    try:
        from torch.backends import cpu

        return cpu.get_cpu_capability() in ("AVX512", "AMX") or "avx512_bf16" in Path("/proc/cpuinfo").read_text()
    except Exception:  # noqa: BLE001 - detection is best effort: fall back to fp32
        return False


def train(
    student,
    data: list[Example],
    budget_s: float,
    config: TrainConfig,
    checkpoint: Path | None = None,
    on_step: Callable[[int, float, float, float], None] | None = None,
    max_steps: int | None = None,
) -> dict:
    """Train for `budget_s` seconds of wall time (or `max_steps`); resumes from `checkpoint` when it exists.

    on_step(step, loss, agreement, elapsed_s): agreement is the share of the batch's positions where the
    student's top-1 equals the teacher's (the live estimate of greedy acceptance).
    """
    rng = random.Random(config.seed)
    torch.manual_seed(config.seed)
    params = [p for p in student.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=config.lr, betas=(0.9, 0.95), weight_decay=config.weight_decay)
    step, elapsed = 0, 0.0
    if checkpoint is not None and checkpoint.exists():
        saved = torch.load(checkpoint, weights_only=False)
        student.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        step, elapsed = saved["step"], saved["elapsed"]
    use_bf16 = config.bf16 and bf16_autocast_ok()
    student.train()
    batches = _batches(data, config.batch_tokens, rng)
    for _ in range(step):  # replay the seeded order: the same batches as an uninterrupted run
        next(batches)
    last_save = time.monotonic()
    started = time.monotonic() - elapsed
    history = []
    while True:
        elapsed = time.monotonic() - started
        if elapsed >= budget_s or (max_steps is not None and step >= max_steps):
            break
        progress = elapsed / budget_s if max_steps is None else step / max_steps
        lr = config.lr * min(1.0, (step + 1) / config.warmup_steps) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))
        for group in opt.param_groups:
            group["lr"] = lr
        inputs, mask, tidx, tp, top1 = _collate(next(batches))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_bf16):
            logits = student(input_ids=inputs, attention_mask=mask, use_cache=False).logits
        loss = soft_loss(logits, tidx, tp)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        with torch.no_grad():
            valid = top1 >= 0
            agree = float(((logits.argmax(-1) == top1) & valid).sum() / valid.sum().clamp_min(1))
        history.append((step, loss.item(), agree))
        if on_step:
            on_step(step, history[-1][1], agree, time.monotonic() - started)
        if checkpoint is not None and time.monotonic() - last_save >= config.save_every_s:
            _save(checkpoint, student, opt, step, time.monotonic() - started)
            last_save = time.monotonic()
    student.eval()
    if checkpoint is not None:
        _save(checkpoint, student, opt, step, time.monotonic() - started)
    return {"steps": step, "train_seconds": round(time.monotonic() - started, 1), "bf16_autocast": use_bf16,
            "first_loss": history[0][1] if history else None, "last_loss": history[-1][1] if history else None,
            "history": history}


def _save(path: Path, student, opt, step: int, elapsed: float) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"model": student.state_dict(), "optimizer": opt.state_dict(), "step": step, "elapsed": elapsed}, tmp)
    tmp.replace(path)
