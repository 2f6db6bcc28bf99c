"""Switches for CoSine's four mechanisms (issue 5): which ones a server or a request runs with.

The defaults are the full system. Each switch turns one mechanism off so the
benchmark can measure what it is worth:

* ``routing`` — expertise routing; off: every request uses ``fixed_drafter``
  (None: the first default drafter);
* ``fusion`` — ``"confidence"`` (step-wise confidence fusion), ``"merge"``
  (drafters draft independently, chains prefix-merged) or ``"single"`` (one
  drafter, no fusion);
* ``pipelining`` — off: synchronous rounds (draft, then verify, one group at a
  time, no optimistic drafting ahead);
* ``adaptive_depth`` — off: every round drafts ``fixed_depth`` tokens.

A plain frozen dataclass: it validates in ``__post_init__``, can be a field of
a pydantic settings class, and parses the ``"routing=off,fusion=merge"`` form a
command line or an environment variable carries (`Switches.parse`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

FusionMode = Literal["confidence", "merge", "single"]
FUSION_MODES: tuple[str, ...] = ("confidence", "merge", "single")
_TRUE = {"1", "true", "on", "yes"}
_FALSE = {"0", "false", "off", "no"}


def _flag(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError(f"switch {name} must be on or off (true/false), got {value!r}")


@dataclass(frozen=True)
class Switches:
    routing: bool = True
    fusion: FusionMode = "confidence"
    pipelining: bool = True
    adaptive_depth: bool = True
    fixed_depth: int = 4  # with adaptive_depth off
    fixed_drafter: str | None = None  # with routing off; None: the first default drafter

    def __post_init__(self) -> None:
        for name in ("routing", "pipelining", "adaptive_depth"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                object.__setattr__(self, name, _flag(name, value))
        if self.fusion not in FUSION_MODES:
            raise ValueError(f"fusion must be one of {', '.join(FUSION_MODES)}, got {self.fusion!r}")
        if isinstance(self.fixed_depth, bool) or not isinstance(self.fixed_depth, int):
            try:
                object.__setattr__(self, "fixed_depth", int(str(self.fixed_depth)))
            except ValueError:
                raise ValueError(f"fixed_depth must be an integer, got {self.fixed_depth!r}") from None
        if not 0 <= self.fixed_depth <= 64:
            raise ValueError(f"fixed_depth must be between 0 and 64, got {self.fixed_depth}")
        if self.fixed_drafter is not None and not self.fixed_drafter:
            raise ValueError("fixed_drafter must be a drafter name or None, not empty")

    @property
    def full(self) -> bool:
        """Whether every mechanism is on (the default system)."""
        return self.routing and self.fusion == "confidence" and self.pipelining and self.adaptive_depth

    def replace(self, **changes: Any) -> "Switches":
        """A copy with ``changes`` (validated), e.g. per request."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ValueError(f"unknown switch(es) {sorted(unknown)}; known: {[f.name for f in dataclasses.fields(self)]}")
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> "Switches":
        return cls().replace(**{k.replace("-", "_"): v for k, v in values.items()})

    @classmethod
    def parse(cls, text: str) -> "Switches":
        """``"routing=off,fusion=merge,fixed_depth=3"`` → Switches (empty: defaults)."""
        values: dict[str, str] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            if not sep:
                raise ValueError(f"switch {part!r} must be written name=value")
            values[key.strip()] = value.strip()
        if "fixed_drafter" in values and values["fixed_drafter"].lower() in {"", "none"}:
            values["fixed_drafter"] = None  # type: ignore[assignment]
        return cls.from_mapping(values)

    def label(self) -> str:
        """Short name for a benchmark row: "full", or the mechanisms switched off."""
        off = []
        if not self.routing:
            off.append("no-routing")
        if self.fusion != "confidence":
            off.append({"merge": "merge-only", "single": "single-drafter"}[self.fusion])
        if not self.pipelining:
            off.append("no-pipelining")
        if not self.adaptive_depth:
            off.append(f"fixed-depth-{self.fixed_depth}")
        return "+".join(off) or "full"
