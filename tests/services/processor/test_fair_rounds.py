"""Issue 15 (b): a quiet run's alert is not held behind a noisy run's backlog. The fair queue hands out one
record of each run in turn (tests/services/queue: the lanes), and the processor's round is bounded by time
(``round_target_s``): it takes only as many records as its recent rate processes in about that long, so a
record published now is handed out at the next consume and processed within about one round."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Dict, List

from trainguard import wire
from trainguard.core import events as ev
from trainguard_server.processor.embedded import MIN_ROUND_EVENTS, RECORD_WINDOW, EmbeddedProcessor
from trainguard_server.queue.common import DEFAULT_LANES, lane_of
from trainguard_server.queue.memory import MemoryQueue
from trainguard_server.queue.sqlite import SqliteQueue
from trainguard_server.storage.sqlite import SqliteEventStore, SqliteIncidentStore, SqliteMetricStore

NOISY, QUIET = "noisy-run", "quiet-run"


def _ident(run_id: str) -> Dict[str, object]:
    return {"project": "p", "run_id": run_id, "trace_id": run_id, "host": "node-0", "pid": 4000, "rank": 0,
            "local_rank": 0, "world_size": 1, "run_name": "fair", "sdk": "test", "group_rank": 0}


def _metrics(run_id: str, first_step: int, count: int) -> bytes:
    """``count`` healthy metric envelopes of ``run_id`` in one request (one queue record)."""
    now = time.time_ns()
    dicts = [ev.envelope(_ident(run_id), "metrics",
                         ev.metrics_payload({"loss": 2.0 - 1e-4 * s, "lr": 3e-4, "grad/global_norm": 0.5}),
                         step=s, time_unix_nano=now) for s in range(first_step, first_step + count)]
    return bytes(wire.prepare_batch(dicts).request.SerializeToString())


def _nan_alert(run_id: str) -> bytes:
    """One metric batch with loss = NaN as the SDK sends it (the alert and the recent history)."""
    recent = [("loss", 9, 1.9), ("lr", 9, 3e-4)]
    d = ev.envelope(_ident(run_id), "metrics",
                    ev.metrics_payload({"loss": math.nan, "lr": 3e-4}, alert="non_finite:loss", recent=recent),
                    step=10, time_unix_nano=time.time_ns(), severity="ERROR")
    return bytes(wire.prepare_batch([d]).request.SerializeToString())


def _processor(tmp_path: Path, queue: object, **kw: object) -> EmbeddedProcessor:
    return EmbeddedProcessor(queue, SqliteEventStore(tmp_path / "events.db"),  # type: ignore[arg-type]
                             SqliteMetricStore(tmp_path / "metrics.db"), SqliteIncidentStore(tmp_path / "inc.db"),
                             snapshot_every_s=1e9, tick_interval_s=1e15, **kw)  # type: ignore[arg-type]


def test_the_round_takes_what_the_recent_rate_processes_in_round_target_s(tmp_path: Path) -> None:
    processor = _processor(tmp_path, MemoryQueue(), batch=256, round_events=8192, round_target_s=0.25)
    assert processor._round_cap() == 8192 and processor._take_count(8192) == 256  # no estimate yet
    processor.rate_events_per_s = 4000.0
    processor.record_sizes.append(500)
    assert processor._round_cap() == 1000           # 4,000 ev/s x 0.25 s
    assert processor._take_count(1000) == 2         # two records of 500 envelopes
    assert processor._take_count(999) == 1 and processor._record_room() == 500
    processor.record_sizes.clear()
    processor.record_sizes.append(2)            # the SDK's records: many, up to batch at once
    assert processor._take_count(1000) == 256
    processor.rate_events_per_s = 10.0              # very slow: never below MIN_ROUND_EVENTS
    assert processor._round_cap() == MIN_ROUND_EVENTS
    processor.rate_events_per_s = 1e9               # very fast: never above round_events
    assert processor._round_cap() == 8192
    processor._measured(500, 500, 1.0)              # a slow chunk halves the estimate at once
    assert processor.rate_events_per_s == 0.5 * 500 + 0.5 * 1e9
    processor.record_sizes.append(500)
    for _ in range(RECORD_WINDOW - 1):              # the largest of the window counts, not the mean
        processor._measured(1, 1, 0.1)
    assert processor._record_room() == 500
    processor._measured(1, 1, 0.1)                  # ... until it leaves the window
    assert processor._record_room() == 1
    off = _processor(tmp_path / "off", MemoryQueue(), batch=256, round_events=8192, round_target_s=0.0)
    off.rate_events_per_s = 4000.0
    off.record_sizes.append(500)
    assert off._round_cap() == 8192 and off._take_count(8192) == 256  # 0: no time bound


def _quiet_waits(tmp_path: Path, queue: object, round_target_s: float) -> int:
    """Rounds (run_once calls) a quiet run's NaN alert waits behind a noisy run's backlog of 60 records of
    200 envelopes, published after the processor's first round; asserts the alert became an incident."""
    processor = _processor(tmp_path, queue, batch=256, round_events=8192, round_target_s=round_target_s)
    for i in range(60):
        processor.queue.publish(NOISY, [_metrics(NOISY, 200 * i, 200)])
    assert processor.run_once(timeout=1.0) > 0          # the first round measures the rate
    processor.queue.publish(QUIET, [_nan_alert(QUIET)])
    for rounds in range(1, 200):
        processor.run_once(timeout=1.0)
        if processor.incidents.list_incidents("p").items:
            (incident,) = processor.incidents.list_incidents("p").items
            assert incident.run_id == QUIET and (incident.category, incident.subtype) == ("loss", "non_finite")
            return rounds
    raise AssertionError("the quiet run's alert was never processed")


