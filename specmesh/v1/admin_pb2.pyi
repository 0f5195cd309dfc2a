from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PolicyMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POLICY_MODE_UNSPECIFIED: _ClassVar[PolicyMode]
    POLICY_MODE_AUTO: _ClassVar[PolicyMode]
    POLICY_MODE_FIXED: _ClassVar[PolicyMode]
    POLICY_MODE_OFF: _ClassVar[PolicyMode]
POLICY_MODE_UNSPECIFIED: PolicyMode
POLICY_MODE_AUTO: PolicyMode
POLICY_MODE_FIXED: PolicyMode
POLICY_MODE_OFF: PolicyMode

class SpeculationPolicy(_message.Message):
    __slots__ = ("mode", "proposer", "num_speculative_tokens", "max_tree_nodes")
    MODE_FIELD_NUMBER: _ClassVar[int]
    PROPOSER_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    mode: PolicyMode
    proposer: str
    num_speculative_tokens: int
    max_tree_nodes: int
    def __init__(self, mode: _Optional[_Union[PolicyMode, str]] = ..., proposer: _Optional[str] = ..., num_speculative_tokens: _Optional[int] = ..., max_tree_nodes: _Optional[int] = ...) -> None: ...

class ServerStats(_message.Message):
    __slots__ = ("model", "device", "dtype", "running_requests", "waiting_requests", "finished_requests", "rejected_requests", "cancelled_requests", "prompt_tokens", "generated_tokens", "steps", "max_running_requests", "max_context_tokens", "preempted_requests", "kv_blocks", "kv_block_size", "kv_blocks_in_use", "kv_blocks_cached", "prefix_cache_queries", "prefix_cache_hits", "kv_evictions")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_IN_USE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_CACHED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    KV_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    model: str
    device: str
    dtype: str
    running_requests: int
    waiting_requests: int
    finished_requests: int
    rejected_requests: int
    cancelled_requests: int
    prompt_tokens: int
    generated_tokens: int
    steps: int
    max_running_requests: int
    max_context_tokens: int
    preempted_requests: int
    kv_blocks: int
    kv_block_size: int
    kv_blocks_in_use: int
    kv_blocks_cached: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    kv_evictions: int
    def __init__(self, model: _Optional[str] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., running_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., finished_requests: _Optional[int] = ..., rejected_requests: _Optional[int] = ..., cancelled_requests: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., steps: _Optional[int] = ..., max_running_requests: _Optional[int] = ..., max_context_tokens: _Optional[int] = ..., preempted_requests: _Optional[int] = ..., kv_blocks: _Optional[int] = ..., kv_block_size: _Optional[int] = ..., kv_blocks_in_use: _Optional[int] = ..., kv_blocks_cached: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., kv_evictions: _Optional[int] = ...) -> None: ...

