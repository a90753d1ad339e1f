from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "min_p", "seed", "max_tokens", "min_tokens", "stop_token_ids", "ignore_eos", "top_logprobs", "logprobs", "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "structured")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    max_tokens: int
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    top_logprobs: int
    logprobs: bool
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    structured: StructuredOutput
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., logprobs: _Optional[bool] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., structured: _Optional[_Union[StructuredOutput, _Mapping]] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice", "ebnf", "structural_tag")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    EBNF_FIELD_NUMBER: _ClassVar[int]
    STRUCTURAL_TAG_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    choice: ChoiceList
    ebnf: str
    structural_tag: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[ChoiceList, _Mapping]] = ..., ebnf: _Optional[str] = ..., structural_tag: _Optional[str] = ...) -> None: ...

class ChoiceList(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class DisaggParams(_message.Message):
    __slots__ = ("room", "bootstrap_addr")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    BOOTSTRAP_ADDR_FIELD_NUMBER: _ClassVar[int]
    room: int
    bootstrap_addr: str
    def __init__(self, room: _Optional[int] = ..., bootstrap_addr: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "disagg", "attempt_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DISAGG_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    disagg: DisaggParams
    attempt_id: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., disagg: _Optional[_Union[DisaggParams, _Mapping]] = ..., attempt_id: _Optional[str] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "logprobs", "finish_reason", "num_prompt_tokens", "num_cached_tokens", "transfer")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    finish_reason: str
    num_prompt_tokens: int
    num_cached_tokens: int
    transfer: TransferStats
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., transfer: _Optional[_Union[TransferStats, _Mapping]] = ...) -> None: ...

