"""Queue contract, written once against the ABC and run against every implementation.

Adding an implementation is one line in IMPLEMENTATIONS: ``Impl(factory, durable)``, where the factory
takes (tmp_path, pytest request, max_depth) and opens the queue living under tmp_path — calling it again
after ``close()`` must reopen the same queue when ``durable`` is true (a restart).

The contract is what the ABC promises: order per key (a key stays in one partition and one lane of it),
offsets increasing per partition, commits per lane. The memory and SQLite queues have one partition of many
lanes, served round-robin (``fair``: the fairness tests at the end run on them); the Kafka queue runs here
with three partitions (one lane each), on a real broker (Tansu, tests/support/kafka.py), each test on its
own topic and consumer group -- fair across partitions as librdkafka fetches them, not record by record, so
the record-level fairness tests are not its contract. The embedded queues run a second time with four
partitions (``-p4``: a lane's records in partition lane % 4, all of them this consumer's), where everything
here holds as with one; what partitions add is in test_embedded_partitions.py.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Callable, Dict, Iterator, List, NamedTuple

import pytest

from tests.support.kafka import ReadyKafkaQueues, open_test_queue
from trainguard_server.queue.base import Queue, QueueFull, QueueRecord
from trainguard_server.queue.common import lane_of
from trainguard_server.queue.memory import MemoryQueue
from trainguard_server.queue.sqlite import SqliteQueue

DEFAULT_MAX_DEPTH = 10_000
KAFKA_NAMES = pytest.StashKey[Dict[str, str]]()


class Impl(NamedTuple):
    open: Callable[[Path, pytest.FixtureRequest, int], Queue]
    durable: bool
    fair: bool = False  # round-robin over lanes, record by record (the fairness tests)


def open_kafka(tmp_path: Path, request: pytest.FixtureRequest, max_depth: int) -> Queue:
    """A KafkaQueue on the session's broker, its own topic and consumer group per test. The first open of
    a test takes one opened ahead (its group joined: ~2 s on Tansu); opening again in the same test joins
    the same group on the same topic (a restarted consumer), as does an open with a non-default depth."""
    queues: ReadyKafkaQueues = request.getfixturevalue("kafka_queues")
    names: Dict[str, str] = request.node.stash.setdefault(KAFKA_NAMES, {})
    key = str(tmp_path)
    if key not in names and max_depth == DEFAULT_MAX_DEPTH:
        names[key], queue = queues.take()
        return queue
    name = names.setdefault(key, queues.new_name())
    return open_test_queue(queues.bootstrap, name, max_depth=max_depth)


IMPLEMENTATIONS: Dict[str, Impl] = {
    "memory": Impl(lambda tmp_path, request, max_depth: MemoryQueue(max_depth=max_depth), durable=False,
                   fair=True),
    "sqlite": Impl(lambda tmp_path, request, max_depth: SqliteQueue(tmp_path / "queue.db", max_depth=max_depth),
                   durable=True, fair=True),
    "kafka": Impl(open_kafka, durable=True),
    "memory-p4": Impl(lambda tmp_path, request, max_depth: MemoryQueue(max_depth=max_depth, partitions=4),
                      durable=False, fair=True),
    "sqlite-p4": Impl(lambda tmp_path, request, max_depth: SqliteQueue(tmp_path / "queue.db", max_depth=max_depth,
                                                                       partitions=4),
                      durable=True, fair=True),
}

OpenQueue = Callable[..., Queue]


@pytest.fixture(params=sorted(IMPLEMENTATIONS))
def impl(request: pytest.FixtureRequest) -> Impl:
    return IMPLEMENTATIONS[request.param]


@pytest.fixture(params=sorted(name for name, i in IMPLEMENTATIONS.items() if i.fair))
def fair_impl(request: pytest.FixtureRequest) -> Impl:
    return IMPLEMENTATIONS[request.param]


@pytest.fixture
def open_queue(impl: Impl, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[OpenQueue]:
    yield from _opening(impl, request, tmp_path)


@pytest.fixture
def open_fair_queue(fair_impl: Impl, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[OpenQueue]:
    yield from _opening(fair_impl, request, tmp_path)


def _opening(impl: Impl, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[OpenQueue]:
    opened: List[Queue] = []

    def open_(max_depth: int = DEFAULT_MAX_DEPTH) -> Queue:
        queue = impl.open(tmp_path, request, max_depth)
        opened.append(queue)
        return queue

    yield open_
    for queue in opened:
        queue.close()


@pytest.fixture
def queue(open_queue: OpenQueue) -> Queue:
    return open_queue()


def drain(queue: Queue, timeout: float = 0.2) -> List[QueueRecord]:
    out: List[QueueRecord] = []
    while True:
        got = queue.consume(1000, timeout)
        if not got:
            return out
        out += got


def test_publish_returns_increasing_offsets_and_consume_hands_them_out_in_order(queue: Queue) -> None:
    first = queue.publish("run-a", [b"a0", b"a1"])
    second = queue.publish("run-b", [b"b0"])
    third = queue.publish("run-a", [b"a2"])
    published = [("run-a", b"a0", first[0]), ("run-a", b"a1", first[1]), ("run-b", b"b0", second[0]),
                 ("run-a", b"a2", third[0])]
    records = drain(queue)
    assert sorted((r.key, r.value, r.offset) for r in records) == sorted(published)
    partition = {r.value: r.partition for r in records}
    lane = {r.value: (r.partition, r.lane) for r in records}
    assert partition[b"a0"] == partition[b"a1"] == partition[b"a2"]  # one key, one partition
    assert lane[b"a0"] == lane[b"a1"] == lane[b"a2"]  # and one lane in it
    for p in set(partition.values()):  # per partition: offsets increase in publish order
        mine = [x for x in published if partition[x[1]] == p]
        assert [x[2] for x in mine] == sorted(x[2] for x in mine) and len({x[2] for x in mine}) == len(mine)
    for p_lane in set(lane.values()):  # per lane: handed out in publish order
        mine = [x for x in published if lane[x[1]] == p_lane]
        assert [(r.key, r.value, r.offset) for r in records if (r.partition, r.lane) == p_lane] == mine
    now = time.time_ns()
    assert all(now - 60 * 10**9 < r.published_ns <= now for r in records)


def test_records_of_one_key_keep_publish_order_across_many_batches(queue: Queue) -> None:
    for i in range(200):
        queue.publish(f"run-{i % 3}", [f"{i}".encode()])
    records = drain(queue)
    for key in ("run-0", "run-1", "run-2"):
        values = [int(r.value) for r in records if r.key == key]
        assert values == sorted(values) and len(values) in (66, 67)


def test_consume_never_hands_out_a_record_twice_and_respects_max_records(queue: Queue) -> None:
    queue.publish("k", [bytes([i]) for i in range(10)])
    batches = [queue.consume(3, 0.5) for _ in range(4)]
    assert [len(b) for b in batches] == [3, 3, 3, 1]
    values = [r.value for b in batches for r in b]
    assert values == [bytes([i]) for i in range(10)]
    assert queue.consume(3, 0.05) == []


def test_depth_counts_published_and_uncommitted_records(queue: Queue) -> None:
    assert queue.depth() == 0
    queue.publish("k", [b"1", b"2", b"3"])
    assert queue.depth() == 3
    records = queue.consume(10, 0.5)
    assert queue.depth() == 3  # handed out is not committed
    queue.commit(records[:1])
    assert queue.depth() == 2
    queue.commit(records)
    assert queue.depth() == 0
    queue.commit(records)  # committing again is harmless
    assert queue.depth() == 0


def test_commit_covers_everything_before_the_record(queue: Queue) -> None:
    queue.publish("k", [b"1", b"2", b"3", b"4"])
    records = queue.consume(10, 0.5)
    queue.commit([records[2]])
    assert queue.depth() == 1
    queue.publish("k", [b"5"])
    assert [r.value for r in queue.consume(10, 0.5)] == [b"5"]


def test_commit_of_nothing_is_a_no_op(queue: Queue) -> None:
    queue.publish("k", [b"1"])
    queue.commit([])
    assert queue.depth() == 1


def test_empty_publish_stores_nothing(queue: Queue) -> None:
    assert queue.publish("k", []) == []
    assert queue.depth() == 0 and queue.consume(10, 0.05) == []


def test_large_values_round_trip(queue: Queue) -> None:
    blob = bytes(range(256)) * 4096  # 1 MiB
    queue.publish("k", [blob, b""])
    records = drain(queue)
    assert [r.value for r in records] == [blob, b""]


def test_consume_waits_for_the_timeout_when_empty(queue: Queue) -> None:
    start = time.monotonic()
    assert queue.consume(10, 0.3) == []
    assert time.monotonic() - start >= 0.28
    start = time.monotonic()
    assert queue.consume(10, 0) == []
    assert time.monotonic() - start < 1.0


def test_a_blocked_consumer_wakes_when_a_record_is_published(queue: Queue) -> None:
    got: List[QueueRecord] = []
    woke_after: List[float] = []

    def consumer() -> None:
        start = time.monotonic()
        got.extend(queue.consume(10, 20.0))
        woke_after.append(time.monotonic() - start)

    thread = threading.Thread(target=consumer)
    thread.start()
    time.sleep(0.3)
    assert not got
    queue.publish("k", [b"wake up"])
    thread.join(10)
    assert [r.value for r in got] == [b"wake up"]
    assert woke_after[0] < 10.0  # long before the 20 s timeout (typically ~0.3 s)


def test_queue_full_rejects_the_whole_call_and_recovers_after_commit(open_queue: OpenQueue) -> None:
    queue = open_queue(max_depth=3)
    queue.publish("k", [b"1", b"2"])
    queue.publish("k", [b"3", b"4"])  # the call crossing the line is accepted whole
    with pytest.raises(QueueFull) as err:
        queue.publish("k", [b"5"])
    assert err.value.retry_after > 0
    assert queue.depth() == 4
    records = drain(queue)
    assert [r.value for r in records] == [b"1", b"2", b"3", b"4"]  # nothing of the rejected call
    queue.commit(records)
    queue.publish("k", [b"6"])
    assert [r.value for r in queue.consume(10, 0.5)] == [b"6"]


@pytest.mark.parametrize("max_records, timeout", [(0, 0.1), (-1, 0.1), (1, -1.0)])
def test_invalid_consume_arguments_are_value_errors(queue: Queue, max_records: int, timeout: float) -> None:
    with pytest.raises(ValueError):
        queue.consume(max_records, timeout)


def test_concurrent_publishers_lose_nothing(queue: Queue) -> None:
    def publisher(n: int) -> None:
        for i in range(100):
            queue.publish(f"run-{n}", [f"{n}:{i}".encode()])

    threads = [threading.Thread(target=publisher, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    consumed: List[QueueRecord] = []
    deadline = time.monotonic() + 30
    while len(consumed) < 400 and time.monotonic() < deadline:
        batch = queue.consume(50, 0.5)
        consumed += batch
        queue.commit(batch)
    for t in threads:
        t.join()
    consumed += drain(queue, 0.1)
    assert sorted(r.value for r in consumed) == sorted(f"{n}:{i}".encode() for n in range(4) for i in range(100))
    for n in range(4):
        mine = [int(r.value.split(b":")[1]) for r in consumed if r.key == f"run-{n}"]
        assert mine == sorted(mine)
    assert queue.depth() == 0


def test_uncommitted_records_are_redelivered_after_reopen(impl: Impl, open_queue: OpenQueue) -> None:
    if not impl.durable:  # the documented difference: a memory queue starts empty after a restart
        queue = open_queue()
        queue.publish("k", [b"1"])
        queue.close()
        assert open_queue().depth() == 0
        return
    queue = open_queue()
    queue.publish("k", [b"1", b"2", b"3"])
    queue.publish("j", [b"4"])
    records = drain(queue)
    k = [r for r in records if r.key == "k"]
    j = [r for r in records if r.key == "j"]
    assert [r.value for r in k] == [b"1", b"2", b"3"] and [r.value for r in j] == [b"4"]
    queue.commit(k[:2])
    queue.close()
    reopened = open_queue()
    assert reopened.depth() == 2
    again = drain(reopened)
    assert sorted((r.key, r.value) for r in again) == [("j", b"4"), ("k", b"3")]
    assert sorted((r.partition, r.offset) for r in again) == sorted((r.partition, r.offset) for r in k[2:] + j)
    new = reopened.publish("k", [b"5"])
    assert new[0] > k[-1].offset  # offsets are never reused
    reopened.commit(again)
    reopened.close()
    assert [r.value for r in drain(open_queue())] == [b"5"]


def test_offsets_are_never_reused_after_everything_is_committed(impl: Impl, open_queue: OpenQueue) -> None:
    queue = open_queue()
    offsets = queue.publish("k", [b"1", b"2"])
    queue.commit(queue.consume(10, 0.5))
    if impl.durable:
        queue.close()
        queue = open_queue()
    assert queue.publish("k", [b"3"])[0] > offsets[-1]


def test_close_wakes_a_blocked_consumer(open_queue: OpenQueue) -> None:
    queue = open_queue()
    result: List[object] = []

    def consumer() -> None:
        try:
            result.append(queue.consume(10, 20.0))
        except Exception as exc:  # a closed queue may also say so
            result.append(exc)

    thread = threading.Thread(target=consumer)
    thread.start()
    time.sleep(0.2)
    queue.close()
    thread.join(10)
    assert not thread.is_alive()
    assert result == [[]] or isinstance(result[0], Exception)


# --- fairness between keys (the queues with lanes: memory, SQLite) ---------------------------------------
NOISY, QUIET = "noisy", "quiet"  # in different lanes (checked): lane_of 51814 and 46244 of 65,536


def _two_lanes(queue: Queue) -> None:
    lanes = queue.lanes
    assert lane_of(NOISY, lanes) != lane_of(QUIET, lanes)


def test_a_noisy_keys_backlog_does_not_delay_another_keys_record_beyond_one_consume(
        open_fair_queue: OpenQueue) -> None:
    queue = open_fair_queue()
    _two_lanes(queue)
    queue.publish(NOISY, [f"n{i}".encode() for i in range(500)])
    assert [r.value for r in queue.consume(3, 0.5)] == [b"n0", b"n1", b"n2"]  # one lane: in order
    queue.publish(QUIET, [b"q0", b"q1"])
    first = queue.consume(2, 0.5)  # the noisy lane's turn, then the quiet one's: not its 497 behind
    assert [r.value for r in first] == [b"n3", b"q0"]
    assert [r.value for r in queue.consume(4, 0.5)] == [b"n4", b"q1", b"n5", b"n6"]
    rest = drain(queue)
    assert [r.value for r in rest] == [f"n{i}".encode() for i in range(7, 500)]
    assert len({r.lane for r in first}) == 2


def test_many_keys_take_turns_one_record_each(open_fair_queue: OpenQueue) -> None:
    queue = open_fair_queue()
    keys = [f"run-{i}" for i in range(5)]
    lanes = queue.lanes
    assert len({lane_of(k, lanes) for k in keys}) == len(keys)
    for key in keys:
        queue.publish(key, [f"{key}:{i}".encode() for i in range(20)])
    got = queue.consume(10, 0.5)
    assert sorted(r.key for r in got) == sorted(keys * 2)  # every key twice, none more: a round-robin
    assert [r.key for r in got[:5]] == keys  # in the order their lanes first held records
    records = got + drain(queue)
    for key in keys:
        assert [r.value for r in records if r.key == key] == [f"{key}:{i}".encode() for i in range(20)]


def test_a_commit_covers_its_own_lane_only(fair_impl: Impl, open_fair_queue: OpenQueue) -> None:
    """Records are handed out out of offset order across lanes: committing a later offset of one lane must
    not drop an earlier record of another lane that is handed out and not committed (or not handed out)."""
    queue = open_fair_queue()
    _two_lanes(queue)
    queue.publish(NOISY, [b"n0", b"n1", b"n2", b"n3"])
    queue.publish(QUIET, [b"q0"])
    got = queue.consume(2, 0.5)
    assert [r.value for r in got] == [b"n0", b"q0"]
    queue.commit([got[1]])          # q0: its offset is above all of the noisy records
    assert queue.depth() == 4
    assert [r.value for r in queue.consume(10, 0.5)] == [b"n1", b"n2", b"n3"]
    queue.commit([got[0]])          # n0 only: n1-n3 are handed out, not committed
    assert queue.depth() == 3
    if fair_impl.durable:
        queue.close()
        queue = open_fair_queue()   # a restart: what was handed out and not committed comes again
        assert queue.depth() == 3
        again = drain(queue)
        assert [r.value for r in again] == [b"n1", b"n2", b"n3"]
        queue.commit(again)
        assert queue.depth() == 0
        queue.close()
        assert open_fair_queue().depth() == 0


def test_records_committed_before_they_were_handed_out_are_not_handed_out(open_fair_queue: OpenQueue) -> None:
    queue = open_fair_queue()
    _two_lanes(queue)
    queue.publish(NOISY, [b"n0", b"n1", b"n2"])
    queue.publish(QUIET, [b"q0"])
    first = queue.consume(1, 0.5)
    assert [r.value for r in first] == [b"n0"]
    late = QueueRecord(partition=first[0].partition, offset=first[0].offset + 1, key=NOISY, value=b"n1",
                       published_ns=first[0].published_ns, lane=first[0].lane)
    queue.commit([late])            # n0 and n1 (everything before it in its lane)
    assert queue.depth() == 2
    assert sorted(r.value for r in drain(queue)) == [b"n2", b"q0"]


def test_a_commit_of_an_unknown_lane_is_a_value_error(open_fair_queue: OpenQueue) -> None:
    queue = open_fair_queue()
    queue.publish(QUIET, [b"q0"])
    record = queue.consume(1, 0.5)[0]
    bad = QueueRecord(partition=0, offset=record.offset, key=QUIET, value=b"", published_ns=0,
                      lane=queue.lanes)
    with pytest.raises(ValueError):
        queue.commit([bad])
    assert queue.depth() == 1
