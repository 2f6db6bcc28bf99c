"""τ at depth 4 of prompt lookup (ngram) against suffix decoding, on the real target, teacher-forced.

The target continues each prompt greedily (64 tokens by default; cached under $COSINE_CACHE/suffix-measure/);
each drafter then drafts round by round along that continuation exactly as `cosine zoo eval` simulates
prompt lookup (`cosine.zoo.build._model_free_tau`): a round accepts the drafted prefix that equals the
target's tokens, plus the target's own token.

Two passes over different prompts of the same domains (code, prose, technical, chat, math): the suffix
drafter with memory keeps one global index through both, so the second pass drafts over the first pass's
outputs (and each pass over its own earlier requests). `--set tune` runs the prompts the parameters were
chosen on; the default sets (`pass1`, `pass2`) were written before measuring and never tuned on.

    PYTHONPATH=services python tools/measure_suffix.py [--new-tokens 64] [--depth 4]

`--cluster` also serves both passes through a local cluster (Redis, the five services, the real target; drafters
suffix and ngram only), one request at a time, each drafter alone at depth 4 (fusion single, no routing, no
adaptive depth): tokens committed per round, and whether every output equals the other drafter's.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from cosine.bench.prompts import UNLIKE as PROMPTS  # pass1[i] and pass2[i] share a domain, never a topic
from cosine.engine.suffix import SuffixDrafter, SuffixMemory
from cosine.zoo.build import Target, _model_free_tau, _stop_ids
from cosine.zoo.corpora import DomainPrompt
from cosine.zoo.distill import Sample, generate
from cosine.zoo.registry import cache_root


def continuations(target: Target, name: str, new_tokens: int) -> list[Sample]:
    """The target's greedy continuations of one prompt set (cached)."""
    path = cache_root() / "suffix-measure" / f"{name}-{new_tokens}.pt"
    if path.exists():
        return [Sample.from_dict(d) for d in torch.load(path, weights_only=False)]
    prompts = [DomainPrompt(domain, text, chat).token_ids(target.tokenizer) for domain, chat, text in PROMPTS[name]]
    samples = generate(target.model, prompts, new_tokens, _stop_ids(target.tokenizer), batch=len(prompts))
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save([s.to_dict() for s in samples], path)
    return samples


def calibration(samples: list[Sample], depth: int) -> list[tuple[float, float, int]]:
    """Suffix decoding with memory over `samples` in order: for the drafted tokens the target got to judge (those
    after an accepted prefix), (mean confidence, share accepted, count) per confidence bin, and overall last."""
    drafter = SuffixDrafter(memory=SuffixMemory())
    judged: list[tuple[float, bool]] = []
    for i, s in enumerate(samples):
        drafter.open(str(i), s.tokens[: s.prompt_len])
        p, new = s.prompt_len, []
        while p < len(s.tokens):
            chain, probs = drafter.draft(str(i), new, min(depth, len(s.tokens) - p - 1))
            a = 0
            while a < len(chain) and s.tokens[p + a] == chain[a]:
                a += 1
            judged += [(probs[k], k < a) for k in range(min(len(chain), a + 1))]
            new = s.tokens[p: p + a + 1]
            p += a + 1
        drafter.draft(str(i), new, 0)
        drafter.release(str(i))
    out = []
    for lo, hi in ((0.0, 0.3), (0.3, 0.5), (0.5, 0.7), (0.7, 1.01), (0.0, 1.01)):
        xs = [(q, ok) for q, ok in judged if lo <= q < hi]
        if xs:
            out.append((statistics.mean(q for q, _ in xs), statistics.mean(ok for _, ok in xs), len(xs)))
    return out


def serve_one(stub, chat: bool, text: str, new_tokens: int, speculation: dict):
    """One Generate stream through a local cluster's router: (token ids, the final message)."""
    from cosine.router.v1 import router_pb2

    request = router_pb2.GenerateRequest(max_new_tokens=new_tokens, speculation=speculation)
    if chat:
        request.messages.append(router_pb2.ChatMessage(role="user", content=text))
    else:
        request.prompt = text.encode()
    ids, final = [], None
    for reply in stub.Generate(request, timeout=600):
        if reply.WhichOneof("kind") == "chunk":
            ids += reply.chunk.token_ids
        else:
            final = reply.final
    return ids, final


