from pdserve.v1 import inference_pb2 as _inference_pb2
from pdserve.v1 import kv_transfer_pb2 as _kv_transfer_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_ROLE_UNSPECIFIED: _ClassVar[WorkerRole]
    WORKER_ROLE_PREFILL: _ClassVar[WorkerRole]
    WORKER_ROLE_DECODE: _ClassVar[WorkerRole]
    WORKER_ROLE_COLOCATED: _ClassVar[WorkerRole]
WORKER_ROLE_UNSPECIFIED: WorkerRole
WORKER_ROLE_PREFILL: WorkerRole
WORKER_ROLE_DECODE: WorkerRole
WORKER_ROLE_COLOCATED: WorkerRole

class KvCacheGeometry(_message.Message):
    __slots__ = ("num_layers", "num_blocks", "block_size", "width", "dtype")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_blocks: int
    block_size: int
    width: int
    dtype: _kv_transfer_pb2.KvDtype
    def __init__(self, num_layers: _Optional[int] = ..., num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., width: _Optional[int] = ..., dtype: _Optional[_Union[_kv_transfer_pb2.KvDtype, str]] = ...) -> None: ...

class GetEngineInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineInfo(_message.Message):
    __slots__ = ("role", "model", "dp_rank", "identity", "kv_cache", "compat_hash", "max_model_len", "vocab_size", "dp_size", "ep_size", "kv_cache_spec", "nixl", "max_pinned_blocks")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_FIELD_NUMBER: _ClassVar[int]
    COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    DP_SIZE_FIELD_NUMBER: _ClassVar[int]
    EP_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_SPEC_FIELD_NUMBER: _ClassVar[int]
    NIXL_FIELD_NUMBER: _ClassVar[int]
    MAX_PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    role: WorkerRole
    model: str
    dp_rank: int
    identity: _kv_transfer_pb2.KvProducer
    kv_cache: KvCacheGeometry
    compat_hash: str
    max_model_len: int
    vocab_size: int
    dp_size: int
    ep_size: int
    kv_cache_spec: _kv_transfer_pb2.KvCacheSpec
    nixl: _kv_transfer_pb2.NixlAgentInfo
    max_pinned_blocks: int
    def __init__(self, role: _Optional[_Union[WorkerRole, str]] = ..., model: _Optional[str] = ..., dp_rank: _Optional[int] = ..., identity: _Optional[_Union[_kv_transfer_pb2.KvProducer, _Mapping]] = ..., kv_cache: _Optional[_Union[KvCacheGeometry, _Mapping]] = ..., compat_hash: _Optional[str] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., dp_size: _Optional[int] = ..., ep_size: _Optional[int] = ..., kv_cache_spec: _Optional[_Union[_kv_transfer_pb2.KvCacheSpec, _Mapping]] = ..., nixl: _Optional[_Union[_kv_transfer_pb2.NixlAgentInfo, _Mapping]] = ..., max_pinned_blocks: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "lease_ms", "client")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _inference_pb2.SamplingParams
    lease_ms: int
    client: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_inference_pb2.SamplingParams, _Mapping]] = ..., lease_ms: _Optional[int] = ..., client: _Optional[str] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("output", "kv_handle", "sampler_state")
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_STATE_FIELD_NUMBER: _ClassVar[int]
    output: _inference_pb2.GenerateResponse
    kv_handle: _kv_transfer_pb2.KvHandle
    sampler_state: bytes
    def __init__(self, output: _Optional[_Union[_inference_pb2.GenerateResponse, _Mapping]] = ..., kv_handle: _Optional[_Union[_kv_transfer_pb2.KvHandle, _Mapping]] = ..., sampler_state: _Optional[bytes] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "output_token_ids", "kv_handle", "sampler_state", "kv_failure_policy", "kv_handle_mac", "subscription_id", "client")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_STATE_FIELD_NUMBER: _ClassVar[int]
    KV_FAILURE_POLICY_FIELD_NUMBER: _ClassVar[int]
    KV_HANDLE_MAC_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIPTION_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _inference_pb2.SamplingParams
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    kv_handle: _kv_transfer_pb2.KvHandle
    sampler_state: bytes
    kv_failure_policy: _inference_pb2.KvFailurePolicy
    kv_handle_mac: bytes
    subscription_id: str
    client: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_inference_pb2.SamplingParams, _Mapping]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., kv_handle: _Optional[_Union[_kv_transfer_pb2.KvHandle, _Mapping]] = ..., sampler_state: _Optional[bytes] = ..., kv_failure_policy: _Optional[_Union[_inference_pb2.KvFailurePolicy, str]] = ..., kv_handle_mac: _Optional[bytes] = ..., subscription_id: _Optional[str] = ..., client: _Optional[str] = ...) -> None: ...

class SubscribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DecodeOutputs(_message.Message):
    __slots__ = ("subscription_id", "outputs")
    SUBSCRIPTION_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    subscription_id: str
    outputs: _containers.RepeatedCompositeFieldContainer[_inference_pb2.GenerateResponse]
    def __init__(self, subscription_id: _Optional[str] = ..., outputs: _Optional[_Iterable[_Union[_inference_pb2.GenerateResponse, _Mapping]]] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Load(_message.Message):
    __slots__ = ("num_running", "num_waiting", "kv_usage", "num_free_blocks", "num_total_blocks", "num_pinned_transfers", "prefix_hit_rate", "draining")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_PINNED_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    kv_usage: float
    num_free_blocks: int
    num_total_blocks: int
    num_pinned_transfers: int
    prefix_hit_rate: float
    draining: bool
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., kv_usage: _Optional[float] = ..., num_free_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., num_pinned_transfers: _Optional[int] = ..., prefix_hit_rate: _Optional[float] = ..., draining: _Optional[bool] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("num_in_flight",)
    NUM_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    num_in_flight: int
    def __init__(self, num_in_flight: _Optional[int] = ...) -> None: ...
