"""Issue 20: processors over Kafka keep detection state per partition, and a rebalance hands it over.

Two embedded processors join one consumer group on a real Kafka-protocol broker (Tansu) and share the
stores. The first owns every partition while half of each recorded run (the scenario corpus: real
trainings as the SDK sent them) is processed; then the second joins, the group rebalances -- the first
saves the pipelines of the partitions it gives up and commits their records in the revoke callback, the
second restores them on assignment -- and the rest of every run is processed by whichever owns it now.

Every run must end with exactly the incidents one pipeline that saw the whole run produces (the same
records in one process, no rebalance), each partition must be owned by one processor only, each run must
live in the pipeline of the one that owns its partition and nowhere else, and at least one run must have
been handed over mid-stream (its first half processed by one processor, its second half by the other).
"""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import pytest

from tests.scenarios.corpus import SCENARIOS
from tests.support.kafka import Tansu
from trainguard import wire
from trainguard_engine.catalogue import DetectionSettings
from trainguard_engine.pipeline import Pipeline, ReadEnvelope
from trainguard_server.config import Settings
from trainguard_server.processor.embedded import PARTITION_PREFIX, EmbeddedProcessor
from trainguard_server.queue.kafka import KafkaQueue
from trainguard_server.storage.select import Stores, open_stores

PARTITIONS = 4
RECORD = 50
SETTINGS = DetectionSettings.from_overrides({"stall_min_s": 5.0})
RUNS = [s for s in SCENARIOS if s.source in ("cpu", "gpu")][:12]
CONSUMER = {"fetch.wait.max.ms": 10}


def _records(events: List[Dict[str, Any]]) -> List[bytes]:
    return [wire.prepare_batch(events[i:i + RECORD]).request.SerializeToString()
            for i in range(0, len(events), RECORD)]


Verdict = List[Tuple[str, str, str, int, int, str]]


def _verdict(incidents: Any) -> Verdict:
    """What decides a run's verdict, per incident: kind, status, where and on which rank it started."""
    return sorted((i.category, i.subtype, i.status, i.first_step, i.lead_rank, i.incident_id)
                  for i in incidents)


def _expected() -> Dict[str, Verdict]:
    """Each run's incidents when one pipeline sees the whole run (in records, as published)."""
    out: Dict[str, Verdict] = {}
    for scenario in RUNS:
        pipeline = Pipeline(SETTINGS)
        events = scenario.events()
        for i in range(0, len(events), RECORD):
            pipeline.process(events[i:i + RECORD])
        run_id = events[0]["run_id"]
        out[run_id] = _verdict(pipeline.incidents())
    return out


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Tansu]:
    tansu = Tansu(tmp_path / "tansu.log").start()
    yield tansu
    tansu.stop(kill=True)


class Member:
    """One processor of the group: its queue, stores and processor, driven by a thread on demand."""

    def __init__(self, bootstrap: str, topic: str, data_dir: Path) -> None:
        self.queue = KafkaQueue(bootstrap, topic, group_id=topic, partitions=PARTITIONS,
                                session_timeout_ms=6000, consumer_config=CONSUMER)
        self.stores: Stores = open_stores(Settings(), data_dir)
        self.processor = EmbeddedProcessor(self.queue, self.stores.events, self.stores.metrics,
                                           self.stores.incidents, SETTINGS, batch=64, snapshot_every_s=0.2,
                                           tick_interval_s=1e12)  # no wall-clock timers: deterministic
        self.seen: Dict[str, int] = {}  # run id -> envelopes this member processed
        original = self.processor._run_pipeline

        def counting(partition: int, envelopes: Any, points: Any) -> None:
            for env in envelopes:  # dicts, and plain metric batches already read (decode.read_request)
                run_id = env.run_id if isinstance(env, ReadEnvelope) else env["run_id"]
                self.seen[run_id] = self.seen.get(run_id, 0) + 1
            original(partition, envelopes, points)
        self.processor._run_pipeline = counting  # type: ignore[method-assign]

    def runs(self) -> Dict[int, List[str]]:
        return {p: [r.run_id for r in pipeline.runs()] for p, pipeline in self.processor.pipelines.items()}

    def close(self) -> None:
        self.queue.close()
        self.stores.close()


