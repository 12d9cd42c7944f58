"""KafkaQueue beyond the contract, on a real Kafka-protocol broker (Tansu, tests/support/kafka.py): topic
creation, dead letters, backpressure, a broker that is not there, depth seen from another process, the
server's queue selection — and the fault test of issue 5: the broker restarted mid-stream (Tansu on S3
storage served by a local moto_server, since its memory storage forgets everything on restart), then a
consumer killed with uncommitted records and restarted."""

from __future__ import annotations

import json
import threading
import time
import uuid
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
from confluent_kafka import Consumer, ConsumerGroupTopicPartitions, TopicPartition
from confluent_kafka.admin import AdminClient, ConfigResource

from tests.services.killing import run_until_killed
from tests.support.kafka import (
    CLIENT_TEST_CONFIG,
    CONSUMER_TEST_CONFIG,
    SESSION_TIMEOUT_MS,
    MotoS3,
    Tansu,
    open_test_queue,
)
from tests.support.net import free_port
from trainguard.v1 import events_pb2, ingest_pb2
from trainguard_server.config import Settings
from trainguard_server.queue import open_queue
from trainguard_server.queue.base import QueueFull, QueueRecord
from trainguard_server.queue.kafka import (
    HEADER_OFFSET,
    HEADER_PARTITION,
    HEADER_REASON,
    HEADER_TOPIC,
    KafkaQueue,
    KafkaQueueError,
    ingest_request_problem,
)
from trainguard_server.queue.sqlite import SqliteQueue


def ingest_request(event_ids: List[str], run_id: str = "run-x") -> bytes:
    """What the gateway publishes: a serialized IngestRequest (here with bare envelopes)."""
    return ingest_pb2.IngestRequest(
        events=[events_pb2.Envelope(event_id=e, run_id=run_id) for e in event_ids]).SerializeToString()


def event_ids(record: QueueRecord) -> List[str]:
    return [e.event_id for e in ingest_pb2.IngestRequest.FromString(record.value).events]


def drain(queue: KafkaQueue, timeout: float = 0.3) -> List[QueueRecord]:
    out: List[QueueRecord] = []
    while True:
        got = queue.consume(1000, timeout)
        if not got:
            return out
        out += got


