"""τ at depth 4 of the zoo's drafters on prompts unlike anything they were trained on, as an outside check computes it.

The prompts are the hand-written sets of `tools/measure_suffix.py` (pass 1 and pass 2: code, prose, technical, chat,
arithmetic; written before any drafter was trained, never tuned on); the target continues each greedily (64 tokens,
cached). Each LM drafter is loaded from its saved directory with plain `AutoModelForCausalLM.from_pretrained` and its
`draft_vocab.json`, and teacher-forced along the target's continuation: while a greedy drafter's top-1 equals the
target's token its context is the true context, so the round simulation of `cosine.zoo.evaluate.tau` gives exactly
what greedy verification would accept. Prompt lookup and suffix decoding (with memory over both passes, in order)
are drafted round by round along the same continuations for reference.

    PYTHONPATH=services python tools/measure_drafters.py [--depth 4] [--json out.json]

Prints τ@depth per drafter and domain, the best drafter per prompt (mean over prompts, as the issue's figure),
the routed specialist (code → lm-code, prose → lm-literary, technical → lm-docs, chat and arithmetic → lm-chat),
and each drafter's top-1 agreement.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from measure_suffix import PROMPTS, continuations  # noqa: E402

from cosine.engine.suffix import SuffixDrafter, SuffixMemory  # noqa: E402
from cosine.engine.vocab import DraftVocab  # noqa: E402
from cosine.zoo.build import Target, _model_free_tau  # noqa: E402
from cosine.zoo.evaluate import tau  # noqa: E402
from cosine.zoo.registry import list_models  # noqa: E402

ROUTED = {"code": "lm-code", "prose": "lm-literary", "technical": "lm-docs", "chat": "lm-chat", "math": "lm-chat"}


@torch.inference_mode()
def lm_matches(directory: Path, samples) -> list[list[bool]]:
    """Per sample, per continuation position: the drafter's top-1 (plain transformers, fp32) equals the target's token."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    vocab = DraftVocab.load(directory)
    out = []
    for s in samples:
        ids = vocab.to_draft(s.tokens) if vocab else s.tokens
        logits = model(input_ids=torch.tensor([ids])).logits[0]
        pred = logits.argmax(-1).tolist()
        if vocab:
            pred = vocab.to_target(pred)
        out.append([pred[p] == s.tokens[p + 1] for p in range(s.prompt_len - 1, len(s.tokens) - 1)])
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--json", type=Path, help="write every figure here too")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    t0 = time.monotonic()
    target = Target()
    passes = ["pass1", "pass2"]
    samples = [s for p in passes for s in continuations(target, p, args.new_tokens)]
    domains = [d for p in passes for d, _, _ in PROMPTS[p]]
    del target
    per_prompt: dict[str, list[float]] = {}
    agreement: dict[str, float] = {}
    lms = sorted((e for e in list_models() if e.kind == "lm"), key=lambda e: e.name)
    for entry in lms:
        matches = lm_matches(Path(entry.path), samples)
        per_prompt[entry.name] = [tau(m, args.depth) for m in matches]
        flat = [x for m in matches for x in m]
        agreement[entry.name] = sum(flat) / max(len(flat), 1)
    for name, drafter in (("ngram", None), ("suffix+memory", SuffixDrafter(memory=SuffixMemory()))):
        per_prompt[name] = []
        agreed = 0.0
        for s in samples:  # one sample at a time, in order: the suffix memory learns the earlier outputs
            t, a = _model_free_tau([s], args.depth, drafter)
            per_prompt[name].append(t)
            agreed += a
        agreement[name] = agreed / len(samples)
    kinds = sorted(set(domains), key=domains.index)
    head = ["drafter"] + kinds + ["all", "top-1 agree"]
    rows = []
    for name, taus in per_prompt.items():
        by = [statistics.mean(t for t, d in zip(taus, domains) if d == k) for k in kinds]
        rows.append([name] + [f"{x:.2f}" for x in by] + [f"{statistics.mean(taus):.2f}", f"{agreement[name]:.2f}"])
    lm_names = [e.name for e in lms if e.domain != "general"]  # the domain drafters (not the untrained lm-2layer)
    figures: dict[str, dict] = {}
    if lm_names:
        best = [max(per_prompt[n][i] for n in lm_names) for i in range(len(samples))]
        routed = [per_prompt[ROUTED[d]][i] if ROUTED[d] in per_prompt else float("nan") for i, d in enumerate(domains)]
        for label, taus in (("best LM drafter per prompt", best), ("routed specialist", routed)):
            by = [statistics.mean(t for t, d in zip(taus, domains) if d == k) for k in kinds]
            rows.append([label] + [f"{x:.2f}" for x in by] + [f"{statistics.mean(taus):.2f}", "-"])
            figures[label] = {"by_domain": dict(zip(kinds, by)), "mean": statistics.mean(taus)}
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    print(f"τ@{args.depth}, greedy, {len(samples)} hand-written prompts (pass 1 + pass 2 of tools/measure_suffix.py), "
          f"{args.new_tokens} target tokens each; LM drafters through plain transformers")
    print(" | ".join(h.ljust(w) for h, w in zip(head, widths)))
    print("-|-".join("-" * w for w in widths))
    for r in rows:
        print(" | ".join(c.ljust(w) for c, w in zip(r, widths)))
    print(f"({time.monotonic() - t0:.0f}s)")
    if args.json:
        args.json.write_text(json.dumps({"depth": args.depth, "domains": domains, "per_prompt": per_prompt,
                                         "agreement": agreement, "summary": figures}, indent=2) + "\n")


if __name__ == "__main__":
    main()
