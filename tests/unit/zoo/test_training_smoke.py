"""Distillation end to end on tiny configs: the target's continuations, a reduced-vocabulary student whose
loss falls, a saved checkpoint that plain transformers loads and that drafts the same tokens on the native
engine as the model that was trained."""

from __future__ import annotations

import json
from collections import Counter

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from cosine.engine.drafters import NativeLMDrafter
from cosine.engine.llama import NativeLlama
from cosine.engine.vocab import FILE, DraftVocab, select_vocab
from cosine.zoo.distill import generate
from cosine.zoo.train import TrainConfig, examples, make_student, train


def _prompts(tokenizer):
    texts = ["def add(a, b):", "The sea was calm and", "grep searches for", "Once upon a time", "import os\n",
             "What is a cache?", "To be, or not to be", "Explain TCP in one line"]
    return [tokenizer(t)["input_ids"] for t in texts]


def test_generate_is_the_targets_greedy_output_with_its_top_k(tiny_dirs):
    target_dir = tiny_dirs["target"]
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    model = NativeLlama.from_pretrained(target_dir, dtype="float32")
    reference = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32)
    prompts = _prompts(tokenizer)
    samples = generate(model, prompts, 12, stop_ids=set(), batch=3, topk=8)  # fewer slots than prompts
    assert [s.tokens[: s.prompt_len] for s in samples] == prompts
    for s, prompt in zip(samples, prompts):
        out = reference.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12)
        assert s.tokens == out[0].tolist()
        assert s.topk_ids.shape == (len(s.tokens) - 1, 8)
        # row p holds the target's top-k for the token at p + 1; greedy: its first entry is that token
        assert [int(s.topk_ids[p, 0]) for p in range(s.prompt_len - 1, len(s.tokens) - 1)] == s.continuation
        assert torch.all(s.topk_logprobs[:, :-1] >= s.topk_logprobs[:, 1:])


def test_student_trains_saves_reloads_and_drafts_the_same_tokens(tiny_dirs, tmp_path):
    target_dir = tiny_dirs["target"]
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    target = NativeLlama.from_pretrained(target_dir, dtype="float32")
    samples = generate(target, _prompts(tokenizer), 24, stop_ids=set(), batch=8, topk=8)
    counts = Counter(t for s in samples for t in s.tokens)
    vocab = select_vocab(counts, 96, always=[0, 1, 2])  # the tiny target writes fewer distinct tokens than that
    student = make_student(target_dir, vocab, layers=(0,))
    assert student.config.vocab_size == len(vocab) < len(tokenizer) and student.config.num_hidden_layers == 1
    data = examples(samples, vocab, max_len=64)
    result = train(student, data, budget_s=600, config=TrainConfig(layers=(0,), vocab_size=len(vocab), lr=3e-3, batch_tokens=64,
                                                                     bf16=False), max_steps=60)
    losses = [loss for _, loss, _ in result["history"]]
    assert result["steps"] == 60
    assert sum(losses[-10:]) / 10 < 0.7 * sum(losses[:10]) / 10, "the distillation loss must fall"

    student.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    vocab.save(tmp_path)
    assert json.loads((tmp_path / FILE).read_text()) == vocab.token_ids
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path))  # a plain checkpoint, as outside checks load it
    ids = torch.tensor([vocab.to_draft(samples[0].tokens)])
    with torch.no_grad():
        assert torch.allclose(reloaded(input_ids=ids).logits, student(input_ids=ids).logits, atol=1e-5)

    # the served drafter (native engine, reduced vocabulary) drafts what the trained model predicts greedily
    drafter = NativeLMDrafter("tiny", NativeLlama.from_pretrained(tmp_path, dtype="float32"), n_slots=2,
                              vocab=DraftVocab.load(tmp_path), target_vocab_size=len(tokenizer))
    assert drafter.vocab_size == len(tokenizer)
    prompt = samples[1].tokens[:10]
    drafter.open("r", prompt)
    drafted, probs = drafter.draft("r", [], 6)
    expected, context = [], list(prompt)
    with torch.no_grad():
        for _ in range(6):
            index = int(student(input_ids=torch.tensor([vocab.to_draft(context)])).logits[0, -1].argmax())
            expected.append(vocab.token_ids[index])
            context.append(vocab.token_ids[index])
    assert drafted == expected
    assert all(t in vocab for t in drafted) and all(0 < p <= 1 for p in probs)