def read_topic(bootstrap: str, topic: str, expect: int, timeout: float = 10.0) -> list:
    """Every message of partition 0 of ``topic`` (no consumer group: assigned directly)."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "test-reader", "enable.auto.commit": False,
                         **CONSUMER_TEST_CONFIG})
    consumer.assign([TopicPartition(topic, 0, 0)])
    out: list = []
    deadline = time.monotonic() + timeout
    while len(out) < expect and time.monotonic() < deadline:
        msg = consumer.poll(0.1)
        if msg is not None and msg.error() is None:
            out.append(msg)
    consumer.close()
    return out


def test_topics_are_created_with_their_partitions_and_retention_and_an_existing_one_is_kept(tansu: Tansu) -> None:
    queue = KafkaQueue(tansu.bootstrap, "created-topic", partitions=5, retention_ms=3_600_000, consume=False)
    again = KafkaQueue(tansu.bootstrap, "created-topic", partitions=2, consume=False)  # exists: left as it is
    try:
        admin = AdminClient({"bootstrap.servers": tansu.bootstrap})
        topics = admin.list_topics(timeout=10).topics
        assert len(topics["created-topic"].partitions) == 5
        assert len(topics["created-topic.dlq"].partitions) == 1
        resource = ConfigResource(ConfigResource.Type.TOPIC, "created-topic")
        config = admin.describe_configs([resource])[resource].result(10)
        assert config["retention.ms"].value == "3600000"
        assert int(config["max.message.bytes"].value) > 16 * 2**20
    finally:
        again.close()
        queue.close()


def test_undecodable_records_go_to_the_dead_letter_topic_with_the_reason(tansu: Tansu) -> None:
    """A value that is not an IngestRequest never reaches the processor and never blocks its partition:
    it is copied to <topic>.dlq with the reason and its origin in headers, and its offset is committed
    with the records around it (or at once when nothing before it is pending)."""
    name = f"dlq-{uuid.uuid4().hex[:8]}"
    queue = open_test_queue(tansu.bootstrap, name, partitions=1, validate=ingest_request_problem)
    try:
        queue.publish("run-1", [ingest_request(["a"]), b"not protobuf", ingest_request(["b"])])
        records = drain(queue)
        assert [event_ids(r) for r in records] == [["a"], ["b"]]
        assert [r.offset for r in records] == [0, 2]
        queue.commit(records)
        queue.publish("run-1", [b"\xff\xfftrailing garbage"])  # a dead letter with nothing pending before it
        assert drain(queue) == []
        letters = read_topic(tansu.bootstrap, name + ".dlq", expect=2)
        assert [m.value() for m in letters] == [b"not protobuf", b"\xff\xfftrailing garbage"]
        headers = [dict(m.headers()) for m in letters]
        assert [(h[HEADER_TOPIC], h[HEADER_PARTITION], h[HEADER_OFFSET]) for h in headers] == [
            (name.encode(), b"0", b"1"), (name.encode(), b"0", b"3")]
        assert all(h[HEADER_REASON].startswith(b"not a serialized trainguard.v1.IngestRequest") for h in headers)
        assert letters[0].key() == b"run-1"
        assert queue.depth() == 0  # the dead letters count as done: nothing is handed out again
        assert queue.dead_letters == 2
        admin = AdminClient({"bootstrap.servers": tansu.bootstrap})
        group = admin.list_consumer_group_offsets(
            [ConsumerGroupTopicPartitions(name, [TopicPartition(name, 0)])])[name].result(10)
        assert [tp.offset for tp in group.topic_partitions] == [4]  # a restart resumes after the last letter
    finally:
        queue.close()


def test_a_full_local_producer_queue_refuses_the_whole_call(tansu: Tansu) -> None:
    queue = KafkaQueue(tansu.bootstrap, "small-buffer", consume=False, retry_after=2.5,
                       producer_config={"queue.buffering.max.messages": 4})
    try:
        with pytest.raises(QueueFull) as err:
            queue.publish("k", [b"1", b"2", b"3", b"4", b"5"])
        assert err.value.retry_after == 2.5
        assert queue.publish("k", [b"1", b"2", b"3", b"4"]) == [0, 1, 2, 3]  # nothing of the refused call
    finally:
        queue.close()


def test_publish_fails_when_no_broker_acknowledges() -> None:
    """Broker down: a publish raises after the delivery timeout instead of claiming durability (the
    gateway answers 503 and the client retries); depth() answers from what it knows."""
    queue = KafkaQueue(f"127.0.0.1:{free_port()}", "nowhere", consume=False, create_topics=False,
                       delivery_timeout_s=1.0)
    try:
        start = time.monotonic()
        with pytest.raises(KafkaQueueError, match="delivery"):
            queue.publish("k", [b"lost?"])
        assert time.monotonic() - start < 8
        assert queue.depth() == 0
    finally:
        queue.close()


def test_depth_counts_another_process_publishes_from_the_broker(tansu: Tansu) -> None:
    """The gateway's queue and the processor's may be different processes: depth comes from the broker's
    end offsets and the group's committed offsets. (Tansu 0.6.0 reports a partition's end as the base
    offset of its last batch + 1, so it would under-count records batched together; one record per
    publish here, as each gateway request publishes one value per run.)"""
    publisher = KafkaQueue(tansu.bootstrap, "depth-elsewhere", partitions=2, consume=False)
    observer = KafkaQueue(tansu.bootstrap, "depth-elsewhere", consume=False, create_topics=False)
    try:
        for i in range(5):
            publisher.publish(f"run-{i}", [b"x"])
        assert observer.depth() == 5
    finally:
        observer.close()
        publisher.close()


def test_the_server_opens_the_queue_its_settings_name(tansu: Tansu, tmp_path: Path) -> None:
    default = open_queue(Settings(data_dir=tmp_path), tmp_path)
    assert isinstance(default, SqliteQueue)  # `trainguard serve` stays embedded
    default.close()
    settings = Settings(queue="kafka", kafka_bootstrap_servers=tansu.bootstrap, kafka_topic="from-settings",
                        kafka_partitions=4, kafka_group_id="settings-group", max_queue_depth=7,
                        kafka_session_timeout_ms=SESSION_TIMEOUT_MS,
                        kafka_client_config=json.dumps({"client.id": "tg-test"}))
    queue = open_queue(settings, tmp_path)
    try:
        assert isinstance(queue, KafkaQueue)
        assert (queue.topic, queue.dead_letter_topic, queue.group_id) == (
            "from-settings", "from-settings.dlq", "settings-group")
        topics = AdminClient({"bootstrap.servers": tansu.bootstrap}).list_topics(timeout=10).topics
        assert len(topics["from-settings"].partitions) == 4
    finally:
        queue.close()
    with pytest.raises(ValueError, match="JSON object"):
        open_queue(settings.model_copy(update={"kafka_client_config": "[1]"}), tmp_path)


# --- faults ------------------------------------------------------------------------------------------

S3_CONSUMER_CONFIG = {"fetch.wait.max.ms": 500}
CHILD_CONSUMER = """
    import json, time
    from trainguard.v1.ingest_pb2 import IngestRequest
    from trainguard_server.queue.kafka import KafkaQueue
    queue = KafkaQueue({bootstrap!r}, {topic!r}, group_id={topic!r}, create_topics=False,
                       session_timeout_ms={session}, client_config={client!r}, consumer_config={consumer!r})
    records = []
    deadline = time.monotonic() + 30
    while len(records) < {expect} and time.monotonic() < deadline:
        records += queue.consume(1000, 0.2)
    queue.commit(records[:{commit}])
    ids = lambda r: [e.event_id for e in IngestRequest.FromString(r.value).events]
    print("done " + json.dumps([[r.partition, r.offset, ids(r)] for r in records]), flush=True)
    time.sleep(60)
