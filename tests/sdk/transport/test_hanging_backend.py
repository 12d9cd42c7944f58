"""Issue 18, finding 4: a backend that accepts and never answers (or never lets us connect, or trickles its
answer) must cost the job nothing but a bounded wait on the SDK's thread. Each request ends by its
connect/read timeouts or its deadline, the batch goes to the disk spool, shutdown spools whatever is still
queued or in flight within its timeout, memory stays within the queue bound, and every event is accounted
for: ``sent + spooled + dropped == logged``, exactly. Real sockets on 127.0.0.1 throughout."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, Dict, List

import pytest

import trainguard
from tests.sdk.scripting import run_python
from tests.sdk.transport.hostile import (  # noqa: F401 (clean_sdk: a fixture)
    BASE,
    FullBacklogServer,
    HangingServer,
    TricklingServer,
    clean_sdk,
)
from tests.support.waiting import poll
from trainguard.core import events as ev
from trainguard.core.events import decode_events
from trainguard.transport.base import TransportError
from trainguard.transport.http import HttpTransport

QUIET = {"flush_interval": 0.05, "backoff_initial": 0.05, "backoff_max": 0.2, "heartbeat_interval": 0,
         "capture_exit": False, "capture_uncaught": False}
pytestmark = pytest.mark.usefixtures("clean_sdk")


def _spooled_events(root: Path) -> List[Dict[str, Any]]:
    """Every envelope in the disk spool under ``root``, in spool order."""
    out: List[Dict[str, Any]] = []
    for path in sorted(root.rglob("*.json")):
        out.extend(decode_events(path.read_bytes()))
    return out


def _steps(events: List[Dict[str, Any]]) -> List[int]:
    return [int(e.get("step", 0)) for e in events if "metrics" in e]


def _metric_events(n: int) -> List[Dict[str, Any]]:
    return [ev.envelope(BASE, "metrics", ev.metrics_payload({"loss": 1.0}), step=i,
                        time_unix_nano=1_700_000_000_000_000_000 + i) for i in range(n)]


def test_a_backend_that_never_answers_fails_over_to_the_spool_and_counts_every_event(tmp_path: Path) -> None:
    with HangingServer() as backend:
        trainguard.init(endpoint=backend.url, project="p", spool_dir=str(tmp_path), read_timeout=0.3,
                        connect_timeout=1.0, send_timeout=30.0, **QUIET)
        client = trainguard.get_client()
        assert client is not None
        for step in range(1500):
            trainguard.log(step=step, loss=1.0 / (step + 1))
        # the read timeout (0.3 s), not the 30 s send timeout, ends the hanging request: the batch is spooled
        assert poll(lambda: _spooled_events(tmp_path), timeout=10), "nothing reached the spool"
        assert backend.connections >= 1
        trainguard.shutdown(timeout=3)
    stats = client.stats
    assert stats.sent == 0 and stats.dropped_total == 0, stats.snapshot()
    assert stats.spooled == 1501, stats.snapshot()  # the start event + 1500 steps: all kept on disk
    spooled = _spooled_events(tmp_path)
    assert len(spooled) == 1501 and len({e["event_id"] for e in spooled}) == 1501
    assert _steps(spooled) == list(range(1500))
    assert client.accounting() == {"logged": 1501, "sent": 0, "spooled": 1501, "dropped": 0, "queued": 0}


@pytest.mark.parametrize("scheme", ["http", "grpc"])
def test_shutdown_with_a_request_hanging_spools_everything_within_its_timeout(scheme: str,
                                                                             tmp_path: Path) -> None:
    """HTTP: a socket that never answers. gRPC: a real gRPC server whose handler never returns (a bare
    socket fails the gRPC handshake at once, which is not a hang)."""
    backend: Any
    if scheme == "http":
        backend = HangingServer()
    else:
        pytest.importorskip("grpc")
        from tests.support.receivers import GrpcReceiver

        backend = GrpcReceiver()
        backend.delay_s = 60.0

    def request_started() -> bool:
        return bool(backend.bytes_received if scheme == "http" else backend.requests)

    with backend:
        # the backend holds every request far longer than the shutdown may take
        trainguard.init(endpoint=backend.url, project="p", spool_dir=str(tmp_path), read_timeout=60.0,
                        send_timeout=60.0, **QUIET)
        client = trainguard.get_client()
        assert client is not None
        for step in range(1500):
            trainguard.log(step=step, loss=1.0)
        assert poll(request_started, timeout=10), "the worker never sent"
        started = time.monotonic()
        trainguard.shutdown(timeout=2.0)
        took = time.monotonic() - started
    assert took < 2.0 + 1.5, f"shutdown took {took:.1f} s with a 2 s timeout"
    stats = client.stats
    spooled = _spooled_events(tmp_path)
    # nothing lost, nothing left to a dying daemon thread: the batch in flight and the queue are on disk
    assert stats.sent == 0 and stats.dropped_total == 0, stats.snapshot()
    assert stats.spooled == len(spooled) == 1501, stats.snapshot()
    assert _steps(spooled) == list(range(1500))
    assert client.accounting() == {"logged": 1501, "sent": 0, "spooled": 1501, "dropped": 0, "queued": 0}


def test_connect_timeout_bounds_a_connection_that_never_completes() -> None:
    with FullBacklogServer() as backend:
        transport = HttpTransport(backend.url, None, "ua", connect_timeout=0.3, read_timeout=30.0)
        started = time.monotonic()
        with pytest.raises(TransportError) as info:
            transport.send(_metric_events(3), 30.0)
        took = time.monotonic() - started
        transport.close()
    assert info.value.retryable and info.value.status == "connect_timeout", info.value
    assert took < 5.0, f"connect took {took:.1f} s with connect_timeout=0.3"


def test_the_send_deadline_ends_an_answer_that_trickles_in() -> None:
    """Each read gets a byte within the read timeout; only the request's deadline can end it."""
    with TricklingServer(interval_s=0.05) as backend:
        transport = HttpTransport(backend.url, None, "ua", connect_timeout=1.0, read_timeout=1.0)
        outcome: List[BaseException] = []

        def send() -> None:
            try:
                transport.send(_metric_events(3), 1.0)
            except BaseException as exc:  # whatever it is, the test reports it
                outcome.append(exc)

        worker = threading.Thread(target=send, daemon=True)
        started = time.monotonic()
        worker.start()
        worker.join(10)
        took = time.monotonic() - started
        finished = not worker.is_alive()
        transport.close()
    assert finished, "the send was still reading a trickled answer after 10 s (deadline 1 s)"
    assert took < 5.0
    (error,) = outcome
    assert isinstance(error, TransportError) and error.retryable and error.status == "timeout", error


