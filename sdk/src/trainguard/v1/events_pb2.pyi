from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Severity(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SEVERITY_UNSPECIFIED: _ClassVar[Severity]
    DEBUG: _ClassVar[Severity]
    INFO: _ClassVar[Severity]
    WARNING: _ClassVar[Severity]
    ERROR: _ClassVar[Severity]
    CRITICAL: _ClassVar[Severity]
SEVERITY_UNSPECIFIED: Severity
DEBUG: Severity
INFO: Severity
WARNING: Severity
ERROR: Severity
CRITICAL: Severity

class Envelope(_message.Message):
    __slots__ = ("event_id", "project", "run_id", "trace_id", "host", "pid", "rank", "local_rank", "world_size", "step", "time_unix_nano", "severity", "run_name", "sdk", "group_rank", "metrics", "exception", "lifecycle", "heartbeat", "log", "memory")
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    PROJECT_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TIME_UNIX_NANO_FIELD_NUMBER: _ClassVar[int]
    SEVERITY_FIELD_NUMBER: _ClassVar[int]
    RUN_NAME_FIELD_NUMBER: _ClassVar[int]
    SDK_FIELD_NUMBER: _ClassVar[int]
    GROUP_RANK_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    EXCEPTION_FIELD_NUMBER: _ClassVar[int]
    LIFECYCLE_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    LOG_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    event_id: str
    project: str
    run_id: str
    trace_id: str
    host: str
    pid: int
    rank: int
    local_rank: int
    world_size: int
    step: int
    time_unix_nano: int
    severity: Severity
    run_name: str
    sdk: str
    group_rank: int
    metrics: MetricBatch
    exception: ExceptionEvent
    lifecycle: Lifecycle
    heartbeat: Heartbeat
    log: LogRecord
    memory: MemorySnapshot
    def __init__(self, event_id: _Optional[str] = ..., project: _Optional[str] = ..., run_id: _Optional[str] = ..., trace_id: _Optional[str] = ..., host: _Optional[str] = ..., pid: _Optional[int] = ..., rank: _Optional[int] = ..., local_rank: _Optional[int] = ..., world_size: _Optional[int] = ..., step: _Optional[int] = ..., time_unix_nano: _Optional[int] = ..., severity: _Optional[_Union[Severity, str]] = ..., run_name: _Optional[str] = ..., sdk: _Optional[str] = ..., group_rank: _Optional[int] = ..., metrics: _Optional[_Union[MetricBatch, _Mapping]] = ..., exception: _Optional[_Union[ExceptionEvent, _Mapping]] = ..., lifecycle: _Optional[_Union[Lifecycle, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., log: _Optional[_Union[LogRecord, _Mapping]] = ..., memory: _Optional[_Union[MemorySnapshot, _Mapping]] = ...) -> None: ...

class MetricBatch(_message.Message):
    __slots__ = ("points", "alert", "recent")
    POINTS_FIELD_NUMBER: _ClassVar[int]
    ALERT_FIELD_NUMBER: _ClassVar[int]
    RECENT_FIELD_NUMBER: _ClassVar[int]
    points: _containers.RepeatedCompositeFieldContainer[Metric]
    alert: str
    recent: _containers.RepeatedCompositeFieldContainer[Metric]
    def __init__(self, points: _Optional[_Iterable[_Union[Metric, _Mapping]]] = ..., alert: _Optional[str] = ..., recent: _Optional[_Iterable[_Union[Metric, _Mapping]]] = ...) -> None: ...

class Metric(_message.Message):
    __slots__ = ("name", "value", "step")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    name: str
    value: float
    step: int
    def __init__(self, name: _Optional[str] = ..., value: _Optional[float] = ..., step: _Optional[int] = ...) -> None: ...

class Frame(_message.Message):
    __slots__ = ("filename", "module", "function", "lineno", "in_app", "context_line")
    FILENAME_FIELD_NUMBER: _ClassVar[int]
    MODULE_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    LINENO_FIELD_NUMBER: _ClassVar[int]
    IN_APP_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LINE_FIELD_NUMBER: _ClassVar[int]
    filename: str
    module: str
    function: str
    lineno: int
    in_app: bool
    context_line: str
    def __init__(self, filename: _Optional[str] = ..., module: _Optional[str] = ..., function: _Optional[str] = ..., lineno: _Optional[int] = ..., in_app: bool = ..., context_line: _Optional[str] = ...) -> None: ...

class ExceptionEvent(_message.Message):
    __slots__ = ("type", "message", "frames", "fingerprint", "fingerprint_version", "message_template", "hints", "handled", "mechanism", "thread", "traceback", "chain", "context", "recent_metrics")
    class ContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TYPE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_VERSION_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    HINTS_FIELD_NUMBER: _ClassVar[int]
    HANDLED_FIELD_NUMBER: _ClassVar[int]
    MECHANISM_FIELD_NUMBER: _ClassVar[int]
    THREAD_FIELD_NUMBER: _ClassVar[int]
    TRACEBACK_FIELD_NUMBER: _ClassVar[int]
    CHAIN_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    RECENT_METRICS_FIELD_NUMBER: _ClassVar[int]
    type: str
    message: str
    frames: _containers.RepeatedCompositeFieldContainer[Frame]
    fingerprint: str
    fingerprint_version: str
    message_template: str
    hints: _containers.RepeatedCompositeFieldContainer[FingerprintHint]
    handled: bool
    mechanism: str
    thread: str
    traceback: str
    chain: _containers.RepeatedCompositeFieldContainer[ChainedException]
    context: _containers.ScalarMap[str, str]
    recent_metrics: _containers.RepeatedCompositeFieldContainer[Metric]
    def __init__(self, type: _Optional[str] = ..., message: _Optional[str] = ..., frames: _Optional[_Iterable[_Union[Frame, _Mapping]]] = ..., fingerprint: _Optional[str] = ..., fingerprint_version: _Optional[str] = ..., message_template: _Optional[str] = ..., hints: _Optional[_Iterable[_Union[FingerprintHint, _Mapping]]] = ..., handled: bool = ..., mechanism: _Optional[str] = ..., thread: _Optional[str] = ..., traceback: _Optional[str] = ..., chain: _Optional[_Iterable[_Union[ChainedException, _Mapping]]] = ..., context: _Optional[_Mapping[str, str]] = ..., recent_metrics: _Optional[_Iterable[_Union[Metric, _Mapping]]] = ...) -> None: ...

class ChainedException(_message.Message):
    __slots__ = ("type", "message", "relation", "frames")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RELATION_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    type: str
    message: str
    relation: str
    frames: _containers.RepeatedCompositeFieldContainer[Frame]
    def __init__(self, type: _Optional[str] = ..., message: _Optional[str] = ..., relation: _Optional[str] = ..., frames: _Optional[_Iterable[_Union[Frame, _Mapping]]] = ...) -> None: ...

class FingerprintHint(_message.Message):
    __slots__ = ("frame_index", "contributes", "reason")
    FRAME_INDEX_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTES_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    frame_index: int
    contributes: bool
    reason: str
    def __init__(self, frame_index: _Optional[int] = ..., contributes: bool = ..., reason: _Optional[str] = ...) -> None: ...

class Lifecycle(_message.Message):
    __slots__ = ("phase", "exit_code", "signal", "reason", "argv", "python", "torch", "cuda", "tags", "config", "sdk_stats")
    class Phase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        PHASE_UNSPECIFIED: _ClassVar[Lifecycle.Phase]
        START: _ClassVar[Lifecycle.Phase]
        EXIT: _ClassVar[Lifecycle.Phase]
    PHASE_UNSPECIFIED: Lifecycle.Phase
    START: Lifecycle.Phase
    EXIT: Lifecycle.Phase
    class TagsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class ConfigEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class SdkStatsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    PHASE_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ARGV_FIELD_NUMBER: _ClassVar[int]
    PYTHON_FIELD_NUMBER: _ClassVar[int]
    TORCH_FIELD_NUMBER: _ClassVar[int]
    CUDA_FIELD_NUMBER: _ClassVar[int]
    TAGS_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    SDK_STATS_FIELD_NUMBER: _ClassVar[int]
    phase: Lifecycle.Phase
    exit_code: int
    signal: int
    reason: str
    argv: _containers.RepeatedScalarFieldContainer[str]
    python: str
    torch: str
    cuda: str
    tags: _containers.ScalarMap[str, str]
    config: _containers.ScalarMap[str, str]
    sdk_stats: _containers.ScalarMap[str, float]
    def __init__(self, phase: _Optional[_Union[Lifecycle.Phase, str]] = ..., exit_code: _Optional[int] = ..., signal: _Optional[int] = ..., reason: _Optional[str] = ..., argv: _Optional[_Iterable[str]] = ..., python: _Optional[str] = ..., torch: _Optional[str] = ..., cuda: _Optional[str] = ..., tags: _Optional[_Mapping[str, str]] = ..., config: _Optional[_Mapping[str, str]] = ..., sdk_stats: _Optional[_Mapping[str, float]] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("last_step", "last_step_time_unix_nano", "step_time_ewma_s", "uptime_s", "sdk_stats")
    class SdkStatsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_TIME_UNIX_NANO_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_EWMA_S_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    SDK_STATS_FIELD_NUMBER: _ClassVar[int]
    last_step: int
    last_step_time_unix_nano: int
    step_time_ewma_s: float
    uptime_s: float
    sdk_stats: _containers.ScalarMap[str, float]
    def __init__(self, last_step: _Optional[int] = ..., last_step_time_unix_nano: _Optional[int] = ..., step_time_ewma_s: _Optional[float] = ..., uptime_s: _Optional[float] = ..., sdk_stats: _Optional[_Mapping[str, float]] = ...) -> None: ...

class LogRecord(_message.Message):
    __slots__ = ("logger", "level", "message", "source")
    LOGGER_FIELD_NUMBER: _ClassVar[int]
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    logger: str
    level: str
    message: str
    source: str
    def __init__(self, logger: _Optional[str] = ..., level: _Optional[str] = ..., message: _Optional[str] = ..., source: _Optional[str] = ...) -> None: ...

class MemorySnapshot(_message.Message):
    __slots__ = ("device", "allocated", "reserved", "active", "max_allocated", "total_capacity", "free", "fragmentation", "num_alloc_retries", "num_ooms", "rss", "summary", "stats")
    class StatsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    ALLOCATED_FIELD_NUMBER: _ClassVar[int]
    RESERVED_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    MAX_ALLOCATED_FIELD_NUMBER: _ClassVar[int]
    TOTAL_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    FREE_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTATION_FIELD_NUMBER: _ClassVar[int]
    NUM_ALLOC_RETRIES_FIELD_NUMBER: _ClassVar[int]
    NUM_OOMS_FIELD_NUMBER: _ClassVar[int]
    RSS_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    device: str
    allocated: int
    reserved: int
    active: int
    max_allocated: int
    total_capacity: int
    free: int
    fragmentation: float
    num_alloc_retries: int
    num_ooms: int
    rss: int
    summary: str
    stats: _containers.ScalarMap[str, float]
    def __init__(self, device: _Optional[str] = ..., allocated: _Optional[int] = ..., reserved: _Optional[int] = ..., active: _Optional[int] = ..., max_allocated: _Optional[int] = ..., total_capacity: _Optional[int] = ..., free: _Optional[int] = ..., fragmentation: _Optional[float] = ..., num_alloc_retries: _Optional[int] = ..., num_ooms: _Optional[int] = ..., rss: _Optional[int] = ..., summary: _Optional[str] = ..., stats: _Optional[_Mapping[str, float]] = ...) -> None: ...
