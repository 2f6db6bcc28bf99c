"""`cosine bench engine`: the native engine against the `transformers` backend on the real target.

For each backend: a one-token decode at batch 1, 4 and 8 (batch 4: what
llama.cpp's server does with 4 parallel streams), verifying a 4-token chain and
a 16-node tree at the same batches; each as the median milliseconds of one
forward step (plus the cut back to the prompt) and as a ratio to the same
backend's one-token decode at batch 1. Then the bookkeeping costs (cut back,
release + reopen slot) in microseconds. Greedy by default; --temperature (with
--top-p, --top-k) makes the native and hf_target backends verify by seeded
sampling, token choice included in the time.

The `transformers` backend is measured at its best: one batched forward of
`LlamaForCausalLM` over a batched DynamicCache (equal prompt lengths, so no
padding), trees with a 4D ancestor mask and depth positions, then `crop`.
The cases are interleaved round by round so that machine noise falls on all
of them alike.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import torch

from cosine.engine.models import cpu_bf16_flags, fast_bf16, resolve_dtype

BATCHES = (1, 4, 8)
DEFAULT_BACKENDS = "native,transformers,hf_target"


CASES = (("decode", 0), ("chain4", 4), ("tree16", 16))


def tree16():
    """A 16-node tree of depth 3: 4 children of the root, 2 under each, 1 under each of those ... (4+8+4)."""
    from cosine.engine.tree import DraftTree

    parents = [-1, -1, -1, -1]  # 0..3
    for p in range(4):
        parents += [p, p]  # 4..11
    parents += [4, 6, 8, 10]  # 12..15
    return DraftTree([0] * 16, parents)


def make_draft(kind: str, n: int, rng: random.Random, vocab: int):
    from cosine.engine.tree import DraftTree

    if kind == "tree16":
        t = tree16()
        t.tokens = [rng.randrange(vocab) for _ in t.tokens]
        return t
    return DraftTree.chain([rng.randrange(vocab) for _ in range(n)])


class NativeBench:
    name = "native"

    def __init__(self, path, device, dtype, context, name=None):
        self.name = name or self.name
        from cosine.engine.native_target import NativeTarget

        self.target = NativeTarget.from_pretrained(path, device=device, dtype=dtype, n_slots=max(BATCHES) + 1,
                                                   max_context=context + 64)
        self.vocab = self.target.vocab_size

    def setup(self, batch: int, prompt: list[int]) -> None:
        for rid in list(self.target._reqs):
            self.target.release(rid)
        self.rids = [f"b{i}" for i in range(batch)]
        self.prompt_len = len(prompt)
        self.target.open_batch([(rid, prompt, len(prompt)) for rid in self.rids])

    def step(self, drafts, sampling) -> None:
        self.target.verify_batch([(rid, d, sampling) for rid, d in zip(self.rids, drafts)])
        for rid in self.rids:
            self.target.truncate(rid, self.prompt_len)

    def bookkeeping_us(self, prompt) -> dict[str, float]:
        self.setup(1, prompt)
        t = self.target
        rid = self.rids[0]
        n = 2000
        t0 = time.perf_counter()
        for _ in range(n):
            t.truncate(rid, len(prompt))  # cut back (to where it is: the same bookkeeping)
        cut = (time.perf_counter() - t0) / n * 1e6
        slot = t.slot_of(rid)
        t0 = time.perf_counter()
        for _ in range(n):
            t.cache.release(slot)
            slot = t.cache.allocate()
        rel = (time.perf_counter() - t0) / n * 1e6
        return {"cut_back_us": cut, "release_reopen_slot_us": rel}


class HFTargetBench:
    """The project's HFTarget as the verifier uses it today: one forward (and one cache) per request."""

    name = "hf_target"

    def __init__(self, path, device, dtype, context):
        from cosine.engine.hf_target import HFTarget
        from cosine.engine.models import load_causal_lm

        self.target = HFTarget(load_causal_lm(path, device, dtype))
        self.vocab = self.target.vocab_size

    def setup(self, batch: int, prompt: list[int]) -> None:
        for rid in list(self.target._slots):
            self.target.release(rid)
        self.rids = [f"b{i}" for i in range(batch)]
        self.prompt_len = len(prompt)
        for rid in self.rids:
            self.target.open(rid, prompt, len(prompt))

    def step(self, drafts, sampling) -> None:
        for rid, d in zip(self.rids, drafts):
            self.target.verify(rid, d, sampling)  # a tree: its main chain only (HFTarget's rule)
        for rid in self.rids:  # cut back to the prompt
            slot = self.target._slots[rid]
            extra = len(slot.tokens) - self.prompt_len
            if extra:
                slot.cache.crop(-extra)
                del slot.tokens[self.prompt_len:]

    def bookkeeping_us(self, prompt) -> dict[str, float]:
        return {}