def test_a_long_run_against_a_hanging_backend_stays_within_the_queue_bound(tmp_path: Path) -> None:
    """Metrics, log records and exceptions at full speed while every request hangs: the queue never holds
    more than its documented bound, the memory the SDK retains does not grow with the run, and at the end
    every event is sent, spooled or dropped (counted)."""
    with HangingServer() as backend:
        code = f"""
            import gc, json, logging, tracemalloc
            import trainguard
            tracemalloc.start()
            trainguard.init(endpoint={backend.url!r}, project="p", spool_dir={str(tmp_path)!r},
                            max_queue_events=500, queue_reserve_events=50, read_timeout=0.5,
                            send_timeout=20.0, heartbeat_interval=0, flush_interval=0.05,
                            backoff_initial=0.05, backoff_max=0.5, capture_exit=False, log_loggers=["job"])
            client = trainguard.get_client()
            log = logging.getLogger("job")
            log.propagate = False
            def step(i):
                trainguard.log(step=i, loss=0.5, lr=1e-4)
                log.warning("slow data loader at step %d", i)
                if i % 10 == 0:
                    try:
                        raise ValueError(f"bad sample {{i}}")
                    except ValueError as exc:
                        trainguard.capture_exception(exc)
            for i in range(2_000):  # warm up: allocator pools, interned strings, the first spool files
                step(i)
            gc.collect()
            base = tracemalloc.get_traced_memory()[0]
            most_queued = grown = 0
            for i in range(2_000, 40_000):
                step(i)
                if i % 100 == 0:
                    most_queued = max(most_queued, len(client._queue))
                if i % 2_000 == 0:
                    gc.collect()
                    grown = max(grown, tracemalloc.get_traced_memory()[0] - base)
            trainguard.shutdown(timeout=5)
            print(json.dumps({{"most_queued": most_queued, "grown_mb": grown / 2**20,
                              "accounting": getattr(client, "accounting", dict)()}}))
        """
        result = run_python(code, timeout=300)
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["most_queued"] <= 500 + 50 + 1, figures  # max_queue_events + reserve (+ the start event)
    assert figures["grown_mb"] < 8, figures  # 38k steps of metrics, logs and exceptions retained nothing
    acc = figures["accounting"]
    logged = 1 + 40_000 * 2 + 4_000  # start + (metrics + log record) per step + an exception every 10th
    assert acc["logged"] == logged and acc["queued"] == 0, acc
    assert acc["sent"] + acc["spooled"] + acc["dropped"] == logged, acc
    assert acc["sent"] == 0 and acc["spooled"] == len(_spooled_events(tmp_path)), acc
