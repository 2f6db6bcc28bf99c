from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FusionMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FUSION_MODE_UNSPECIFIED: _ClassVar[FusionMode]
    FUSION_MODE_CONFIDENCE: _ClassVar[FusionMode]
    FUSION_MODE_MERGE: _ClassVar[FusionMode]
    FUSION_MODE_SINGLE: _ClassVar[FusionMode]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_CONTEXT: _ClassVar[FinishReason]
FUSION_MODE_UNSPECIFIED: FusionMode
FUSION_MODE_CONFIDENCE: FusionMode
FUSION_MODE_MERGE: FusionMode
FUSION_MODE_SINGLE: FusionMode
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_EOS: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_CONTEXT: FinishReason

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class SpeculationParams(_message.Message):
    __slots__ = ("disabled", "drafters", "max_depth", "fusion", "routing", "adaptive_depth", "pipelining")
    DISABLED_FIELD_NUMBER: _ClassVar[int]
    DRAFTERS_FIELD_NUMBER: _ClassVar[int]
    MAX_DEPTH_FIELD_NUMBER: _ClassVar[int]
    FUSION_FIELD_NUMBER: _ClassVar[int]
    ROUTING_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    PIPELINING_FIELD_NUMBER: _ClassVar[int]
    disabled: bool
    drafters: _containers.RepeatedScalarFieldContainer[str]
    max_depth: int
    fusion: FusionMode
    routing: bool
    adaptive_depth: bool
    pipelining: bool
    def __init__(self, disabled: _Optional[bool] = ..., drafters: _Optional[_Iterable[str]] = ..., max_depth: _Optional[int] = ..., fusion: _Optional[_Union[FusionMode, str]] = ..., routing: _Optional[bool] = ..., adaptive_depth: _Optional[bool] = ..., pipelining: _Optional[bool] = ...) -> None: ...

class Stats(_message.Message):
    __slots__ = ("rounds", "drafted_tokens", "accepted_tokens", "drafters", "lookup_drafted_tokens", "lookup_accepted_tokens")
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFTERS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    rounds: int
    drafted_tokens: int
    accepted_tokens: int
    drafters: _containers.RepeatedScalarFieldContainer[str]
    lookup_drafted_tokens: int
    lookup_accepted_tokens: int
    def __init__(self, rounds: _Optional[int] = ..., drafted_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., drafters: _Optional[_Iterable[str]] = ..., lookup_drafted_tokens: _Optional[int] = ..., lookup_accepted_tokens: _Optional[int] = ...) -> None: ...

class DraftTree(_message.Message):
    __slots__ = ("token_ids", "parents", "probs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    parents: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., parents: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "kind", "vocab_size", "tokenizer_hash", "max_context", "domain")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_HASH_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    DOMAIN_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: str
    vocab_size: int
    tokenizer_hash: str
    max_context: int
    domain: str
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[str] = ..., vocab_size: _Optional[int] = ..., tokenizer_hash: _Optional[str] = ..., max_context: _Optional[int] = ..., domain: _Optional[str] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PromptFit(_message.Message):
    __slots__ = ("drafter", "positions", "hits", "confidence_sum", "logprob_sum", "has_logprob")
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_SUM_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_SUM_FIELD_NUMBER: _ClassVar[int]
    HAS_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    drafter: str
    positions: int
    hits: int
    confidence_sum: float
    logprob_sum: float
    has_logprob: bool
    def __init__(self, drafter: _Optional[str] = ..., positions: _Optional[int] = ..., hits: _Optional[int] = ..., confidence_sum: _Optional[float] = ..., logprob_sum: _Optional[float] = ..., has_logprob: _Optional[bool] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("ready", "live_requests", "capacity", "queued", "busy_seconds")
    READY_FIELD_NUMBER: _ClassVar[int]
    LIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    BUSY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    live_requests: int
    capacity: int
    queued: int
    busy_seconds: float
    def __init__(self, ready: _Optional[bool] = ..., live_requests: _Optional[int] = ..., capacity: _Optional[int] = ..., queued: _Optional[int] = ..., busy_seconds: _Optional[float] = ...) -> None: ...