class HFBench:
    name = "transformers"

    def __init__(self, path, device, dtype, context):
        from cosine.engine.models import load_causal_lm

        self.model = load_causal_lm(path, device, dtype)
        self.device = next(self.model.parameters()).device
        self.vocab = int(self.model.config.vocab_size)

    @torch.inference_mode()
    def setup(self, batch: int, prompt: list[int]) -> None:
        from transformers import DynamicCache

        self.batch = batch
        self.cache = DynamicCache(config=self.model.config)
        ids = torch.tensor([prompt[:-1]] * batch, device=self.device)
        self.model(input_ids=ids, cache=self.cache, use_cache=True, logits_to_keep=1)
        self.n_cached = len(prompt) - 1
        self.last = prompt[-1]

    @torch.inference_mode()
    def step(self, drafts, sampling) -> None:  # greedy only (main() refuses sampling for this backend)
        tree = drafts[0]
        n = len(tree) + 1
        ids = torch.tensor([[self.last, *d.tokens] for d in drafts], device=self.device)
        depths = tree.depths()
        pos = torch.tensor([[self.n_cached] + [self.n_cached + x for x in depths]] * self.batch, device=self.device)
        kwargs = {}
        if not tree.is_chain():
            anc: list[list[bool]] = []
            parents = [-1] + [p + 1 for p in tree.parents]
            for i, p in enumerate(parents):
                row = list(anc[p]) if p >= 0 else [False] * n
                row[i] = True
                anc.append(row)
            mask = torch.ones(self.batch, 1, n, self.n_cached + n, dtype=torch.bool, device=self.device)
            mask[:, 0, :, self.n_cached:] = torch.tensor(anc, dtype=torch.bool, device=self.device)
            kwargs["attention_mask"] = mask
        logits = self.model(input_ids=ids, cache=self.cache, use_cache=True, position_ids=pos, **kwargs).logits
        logits.argmax(-1).tolist()  # the token choice, as a verifier makes it
        self.cache.crop(-n)

    def bookkeeping_us(self, prompt) -> dict[str, float]:
        self.setup(1, prompt)
        n = min(100, self.n_cached - 1)
        t0 = time.perf_counter()
        for _ in range(n):
            self.cache.crop(-1)  # cut back by one token
        return {"cut_back_us": (time.perf_counter() - t0) / n * 1e6}


def run(args) -> dict:
    from cosine.engine.sampling import Sampling

    sampling = Sampling(args.temperature, args.top_p, args.top_k, args.seed)
    torch.set_num_threads(args.threads)
    # cpu: this thread's CPU time, which a descheduled step does not accrue (one thread only: with more,
    # the other threads' work would be missed); wall: elapsed time
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    path = args.model or _target_path()
    rng = random.Random(0)
    backends = []
    names = args.backends.split(",")
    if args.backends == DEFAULT_BACKENDS and fast_bf16(args.device):
        names.insert(1, "native-bf16")
    for name in names:
        if name == "native-bf16":
            backends.append(NativeBench(path, args.device, "bfloat16", args.context, name="native-bf16"))
            continue
        cls = {"native": NativeBench, "transformers": HFBench, "hf_target": HFTargetBench}[name]
        backends.append(cls(path, args.device, args.dtype, args.context))
    vocab = backends[0].vocab
    prompt = [rng.randrange(vocab) for _ in range(args.context)]
    from tqdm import tqdm

    times: dict[tuple[str, str, int], list[float]] = {}
    total = len(BATCHES) * args.repeats * len(backends) * len(CASES)
    bar = tqdm(total=total, desc="bench engine", unit="step", file=sys.stderr, disable=args.no_progress)
    for batch in BATCHES:
        for b in backends:
            b.setup(batch, prompt)
            for kind, n in CASES:  # warm up
                b.step([make_draft(kind, n, rng, vocab) for _ in range(batch)], sampling)
        for _ in range(args.repeats):
            for b in backends:
                for kind, n in CASES:
                    drafts = [make_draft(kind, n, rng, vocab) for _ in range(batch)]
                    t0 = clock()
                    b.step(drafts, sampling)
                    times.setdefault((b.name, kind, batch), []).append((clock() - t0) * 1e3)
                    bar.update(1)
    bar.close()
    rows = []
    for b in backends:
        base = statistics.median(times[(b.name, "decode", 1)])
        for kind, _ in CASES:
            for batch in BATCHES:
                ms = statistics.median(times[(b.name, kind, batch)])
                rows.append({"backend": b.name, "case": kind, "batch": batch, "ms": round(ms, 2),
                             "min_ms": round(min(times[(b.name, kind, batch)]), 2),
                             "ratio_to_decode_b1": round(ms / base, 2),
                             "tokens_per_s": round(batch * 1e3 / ms, 1) if kind == "decode" else None})
    book = {b.name: {k: round(v, 2) for k, v in b.bookkeeping_us(prompt).items()} for b in backends}
    chain_only = [b.name for b in backends if isinstance(b, NativeBench) and not b.target.verifies_trees]
    summary = {}
    for stat, suffix in (("ms", ""), ("min_ms", "_by_min")):  # min: robust to a busy shared machine
        by = {(r["backend"], r["case"], r["batch"]): r[stat] for r in rows}

        def ratio(num, den):
            return round(by[num] / by[den], 2) if num in by and den in by else None

        pairs = {
            "native_vs_transformers_decode_b1_speedup": (("transformers", "decode", 1), ("native", "decode", 1)),
            "native_vs_transformers_decode_b8_throughput": (("transformers", "decode", 8), ("native", "decode", 8)),
            "native_vs_hf_target_decode_b8_throughput": (("hf_target", "decode", 8), ("native", "decode", 8)),
            "native_tree16_b1_over_decode_b1": (("native", "tree16", 1), ("native", "decode", 1)),
            "native_bf16_vs_transformers_decode_b1_speedup": (("transformers", "decode", 1), ("native-bf16", "decode", 1)),
            "native_bf16_tree16_b1_over_decode_b1": (("native-bf16", "tree16", 1), ("native-bf16", "decode", 1)),
        }
        for key, (num, den) in pairs.items():
            value = ratio(num, den)
            if value is not None:
                summary[key + suffix] = value
    auto = str(resolve_dtype("auto", args.device)).replace("torch.", "")
    return {"model": str(path), "threads": args.threads, "clock": args.clock, "device": args.device, "dtype": args.dtype,
            "auto_dtype": auto, "cpu_bf16_flags": cpu_bf16_flags() if args.device == "cpu" else [],
            "context": args.context, "repeats": args.repeats, "rows": rows, "bookkeeping_us": book,
            "summary": summary, "verifies_main_chain_only": chain_only, "sampling": {"temperature": sampling.temperature, "top_p": sampling.top_p,
                                             "top_k": sampling.top_k, "seed": sampling.seed}}


