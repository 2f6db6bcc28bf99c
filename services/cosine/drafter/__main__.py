"""Start one drafter service: `python -m cosine.drafter --kind lm --model PATH --name NAME`."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from cosine.common.config import ModelSettings
from cosine.common.server import GrpcService, run_service
from cosine.common.streams import ModelWorker
from cosine.common.v1 import common_pb2
from cosine.drafter.service import DrafterServicer
from cosine.drafter.v1 import drafter_pb2, drafter_pb2_grpc


class DrafterSettings(ModelSettings):
    """A drafter service (environment: COSINE_DRAFTER_*)."""

    model_config = ModelSettings.model_config | {"env_prefix": "COSINE_DRAFTER_"}

    name: str = Field("ngram", description="the name requests and fusion use for this drafter")
    kind: Literal["lm", "ngram", "suffix"] = Field(
        "ngram", description="lm: a small causal LM; ngram: prompt lookup; suffix: suffix decoding with a global memory")
    domain: str = Field("general", description="the domain this drafter specialises in")
    max_depth: int = Field(32, ge=1, description="most tokens proposed per step")
    backend: Literal["auto", "native", "transformers"] = Field(
        "auto", description="for lm: the native engine for Llama-family checkpoints (auto), or transformers")
    max_requests: int = Field(16, ge=1, description="for lm on the native engine: KV slots, one per live request")
    memory_tokens: int = Field(131072, ge=0, description="for suffix: the global index's bound in tokens (0: no global index)")


def build(settings: DrafterSettings):
    from cosine.engine.drafters import LMDrafter, NativeLMDrafter, NgramDrafter
    from cosine.engine.llama import NativeLlama
    from cosine.engine.models import load_causal_lm, tokenizer_fingerprint
    from cosine.engine.vocab import FILE as VOCAB_FILE
    from cosine.engine.vocab import DraftVocab
    from cosine.zoo.registry import path_of

    if settings.threads:
        torch.set_num_threads(settings.threads)
    if settings.kind == "ngram":
        return NgramDrafter(settings.name), ""
    if settings.kind == "suffix":
        from cosine.engine.suffix import SuffixDrafter, SuffixMemory

        return SuffixDrafter(settings.name, SuffixMemory(settings.memory_tokens) if settings.memory_tokens else None), ""
    path = path_of(settings.model or "lm-2layer")
    tok_size, tok_hash = tokenizer_fingerprint(path)
    vocab = DraftVocab.load(path)  # a reduced drafting vocabulary, when the checkpoint has one
    if vocab is not None and not tok_size:
        raise ValueError(f"{path} has {VOCAB_FILE} but no tokenizer: the target's vocabulary size is unknown")
    extra = {"vocab": vocab, "target_vocab_size": tok_size if vocab is not None else 0}
    domain = settings.domain if settings.domain != "general" else _card_domain(path)
    if settings.backend == "native" or (settings.backend == "auto" and NativeLlama.supports(path)):
        # drafts are verified: a drafter's rows need not be exact, so bf16 takes its fastest matmuls
        model = NativeLlama.from_pretrained(path, device=settings.device, dtype=settings.dtype, exact_rows=False)
        return NativeLMDrafter(settings.name, model, domain, n_slots=settings.max_requests, **extra), tok_hash
    return LMDrafter(settings.name, load_causal_lm(path, settings.device, settings.dtype), domain, **extra), tok_hash


def _card_domain(path) -> str:
    """The domain written in a zoo model's card (cosine.json), else "general"."""
    import json

    from cosine.zoo.registry import CARD

    try:
        return str(json.loads((path / CARD).read_text()).get("domain") or "general")
    except (OSError, ValueError):
        return "general"


async def serve(settings: DrafterSettings) -> GrpcService:
    def register(server):
        drafter_pb2_grpc.add_DrafterServicer_to_server(servicer, server)
        return [drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name]

    async def on_stop():
        worker.shutdown()

    name = f"drafter-{settings.name}"
    service = GrpcService(name, settings, register, on_stop)
    m = service.metrics
    worker = ModelWorker(name, m.worker_busy_seconds.labels(name), m.worker_queue_depth.labels(name))
    drafter, tok_hash = await worker.load(build, settings)
    if getattr(drafter, "memory", None) is not None:
        from cosine.drafter.metrics import MemoryCollector

        m.registry.register(MemoryCollector(settings.name, drafter.memory))
    servicer = DrafterServicer(drafter, worker, tok_hash, settings.max_depth, service.tracing,
                               opened=m.requests_opened.labels(name))
    service.servicer = servicer
    capacity = settings.max_requests if settings.kind == "lm" else 0
    service.report_load = lambda: common_pb2.LoadReport(live_requests=len(servicer.open_ids), capacity=capacity,
                                                        queued=worker.pending, busy_seconds=worker.busy_s)
    await service.start()
    await service.set_ready()
    if settings.wedged_after_s:
        service.watch_liveness("the model thread", lambda: worker.running_for() < settings.wedged_after_s,
                               min(5.0, settings.wedged_after_s / 2))
    return service


def main(argv: list[str] | None = None) -> None:
    run_service(DrafterSettings, serve, argv)


if __name__ == "__main__":
    main()
