from trainguard.v1 import events_pb2 as _events_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class IngestRequest(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[_events_pb2.Envelope]
    def __init__(self, events: _Optional[_Iterable[_Union[_events_pb2.Envelope, _Mapping]]] = ...) -> None: ...

class IngestResponse(_message.Message):
    __slots__ = ("accepted", "duplicates", "rejected")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    duplicates: int
    rejected: _containers.RepeatedCompositeFieldContainer[Rejection]
    def __init__(self, accepted: _Optional[int] = ..., duplicates: _Optional[int] = ..., rejected: _Optional[_Iterable[_Union[Rejection, _Mapping]]] = ...) -> None: ...

class Rejection(_message.Message):
    __slots__ = ("index", "event_id", "code", "message")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    index: int
    event_id: str
    code: str
    message: str
    def __init__(self, index: _Optional[int] = ..., event_id: _Optional[str] = ..., code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...