class ProposerStats(_message.Message):
    __slots__ = ("proposer", "workload_tag", "steps", "drafted_tokens", "accepted_tokens", "invalid_trees", "fallbacks")
    PROPOSER_FIELD_NUMBER: _ClassVar[int]
    WORKLOAD_TAG_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INVALID_TREES_FIELD_NUMBER: _ClassVar[int]
    FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    proposer: str
    workload_tag: str
    steps: int
    drafted_tokens: int
    accepted_tokens: int
    invalid_trees: int
    fallbacks: int
    def __init__(self, proposer: _Optional[str] = ..., workload_tag: _Optional[str] = ..., steps: _Optional[int] = ..., drafted_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., invalid_trees: _Optional[int] = ..., fallbacks: _Optional[int] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("server", "proposers", "policy")
    SERVER_FIELD_NUMBER: _ClassVar[int]
    PROPOSERS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    server: ServerStats
    proposers: _containers.RepeatedCompositeFieldContainer[ProposerStats]
    policy: SpeculationPolicy
    def __init__(self, server: _Optional[_Union[ServerStats, _Mapping]] = ..., proposers: _Optional[_Iterable[_Union[ProposerStats, _Mapping]]] = ..., policy: _Optional[_Union[SpeculationPolicy, _Mapping]] = ...) -> None: ...

class GetPolicyRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetPolicyResponse(_message.Message):
    __slots__ = ("policy",)
    POLICY_FIELD_NUMBER: _ClassVar[int]
    policy: SpeculationPolicy
    def __init__(self, policy: _Optional[_Union[SpeculationPolicy, _Mapping]] = ...) -> None: ...

class SetPolicyRequest(_message.Message):
    __slots__ = ("policy",)
    POLICY_FIELD_NUMBER: _ClassVar[int]
    policy: SpeculationPolicy
    def __init__(self, policy: _Optional[_Union[SpeculationPolicy, _Mapping]] = ...) -> None: ...

class SetPolicyResponse(_message.Message):
    __slots__ = ("policy",)
    POLICY_FIELD_NUMBER: _ClassVar[int]
    policy: SpeculationPolicy
    def __init__(self, policy: _Optional[_Union[SpeculationPolicy, _Mapping]] = ...) -> None: ...

class GetRouterStatsRequest(_message.Message):
    __slots__ = ("proposer", "workload_tag", "model")
    PROPOSER_FIELD_NUMBER: _ClassVar[int]
    WORKLOAD_TAG_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    proposer: str
    workload_tag: str
    model: str
    def __init__(self, proposer: _Optional[str] = ..., workload_tag: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...

class RouterStats(_message.Message):
    __slots__ = ("model", "proposer", "workload_tag", "steps", "drafted_tokens", "accepted_tokens", "accepted_per_step", "drafted_per_step", "proposer_wait_ms_per_step", "position_trials", "position_accepted", "position_ends", "coverage", "served_steps", "served_tokens_per_step", "served_tokens_per_s", "served_steps_by_batch", "served_tokens_per_s_by_batch")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROPOSER_FIELD_NUMBER: _ClassVar[int]
    WORKLOAD_TAG_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    PROPOSER_WAIT_MS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    POSITION_TRIALS_FIELD_NUMBER: _ClassVar[int]
    POSITION_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    POSITION_ENDS_FIELD_NUMBER: _ClassVar[int]
    COVERAGE_FIELD_NUMBER: _ClassVar[int]
    SERVED_STEPS_FIELD_NUMBER: _ClassVar[int]
    SERVED_TOKENS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    SERVED_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    SERVED_STEPS_BY_BATCH_FIELD_NUMBER: _ClassVar[int]
    SERVED_TOKENS_PER_S_BY_BATCH_FIELD_NUMBER: _ClassVar[int]
    model: str
    proposer: str
    workload_tag: str
    steps: float
    drafted_tokens: float
    accepted_tokens: float
    accepted_per_step: float
    drafted_per_step: float
    proposer_wait_ms_per_step: float
    position_trials: _containers.RepeatedScalarFieldContainer[float]
    position_accepted: _containers.RepeatedScalarFieldContainer[float]
    position_ends: _containers.RepeatedScalarFieldContainer[float]
    coverage: float
    served_steps: float
    served_tokens_per_step: float
    served_tokens_per_s: float
    served_steps_by_batch: _containers.RepeatedScalarFieldContainer[float]
    served_tokens_per_s_by_batch: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, model: _Optional[str] = ..., proposer: _Optional[str] = ..., workload_tag: _Optional[str] = ..., steps: _Optional[float] = ..., drafted_tokens: _Optional[float] = ..., accepted_tokens: _Optional[float] = ..., accepted_per_step: _Optional[float] = ..., drafted_per_step: _Optional[float] = ..., proposer_wait_ms_per_step: _Optional[float] = ..., position_trials: _Optional[_Iterable[float]] = ..., position_accepted: _Optional[_Iterable[float]] = ..., position_ends: _Optional[_Iterable[float]] = ..., coverage: _Optional[float] = ..., served_steps: _Optional[float] = ..., served_tokens_per_step: _Optional[float] = ..., served_tokens_per_s: _Optional[float] = ..., served_steps_by_batch: _Optional[_Iterable[float]] = ..., served_tokens_per_s_by_batch: _Optional[_Iterable[float]] = ...) -> None: ...

class GetRouterStatsResponse(_message.Message):
    __slots__ = ("backend", "connected", "detail", "half_life_s", "stats")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    HALF_LIFE_S_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    backend: str
    connected: bool
    detail: str
    half_life_s: float
    stats: _containers.RepeatedCompositeFieldContainer[RouterStats]
    def __init__(self, backend: _Optional[str] = ..., connected: _Optional[bool] = ..., detail: _Optional[str] = ..., half_life_s: _Optional[float] = ..., stats: _Optional[_Iterable[_Union[RouterStats, _Mapping]]] = ...) -> None: ...
