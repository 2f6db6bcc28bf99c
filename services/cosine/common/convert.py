"""The one conversion between the protos' sampling parameters and fusion modes and the domain's.

Every service that reads or writes them goes through here: the router (a request's sampling), the
scheduler (what it keeps in Redis and hands to the verifier on a resume), the verifier (the token
choice) and fusion (how drafts are fused).
"""

from __future__ import annotations

from dataclasses import asdict

from cosine.common.v1 import common_pb2
from cosine.engine.sampling import Sampling

# the fusion modes by their domain names ("confidence", "merge", "single"; cosine.scheduler.switches)
FUSION_MODE_PROTO: dict[str, int] = {"confidence": common_pb2.FUSION_MODE_CONFIDENCE, "merge": common_pb2.FUSION_MODE_MERGE,
                                     "single": common_pb2.FUSION_MODE_SINGLE}
FUSION_MODE_NAME: dict[int, str] = {v: k for k, v in FUSION_MODE_PROTO.items()}


def fusion_mode_name(value: int, unspecified: str | None = None) -> str:
    """A FusionMode enum value as its domain name; FUSION_MODE_UNSPECIFIED gives ``unspecified``.
    Raises ValueError for a value that is no mode (or unspecified when ``unspecified`` is None)."""
    if value == common_pb2.FUSION_MODE_UNSPECIFIED and unspecified is not None:
        return unspecified
    try:
        return FUSION_MODE_NAME[value]
    except KeyError:
        raise ValueError(f"fusion must be one of {sorted(FUSION_MODE_NAME)} ({', '.join(FUSION_MODE_PROTO)}), got {value}") from None


def sampling_from_proto(msg: common_pb2.SamplingParams, default_seed: int = 0) -> Sampling:
    """The request's sampling; an unset top_p is 1 (off), an unset seed ``default_seed``."""
    return Sampling(temperature=msg.temperature, top_p=msg.top_p if msg.HasField("top_p") else 1.0, top_k=msg.top_k,
                    seed=msg.seed if msg.HasField("seed") else default_seed)


def sampling_to_proto(sampling: Sampling) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                                     seed=sampling.seed)


def sampling_to_dict(sampling: Sampling) -> dict:
    """JSON-safe, as Redis keeps it with the request."""
    return asdict(sampling)


def sampling_from_dict(data: dict) -> Sampling:
    fields = Sampling.__dataclass_fields__
    return Sampling(**{k: v for k, v in data.items() if k in fields})
