"""Usage: python tools/measure_small_rows_lossless.py   (the zoo's target; a few minutes on 2 cores)

Real target, fp32: the native engine's plain decoding (one-row steps) against transformers' greedy, and its
speculative decoding (random trees that follow the plain output for a while) against its own plain decoding,
with few-row steps on plain weights (small_rows=2) and without (0)."""
import random, sys, torch
from pathlib import Path
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "services"), str(ROOT)]
from transformers import AutoTokenizer
from cosine.engine.llama import NativeLlama
from cosine.engine.native_target import NativeTarget
from cosine.engine.models import load_causal_lm
from cosine.engine.sampling import Sampling
from cosine.engine.tree import DraftTree
from cosine.bench.engine import _target_path
from tests.unit.engine.helpers import hf_greedy, speculative_greedy
torch.set_num_threads(2)
N = 48
path = _target_path()
tok = AutoTokenizer.from_pretrained(str(path))
texts = ["Write a Python function that merges two sorted lists.", "Explain what a hash table is.",
         "Tell me a short story about a lighthouse keeper.", "How do I list files by size in Linux?",
         "What is 17 times 23? Show your steps.", "Summarize the causes of the French Revolution.",
         "def quicksort(arr):", "The best way to learn a new language is"]
prompts = {f"p{i}": tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True) if i % 3 else tok(t)["input_ids"]
           for i, t in enumerate(texts)}
prompts = {k: list(v["input_ids"] if hasattr(v, "keys") else v) for k, v in prompts.items()}
hf = load_causal_lm(path, "cpu", "float32")
refs = {rid: hf_greedy(hf, p, N) for rid, p in prompts.items()}
for sr in (2, 0):
    model = NativeLlama.from_pretrained(path, dtype=torch.float32, small_rows=sr)
    plain_t = NativeTarget(model, 1024, 10)
    plain_t.open_batch([(rid, p, len(p)) for rid, p in prompts.items()])
    plain = {rid: [] for rid in prompts}
    for rid in prompts:  # one request at a time: one-row steps
        while len(plain[rid]) < N:
            plain[rid] += plain_t.verify_batch([(rid, DraftTree(), Sampling())])[0].token_ids
        plain[rid] = plain[rid][:N]
        plain_t.release(rid)
    same_hf = sum(plain[r] == refs[r] for r in prompts)
    spec_same = 0
    for seed in range(3):
        t = NativeTarget(model, 1024, 10)
        got = speculative_greedy(t, prompts, plain, N, random.Random(seed), chain=False)
        spec_same += sum(got[r] == plain[r] for r in prompts)
    print(f"small_rows={sr}: plain == transformers {same_hf}/8; speculative (3 seeds of random trees, batched) == own plain {spec_same}/24", flush=True)
    for r in prompts:  # where plain decoding and transformers differ: the first differing position
        if plain[r] != refs[r]:
            k = next((i for i, (a, b) in enumerate(zip(plain[r], refs[r])) if a != b), None)
            print(f"  {r}: transformers gave {len(refs[r])} tokens (it stops at EOS), first difference at "
                  f"{'none: the same up to its end' if k is None else k}")
