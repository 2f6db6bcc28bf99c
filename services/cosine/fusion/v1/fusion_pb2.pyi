from cosine.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SpeculateOpen(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "drafters")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFTERS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    drafters: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., drafters: _Optional[_Iterable[str]] = ...) -> None: ...

class SpeculateRound(_message.Message):
    __slots__ = ("committed_token_ids", "depth", "trace_context")
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
    committed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    depth: int
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, committed_token_ids: _Optional[_Iterable[int]] = ..., depth: _Optional[int] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class SpeculateRequest(_message.Message):
    __slots__ = ("open", "round")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    open: SpeculateOpen
    round: SpeculateRound
    def __init__(self, open: _Optional[_Union[SpeculateOpen, _Mapping]] = ..., round: _Optional[_Union[SpeculateRound, _Mapping]] = ...) -> None: ...

class SpeculateResponse(_message.Message):
    __slots__ = ("tree", "draft_ms")
    TREE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MS_FIELD_NUMBER: _ClassVar[int]
    tree: _common_pb2.DraftTree
    draft_ms: float
    def __init__(self, tree: _Optional[_Union[_common_pb2.DraftTree, _Mapping]] = ..., draft_ms: _Optional[float] = ...) -> None: ...

class DrafterList(_message.Message):
    __slots__ = ("drafters",)
    DRAFTERS_FIELD_NUMBER: _ClassVar[int]
    drafters: _containers.RepeatedCompositeFieldContainer[_common_pb2.ModelInfo]
    def __init__(self, drafters: _Optional[_Iterable[_Union[_common_pb2.ModelInfo, _Mapping]]] = ...) -> None: ...
