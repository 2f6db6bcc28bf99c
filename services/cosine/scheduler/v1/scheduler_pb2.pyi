from cosine.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SubmitRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "max_new_tokens", "sampling", "speculation", "stop_token_ids", "candidate_drafters", "resume", "resume_from")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_DRAFTERS_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    RESUME_FROM_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens: int
    sampling: _common_pb2.SamplingParams
    speculation: _common_pb2.SpeculationParams
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    candidate_drafters: _containers.RepeatedScalarFieldContainer[str]
    resume: bool
    resume_from: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., max_new_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., speculation: _Optional[_Union[_common_pb2.SpeculationParams, _Mapping]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., candidate_drafters: _Optional[_Iterable[str]] = ..., resume: _Optional[bool] = ..., resume_from: _Optional[int] = ...) -> None: ...

class CommittedTokens(_message.Message):
    __slots__ = ("token_ids", "drafted_tokens", "accepted_tokens", "start_index")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    START_INDEX_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    drafted_tokens: int
    accepted_tokens: int
    start_index: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., drafted_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., start_index: _Optional[int] = ...) -> None: ...

class Handover(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class SubmitFinal(_message.Message):
    __slots__ = ("finish_reason", "stats")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    finish_reason: _common_pb2.FinishReason
    stats: _common_pb2.Stats
    def __init__(self, finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., stats: _Optional[_Union[_common_pb2.Stats, _Mapping]] = ...) -> None: ...

class SubmitResponse(_message.Message):
    __slots__ = ("request_id", "tokens", "final", "handover")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    HANDOVER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tokens: CommittedTokens
    final: SubmitFinal
    handover: Handover
    def __init__(self, request_id: _Optional[str] = ..., tokens: _Optional[_Union[CommittedTokens, _Mapping]] = ..., final: _Optional[_Union[SubmitFinal, _Mapping]] = ..., handover: _Optional[_Union[Handover, _Mapping]] = ...) -> None: ...
