from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HiddenDtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HIDDEN_DTYPE_UNSPECIFIED: _ClassVar[HiddenDtype]
    HIDDEN_DTYPE_FLOAT16: _ClassVar[HiddenDtype]
    HIDDEN_DTYPE_BFLOAT16: _ClassVar[HiddenDtype]
    HIDDEN_DTYPE_FLOAT32: _ClassVar[HiddenDtype]
HIDDEN_DTYPE_UNSPECIFIED: HiddenDtype
HIDDEN_DTYPE_FLOAT16: HiddenDtype
HIDDEN_DTYPE_BFLOAT16: HiddenDtype
HIDDEN_DTYPE_FLOAT32: HiddenDtype

class VocabIdentity(_message.Message):
    __slots__ = ("vocab_size", "tokenizer_hash", "eos_token_ids")
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_HASH_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    vocab_size: int
    tokenizer_hash: str
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, vocab_size: _Optional[int] = ..., tokenizer_hash: _Optional[str] = ..., eos_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TreeBudget(_message.Message):
    __slots__ = ("max_nodes", "max_depth")
    MAX_NODES_FIELD_NUMBER: _ClassVar[int]
    MAX_DEPTH_FIELD_NUMBER: _ClassVar[int]
    max_nodes: int
    max_depth: int
    def __init__(self, max_nodes: _Optional[int] = ..., max_depth: _Optional[int] = ...) -> None: ...

class ProposalSampling(_message.Message):
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

class ProposeStart(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "budget", "sampling", "vocab", "target_model", "workload_tag", "corpus", "cache_scope")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    VOCAB_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODEL_FIELD_NUMBER: _ClassVar[int]
    WORKLOAD_TAG_FIELD_NUMBER: _ClassVar[int]
    CORPUS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SCOPE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    budget: TreeBudget
    sampling: ProposalSampling
    vocab: VocabIdentity
    target_model: str
    workload_tag: str
    corpus: str
    cache_scope: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., budget: _Optional[_Union[TreeBudget, _Mapping]] = ..., sampling: _Optional[_Union[ProposalSampling, _Mapping]] = ..., vocab: _Optional[_Union[VocabIdentity, _Mapping]] = ..., target_model: _Optional[str] = ..., workload_tag: _Optional[str] = ..., corpus: _Optional[str] = ..., cache_scope: _Optional[str] = ...) -> None: ...

class HiddenStateRequest(_message.Message):
    __slots__ = ("dtype",)
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    dtype: HiddenDtype
    def __init__(self, dtype: _Optional[_Union[HiddenDtype, str]] = ...) -> None: ...

class HiddenStates(_message.Message):
    __slots__ = ("dtype", "hidden_size", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: HiddenDtype
    hidden_size: int
    data: bytes
    def __init__(self, dtype: _Optional[_Union[HiddenDtype, str]] = ..., hidden_size: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class ProposeAdvance(_message.Message):
    __slots__ = ("accepted_token_ids", "budget", "hidden_states")
    ACCEPTED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    accepted_token_ids: _containers.RepeatedScalarFieldContainer[int]
    budget: TreeBudget
    hidden_states: HiddenStates
    def __init__(self, accepted_token_ids: _Optional[_Iterable[int]] = ..., budget: _Optional[_Union[TreeBudget, _Mapping]] = ..., hidden_states: _Optional[_Union[HiddenStates, _Mapping]] = ...) -> None: ...

class ProposeEnd(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LearnRequest(_message.Message):
    __slots__ = ("request_id", "cache_scope", "prompt_token_ids", "output_token_ids", "target_model")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_SCOPE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODEL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    cache_scope: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    target_model: str
    def __init__(self, request_id: _Optional[str] = ..., cache_scope: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., target_model: _Optional[str] = ...) -> None: ...

class LearnResponse(_message.Message):
    __slots__ = ("learned_tokens",)
    LEARNED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    learned_tokens: int
    def __init__(self, learned_tokens: _Optional[int] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("start", "advance", "end")
    START_FIELD_NUMBER: _ClassVar[int]
    ADVANCE_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    start: ProposeStart
    advance: ProposeAdvance
    end: ProposeEnd
    def __init__(self, start: _Optional[_Union[ProposeStart, _Mapping]] = ..., advance: _Optional[_Union[ProposeAdvance, _Mapping]] = ..., end: _Optional[_Union[ProposeEnd, _Mapping]] = ...) -> None: ...

class NodeDistribution(_message.Message):
    __slots__ = ("ids", "probs")
    IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class TokenTree(_message.Message):
    __slots__ = ("tokens", "parents", "distributions", "path_probs")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    DISTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    PATH_PROBS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    parents: _containers.RepeatedScalarFieldContainer[int]
    distributions: _containers.RepeatedCompositeFieldContainer[NodeDistribution]
    path_probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., parents: _Optional[_Iterable[int]] = ..., distributions: _Optional[_Iterable[_Union[NodeDistribution, _Mapping]]] = ..., path_probs: _Optional[_Iterable[float]] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("context_length", "tree", "hidden_states")
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    context_length: int
    tree: TokenTree
    hidden_states: HiddenStateRequest
    def __init__(self, context_length: _Optional[int] = ..., tree: _Optional[_Union[TokenTree, _Mapping]] = ..., hidden_states: _Optional[_Union[HiddenStateRequest, _Mapping]] = ...) -> None: ...
