from cosine.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftOpen(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "score_prompt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SCORE_PROMPT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    score_prompt: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., score_prompt: _Optional[bool] = ...) -> None: ...

class DraftStep(_message.Message):
    __slots__ = ("committed_token_ids", "depth", "trace_context", "context_token_ids", "top_k")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    COMMITTED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    committed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    depth: int
    trace_context: _containers.ScalarMap[str, str]
    context_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_k: int
    def __init__(self, committed_token_ids: _Optional[_Iterable[int]] = ..., depth: _Optional[int] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., context_token_ids: _Optional[_Iterable[int]] = ..., top_k: _Optional[int] = ...) -> None: ...

class DraftRequest(_message.Message):
    __slots__ = ("open", "step")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    open: DraftOpen
    step: DraftStep
    def __init__(self, open: _Optional[_Union[DraftOpen, _Mapping]] = ..., step: _Optional[_Union[DraftStep, _Mapping]] = ...) -> None: ...

class Candidates(_message.Message):
    __slots__ = ("token_ids", "probs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class DraftResponse(_message.Message):
    __slots__ = ("token_ids", "probs", "candidates", "prompt_fit")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIT_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    candidates: _containers.RepeatedCompositeFieldContainer[Candidates]
    prompt_fit: _common_pb2.PromptFit
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ..., candidates: _Optional[_Iterable[_Union[Candidates, _Mapping]]] = ..., prompt_fit: _Optional[_Union[_common_pb2.PromptFit, _Mapping]] = ...) -> None: ...
