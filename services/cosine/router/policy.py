"""Router policy (pure logic): validating a request and choosing its drafters."""

from __future__ import annotations

from dataclasses import dataclass, field

from cosine.common.convert import FUSION_MODE_NAME, fusion_mode_name, sampling_from_proto
from cosine.common.v1 import common_pb2
from cosine.engine.sampling import Sampling



class BadRequest(ValueError):
    """Input the client must fix; the message says how."""


@dataclass(frozen=True)
class Limits:
    max_new_tokens_default: int = 128
    max_new_tokens_limit: int = 2048
    max_context: int = 8192
    max_stop_strings: int = 16
    max_depth: int = 16


@dataclass
class Admission:
    """What a validated request asks for, before tokenizing."""

    text: str | None
    messages: list[dict[str, str]] | None
    max_new_tokens: int
    sampling: Sampling
    stop: list[str]
    drafters: list[str] = field(default_factory=list)
    speculate: bool = True
    max_depth: int | None = None
    # drafters the scheduler's expertise routing may choose among (empty: the client named its drafters)
    candidates: list[str] = field(default_factory=list)
    # per-request switches (a common_pb2.FusionMode; None: the server's setting)
    fusion: int = 0
    routing: bool | None = None
    adaptive_depth: bool | None = None
    pipelining: bool | None = None


def admit(request, limits: Limits, known_drafters: set[str], default_drafters: list[str], random_seed: int) -> Admission:
    """Check everything but the token counts; raises BadRequest with a readable message."""
    has_prompt = len(request.prompt) > 0
    if has_prompt and request.messages:
        raise BadRequest("give either prompt or messages, not both")
    text = messages = None
    if has_prompt:
        try:
            text = request.prompt.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise BadRequest(f"prompt is not valid UTF-8 (byte {exc.start}): send UTF-8 text") from None
        if not text.strip():
            raise BadRequest("prompt is empty (only whitespace)")
    elif request.messages:
        messages = []
        for i, m in enumerate(request.messages):
            if not m.role:
                raise BadRequest(f"messages[{i}].role is empty")
            messages.append({"role": m.role, "content": m.content})
    else:
        raise BadRequest("prompt is empty: send prompt (UTF-8 bytes) or messages")

    if request.HasField("max_new_tokens"):
        max_new = request.max_new_tokens
        if not 1 <= max_new <= limits.max_new_tokens_limit:
            raise BadRequest(f"max_new_tokens must be between 1 and {limits.max_new_tokens_limit}, got {max_new}")
    else:
        max_new = limits.max_new_tokens_default

    sampling = sampling_from_proto(request.sampling, default_seed=random_seed)
    try:
        sampling.check()
    except ValueError as exc:
        raise BadRequest(str(exc)) from None

    stop = list(request.stop)
    if len(stop) > limits.max_stop_strings:
        raise BadRequest(f"at most {limits.max_stop_strings} stop strings, got {len(stop)}")
    if any(not x for x in stop):
        raise BadRequest("stop strings must not be empty")

    spec = request.speculation
    drafters = list(dict.fromkeys(spec.drafters))
    unknown = [d for d in drafters if d not in known_drafters]
    if unknown:
        raise BadRequest(f"unknown drafter(s) {unknown}; available: {sorted(known_drafters)}")
    max_depth = None
    if spec.HasField("max_depth"):
        if spec.max_depth > limits.max_depth:
            raise BadRequest(f"speculation.max_depth must be at most {limits.max_depth}, got {spec.max_depth}")
        max_depth = spec.max_depth
    try:
        fusion_mode_name(spec.fusion, unspecified="")
    except ValueError:
        names = ", ".join(common_pb2.FusionMode.Name(v) for v in sorted(FUSION_MODE_NAME))
        raise BadRequest(f"speculation.fusion must be FUSION_MODE_UNSPECIFIED or one of {names}, got {spec.fusion}") from None
    candidates: list[str] = []
    if not drafters:
        defaults = [d for d in default_drafters if d in known_drafters]
        drafters = defaults[:1]
        candidates = defaults + sorted(set(known_drafters) - set(defaults))
    return Admission(text, messages, max_new, sampling, stop, drafters, not spec.disabled and bool(drafters), max_depth,
                     candidates if not spec.disabled else [], spec.fusion,
                     spec.routing if spec.HasField("routing") else None,
                     spec.adaptive_depth if spec.HasField("adaptive_depth") else None,
                     spec.pipelining if spec.HasField("pipelining") else None)


def check_lengths(prompt_tokens: int, max_new_tokens: int, limits: Limits) -> None:
    if prompt_tokens == 0:
        raise BadRequest("prompt tokenizes to no tokens")
    if prompt_tokens + max_new_tokens > limits.max_context:
        raise BadRequest(
            f"prompt ({prompt_tokens} tokens) + max_new_tokens ({max_new_tokens}) exceeds the context limit of "
            f"{limits.max_context} tokens: shorten the prompt or ask for fewer tokens"
        )
