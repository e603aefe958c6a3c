from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KvDtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_DTYPE_UNSPECIFIED: _ClassVar[KvDtype]
    KV_DTYPE_FLOAT32: _ClassVar[KvDtype]
    KV_DTYPE_BFLOAT16: _ClassVar[KvDtype]
    KV_DTYPE_FLOAT16: _ClassVar[KvDtype]
    KV_DTYPE_FLOAT8_E4M3: _ClassVar[KvDtype]

class ReleaseReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RELEASE_REASON_UNSPECIFIED: _ClassVar[ReleaseReason]
    RELEASE_REASON_DONE: _ClassVar[ReleaseReason]
    RELEASE_REASON_ABORT: _ClassVar[ReleaseReason]
KV_DTYPE_UNSPECIFIED: KvDtype
KV_DTYPE_FLOAT32: KvDtype
KV_DTYPE_BFLOAT16: KvDtype
KV_DTYPE_FLOAT16: KvDtype
KV_DTYPE_FLOAT8_E4M3: KvDtype
RELEASE_REASON_UNSPECIFIED: ReleaseReason
RELEASE_REASON_DONE: ReleaseReason
RELEASE_REASON_ABORT: ReleaseReason

class KvProducer(_message.Message):
    __slots__ = ("engine_id", "epoch", "dp_rank", "endpoint")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    epoch: int
    dp_rank: int
    endpoint: str
    def __init__(self, engine_id: _Optional[str] = ..., epoch: _Optional[int] = ..., dp_rank: _Optional[int] = ..., endpoint: _Optional[str] = ...) -> None: ...

class KvHandle(_message.Message):
    __slots__ = ("transfer_id", "producer", "block_hashes", "num_tokens", "num_blocks", "block_size", "lease_expiry_unix_ms", "compat_hash", "block_ids", "block_checksums")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRY_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    producer: KvProducer
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    num_tokens: int
    num_blocks: int
    block_size: int
    lease_expiry_unix_ms: int
    compat_hash: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    block_checksums: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, transfer_id: _Optional[str] = ..., producer: _Optional[_Union[KvProducer, _Mapping]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., num_tokens: _Optional[int] = ..., num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., lease_expiry_unix_ms: _Optional[int] = ..., compat_hash: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., block_checksums: _Optional[_Iterable[int]] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("transfer_id", "epoch", "first_block", "max_chunk_bytes")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    epoch: int
    first_block: int
    max_chunk_bytes: int
    def __init__(self, transfer_id: _Optional[str] = ..., epoch: _Optional[int] = ..., first_block: _Optional[int] = ..., max_chunk_bytes: _Optional[int] = ...) -> None: ...

class BeginReadRequest(_message.Message):
    __slots__ = ("transfer_id", "epoch", "first_block", "read_timeout_ms")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    READ_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    epoch: int
    first_block: int
    read_timeout_ms: int
    def __init__(self, transfer_id: _Optional[str] = ..., epoch: _Optional[int] = ..., first_block: _Optional[int] = ..., read_timeout_ms: _Optional[int] = ...) -> None: ...

class BeginReadResponse(_message.Message):
    __slots__ = ("block_ids", "block_checksums", "read_deadline_unix_ms", "read_hold_ms")
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    READ_DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    READ_HOLD_MS_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    block_checksums: _containers.RepeatedScalarFieldContainer[int]
    read_deadline_unix_ms: int
    read_hold_ms: int
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ..., block_checksums: _Optional[_Iterable[int]] = ..., read_deadline_unix_ms: _Optional[int] = ..., read_hold_ms: _Optional[int] = ...) -> None: ...

class NixlRegion(_message.Message):
    __slots__ = ("addr", "length", "device_id")
    ADDR_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    addr: int
    length: int
    device_id: int
    def __init__(self, addr: _Optional[int] = ..., length: _Optional[int] = ..., device_id: _Optional[int] = ...) -> None: ...