class TransferStats(_message.Message):
    __slots__ = ("pages", "bytes", "duration_ms")
    PAGES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    pages: int
    bytes: int
    duration_ms: float
    def __init__(self, pages: _Optional[int] = ..., bytes: _Optional[int] = ..., duration_ms: _Optional[float] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id", "room", "attempt_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ROOM_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    room: int
    attempt_id: str
    def __init__(self, request_id: _Optional[str] = ..., room: _Optional[int] = ..., attempt_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Load(_message.Message):
    __slots__ = ("running", "waiting", "kv_used_pages", "kv_total_pages", "kv_cached_pages", "rooms", "transfer_bytes", "transfer_pages", "prompt_tokens_computed", "kv_window_used_pages", "dp_groups", "spec")
    class RoomsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_USED_PAGES_FIELD_NUMBER: _ClassVar[int]
    KV_TOTAL_PAGES_FIELD_NUMBER: _ClassVar[int]
    KV_CACHED_PAGES_FIELD_NUMBER: _ClassVar[int]
    ROOMS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_PAGES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    KV_WINDOW_USED_PAGES_FIELD_NUMBER: _ClassVar[int]
    DP_GROUPS_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    running: int
    waiting: int
    kv_used_pages: int
    kv_total_pages: int
    kv_cached_pages: int
    rooms: _containers.ScalarMap[str, int]
    transfer_bytes: int
    transfer_pages: int
    prompt_tokens_computed: int
    kv_window_used_pages: int
    dp_groups: _containers.RepeatedCompositeFieldContainer[GroupLoad]
    spec: SpecLoad
    def __init__(self, running: _Optional[int] = ..., waiting: _Optional[int] = ..., kv_used_pages: _Optional[int] = ..., kv_total_pages: _Optional[int] = ..., kv_cached_pages: _Optional[int] = ..., rooms: _Optional[_Mapping[str, int]] = ..., transfer_bytes: _Optional[int] = ..., transfer_pages: _Optional[int] = ..., prompt_tokens_computed: _Optional[int] = ..., kv_window_used_pages: _Optional[int] = ..., dp_groups: _Optional[_Iterable[_Union[GroupLoad, _Mapping]]] = ..., spec: _Optional[_Union[SpecLoad, _Mapping]] = ...) -> None: ...

class GroupLoad(_message.Message):
    __slots__ = ("running", "waiting", "kv_used_pages", "kv_total_pages", "prompt_tokens_computed")
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_USED_PAGES_FIELD_NUMBER: _ClassVar[int]
    KV_TOTAL_PAGES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    running: int
    waiting: int
    kv_used_pages: int
    kv_total_pages: int
    prompt_tokens_computed: int
    def __init__(self, running: _Optional[int] = ..., waiting: _Optional[int] = ..., kv_used_pages: _Optional[int] = ..., kv_total_pages: _Optional[int] = ..., prompt_tokens_computed: _Optional[int] = ...) -> None: ...

class SpecLoad(_message.Message):
    __slots__ = ("draft_tokens", "accepted_tokens", "request_steps", "verify_steps", "draft_seconds", "verify_seconds", "accepted_hist")
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_STEPS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_STEPS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_HIST_FIELD_NUMBER: _ClassVar[int]
    draft_tokens: int
    accepted_tokens: int
    request_steps: int
    verify_steps: int
    draft_seconds: float
    verify_seconds: float
    accepted_hist: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., request_steps: _Optional[int] = ..., verify_steps: _Optional[int] = ..., draft_seconds: _Optional[float] = ..., verify_seconds: _Optional[float] = ..., accepted_hist: _Optional[_Iterable[int]] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("model", "role", "max_model_len", "page_size", "vocab_size", "eos_token_ids", "bootstrap_addr", "tp_size", "epoch", "transfer_backend", "cluster_id", "replica", "model_fingerprint", "contract_hash", "draining", "max_running_requests")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BOOTSTRAP_ADDR_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BACKEND_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    CONTRACT_HASH_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    model: str
    role: str
    max_model_len: int
    page_size: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bootstrap_addr: str
    tp_size: int
    epoch: int
    transfer_backend: str
    cluster_id: str
    replica: int
    model_fingerprint: str
    contract_hash: str
    draining: bool
    max_running_requests: int
    def __init__(self, model: _Optional[str] = ..., role: _Optional[str] = ..., max_model_len: _Optional[int] = ..., page_size: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., bootstrap_addr: _Optional[str] = ..., tp_size: _Optional[int] = ..., epoch: _Optional[int] = ..., transfer_backend: _Optional[str] = ..., cluster_id: _Optional[str] = ..., replica: _Optional[int] = ..., model_fingerprint: _Optional[str] = ..., contract_hash: _Optional[str] = ..., draining: _Optional[bool] = ..., max_running_requests: _Optional[int] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("running", "waiting")
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    running: int
    waiting: int
    def __init__(self, running: _Optional[int] = ..., waiting: _Optional[int] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("submits", "aborts")
    SUBMITS_FIELD_NUMBER: _ClassVar[int]
    ABORTS_FIELD_NUMBER: _ClassVar[int]
    submits: _containers.RepeatedCompositeFieldContainer[Submit]
    aborts: _containers.RepeatedCompositeFieldContainer[SessionAbort]
    def __init__(self, submits: _Optional[_Iterable[_Union[Submit, _Mapping]]] = ..., aborts: _Optional[_Iterable[_Union[SessionAbort, _Mapping]]] = ...) -> None: ...

class Submit(_message.Message):
    __slots__ = ("slot", "request")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    slot: int
    request: GenerateRequest
    def __init__(self, slot: _Optional[int] = ..., request: _Optional[_Union[GenerateRequest, _Mapping]] = ...) -> None: ...

class SessionAbort(_message.Message):
    __slots__ = ("slot", "request_id", "room", "attempt_id")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ROOM_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_ID_FIELD_NUMBER: _ClassVar[int]
    slot: int
    request_id: str
    room: int
    attempt_id: str
    def __init__(self, slot: _Optional[int] = ..., request_id: _Optional[str] = ..., room: _Optional[int] = ..., attempt_id: _Optional[str] = ...) -> None: ...

class SessionResponse(_message.Message):
    __slots__ = ("slots", "num_tokens", "token_ids", "num_logprobs", "logprobs", "started", "ended")
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    slots: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_logprobs: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    started: _containers.RepeatedCompositeFieldContainer[RequestStart]
    ended: _containers.RepeatedCompositeFieldContainer[RequestEnd]
    def __init__(self, slots: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_logprobs: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., started: _Optional[_Iterable[_Union[RequestStart, _Mapping]]] = ..., ended: _Optional[_Iterable[_Union[RequestEnd, _Mapping]]] = ...) -> None: ...

class RequestStart(_message.Message):
    __slots__ = ("slot", "num_prompt_tokens", "num_cached_tokens")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    slot: int
    num_prompt_tokens: int
    num_cached_tokens: int
    def __init__(self, slot: _Optional[int] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ...) -> None: ...

class RequestEnd(_message.Message):
    __slots__ = ("slot", "finish_reason", "status_code", "error", "transfer", "error_code")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATUS_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    slot: int
    finish_reason: str
    status_code: int
    error: str
    transfer: TransferStats
    error_code: str
    def __init__(self, slot: _Optional[int] = ..., finish_reason: _Optional[str] = ..., status_code: _Optional[int] = ..., error: _Optional[str] = ..., transfer: _Optional[_Union[TransferStats, _Mapping]] = ..., error_code: _Optional[str] = ...) -> None: ...