def _target_path():
    from cosine.zoo.prepare import prepare_target

    return prepare_target()


def _sampling_text(s: dict) -> str:
    if s["temperature"] == 0:
        return "greedy"
    return f"sampling: temperature {s['temperature']} top_p {s['top_p']} top_k {s['top_k']} seed {s['seed']}"


def format_table(result: dict) -> str:
    lines = [f"model {result['model']}  threads {result['threads']}  clock {result['clock']}  {result['device']}/{result['dtype']}  "
             f"context {result['context']}  median of {result['repeats']}  {_sampling_text(result['sampling'])}",
             f"--dtype auto picks {result['auto_dtype']}; CPU bf16 features: "
             f"{', '.join(result['cpu_bf16_flags']) or 'none'}",
             f"{'backend':<13}{'case':<8}{'batch':>6}{'ms':>10}{'min ms':>10}{'× decode b1':>13}{'tok/s':>9}"]
    for r in result["rows"]:
        tps = f"{r['tokens_per_s']:.1f}" if r["tokens_per_s"] else ""
        lines.append(f"{r['backend']:<13}{r['case']:<8}{r['batch']:>6}{r['ms']:>10.2f}{r['min_ms']:>10.2f}"
                     f"{r['ratio_to_decode_b1']:>13.2f}{tps:>9}")
    for name, book in result["bookkeeping_us"].items():
        lines.append(f"{name}: " + ", ".join(f"{k} {v:.2f}" for k, v in book.items()))
    for k, v in result["summary"].items():
        lines.append(f"{k}: {v}")
    for name in result.get("verifies_main_chain_only", []):
        lines.append(f"{name} verifies a tree along its main chain only (bf16 on a CPU: a node off it would not get "
                     f"the logits plain decoding gives it), so its tree16 rows are a 3-token chain")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="cosine bench engine", description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    ap.add_argument("--model", default=None, help="model directory (default: the zoo's target)")
    ap.add_argument("--backends", default=DEFAULT_BACKENDS,
                    help="comma list of native, native-bf16, transformers, hf_target "
                         "(the default adds native-bf16 where bf16 is fast)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32",
                    help="dtype of the native, transformers and hf_target backends: float32, bfloat16, float16 or auto "
                         "(what the services' --dtype auto picks); native-bf16 is always bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=128, help="prompt length of every request")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="wall: elapsed time; cpu: the thread's CPU time, robust to other processes on a busy machine "
                         "(needs --threads 1)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0: greedy (default); above 0: the native and hf_target backends verify by seeded sampling")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    from cosine.engine.sampling import Sampling

    try:
        Sampling(args.temperature, args.top_p, args.top_k, args.seed).check()
    except ValueError as e:
        ap.error(str(e))
    if args.temperature > 0 and "transformers" in args.backends.split(","):
        ap.error("the transformers backend measures greedy steps only: with --temperature, pick --backends from "
                 "native, native-bf16, hf_target")
    if args.clock == "cpu" and args.threads != 1:
        ap.error("--clock cpu measures one thread: use it with --threads 1")
    result = run(args)
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
