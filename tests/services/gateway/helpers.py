"""Shared pieces of the gateway tests: settings, tokens (MemoryProjectStore), a MemoryQueue with fault
injection, event builders, a uvicorn thread."""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from trainguard.v1 import events_pb2, ingest_pb2
from trainguard_server.config import Settings
from trainguard_server.gateway.ingest import Gateway
from trainguard_server.queue.base import Queue, QueueFull, QueueRecord
from trainguard_server.queue.memory import MemoryQueue
from trainguard_server.storage.base import ProjectStore
from trainguard_server.storage.memory import MemoryProjectStore

PROJECT = "llm"
RUN = "5f0c" * 8
NOW_NS = 1_764_000_000_000_000_000


def gateway_settings(**overrides: Any) -> Settings:
    """Small limits so the limit tests stay cheap; the messages quote these numbers. The gateways of these
    tests read a clock pinned at NOW_NS while the SDK's transports stamp their requests' x-trainguard-sent-at
    with the real clock: the sent-at correction is off (``clock_skew_correct_s=0``) unless a test turns it on
    (tests/services/gateway/test_sent_at.py)."""
    values: Dict[str, Any] = dict(max_batch_bytes=256 * 1024, max_event_bytes=64 * 1024, max_batch_events=200,
                                  max_frames=64, max_string_length=8192, max_id_length=64,
                                  max_future_skew_s=300.0, max_past_age_s=86400.0, retry_after_s=3.0,
                                  clock_skew_correct_s=0.0)
    values.update(overrides)
    return Settings(**values)




class ControlledQueue(Queue):
    """Wraps a real queue; ``full`` makes publish raise QueueFull, ``broken`` raise that exception,
    ``full_after = n`` turns ``full`` on once ``publishes`` reaches n."""

    def __init__(self, inner: Queue, retry_after: float = 2.0) -> None:
        self.inner = inner
        self.full = False
        self.broken: Optional[Exception] = None
        self.full_after: Optional[int] = None  # become full once this many publishes succeeded
        self.retry_after = retry_after
        self.publishes = 0

    def publish(self, key: str, values: Sequence[bytes]) -> List[int]:
        if self.full_after is not None and self.publishes >= self.full_after:
            self.full = True
        if self.full:
            raise QueueFull("depth 50000 over max_queue_depth=50000", self.retry_after)
        if self.broken is not None:
            raise self.broken
        self.publishes += 1
        return self.inner.publish(key, values)

    def consume(self, max_records: int, timeout: float) -> List[QueueRecord]:
        return self.inner.consume(max_records, timeout)

    def commit(self, records: Sequence[QueueRecord]) -> None:
        self.inner.commit(records)

    def depth(self) -> int:
        return self.inner.depth()


def new_queue() -> ControlledQueue:
    return ControlledQueue(MemoryQueue())


def drain(queue: Queue) -> List[Tuple[str, events_pb2.Envelope]]:
    """Everything published so far, as (key, envelope) in queue order; commits what it read."""
    out: List[Tuple[str, events_pb2.Envelope]] = []
    while True:
        records = queue.consume(1000, 0.0)
        if not records:
            return out
        for record in records:
            out.extend((record.key, e) for e in ingest_pb2.IngestRequest.FromString(record.value).events)
        queue.commit(records)


@dataclass
class Tokens:
    ingest: str
    read: str
    revoked: str
    other_project: str


def new_projects() -> Tuple[ProjectStore, Tokens]:
    store = MemoryProjectStore()
    ingest = store.create_token(PROJECT, "ingest")
    read = store.create_token(PROJECT, "read")
    revoked = store.create_token(PROJECT, "ingest")
    other = store.create_token("other", "ingest")
    info = store.authenticate(revoked)
    assert info is not None
    store.revoke(info.token_id)
    assert store.authenticate(revoked) is None
    return store, Tokens(ingest, read, revoked, other)


def new_gateway(**settings: Any) -> Tuple[Gateway, ControlledQueue, Tokens]:
    projects, tokens = new_projects()
    queue = new_queue()
    return Gateway(queue, projects, gateway_settings(**settings), clock=lambda: NOW_NS), queue, tokens


# ------------------------------------------------------------------------------------------------ events

def event_id() -> str:
    return uuid.uuid4().hex


def metric_event(step: int = 0, **fields: Any) -> Dict[str, Any]:
    """An SDK-shaped metrics envelope dict (JSON mapping) for PROJECT/RUN at NOW_NS."""
    event: Dict[str, Any] = {
        "event_id": event_id(), "project": PROJECT, "run_id": RUN, "trace_id": RUN, "run_name": "sft",
        "host": "node-1", "pid": 42, "rank": 0, "local_rank": 0, "world_size": 1, "group_rank": -1,
        "sdk": "trainguard-python/0.1.0", "step": step, "time_unix_nano": NOW_NS - 1000 + step,
        "severity": "INFO",
        "metrics": {"points": [{"name": "loss", "value": 2.0 / (step + 1)}, {"name": "lr", "value": 3e-4}]},
    }
    event.update(fields)
    return event


def exception_event(frames: int = 3, **fields: Any) -> Dict[str, Any]:
    event = metric_event(**fields)
    del event["metrics"]
    event.setdefault("severity", "CRITICAL")
    event["exception"] = {"type": "RuntimeError", "message": "boom",
                          "frames": [{"filename": "/app/train.py", "module": "train", "function": f"f{i}",
                                      "lineno": i + 1} for i in range(frames)]}
    return event


def frame(envelope: bytes) -> bytes:
    """``envelope`` as one ``IngestRequest.events`` entry (tag 1, length-delimited)."""
    n, out = len(envelope), bytearray(b"\x0a")
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out) + envelope


class UvicornThread:
    """A real uvicorn server for ``app`` on 127.0.0.1 (ephemeral port) in a daemon thread."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                                    lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, name="uvicorn-test", daemon=True)
        self.port = 0

    def __enter__(self) -> UvicornThread:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        self.port = int(self.server.servers[0].sockets[0].getsockname()[1])
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)
