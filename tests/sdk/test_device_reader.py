"""A device stream that never computes a logged value must not stop the SDK's delivery thread.

Recorded on two H200s (tests/fixtures/nccl/rank_lost): once its DDP peer was SIGKILLed, a rank's grad-norm
read-back waited on the hung all-reduce and the rank sent nothing more -- no heartbeat, no event -- until
torchrun killed it. Here a stand-in device tensor whose read-back blocks until the test releases it plays
the stuck stream (a non-CPU device: queued for the reader's thread exactly as a CUDA tensor is; its copy
is the generic ``.cpu()`` one, the CUDA batch copy is tested on a GPU in test_read_back.py)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any, Iterator, List

import pytest

import trainguard
from tests.support.sdk_events import series
from trainguard.device_reader import DeviceReader
from trainguard.guard import reset_warnings


class StuckDeviceTensor:
    """A 1-D "device" tensor whose copy to the host waits for ``gate`` (a stream stuck in a collective)."""

    device = SimpleNamespace(type="xla")

    def __init__(self, gate: threading.Event, values: List[float]) -> None:
        self.gate = gate
        self.values = values

    def detach(self) -> StuckDeviceTensor:
        return self

    def double(self) -> StuckDeviceTensor:
        return self

    def reshape(self, *_shape: int) -> StuckDeviceTensor:
        return self

    def cpu(self) -> StuckDeviceTensor:
        self.gate.wait()
        return self

    def tolist(self) -> List[float]:
        return list(self.values)


@pytest.fixture
def sdk() -> Iterator[Any]:
    reset_warnings()
    trainguard.init(endpoint="memory://", spool_dir="", heartbeat_interval=0.1, flush_interval=0.05,
                    capture_exit=False, capture_uncaught=False)
    client = trainguard.get_client()
    yield client
    trainguard.shutdown(timeout=2)


def delivered(client: Any) -> List[dict]:
    transport = client.worker._transport  # created by the worker's first delivery
    return list(transport.events) if transport is not None else []


def wait_for(predicate: Any, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_heartbeats_and_host_events_flow_while_a_device_read_back_is_stuck(sdk: Any) -> None:
    gate = threading.Event()
    trainguard.log(step=1, loss=0.5)
    sdk.log_vector(1, ("grad/global_norm",), StuckDeviceTensor(gate, [3.0]))
    trainguard.log(step=2, loss=0.25)
    start = len([e for e in delivered(sdk) if "heartbeat" in e])
    # the stuck read-back is on the reader's thread: the delivery thread keeps sending
    assert wait_for(lambda: len([e for e in delivered(sdk) if "heartbeat" in e]) >= start + 5)
    evs = delivered(sdk)
    assert series(evs, "loss") == [(1, 0.5), (2, 0.25)]
    assert series(evs, "grad/global_norm") == []
    beats = [e["heartbeat"] for e in evs if "heartbeat" in e]
    assert beats[-1]["last_step"] == 2
    # the heartbeat says the device has been waited on (a stuck stream, not a dead process)
    assert wait_for(lambda: any(e["heartbeat"]["sdk_stats"].get("device_wait_s", 0) >= 1.0
                                for e in delivered(sdk) if "heartbeat" in e))
    assert sdk.pending() == 1  # the stuck value is not forgotten
    gate.set()  # the collective completes after all: the value arrives, in its step
    assert wait_for(lambda: series(delivered(sdk), "grad/global_norm") == [(1, 3.0)])
    assert sdk.pending() == 0
    assert sdk.stats.dropped_total == 0


def test_an_exit_is_delivered_at_shutdown_while_the_device_is_stuck(sdk: Any) -> None:
    gate = threading.Event()
    sdk.log_vector(4, ("grad/global_norm",), StuckDeviceTensor(gate, [1.0]))
    sdk.capture_event("lifecycle", {"phase": "EXIT", "exit_code": 134, "signal": 6, "reason": "signal"},
                      severity="ERROR", urgent=True)
    assert wait_for(lambda: any(e.get("lifecycle", {}).get("phase") == "EXIT" for e in delivered(sdk)))
    started = time.monotonic()
    assert sdk.close(timeout=5) is True  # bounded: the final drain waits a moment, not forever
    assert time.monotonic() - started < 8.0  # the drain's own wait is 2 s; a stuck one would never return
    gate.set()


def test_reader_keeps_submission_order_and_bounds_what_waits() -> None:
    gate = threading.Event()
    seen: List[int] = []

    def resolve(items: List[tuple]) -> List[tuple]:
        gate.wait()
        seen.extend(i[1] for i in items)
        return items

    reader = DeviceReader(resolve, max_items=4)
    assert reader.submit([(0, 1)]) == 0          # in flight, stuck
    assert wait_for(lambda: reader.waiting_s() > 0)
    assert reader.collect(0.05) == []             # returns after its wait, with nothing
    assert reader.submit([(0, 2), (0, 3)]) == 0
    assert reader.submit([(0, 4), (0, 5)]) == 0
    assert reader.submit([(0, 6)]) == 2           # 5 waiting > 4: the oldest waiting batch goes
    assert reader.pending() == 4                  # 1 in flight + 3 waiting
    gate.set()
    out: List[tuple] = []
    assert wait_for(lambda: out.extend(reader.collect(0.05)) or len(out) == 4)
    assert [i[1] for i in out] == [1, 4, 5, 6]
    assert seen == [1, 4, 5, 6]
    assert reader.pending() == 0 and reader.waiting_s() == 0.0


def test_a_resolver_that_raises_loses_its_batch_not_the_thread() -> None:
    calls: List[int] = []

    def resolve(items: List[tuple]) -> List[tuple]:
        calls.append(len(items))
        if len(calls) == 1:
            raise RuntimeError("device lost")
        return items

    reader = DeviceReader(resolve, max_items=10)
    reader.submit([(0, 1)])
    assert wait_for(lambda: len(calls) == 1 and reader.pending() == 0)
    assert reader.collect(0.05) == []
    reader.submit([(0, 2)])
    out: List[tuple] = []
    assert wait_for(lambda: out.extend(reader.collect(0.05)) or out == [(0, 2)])
    assert calls == [1, 1]