class NixlAgentInfo(_message.Message):
    __slots__ = ("agent_name", "metadata", "regions", "mem_type", "num_blocks", "checksums", "table_blocks")
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    MEM_TYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    TABLE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    agent_name: str
    metadata: bytes
    regions: _containers.RepeatedCompositeFieldContainer[NixlRegion]
    mem_type: str
    num_blocks: int
    checksums: bool
    table_blocks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, agent_name: _Optional[str] = ..., metadata: _Optional[bytes] = ..., regions: _Optional[_Iterable[_Union[NixlRegion, _Mapping]]] = ..., mem_type: _Optional[str] = ..., num_blocks: _Optional[int] = ..., checksums: _Optional[bool] = ..., table_blocks: _Optional[_Iterable[int]] = ...) -> None: ...

class KvCacheGroup(_message.Message):
    __slots__ = ("kind", "layers", "block_size", "width", "dtype", "rope_width", "rotary_layout", "tokens_per_entry", "rope_offset", "scale", "window")
    KIND_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ROPE_WIDTH_FIELD_NUMBER: _ClassVar[int]
    ROTARY_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_ENTRY_FIELD_NUMBER: _ClassVar[int]
    ROPE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    kind: str
    layers: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    width: int
    dtype: KvDtype
    rope_width: int
    rotary_layout: str
    tokens_per_entry: int
    rope_offset: int
    scale: str
    window: int
    def __init__(self, kind: _Optional[str] = ..., layers: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., width: _Optional[int] = ..., dtype: _Optional[_Union[KvDtype, str]] = ..., rope_width: _Optional[int] = ..., rotary_layout: _Optional[str] = ..., tokens_per_entry: _Optional[int] = ..., rope_offset: _Optional[int] = ..., scale: _Optional[str] = ..., window: _Optional[int] = ...) -> None: ...

class KvState(_message.Message):
    __slots__ = ("name", "layers", "shape", "dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    layers: _containers.RepeatedScalarFieldContainer[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: KvDtype
    def __init__(self, name: _Optional[str] = ..., layers: _Optional[_Iterable[int]] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[KvDtype, str]] = ...) -> None: ...

class KvCacheSpec(_message.Message):
    __slots__ = ("groups", "model_fingerprint", "states")
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[KvCacheGroup]
    model_fingerprint: str
    states: _containers.RepeatedCompositeFieldContainer[KvState]
    def __init__(self, groups: _Optional[_Iterable[_Union[KvCacheGroup, _Mapping]]] = ..., model_fingerprint: _Optional[str] = ..., states: _Optional[_Iterable[_Union[KvState, _Mapping]]] = ...) -> None: ...

class KvChunk(_message.Message):
    __slots__ = ("layer_start", "num_layers", "block_start", "num_blocks", "dtype", "shape", "data", "crc32", "state")
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_START_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    layer_start: int
    num_layers: int
    block_start: int
    num_blocks: int
    dtype: KvDtype
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    crc32: int
    state: int
    def __init__(self, layer_start: _Optional[int] = ..., num_layers: _Optional[int] = ..., block_start: _Optional[int] = ..., num_blocks: _Optional[int] = ..., dtype: _Optional[_Union[KvDtype, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., crc32: _Optional[int] = ..., state: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("transfer_id", "reason")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    reason: ReleaseReason
    def __init__(self, transfer_id: _Optional[str] = ..., reason: _Optional[_Union[ReleaseReason, str]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RenewLeaseRequest(_message.Message):
    __slots__ = ("transfer_id", "lease_ms")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    lease_ms: int
    def __init__(self, transfer_id: _Optional[str] = ..., lease_ms: _Optional[int] = ...) -> None: ...

class RenewLeaseResponse(_message.Message):
    __slots__ = ("lease_expiry_unix_ms",)
    LEASE_EXPIRY_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    lease_expiry_unix_ms: int
    def __init__(self, lease_expiry_unix_ms: _Optional[int] = ...) -> None: ...
