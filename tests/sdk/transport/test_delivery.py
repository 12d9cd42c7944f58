"""End-to-end delivery through the public API to real HTTP and gRPC receivers: exactly once, in order,
through outages, throttling and slow servers — and the training thread never waits."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List

import pytest

import trainguard
from tests.support.receivers import GrpcReceiver, HttpReceiver
from tests.support.waiting import poll
from trainguard.guard import reset_warnings

FAST = {"flush_interval": 0.05, "backoff_initial": 0.05, "backoff_max": 0.2, "heartbeat_interval": 0,
        "capture_exit": False, "capture_uncaught": False, "send_timeout": 2.0}


@pytest.fixture(autouse=True)
def _clean() -> Iterator[None]:
    reset_warnings()
    yield
    trainguard.shutdown(timeout=2)


@pytest.fixture(params=["http", "grpc"])
def receiver(request: pytest.FixtureRequest) -> Iterator[Any]:
    rx = HttpReceiver() if request.param == "http" else GrpcReceiver()
    rx.start()
    yield rx
    rx.stop()


def _metric_steps(events: List[Dict[str, Any]]) -> List[int]:
    return [int(e.get("step", 0)) for e in events if "metrics" in e]


def _flush_until(deadline_s: float) -> bool:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if trainguard.flush(1.0):
            return True
    return False


def test_every_event_arrives_exactly_once_in_order(receiver: Any, tmp_path: Path) -> None:
    trainguard.init(endpoint=receiver.url, project="p", spool_dir=str(tmp_path), **FAST)
    for step in range(3000):
        trainguard.log(step=step, loss=1.0 / (step + 1), lr=0.1)
    assert trainguard.flush(10)
    events = receiver.events
    assert _metric_steps(events) == list(range(3000))
    assert set(receiver.received_ids.values()) == {1}
    client = trainguard.get_client()
    assert client is not None and client.stats.dropped_total == 0
    assert client.stats.sent == len(events)


def test_outage_spools_to_disk_and_replays_exactly_once_in_order(receiver: Any, tmp_path: Path) -> None:
    receiver.stop()
    spool = tmp_path / "spool"
    trainguard.init(endpoint=receiver.url, project="p", spool_dir=str(spool), **FAST)
    for step in range(2000):
        trainguard.log(step=step, loss=float(step))
    assert trainguard.flush(1.0) is False  # nothing can be acknowledged while the server is down
    spooled = [p for p in spool.rglob("*.json")]
    assert spooled, "undeliverable batches are on disk"
    for step in range(2000, 2500):  # logging goes on during the outage
        trainguard.log(step=step, loss=float(step))
    receiver.start()  # same port
    assert _flush_until(20)
    assert _metric_steps(receiver.events) == list(range(2500))
    assert set(receiver.received_ids.values()) == {1}
    client = trainguard.get_client()
    assert client is not None
    assert client.stats.dropped_total == 0 and client.stats.replayed > 0
    assert not list(spool.rglob("*.json")), "the spool is empty once everything was acknowledged"


def test_throttling_honours_retry_after(receiver: Any, tmp_path: Path) -> None:
    receiver.mode = "throttle"
    receiver.retry_after_s = 3.0
    trainguard.init(endpoint=receiver.url, project="p", spool_dir=str(tmp_path), **FAST)
    trainguard.log(step=0, loss=1.0)
    trainguard.flush(0.5)
    assert poll(lambda: receiver.requests >= 1, timeout=10)  # the first try may come after flush's 0.5 s
    first = receiver.requests
    assert first == 1
    time.sleep(1.0)  # well inside the 3 s the server asked for; our own backoff alone would be 0.05 s
    assert receiver.requests == first, "no retry before Retry-After"
    receiver.mode = "ok"
    assert _flush_until(10)
    assert _metric_steps(receiver.events) == [0]


def test_server_errors_are_retried(receiver: Any, tmp_path: Path) -> None:
    receiver.mode = "error_500"
    trainguard.init(endpoint=receiver.url, project="p", spool_dir=str(tmp_path), **FAST)
    for step in range(50):
        trainguard.log(step=step, loss=1.0)
    trainguard.flush(0.3)
    assert receiver.events == []
    receiver.mode = "ok"
    assert _flush_until(10)
    assert _metric_steps(receiver.events) == list(range(50))
    client = trainguard.get_client()
    assert client is not None and client.stats.retries >= 1


def test_wrong_token_is_final_counted_and_warned_once(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    with HttpReceiver(token="right") as rx:
        trainguard.init(endpoint=rx.url, project="p", token="wrong", spool_dir=str(tmp_path), **FAST)
        for step in range(20):
            trainguard.log(step=step, loss=1.0)
            trainguard.flush(1)
        client = trainguard.get_client()
        assert client is not None
        assert client.stats.dropped["rejected"] == 21  # 20 metric events + the start event
        assert rx.events == []
    assert capsys.readouterr().err.count("HTTP 401") == 1


def test_a_stalled_server_never_blocks_the_training_thread(receiver: Any, tmp_path: Path) -> None:
    receiver.delay_s = 30.0  # the server holds every request
    trainguard.init(endpoint=receiver.url, project="p", spool_dir=str(tmp_path),
                    **{**FAST, "send_timeout": 60.0})
    trainguard.log(step=0, loss=1.0)
    trainguard.flush(0.3)  # bounded: returns although the request hangs
    assert receiver.requests == 1 and receiver.events == []
    for step in range(1, 20_001):  # 20k steps while the worker is stuck in that request
        trainguard.log(step=step, loss=1.0)
    assert receiver.requests == 1 and receiver.events == [], "the request is still hanging"
    client = trainguard.get_client()
    assert client is not None
    assert client.pending() + client.stats.dropped["queue_full"] == 20_000
    receiver.delay_s = 0.0
    receiver.stop()  # cut the hanging request short


def test_spool_bound_evicts_oldest_and_counts(tmp_path: Path) -> None:
    with HttpReceiver() as rx:
        rx.stop()
        trainguard.init(endpoint=rx.url, project="p", spool_dir=str(tmp_path),
                        spool_max_bytes=64 * 1024, max_batch_events=50, **FAST)
        for step in range(5000):
            trainguard.log(step=step, loss=float(step))
            if step % 500 == 0:
                trainguard.flush(0.2)
        trainguard.flush(1)
        size = sum(p.stat().st_size for p in tmp_path.rglob("*.json"))
        assert 0 < size <= 64 * 1024
        client = trainguard.get_client()
        assert client is not None
        evicted = client.stats.dropped["spool_full"]
        assert evicted > 0
        rx.start()
        assert _flush_until(20)
        steps = _metric_steps(rx.events)
        assert steps == sorted(steps) and steps[-1] == 4999, "the newest survive, in order"
        assert len(rx.events) + evicted + client.stats.dropped["queue_full"] == 5001  # + the start event


def test_fork_child_reports_on_its_own(tmp_path: Path) -> None:
    with HttpReceiver() as rx:
        trainguard.init(endpoint=rx.url, project="p", spool_dir=str(tmp_path), **FAST)
        trainguard.log(step=1, loss=1.0)
        pid = os.fork()
        if pid == 0:  # child: log, flush, leave without running the parent's atexit
            try:
                trainguard.log(step=2, loss=2.0)
                ok = trainguard.flush(5)
            finally:
                os._exit(0 if ok else 3)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        trainguard.log(step=3, loss=3.0)
        assert trainguard.flush(5)
        by_step = {int(e.get("step", 0)): int(e["pid"]) for e in rx.events if "metrics" in e}
        assert sorted(by_step) == [1, 2, 3]
        assert by_step[2] == pid and by_step[1] == by_step[3] == os.getpid()