def serve_passes(passes: list[str], new_tokens: int, depth: int) -> None:
    """Both passes through a local cluster, suffix first (its memory fills in pass 1), then ngram."""
    import os
    import tempfile

    import grpc

    from cosine.cluster import Cluster, ClusterSpec, DrafterSpec, free_port
    from cosine.common.v1 import common_pb2
    from cosine.router.v1 import router_pb2_grpc

    os.environ["COSINE_RUN_DIR"] = tempfile.mkdtemp(prefix="cosine-suffix-")
    cluster = Cluster(ClusterSpec(router_port=free_port(), drafters=[DrafterSpec("suffix", "suffix"), DrafterSpec("ngram", "ngram")]))
    cluster.start()
    outputs: dict[tuple[str, int], list[int]] = {}
    rows = []
    try:
        with grpc.insecure_channel(cluster.router_address) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            for drafter in ("suffix", "ngram"):
                for p in passes:
                    tokens = rounds = accepted = 0
                    t = time.perf_counter()
                    for i, (_, chat, text) in enumerate(PROMPTS[p]):
                        ids, final = serve_one(stub, chat, text, new_tokens, dict(
                            drafters=[drafter], max_depth=depth, fusion=common_pb2.FUSION_MODE_SINGLE, routing=False,
                            adaptive_depth=False))
                        outputs.setdefault((p, i), ids)
                        if outputs[(p, i)] != ids:
                            raise AssertionError(f"{p} prompt {i}: {drafter}'s output differs from the other drafter's")
                        tokens += final.usage.completion_tokens
                        rounds += final.stats.rounds
                        accepted += final.stats.accepted_tokens
                    rows.append((drafter, p, tokens / max(rounds, 1), accepted / max(rounds, 1), time.perf_counter() - t))
    finally:
        cluster.stop()
    print(f"\nthrough the local cluster (each drafter alone, depth {depth}, one request at a time):")
    print("drafter | pass  | tokens committed per round | accepted per round | wall s")
    for drafter, p, per_round, acc, wall in rows:
        print(f"{drafter:<7} | {p} | {per_round:26.3f} | {acc:18.3f} | {wall:6.1f}")
    print("every output identical between the two drafters")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--set", choices=["held-out", "tune"], default="held-out",
                    help="held-out: pass 1 then pass 2; tune: the prompts the parameters were chosen on (one pass)")
    ap.add_argument("--small-memory", type=int, default=256, help="a second suffix drafter's bound, in tokens")
    ap.add_argument("--cluster", action="store_true", help="also serve both passes through a local cluster")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    torch.set_num_threads(2)
    target = Target()
    passes = ["tune"] if args.set == "tune" else ["pass1", "pass2"]
    data = {p: continuations(target, p, args.new_tokens) for p in passes}
    generated = time.monotonic() - t0
    memories = {"suffix, memory 131072 tokens": SuffixMemory(131072),
                f"suffix, memory {args.small_memory} tokens": SuffixMemory(args.small_memory)}
    drafters = {"ngram (prompt lookup)": None, "suffix, no memory": SuffixDrafter()}
    drafters |= {name: SuffixDrafter(memory=m) for name, m in memories.items()}
    rows = []
    for name, drafter in drafters.items():
        row = [name]
        for p in passes:
            tau, agree = _model_free_tau(data[p], args.depth, drafter)
            row += [f"{tau:.3f}", f"{agree:.2f}"]
        memory = getattr(drafter, "memory", None)
        row.append(f"{memory.tokens} / {memory.max_tokens} (evicted {memory.evicted_tokens})" if memory else "-")
        rows.append(row)
    head = ["drafter"] + [h for p in passes for h in (f"{p} τ@{args.depth}", f"{p} agree")] + ["memory after (tokens / bound)"]
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    print(" | ".join(h.ljust(w) for h, w in zip(head, widths)))
    print("-|-".join("-" * w for w in widths))
    for r in rows:
        print(" | ".join(c.ljust(w) for c, w in zip(r, widths)))
    counts = {p: (len(d), statistics.mean(len(s.continuation) for s in d)) for p, d in data.items()}
    print("\n" + "; ".join(f"{p}: {n} prompts, {m:.0f} target tokens each on average" for p, (n, m) in counts.items())
          + f"; greedy continuations of {target.dir.name} ({generated:.0f}s incl. load), drafting "
          f"{time.monotonic() - t0 - generated:.1f}s")
    rows = calibration([x for p in passes for x in data[p]], args.depth)
    print("suffix with memory, confidence against acceptance of the drafted tokens the target judged: "
          + "; ".join(f"{c:.2f} → {a:.2f} (n={n})" for c, a, n in rows[:-1]) + f"; overall {rows[-1][0]:.2f} → {rows[-1][1]:.2f}")
    if args.cluster:
        del target  # the cluster's verifier loads its own
        serve_passes(passes, args.new_tokens, args.depth)


if __name__ == "__main__":
    main()
