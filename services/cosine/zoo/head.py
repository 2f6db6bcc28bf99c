"""`cosine zoo head`: train the feature-conditioned drafter (`cosine.engine.feature_head`) for the target.

Data: the target's own greedy continuations that `cosine zoo build` wrote (``$COSINE_CACHE/zoo-build``,
every domain's training split) and their features, the target's teacher-forced final hidden states,
computed here in the dtype the verifier serves in. One head for all domains.

Training pairs: for each continuation position, (``f[t]``, ``x[t+1]``) → the token ``x[t+2]`` (cross
entropy over the head's vocabulary) and the feature ``f[t+1]`` (smooth L1); then further steps unrolled, each
fed the step before's predicted feature and the next token the target wrote (``x[t+2]`` → ``x[t+3]`` and
``f[t+2]``, ...), so that the deeper steps learn from what they get in serving (`HeadConfig.unrolled`).
Evaluation: the domains' held-out splits (prompts the training never saw), drafting greedy chains from the
target's features as serving does, and counting how many tokens in a row match what the target wrote.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from cosine.common.progress import Progress
from cosine.engine.feature_head import FeatureHead, TargetWeights
from cosine.engine.llama import NativeLlama, Seq
from cosine.engine.tree import walk
from cosine.zoo.distill import Sample

NAME = "feature-head"


@dataclass
class HeadConfig:
    train_seconds: float = 720.0  # `cosine zoo head`'s default; the build gives it its own share (BuildConfig.head_seconds)
    vocab: int = 4096  # 8192 matched less in the same 180 s (fewer steps: 48.5 % against 49.7 % first tokens)
    batch: int = 512
    lr: float = 1e-3
    feature_weight: float = 1.0  # of the feature loss against the token loss
    # the weights of the unrolled steps' losses (the first step's, the second's, ...): serving drafts 3-4 tokens
    # deep, and a step never trained on a predicted feature drifts (2 steps against 3 on the same data, 300 s each:
    # held-out third tokens written 5.9 against 11.7 %, fourth 1.0 against 4.0 %)
    unrolled: tuple[float, ...] = (1.0, 0.8, 0.6)
    dtype: str = "auto"  # the features' dtype: the verifier's
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.unrolled:
            raise ValueError("unrolled needs the weight of at least the first step's loss")


@dataclass
class Features:
    """Every sample's features from ``prompt_len - 2`` on, stacked, with the pairs' indices into them."""

    f: torch.Tensor  # [rows, hidden] bfloat16
    tokens: torch.Tensor  # [rows] long: x[t + 1] for row t (the token the feature chose)
    end: torch.Tensor  # [rows] long: the last row of the row's sample
    pairs: torch.Tensor  # [P] rows t whose next row is of the same sample (x[t + 2] a continuation token)

    def within(self, rows: torch.Tensor, ahead: int) -> torch.Tensor:
        """Whether row + ahead is of the same sample as each row."""
        return rows + ahead <= self.end[rows]


@torch.inference_mode()
def extract(model: NativeLlama | None, samples: list[Sample], batch: int = 8, bar: Progress | None = None) -> Features:
    """The target's features along each sample: those the build kept (`Sample.features`, captured as it
    generated), the rest computed teacher-forced (prompt rows as a prefill) with ``model``."""
    need = [s for s in samples if s.features is None]
    computed: dict[int, torch.Tensor] = {}
    if need:
        if model is None:
            raise ValueError(f"{len(need)} samples have no features and no model was given to compute them")
        longest = max(len(s.tokens) for s in need)
        cache = model.new_cache(batch, longest + 1)
        slots = [cache.allocate() for _ in range(batch)]
        done_tokens = 0
        for i in range(0, len(need), batch):
            group = need[i:i + batch]
            for slot in slots:
                cache.set_length(slot, 0)
            out = model.forward([Seq(slot, s.tokens[:-1], list(range(len(s.tokens) - 1)), logits="all", prompt=True)
                                 for slot, s in zip(slots, group)], cache, hidden="only")
            for s, h in zip(group, out):
                computed[id(s)] = h.to(torch.bfloat16)  # half the memory; the head trains as well on it
                done_tokens += len(s.tokens)
            if bar is not None:
                bar.note(f"target features: {min(i + batch, len(need))}/{len(need)} samples, {done_tokens} tokens")
    feats, toks, ends = [], [], []
    rows = 0
    for s in samples:
        h = s.features if s.features is not None else computed[id(s)]  # row t chose x[t + 1]
        start = max(s.prompt_len - 2, 0)
        n = len(s.tokens) - 1
        if n - start < 2:
            continue
        feats.append(h[start:n].to(torch.bfloat16))
        toks.append(torch.tensor(s.tokens[start + 1:], dtype=torch.long))
        k = n - start  # rows of this sample
        ends.append(torch.full((k,), rows + k - 1, dtype=torch.long))
        rows += k
    if not rows:
        raise ValueError("no sample has two continuation tokens to learn from")
    end = torch.cat(ends)
    every = torch.arange(rows)
    return Features(torch.cat(feats), torch.cat(toks), end, every[every + 1 <= end])


def choose_vocab(samples: list[Sample], size: int) -> torch.Tensor:
    counts: Counter = Counter()
    for s in samples:
        counts.update(s.tokens[s.prompt_len:])
        counts.update(s.tokens)
    return torch.tensor(sorted(t for t, _ in counts.most_common(size)), dtype=torch.long)


def _losses(head: FeatureHead, data: Features, index: torch.Tensor, vmap: torch.Tensor, cfg: HeadConfig) -> torch.Tensor:
    """The unrolled steps' losses from the pairs at ``index``: step k is fed step k - 1's predicted feature (the
    target's own at the first) and the token the target wrote there; it is scored on the next token and the next
    feature, over the rows whose sample goes on that far."""
    f, token, rows = data.f[index].float(), data.tokens[index], index
    loss = torch.zeros(())
    for k, weight in enumerate(cfg.unrolled):
        y = head.step(f, token)
        step = F.cross_entropy(head.logits(y), vmap[data.tokens[rows + 1]], ignore_index=-1)
        loss = loss + weight * (step + cfg.feature_weight * F.smooth_l1_loss(y, data.f[rows + 1].float()))
        on = data.within(rows, 2)  # the row after next is of the same sample: the next step has a token to learn
        if k + 1 == len(cfg.unrolled) or not on.any():
            break
        f, token, rows = y[on], data.tokens[rows[on] + 1], rows[on] + 1
    return loss


@torch.inference_mode()
def evaluate(head: FeatureHead, data: Features, depth: int = 4, dtype: torch.dtype | None = None,
             index: torch.Tensor | None = None) -> dict:
    """Chains drafted from each position's true feature and token, as serving drafts them: how many tokens in a
    row the target wrote (``accepted[k]``: the share of chains whose first k + 1 tokens match) and the tokens a
    step commits drafting d at every step (1 + the expected matched prefix, capped at d). ``path_probability[k]``:
    the head's mean confidence in the first k + 1 tokens (the product of its calibrated probabilities), which the
    verifier's cost rule reads as the chance they are accepted. ``index``: the pairs to draft from (all)."""
    index = data.pairs if index is None else index
    f = data.f[index].to(dtype or head.fc.weight.dtype)
    tok = data.tokens[index]
    alive = torch.ones(len(index), dtype=torch.bool)
    path = torch.ones(len(index))
    accepted, confidence = [], []
    for k in range(depth):
        f = head.step(f, tok)
        best, at = head.probs(head.logits(f), k).max(-1)
        tok = head.vocab_ids[at]
        path = path * best
        ahead = 1 + k  # the row whose token x[t + 2 + k] this predicts
        valid = data.within(index, ahead)
        truth = data.tokens[(index + ahead).clamp(max=len(data.tokens) - 1)]
        alive = alive & valid & (tok == truth)
        accepted.append(round(alive.float().mean().item(), 4))
        confidence.append(round(path.mean().item(), 4))  # calibrated: close to accepted[k]
    return {"accepted": accepted, "path_probability": confidence, "tokens_per_step": {d: round(1 + sum(accepted[:d]), 3) for d in range(1, depth + 1)},
            "positions": len(index)}


def halves(data: Features) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs of the even-numbered samples and those of the odd-numbered ones (no sample in both)."""
    sample = torch.searchsorted(torch.unique(data.end), data.end[data.pairs])
    even = sample % 2 == 0
    return data.pairs[even], data.pairs[~even]


TEMPERATURES = torch.exp(torch.linspace(math.log(0.25), math.log(8.0), 31))


@torch.inference_mode()
def fit_temperatures(head: FeatureHead, data: Features, index: torch.Tensor, depth: int = 4) -> list[float]:
    """Per draft step, the temperature (of `TEMPERATURES`) under which the probability of the head's best token
    best predicts whether the target wrote it (least log loss), over the chains still alive at that step (every
    earlier token written), drafted greedily as serving drafts them."""
    f = data.f[index].to(head.fc.weight.dtype)
    tok = data.tokens[index]
    alive = torch.ones(len(index), dtype=torch.bool)
    out: list[float] = []
    for k in range(depth):
        f = head.step(f, tok)
        logits = head.logits(f).float()
        tok = head.vocab_ids[logits.argmax(-1)]
        ahead = 1 + k
        valid = data.within(index, ahead)
        right = tok == data.tokens[(index + ahead).clamp(max=len(data.tokens) - 1)]
        rows = alive & valid
        if int(rows.sum()) < 50:  # too few to fit: the step before's
            out.append(out[-1] if out else 1.0)
            continue
        shifted = logits[rows] - logits[rows].max(-1, keepdim=True).values
        hit = right[rows].float()
        losses = []
        for t in TEMPERATURES.tolist():
            p = torch.exp(-torch.logsumexp(shifted / t, -1)).clamp(1e-6, 1 - 1e-6)  # the best token's probability
            losses.append(float(F.binary_cross_entropy(p, hit)))
        out.append(round(float(TEMPERATURES[min(range(len(losses)), key=losses.__getitem__)]), 3))
        alive = rows & right
    return out


@torch.inference_mode()
def evaluate_trees(head: FeatureHead, data: Features, floor: float, nodes: int, index: torch.Tensor | None = None) -> dict:
    """What the verifier's drafting from the head commits per step at a cost floor (`RunLookup.min_path`): the
    greedy chain cut at the floor against the tree of every continuation passing it (`FeatureHead.trees`), each
    of at most ``nodes`` nodes, from each held-out position's true feature: tokens a step commits (1 + the longest
    path of the draft the target wrote) and draft nodes a step verifies."""
    index = data.pairs if index is None else index
    f = data.f[index].to(head.fc.weight.dtype)
    last = data.tokens[index].tolist()
    out = {}
    for kind, chains in (("chain", True), ("tree", False)):
        trees = head.trees(f, last, nodes, floor, chains=chains)
        committed = positions = 0
        for row, tree in zip(index.tolist(), trees):
            truth = data.tokens[row + 1:int(data.end[row]) + 1].tolist()  # what the target wrote after the row
            wrote = [truth[d] if d < len(truth) else -1 for d in [0, *tree.depths()]]  # its choice after each node
            path, _ = walk(tree, wrote)
            committed += 1 + len(path)
            positions += len(tree)
        out[kind] = {"tokens_per_step": round(committed / len(index), 3), "nodes_per_step": round(positions / len(index), 3)}
    return out | {"floor": round(floor, 3), "nodes": nodes, "positions": len(index)}


def calibrate(head: FeatureHead, held: Features, bar: Progress | None = None) -> dict:
    """Fit the head's temperatures on half the held-out samples and check them on the other half: the mean path
    probability against the share of chains the target wrote that far, before and after."""
    if bar is not None:
        bar.note("calibrating the feature head's probabilities on held-out samples")
    fit, check = halves(held)
    if len(fit) == 0 or len(check) == 0:
        return {}
    head.temperatures = []
    before = evaluate(head, held, dtype=torch.float32, index=check)
    head.temperatures = fit_temperatures(head, held, fit)
    after = evaluate(head, held, dtype=torch.float32, index=check)
    return {"calibration": {"temperatures": head.temperatures, "fitted_on": len(fit), "checked_on": len(check),
                            "accepted": after["accepted"], "path_probability_before": before["path_probability"],
                            "path_probability_after": after["path_probability"]}}


def train(head: FeatureHead, data: Features, cfg: HeadConfig, bar: Progress | None = None) -> dict:
    """AdamW on `_losses` in minibatches of ``cfg.batch`` pairs (fewer where there are fewer), warm-up and a cosine
    schedule over the wall-clock budget ``cfg.train_seconds``."""
    torch.manual_seed(cfg.seed)
    vmap = torch.full((head.embed.shape[0],), -1, dtype=torch.long)
    vmap[head.vocab_ids] = torch.arange(head.vocab_ids.numel())
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.95))
    started = time.monotonic()
    step = 0
    losses: list[float] = []
    batch = max(1, min(cfg.batch, len(data.pairs)))
    while True:
        order = data.pairs[torch.randperm(len(data.pairs))]
        for i in range(0, len(order) - batch + 1, batch):
            elapsed = time.monotonic() - started
            if elapsed >= cfg.train_seconds:
                return {"steps": step, "train_seconds": round(elapsed, 1), "first_loss": losses[0] if losses else None,
                        "last_loss": round(sum(losses[-20:]) / max(1, len(losses[-20:])), 4)}
            frac = elapsed / cfg.train_seconds
            for g in opt.param_groups:
                g["lr"] = cfg.lr * min(1.0, (step + 1) / 20) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
            loss = _losses(head, data, order[i:i + batch], vmap, cfg)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            losses.append(round(loss.item(), 4))
            step += 1
            if bar is not None and step % 25 == 0:
                bar.note(f"feature head: step {step}, loss {sum(losses[-25:]) / 25:.3f} ({elapsed:.0f}/{cfg.train_seconds:.0f}s)")


def build_head(target_dir: Path, samples: list[Sample], held_samples: list[Sample], out: Path, cfg: HeadConfig,
               bar: Progress | None = None, cache: Path | None = None) -> dict:
    """Extract the features (or read them from ``cache``, where they are kept for a rerun), train, evaluate on
    the held-out samples, save under ``out``; returns the report."""
    from cosine.engine.models import resolve_dtype

    dtype = resolve_dtype(cfg.dtype, "cpu")
    t0 = time.monotonic()
    key = f"{dtype}:{[(len(s.tokens), s.prompt_len, s.tokens[-8:]) for s in samples + held_samples]}"
    cached = torch.load(cache, weights_only=False) if cache is not None and cache.exists() else None
    if cached is not None and cached.get("key") == key:
        data, held = cached["data"], cached["held"]
        if bar is not None:
            bar.note(f"target features of {len(samples)} training samples: cached ({cache})")
    else:
        missing = sum(s.features is None for s in samples + held_samples)
        model = NativeLlama.from_pretrained(target_dir, dtype=dtype, max_positions=1024) if missing else None
        if bar is not None:
            bar.phase(f"target features of {len(samples)} training samples"
                      + (f" ({missing} computed, {dtype})" if missing else " (kept by the build)"))
        data = extract(model, samples, bar=bar)
        held = extract(model, held_samples, bar=bar) if held_samples else None
        del model
        if cache is not None and missing:
            tmp = cache.with_suffix(".tmp")
            torch.save({"key": key, "data": data, "held": held}, tmp)
            tmp.replace(cache)
    extract_s = time.monotonic() - t0
    weights = TargetWeights(target_dir)
    head = FeatureHead(weights.embed, choose_vocab(samples, cfg.vocab), weights.intermediate_size, weights.eps,
                       weights.lm_head)
    head.init_from_target(weights.last_layer, weights.final_norm)
    if bar is not None:
        bar.phase(f"training the feature head for {cfg.train_seconds:.0f}s on {len(data.pairs)} positions")
    result = train(head, data, cfg, bar)
    head.eval()
    report = {"training": result | {"positions": int(len(data.pairs)), "samples": len(samples),
                                    "feature_seconds": round(extract_s, 1), "feature_dtype": str(dtype).replace("torch.", "")}}
    if held is not None:
        report |= calibrate(head, held, bar)
        report["held_out"] = evaluate(head, held, dtype=torch.float32)
        from cosine.verifier.lookup import RunLookup

        floors = RunLookup()  # the verifier's cost rule at its default row cost; 8 nodes: the scheduler's default
        report["held_out_trees"] = {f"batch {b}": evaluate_trees(head, held, floors.min_path(b), 8) for b in (1, 2)}
    import shutil

    from cosine.zoo.registry import ModelEntry, write_card

    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    head.save(staging, target=target_dir.name, **report)
    write_card(staging, ModelEntry(out.name, "head", "general", "", "the verifier's feature-conditioned drafter "
                                   f"(target features, {head.vocab_ids.numel()}-token head)"), **report)
    shutil.rmtree(out, ignore_errors=True)
    staging.replace(out)
    return report


def run_head(cfg: HeadConfig, domains=None) -> tuple[Path, dict]:
    """`cosine zoo head`: from the zoo build's cached samples of ``domains`` (default: all), with progress."""
    from cosine.zoo.build import _load_samples, work_dir
    from cosine.zoo.corpora import CORPUS, DOMAINS
    from cosine.zoo.registry import TARGET, models_dir, path_of

    samples: list[Sample] = []
    held: list[Sample] = []
    missing = []
    for domain in domains or DOMAINS:
        train = _load_samples(work_dir() / f"{domain}-train-{CORPUS}-s{cfg.seed}.pt")
        if train is None:
            missing.append(domain)
            continue
        samples += train
        held += _load_samples(work_dir() / f"{domain}-heldout-{CORPUS}-s{cfg.seed}.pt") or []
    if not samples:
        raise FileNotFoundError("no training data: `cosine zoo build` writes the target's continuations the head "
                                f"learns from (looked in {work_dir()})")
    expected = cfg.train_seconds + sum(len(s.tokens) for s in samples + held) / 1500 + 30
    with Progress("cosine zoo head", expected_s=expected) as bar:
        if missing:
            bar.note(f"no training data for {', '.join(missing)} (run `cosine zoo build` for them)")
        out = models_dir() / NAME
        report = build_head(path_of(TARGET), samples, held, out, cfg, bar,
                            cache=work_dir() / f"head-features-{cfg.dtype}-{CORPUS}-s{cfg.seed}.pt")
    return out, report
