from cosine.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VerifyOpen(_message.Message):
    __slots__ = ("request_id", "committed_token_ids", "sampling", "prompt_len")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    committed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    prompt_len: int
    def __init__(self, request_id: _Optional[str] = ..., committed_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., prompt_len: _Optional[int] = ...) -> None: ...

class VerifyRound(_message.Message):
    __slots__ = ("tree", "trace_context", "steps", "lookup")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TREE_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_FIELD_NUMBER: _ClassVar[int]
    tree: _common_pb2.DraftTree
    trace_context: _containers.ScalarMap[str, str]
    steps: int
    lookup: int
    def __init__(self, tree: _Optional[_Union[_common_pb2.DraftTree, _Mapping]] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., steps: _Optional[int] = ..., lookup: _Optional[int] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("open", "round")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    open: VerifyOpen
    round: VerifyRound
    def __init__(self, open: _Optional[_Union[VerifyOpen, _Mapping]] = ..., round: _Optional[_Union[VerifyRound, _Mapping]] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("token_ids", "accepted_draft", "verify_ms", "lookup_drafted", "lookup_accepted")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFT_FIELD_NUMBER: _ClassVar[int]
    VERIFY_MS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    accepted_draft: int
    verify_ms: float
    lookup_drafted: int
    lookup_accepted: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., accepted_draft: _Optional[int] = ..., verify_ms: _Optional[float] = ..., lookup_drafted: _Optional[int] = ..., lookup_accepted: _Optional[int] = ...) -> None: ...

class VerifyRelease(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class VerifyOpened(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class VerifyEntry(_message.Message):
    __slots__ = ("request_id", "open", "round", "release")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    open: VerifyOpen
    round: VerifyRound
    release: VerifyRelease
    def __init__(self, request_id: _Optional[str] = ..., open: _Optional[_Union[VerifyOpen, _Mapping]] = ..., round: _Optional[_Union[VerifyRound, _Mapping]] = ..., release: _Optional[_Union[VerifyRelease, _Mapping]] = ...) -> None: ...

class VerifyStep(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[VerifyEntry]
    def __init__(self, entries: _Optional[_Iterable[_Union[VerifyEntry, _Mapping]]] = ...) -> None: ...

class VerifyEntryError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class VerifyEntryResult(_message.Message):
    __slots__ = ("request_id", "opened", "verdict", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OPENED_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    opened: VerifyOpened
    verdict: VerifyResponse
    error: VerifyEntryError
    def __init__(self, request_id: _Optional[str] = ..., opened: _Optional[_Union[VerifyOpened, _Mapping]] = ..., verdict: _Optional[_Union[VerifyResponse, _Mapping]] = ..., error: _Optional[_Union[VerifyEntryError, _Mapping]] = ...) -> None: ...

class VerifyStepResult(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[VerifyEntryResult]
    def __init__(self, results: _Optional[_Iterable[_Union[VerifyEntryResult, _Mapping]]] = ...) -> None: ...
