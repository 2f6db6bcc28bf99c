"""Tiny random Llama-family checkpoints (saved with save_pretrained) for the native engine's tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

_COMMON = dict(eos_token_id=None, bos_token_id=None, pad_token_id=None, initializer_range=0.2)


def _save(tmp_path_factory, name: str, cls, config) -> Path:
    torch.manual_seed(abs(hash(name)) % 1000)
    model = cls(config)
    path = tmp_path_factory.mktemp(f"native-{name}")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """'llama': tied embeddings, GQA 4/2; 'qwen2': untied, qkv biases, llama3 rope scaling, MQA 4/1;
    'tinyvocab': an 8-token vocabulary for the statistical tests."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    return {
        "llama": _save(tmp_path_factory, "llama", LlamaForCausalLM, LlamaConfig(
            vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True, rms_norm_eps=1e-5,
            rope_theta=10000.0, **_COMMON)),
        "qwen2": _save(tmp_path_factory, "qwen2", Qwen2ForCausalLM, Qwen2Config(
            vocab_size=80, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=1, max_position_embeddings=256, tie_word_embeddings=False, rms_norm_eps=1e-6,
            rope_theta=5e5, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
            **_COMMON)),
        "tinyvocab": _save(tmp_path_factory, "tinyvocab", LlamaForCausalLM, LlamaConfig(
            vocab_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True, **_COMMON)),
    }


@pytest.fixture(scope="session")
def hf_models(tiny_models):
    from transformers import AutoModelForCausalLM

    return {name: AutoModelForCausalLM.from_pretrained(str(path)).eval() for name, path in tiny_models.items()}


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models gain nothing from a thread pool, and on a shared 2-core machine each parallel
    region of a small op can wait a scheduler slice for a descheduled worker."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
