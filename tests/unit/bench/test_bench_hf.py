"""`cosine bench`'s transformers side on tiny random Llamas: the full-vocabulary assistant drafts what the
reduced drafter drafts, assisted generation with it keeps the target's greedy output, and the step clock
stamps every token."""

from __future__ import annotations

import pytest
import torch

from cosine.bench import hf
from cosine.engine.vocab import DraftVocab

V = 96


class Tok:
    eos_token_id = 2
    pad_token_id = 0


def tiny(vocab: int, layers: int, seed: int, tie: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=tie, bos_token_id=1,
                      eos_token_id=Tok.eos_token_id, pad_token_id=Tok.pad_token_id)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench-hf")
    target = tiny(V, 2, 0)
    target.save_pretrained(root / "target")
    vocab = DraftVocab([0, 1, 2] + list(range(10, 60)))  # 53 of the 96 tokens, fallback index 0
    draft = tiny(len(vocab), 1, 1, tie=True)
    draft.save_pretrained(root / "draft")
    vocab.save(root / "draft")
    return root, target, draft, vocab


def test_full_vocab_assistant_drafts_what_the_reduced_drafter_drafts(dirs):
    root, _, draft, vocab = dirs
    big, note = hf.full_vocab_assistant(root / "draft", root / "target")
    assert big.config.vocab_size == V and not big.config.tie_word_embeddings and "fallback" in note
    ids = [5, 12, 40, 80, 13]  # 5 and 80 lie outside the drafting vocabulary
    with torch.inference_mode():
        small_logits = draft(torch.tensor([vocab.to_draft(ids)])).logits[0]
        big_logits = big(torch.tensor([ids])).logits[0]
    assert torch.allclose(big_logits[:, vocab.token_ids], small_logits, atol=1e-5)
    outside = [t for t in range(V) if t not in vocab]
    assert torch.all(big_logits[:, outside] == 0)
    assert [vocab.to_target([int(i)])[0] for i in small_logits.argmax(-1)] == big_logits.argmax(-1).tolist()


def test_generate_batch_stamps_tokens_and_assisted_output_is_the_targets(dirs):
    root, target, _, _ = dirs
    big, _ = hf.full_vocab_assistant(root / "draft", root / "target")
    prompts = [[1, 12, 13, 14, 15], [1, 40, 41]]
    plain, _ = hf.generate_batch(target, Tok(), prompts[:1], 12)
    seq = plain[0]
    assert len(seq["token_times_s"]) == len(seq["token_ids"]) and seq["rounds"] == len(seq["token_ids"])
    assert seq["token_times_s"] == sorted(seq["token_times_s"])
    assisted, _ = hf.generate_batch(target, Tok(), prompts[:1], 12, assistant_model=big)
    assert assisted[0]["token_ids"] == seq["token_ids"]
    assert assisted[0]["rounds"] <= len(seq["token_ids"])
    lookup, _ = hf.generate_batch(target, Tok(), prompts[:1], 12, prompt_lookup_num_tokens=3)
    assert lookup[0]["token_ids"] == seq["token_ids"]
    batched, returned = hf.generate_batch(target, Tok(), prompts, 12)
    assert len(batched) == 2 and all(len(s["token_times_s"]) == len(s["token_ids"]) for s in batched)
    assert all(t <= returned for s in batched for t in s["token_times_s"])
