from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RoomHold(_message.Message):
    __slots__ = ("room", "peer_id", "epoch")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    room: int
    peer_id: str
    epoch: int
    def __init__(self, room: _Optional[int] = ..., peer_id: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class RoomHeld(_message.Message):
    __slots__ = ("held", "rank_addrs")
    HELD_FIELD_NUMBER: _ClassVar[int]
    RANK_ADDRS_FIELD_NUMBER: _ClassVar[int]
    held: bool
    rank_addrs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, held: _Optional[bool] = ..., rank_addrs: _Optional[_Iterable[str]] = ...) -> None: ...

class RoomRelease(_message.Message):
    __slots__ = ("room", "peer_id", "reason")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    room: int
    peer_id: str
    reason: str
    def __init__(self, room: _Optional[int] = ..., peer_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class RoomReleased(_message.Message):
    __slots__ = ("drained", "waited_ms")
    DRAINED_FIELD_NUMBER: _ClassVar[int]
    WAITED_MS_FIELD_NUMBER: _ClassVar[int]
    drained: bool
    waited_ms: float
    def __init__(self, drained: _Optional[bool] = ..., waited_ms: _Optional[float] = ...) -> None: ...

class CacheGroup(_message.Message):
    __slots__ = ("kind", "layers", "window", "state_bytes", "latent_dim")
    KIND_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LATENT_DIM_FIELD_NUMBER: _ClassVar[int]
    kind: str
    layers: _containers.RepeatedScalarFieldContainer[int]
    window: int
    state_bytes: int
    latent_dim: int
    def __init__(self, kind: _Optional[str] = ..., layers: _Optional[_Iterable[int]] = ..., window: _Optional[int] = ..., state_bytes: _Optional[int] = ..., latent_dim: _Optional[int] = ...) -> None: ...

class LayoutContract(_message.Message):
    __slots__ = ("model_name", "model_fingerprint", "num_layers", "page_size", "num_kv_heads_total", "num_kv_heads_local", "head_dim", "dtype", "tp_rank", "tp_size", "backend", "groups", "hash", "kv_scales", "speculative", "v_layout")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_LOCAL_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    HASH_FIELD_NUMBER: _ClassVar[int]
    KV_SCALES_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    V_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    model_fingerprint: str
    num_layers: int
    page_size: int
    num_kv_heads_total: int
    num_kv_heads_local: int
    head_dim: int
    dtype: str
    tp_rank: int
    tp_size: int
    backend: str
    groups: _containers.RepeatedCompositeFieldContainer[CacheGroup]
    hash: str
    kv_scales: str
    speculative: str
    v_layout: str
    def __init__(self, model_name: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., num_layers: _Optional[int] = ..., page_size: _Optional[int] = ..., num_kv_heads_total: _Optional[int] = ..., num_kv_heads_local: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., backend: _Optional[str] = ..., groups: _Optional[_Iterable[_Union[CacheGroup, _Mapping]]] = ..., hash: _Optional[str] = ..., kv_scales: _Optional[str] = ..., speculative: _Optional[str] = ..., v_layout: _Optional[str] = ...) -> None: ...

class RoomRegistration(_message.Message):
    __slots__ = ("room", "peer_id", "epoch", "agent_name", "agent_metadata", "kv_base", "kv_nbytes", "dst_pages", "skip_pages", "num_tokens", "contract", "num_window_pages", "window_dst_pages", "num_state_slots", "state_base", "state_dst_slot")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    KV_BASE_FIELD_NUMBER: _ClassVar[int]
    KV_NBYTES_FIELD_NUMBER: _ClassVar[int]
    DST_PAGES_FIELD_NUMBER: _ClassVar[int]
    SKIP_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONTRACT_FIELD_NUMBER: _ClassVar[int]
    NUM_WINDOW_PAGES_FIELD_NUMBER: _ClassVar[int]
    WINDOW_DST_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_STATE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    STATE_BASE_FIELD_NUMBER: _ClassVar[int]
    STATE_DST_SLOT_FIELD_NUMBER: _ClassVar[int]
    room: int
    peer_id: str
    epoch: int
    agent_name: str
    agent_metadata: bytes
    kv_base: int
    kv_nbytes: int
    dst_pages: _containers.RepeatedScalarFieldContainer[int]
    skip_pages: int
    num_tokens: int
    contract: LayoutContract
    num_window_pages: int
    window_dst_pages: _containers.RepeatedScalarFieldContainer[int]
    num_state_slots: int
    state_base: int
    state_dst_slot: int
    def __init__(self, room: _Optional[int] = ..., peer_id: _Optional[str] = ..., epoch: _Optional[int] = ..., agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., kv_base: _Optional[int] = ..., kv_nbytes: _Optional[int] = ..., dst_pages: _Optional[_Iterable[int]] = ..., skip_pages: _Optional[int] = ..., num_tokens: _Optional[int] = ..., contract: _Optional[_Union[LayoutContract, _Mapping]] = ..., num_window_pages: _Optional[int] = ..., window_dst_pages: _Optional[_Iterable[int]] = ..., num_state_slots: _Optional[int] = ..., state_base: _Optional[int] = ..., state_dst_slot: _Optional[int] = ...) -> None: ...

class PageGroupChecksum(_message.Message):
    __slots__ = ("start_page", "num_pages", "crc32", "window", "state")
    START_PAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    start_page: int
    num_pages: int
    crc32: int
    window: bool
    state: bool
    def __init__(self, start_page: _Optional[int] = ..., num_pages: _Optional[int] = ..., crc32: _Optional[int] = ..., window: _Optional[bool] = ..., state: _Optional[bool] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class RoomEvent(_message.Message):
    __slots__ = ("kind", "reason", "contract", "first_token", "first_logprob", "top_logprobs", "checksums", "pages", "bytes", "duration_ms", "rank_addrs", "fault", "timed_out", "draft_hidden")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[RoomEvent.Kind]
        ACCEPTED: _ClassVar[RoomEvent.Kind]
        TRANSFERRING: _ClassVar[RoomEvent.Kind]
        DONE: _ClassVar[RoomEvent.Kind]
        FAILED: _ClassVar[RoomEvent.Kind]
        ABORTED: _ClassVar[RoomEvent.Kind]
    KIND_UNSPECIFIED: RoomEvent.Kind
    ACCEPTED: RoomEvent.Kind
    TRANSFERRING: RoomEvent.Kind
    DONE: RoomEvent.Kind
    FAILED: RoomEvent.Kind
    ABORTED: RoomEvent.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CONTRACT_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    RANK_ADDRS_FIELD_NUMBER: _ClassVar[int]
    FAULT_FIELD_NUMBER: _ClassVar[int]
    TIMED_OUT_FIELD_NUMBER: _ClassVar[int]
    DRAFT_HIDDEN_FIELD_NUMBER: _ClassVar[int]
    kind: RoomEvent.Kind
    reason: str
    contract: LayoutContract
    first_token: int
    first_logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    checksums: _containers.RepeatedCompositeFieldContainer[PageGroupChecksum]
    pages: int
    bytes: int
    duration_ms: float
    rank_addrs: _containers.RepeatedScalarFieldContainer[str]
    fault: str
    timed_out: bool
    draft_hidden: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, kind: _Optional[_Union[RoomEvent.Kind, str]] = ..., reason: _Optional[str] = ..., contract: _Optional[_Union[LayoutContract, _Mapping]] = ..., first_token: _Optional[int] = ..., first_logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ..., checksums: _Optional[_Iterable[_Union[PageGroupChecksum, _Mapping]]] = ..., pages: _Optional[int] = ..., bytes: _Optional[int] = ..., duration_ms: _Optional[float] = ..., rank_addrs: _Optional[_Iterable[str]] = ..., fault: _Optional[str] = ..., timed_out: _Optional[bool] = ..., draft_hidden: _Optional[_Iterable[float]] = ...) -> None: ...
