"""Names and directories of prepared models, cached outside the repository.

The cache root is $COSINE_CACHE, or ~/.cache/cosine. Each model is a directory
loadable with `AutoModelForCausalLM.from_pretrained(path)` plus `cosine.json`
(its card), written last so a half-prepared model is never mistaken for one.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

TARGET = "target"
CARD = "cosine.json"


@dataclass
class ModelEntry:
    name: str
    kind: str  # target | lm | ngram | suffix
    domain: str
    path: str  # "" for drafters without weights
    description: str = ""


def cache_root() -> Path:
    return Path(os.environ.get("COSINE_CACHE") or Path.home() / ".cache" / "cosine")


def models_dir() -> Path:
    return cache_root() / "models"


# Drafters that need no weights are always in the zoo.
BUILTIN = [ModelEntry("suffix", "suffix", "general", "", "suffix decoding over the request's own tokens and earlier outputs"),
           ModelEntry("ngram", "ngram", "general", "", "prompt lookup over the request's own tokens")]


def list_models() -> list[ModelEntry]:
    """Every prepared model (target first), then the built-in drafters."""
    entries = []
    root = models_dir()
    if root.is_dir():
        for card in sorted(root.glob(f"*/{CARD}")):
            meta = json.loads(card.read_text())
            entries.append(ModelEntry(meta["name"], meta["kind"], meta.get("domain", "general"), str(card.parent), meta.get("description", "")))
    entries.sort(key=lambda e: (e.kind != "target", e.name))
    return entries + BUILTIN


def find(name: str) -> ModelEntry | None:
    return next((e for e in list_models() if e.name == name), None)


def path_of(name: str) -> Path:
    """Directory of a prepared model; a path that exists is returned as is."""
    entry = find(name)
    if entry is not None and entry.path:
        return Path(entry.path)
    if Path(name).is_dir():
        return Path(name)
    raise FileNotFoundError(f"model {name!r} is not prepared: run `cosine zoo` first (cache: {models_dir()})")


def write_card(directory: Path, entry: ModelEntry, **extra) -> None:
    card = {k: v for k, v in asdict(entry).items() if k != "path"} | extra
    (directory / CARD).write_text(json.dumps(card, indent=2) + "\n")