def test_a_quiet_runs_alert_is_processed_in_the_next_round_not_after_the_noisy_backlog(tmp_path: Path) -> None:
    for lanes, make in ((DEFAULT_LANES, lambda p: SqliteQueue(p / "queue.db")),
                        (DEFAULT_LANES, lambda p: MemoryQueue())):
        assert lane_of(NOISY, lanes) != lane_of(QUIET, lanes)
        path = tmp_path / f"q{len(list(tmp_path.iterdir()))}"
        path.mkdir()
        queue = make(path)
        assert _quiet_waits(path, queue, round_target_s=0.25) == 1
        assert queue.depth() > 0  # most of the noisy backlog is still there (only ~0.25 s a round)
        queue.close()


def test_without_the_time_bound_the_first_round_takes_the_whole_batch(tmp_path: Path) -> None:
    """What the time bound changes: with round_target_s=0 a round takes ``batch`` records (here the whole
    backlog, 12,000 envelopes) before the queue is consumed again -- the alert is still processed in the
    round after (the queue is fair), but that round came only after the backlog's processing."""
    queue = SqliteQueue(tmp_path / "queue.db")
    processor = _processor(tmp_path, queue, batch=256, round_events=8192, round_target_s=0.0)
    for i in range(60):
        queue.publish(NOISY, [_metrics(NOISY, 200 * i, 200)])
    processor.run_once(timeout=1.0)
    assert processor.stats.events == 60 * 200  # one round: everything the consume handed out
    queue.close()


def test_records_of_each_run_keep_their_order_across_bounded_rounds(tmp_path: Path) -> None:
    queue = SqliteQueue(tmp_path / "queue.db")
    seen: List[str] = []

    class Noting(EmbeddedProcessor):
        def _process(self, records, *args):  # type: ignore[no-untyped-def]
            seen.extend(f"{r.key}:{r.offset}" for r in records)
            super()._process(records, *args)

    processor = Noting(queue, SqliteEventStore(tmp_path / "events.db"), SqliteMetricStore(tmp_path / "m.db"),
                       SqliteIncidentStore(tmp_path / "inc.db"), batch=256, round_events=8192,
                       round_target_s=0.01, snapshot_every_s=0.0, tick_interval_s=1e15)
    for i in range(20):
        for run in ("a", "b", "c"):
            queue.publish(run, [_metrics(run, 50 * i, 50)])
    processor.rate_events_per_s = 1000.0  # as if measured: small rounds
    processor.record_sizes.append(50)
    processor.drain(timeout=60)
    assert queue.depth() == 0 and processor.stats.events == 3000
    for run in ("a", "b", "c"):
        offsets = [int(x.split(":")[1]) for x in seen if x.startswith(run + ":")]
        assert offsets == sorted(offsets) and len(offsets) == 20
    assert processor.stats.rounds > 1
    queue.close()


def test_the_lag_reported_is_the_oldest_record_of_the_last_second(tmp_path: Path) -> None:
    """A chunk holding only a quiet run's fresh record must not hide the noisy run's lag (/metrics)."""
    queue = MemoryQueue()
    processor = _processor(tmp_path, queue, batch=1, round_events=10, round_target_s=0.0)
    queue.publish(NOISY, [_metrics(NOISY, 0, 10)])
    time.sleep(0.3)
    queue.publish(QUIET, [_metrics(QUIET, 0, 2)])
    processor.run_once(timeout=1.0)  # the noisy run's record (0.3 s old): the round is full (round_events)
    processor.run_once(timeout=1.0)  # the quiet run's, fresh
    assert (processor.stats.records, processor.stats.rounds) == (2, 2)
    assert processor.stats.last_lag_s >= 0.3  # still the noisy run's, not the fresh record's
