"""Fixtures shared by every test layer: markers by folder, a real Redis server, tiny models."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        layer = Path(str(item.fspath)).relative_to(ROOT / "tests").parts[0]
        if layer in {"unit", "integration", "e2e"}:
            item.add_marker(getattr(pytest.mark, layer))
        if item.get_closest_marker("gpu") is not None:
            import torch

            if not torch.cuda.is_available():
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def redis_server():
    """A real redis-server on a free loopback port, stopped by its own handle."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed (apt-get install -y redis-server); scripts/test.sh installs it")
    port = _free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.fail("redis-server did not start")
            time.sleep(0.05)
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(scope="session")
def target_dir() -> Path:
    """The real target, prepared once into the cache (outside the repo)."""
    from cosine.zoo.prepare import prepare_target

    return prepare_target()


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory, target_dir) -> dict[str, Path]:
    """Tiny random Llama models that share the target's tokenizer: a 'target' and a 'drafter'."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    out = {}
    for name, layers, seed in (("target", 2, 0), ("drafter", 1, 1)):
        torch.manual_seed(seed)
        config = LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        )
        model = LlamaForCausalLM(config)
        path = tmp_path_factory.mktemp(f"tiny-{name}")
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        out[name] = path
    return out