def _pump(members: List[Member], until: Any, timeout: float) -> None:
    """Run every member's rounds on its own thread until ``until()`` holds (or ``timeout``)."""
    stop = threading.Event()
    errors: List[BaseException] = []

    def loop(member: Member) -> None:
        try:
            while not stop.is_set():
                member.processor.run_once(timeout=0.05)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=loop, args=(m,), daemon=True) for m in members]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    try:
        while not until() and time.monotonic() < deadline and not errors:
            time.sleep(0.05)
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    assert not errors, errors
    assert until(), "the group did not get there in time"


def test_rebalance_hands_partition_state_over(broker: Tansu, tmp_path: Path) -> None:
    topic = f"part-{uuid.uuid4().hex[:8]}"
    data_dir = tmp_path / "stores"
    publisher = KafkaQueue(broker.bootstrap, topic, group_id=topic, partitions=PARTITIONS, consume=False)
    runs: List[Tuple[str, List[bytes]]] = []
    for scenario in RUNS:
        events = scenario.events()
        runs.append((events[0]["run_id"], _records(events)))
    first_half = sum(len(records) // 2 for _run, records in runs)
    total = sum(len(records) for _run, records in runs)
    one = Member(broker.bootstrap, topic, data_dir)
    two = None
    try:
        assert one.queue.wait_ready(30.0)
        for run_id, records in runs:
            publisher.publish(run_id, records[:len(records) // 2])
        _pump([one], lambda: one.processor.stats.records >= first_half, 60.0)
        assert sorted(one.processor.pipelines) == list(range(PARTITIONS))  # alone: every partition

        two = Member(broker.bootstrap, topic, data_dir)
        both = [one, two]
        _pump(both, lambda: bool(two.processor.pipelines) and len(one.processor.pipelines) < PARTITIONS,
              60.0)
        for run_id, records in runs:
            publisher.publish(run_id, records[len(records) // 2:])
        _pump(both, lambda: one.queue.depth() + two.queue.depth() == 0
              and sum(m.processor.stats.records for m in both) >= total, 90.0)
        for member in both:
            member.processor.checkpoint()

        owned = [set(m.processor.pipelines) for m in both]
        assert owned[0] and owned[1] and not owned[0] & owned[1]
        assert owned[0] | owned[1] == set(range(PARTITIONS))
        # a run lives in the pipeline of its partition's owner only
        where: Dict[str, List[Tuple[int, int]]] = {}
        for index, member in enumerate(both):
            for partition, run_ids in member.runs().items():
                for run_id in run_ids:
                    where.setdefault(run_id, []).append((index, partition))
        assert sorted(where) == sorted(r for r, _ in runs)
        assert all(len(places) == 1 for places in where.values()), where
        # at least one run was handed over mid-stream: both members processed some of it
        moved = [r for r, _ in runs if one.seen.get(r) and two.seen.get(r)]
        assert moved, (one.seen, two.seen)
        # every run ends with what one pipeline that saw it whole decides
        expected = _expected()
        got = {r: _verdict(one.stores.incidents.list_incidents("scenarios", run_id=r, limit=100).items)
               for r, _ in runs}
        assert got == expected
        assert sum(len(v) for v in expected.values()) >= 8  # the runs went wrong in many ways
        # the state is kept per partition
        keys = one.stores.incidents.state_keys(PARTITION_PREFIX)
        assert {int(k[len(PARTITION_PREFIX):].split("/", 1)[0]) for k in keys} == set(range(PARTITIONS))
    finally:
        publisher.close()
        one.close()
        if two is not None:
            two.close()