"""


def test_broker_restart_mid_stream_loses_nothing_and_a_killed_consumer_resumes_from_committed_offsets(
        tmp_path: Path) -> None:
    """Issue 5's fault test, on Tansu with S3 storage (moto_server): a publisher and a consumer run while the
    broker is SIGKILLed and restarted. Every acknowledged event arrives, each run in publish order, and
    whatever arrives twice is removed by event id, as the stores and the pipeline do (publishes blocked
    during the outage are delivered by the producer's retries, no duplicate needed). Then a consumer
    process is SIGKILLed holding 7 uncommitted records: the group's committed offsets are exactly its
    commits, its successor is handed exactly the uncommitted records, starting at the committed offsets,
    and the records both consumers saw are duplicates the event ids remove.

    Tansu compromises: its memory storage would lose everything on the restart, hence S3 on moto_server.
    On S3 storage a Fetch that cannot read its records within ``fetch.wait.max.ms`` answers empty, and the
    read cost grows with the partition (measured: with 10 ms a 70-record partition is never read, from
    any offset), so these consumers keep Kafka's default 500 ms wait (S3_CONSUMER_CONFIG) and the stream
    is kept short (S3 on moto costs ~50-90 ms per acknowledged publish)."""
    s3 = MotoS3(tmp_path / "moto.log").start()
    broker = Tansu(tmp_path / "tansu.log", storage="s3://tansu/", env=s3.env).start()
    topic = "fault"
    producer = consumer = None
    try:
        producer = open_test_queue(broker.bootstrap, topic, partitions=3, consume=False, delivery_timeout_s=20.0)
        consumer = open_test_queue(broker.bootstrap, topic, partitions=3, validate=ingest_request_problem,
                                   consumer_config=S3_CONSUMER_CONFIG)
        batches, restart_after = 30, 10
        acked: Dict[str, List[int]] = {}  # run -> batch numbers acknowledged, in order
        publish_errors: List[str] = []
        published = threading.Event()
        restarted = threading.Event()

        def publish() -> None:
            assert producer is not None
            for i in range(batches):
                run = f"run-{i % 4}"
                value = ingest_request([f"{i}:{j}" for j in range(5)], run)
                while True:  # what a client does with a 503/429: retry the same batch (same event ids)
                    try:
                        producer.publish(run, [value])
                        break
                    except (KafkaQueueError, QueueFull) as exc:
                        publish_errors.append(str(exc))
                        time.sleep(0.2)
                acked.setdefault(run, []).append(i)
                if i == restart_after:
                    broker.restart(kill=True, down_s=0.5)
                    restarted.set()
            published.set()

        started = time.monotonic()
        thread = threading.Thread(target=publish, name="publisher")
        thread.start()
        seen: List[Tuple[str, str]] = []  # (run, event id) in hand-out order, duplicates included
        pending: List[QueueRecord] = []
        commit_failures = 0
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            records = consumer.consume(500, 0.2)
            for record in records:
                seen += [(record.key, e) for e in event_ids(record)]
            pending += records
            if pending:
                try:
                    consumer.commit(pending)  # after "processing": the processor's order
                    pending = []
                except KafkaQueueError:  # broker away: keep them, commit with the next round
                    commit_failures += 1
            wanted = {f"{i}:{j}" for runs in acked.values() for i in runs for j in range(5)}
            if published.is_set() and not pending and wanted <= {e for _, e in seen}:
                break
        thread.join(30)
        assert restarted.is_set() and published.is_set()

        unique = {e for _, e in seen}
        assert unique == {f"{i}:{j}" for i in range(batches) for j in range(5)}  # nothing lost, nothing invented
        for run, numbers in acked.items():  # per run, first arrivals keep publish order
            first: List[int] = []
            for key, event in seen:
                n = int(event.split(":")[0])
                if key == run and event.endswith(":0") and n not in first:
                    first.append(n)
            assert first == numbers
        print(f"broker restart: {time.monotonic() - started:.1f} s, {len(seen)} events handed out, "
              f"{len(seen) - len(unique)} duplicates removed by id, {len(publish_errors)} publish retries, "
              f"{commit_failures} failed commits retried")
        assert consumer.depth() == 0
        consumer.close()
        consumer = None

        # a consumer process SIGKILLed with uncommitted records; its successor resumes at the commits
        for i in range(batches, batches + 12):
            producer.publish(f"run-{i % 4}", [ingest_request([f"{i}:0"], f"run-{i % 4}")])
        code = CHILD_CONSUMER.format(bootstrap=broker.bootstrap, topic=topic, session=SESSION_TIMEOUT_MS,
                                     client=CLIENT_TEST_CONFIG, consumer=S3_CONSUMER_CONFIG, expect=12, commit=5)
        child = json.loads(run_until_killed(code, acks=1)[0])  # [partition, offset, event ids] handed out
        handed = [(p, o) for p, o, _ in child]
        assert len(handed) == 12
        expected: Dict[int, int] = {}  # committed offsets: the child's commits, else where phase 1 ended
        for partition, offset in handed:
            expected.setdefault(partition, offset)
        for partition, offset in handed[:5]:
            expected[partition] = max(expected[partition], offset + 1)
        successor = open_test_queue(broker.bootstrap, topic, partitions=3, consumer_config=S3_CONSUMER_CONFIG)
        consumer = successor
        # the dead member keeps its partitions until its session times out: they come with a rebalance
        again: List[QueueRecord] = []
        deadline = time.monotonic() + 30
        while len({(r.partition, r.offset) for r in again}) < 7 and time.monotonic() < deadline:
            again += successor.consume(1000, 0.2)
        again += drain(successor)
        admin = AdminClient({"bootstrap.servers": broker.bootstrap})
        group = admin.list_consumer_group_offsets(
            [ConsumerGroupTopicPartitions(topic, [TopicPartition(topic, p) for p in expected])])[topic].result(10)
        assert {tp.partition: tp.offset for tp in group.topic_partitions} == expected
        assert {(r.partition, r.offset) for r in again} == set(handed[5:])  # every uncommitted one, only them
        for partition in {p for p, _ in handed[5:]}:  # each partition resumes at its committed offset
            assert min(r.offset for r in again if r.partition == partition) == expected[partition]
        # what the dead consumer had processed without committing comes twice: the event ids dedupe it
        arrivals = [e for _, _, ids in child for e in ids] + [e for r in again for e in event_ids(r)]
        assert len(arrivals) == 12 + 7 and set(arrivals) == {f"{i}:0" for i in range(batches, batches + 12)}
    finally:
        for queue in (consumer, producer):
            if queue is not None:
                queue.close()
        broker.stop(kill=True)
        s3.stop()
