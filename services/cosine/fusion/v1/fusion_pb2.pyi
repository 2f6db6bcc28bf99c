from cosine.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SpeculateOpen(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "drafters", "fusion", "score_prompt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFTERS_FIELD_NUMBER: _ClassVar[int]
    FUSION_FIELD_NUMBER: _ClassVar[int]
    SCORE_PROMPT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    drafters: _containers.RepeatedScalarFieldContainer[str]
    fusion: _common_pb2.FusionMode
    score_prompt: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., drafters: _Optional[_Iterable[str]] = ..., fusion: _Optional[_Union[_common_pb2.FusionMode, str]] = ..., score_prompt: _Optional[bool] = ...) -> None: ...

class SpeculateRound(_message.Message):
    __slots__ = ("committed_token_ids", "depth", "trace_context", "drafters", "budget", "context_token_ids")
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
    DRAFTERS_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    committed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    depth: int
    trace_context: _containers.ScalarMap[str, str]
    drafters: _containers.RepeatedScalarFieldContainer[str]
    budget: int
    context_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, committed_token_ids: _Optional[_Iterable[int]] = ..., depth: _Optional[int] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., drafters: _Optional[_Iterable[str]] = ..., budget: _Optional[int] = ..., context_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SpeculateRequest(_message.Message):
    __slots__ = ("open", "round")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    open: SpeculateOpen
    round: SpeculateRound
    def __init__(self, open: _Optional[_Union[SpeculateOpen, _Mapping]] = ..., round: _Optional[_Union[SpeculateRound, _Mapping]] = ...) -> None: ...

class SpeculateResponse(_message.Message):
    __slots__ = ("tree", "draft_ms", "proposals", "fused_token_ids", "prompt_fits")
    TREE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MS_FIELD_NUMBER: _ClassVar[int]
    PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    FUSED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FITS_FIELD_NUMBER: _ClassVar[int]
    tree: _common_pb2.DraftTree
    draft_ms: float
    proposals: _containers.RepeatedCompositeFieldContainer[DrafterProposal]
    fused_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_fits: _containers.RepeatedCompositeFieldContainer[_common_pb2.PromptFit]
    def __init__(self, tree: _Optional[_Union[_common_pb2.DraftTree, _Mapping]] = ..., draft_ms: _Optional[float] = ..., proposals: _Optional[_Iterable[_Union[DrafterProposal, _Mapping]]] = ..., fused_token_ids: _Optional[_Iterable[int]] = ..., prompt_fits: _Optional[_Iterable[_Union[_common_pb2.PromptFit, _Mapping]]] = ...) -> None: ...

class DrafterProposal(_message.Message):
    __slots__ = ("drafter", "token_ids", "probs")
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    drafter: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, drafter: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class DrafterList(_message.Message):
    __slots__ = ("drafters",)
    DRAFTERS_FIELD_NUMBER: _ClassVar[int]
    drafters: _containers.RepeatedCompositeFieldContainer[_common_pb2.ModelInfo]
    def __init__(self, drafters: _Optional[_Iterable[_Union[_common_pb2.ModelInfo, _Mapping]]] = ...) -> None: ...
