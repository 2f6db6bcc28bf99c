"""Loading checkpoints with transformers and fingerprinting their tokenizers."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def resolve_dtype(name: str, device: str) -> torch.dtype:
    """auto: fp32 on CPU (bf16 decode measured slower here), bf16 on CUDA."""
    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def load_causal_lm(path: str | Path, device: str = "cpu", dtype: str = "auto"):
    """An AutoModelForCausalLM in eval mode on `device`."""
    from transformers import AutoModelForCausalLM

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"device {device!r} requested but CUDA is not available")
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=resolve_dtype(dtype, device))
    return model.to(device).eval()


def tokenizer_fingerprint(path: str | Path) -> tuple[int, str]:
    """(vocabulary size, hash of the token → id map) of the tokenizer saved in `path`; (0, "") if none."""
    path = Path(path)
    if not (path / "tokenizer.json").exists() and not (path / "tokenizer_config.json").exists():
        return 0, ""
    from transformers import AutoTokenizer

    vocab = AutoTokenizer.from_pretrained(str(path)).get_vocab()
    digest = hashlib.sha256(json.dumps(sorted(vocab.items()), ensure_ascii=False).encode()).hexdigest()[:16]
    return len(vocab), digest
