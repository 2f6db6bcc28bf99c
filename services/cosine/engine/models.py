"""Loading checkpoints with transformers and fingerprinting their tokenizers."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)


BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")


def cpu_bf16_flags(cpuinfo: str | None = None) -> list[str]:
    """The CPU features that make bf16 matmuls fast (AMX, AVX512-BF16) that this CPU has."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return []
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[-1].split())
    return [f for f in BF16_CPU_FLAGS if f in flags]


def fast_bf16(device: str, cpuinfo: str | None = None) -> bool:
    """bf16 matmuls that beat fp32: CUDA, or a CPU with AMX or AVX512-BF16 (detected, not assumed)."""
    if device.startswith("cuda"):
        return True
    return bool(cpu_bf16_flags(cpuinfo))


def resolve_dtype(name: str, device: str) -> torch.dtype:
    """The torch dtype for a `--dtype` setting. auto: bf16 on CUDA, fp32 on CPU.

    bfloat16 on a CPU with AMX or AVX512-BF16 is 1.3x faster per one-row step and 1.6x at eight rows
    (cosine bench engine), and lossless against its own plain bf16 decoding: the native engine makes a
    row's logits independent of the rows that share its step there (NativeLlama.row_chunk, and a tree is
    verified along its main chain). auto stays fp32 on CPU because bf16 is a different model from the
    fp32 one users compare with `transformers`; bfloat16 is there by name.
    """
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
