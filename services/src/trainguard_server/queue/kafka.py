"""KafkaQueue: the queue contract on an Apache Kafka topic (``confluent-kafka``, i.e. librdkafka).

- **publish** produces every value with the run id as key through an idempotent producer (``acks=all``,
  ``enable.idempotence``; the ``murmur2_random`` partitioner, so a run lands in the partition a Java/Flink
  producer would pick) and returns the offsets once the broker has acknowledged all of them: an
  acknowledged batch is durable. One key is one partition, so a run's batches keep their order. A full
  local producer queue (``queue.buffering.max.*``) or a backlog at ``max_depth`` answers QueueFull with
  ``retry_after`` and produces nothing of the call; a failed delivery raises :class:`KafkaQueueError`
  (the gateway answers 503: the client retries, event ids make that safe).
- **topics**: the ingest topic (``partitions``, ``retention.ms``, ``max.message.bytes``) and its dead-letter
  topic are created at open if absent (AdminClient). An existing topic is used as it is.
- **consume** reads as a member of the consumer group ``group_id`` (subscribe; the group assigns the
  partitions) and hands records out in offset order per partition, so per key. It waits for the first
  record, then takes what is already fetched, up to ``max_records``.
- **commit** commits, synchronously, the offset after the highest committed record of each partition this
  member owns, and never past a record handed out and not yet committed. The processor calls it only
  after its outputs are durable (processor/embedded.py: stores written, state snapshot saved, then
  commit). Nothing is auto-committed: after a restart or a rebalance, every uncommitted record is handed
  out again (at-least-once; the stores and the pipeline de-duplicate by event id). Records of partitions
  the group has moved to another member are not committed here: their new owner gets them again.
- **dead letters**: with ``validate`` (the server passes :func:`ingest_request_problem`), a record whose
  value is not a serialized ``trainguard.v1.IngestRequest`` is never handed out: it is copied to the
  dead-letter topic (same key and value, headers ``trainguard-dlq-reason``, ``-topic``, ``-partition``,
  ``-offset``), and once that copy is acknowledged its offset counts as done, so one bad record never
  blocks its partition. The check lives here rather than in the processor so that the pure core and the
  processor stay untouched and every runtime consuming this queue gets it; it costs one extra protobuf
  parse per record.
- **depth** = Σ over partitions of (end offset - committed offset), from the broker (ListOffsets,
  OffsetFetch), corrected with what this process knows for sure (its own acknowledged publishes, what it
  fetched and committed). Backpressure in ``publish`` uses the same figure without a round trip: a
  background thread refreshes it from the broker every ``depth_refresh_s``, and this process's own
  publishes and commits keep it exact in between.
  Caveat, Tansu 0.6.0 (the broker the tests run): it reports a partition's end offset as the base offset
  of its last record batch + 1, short by the number of records in that batch minus one, so another
  process's publishes can be under-counted by that much; Apache Kafka reports it exactly.

Threads: ``publish`` and ``depth`` from any thread; ``consume``, ``commit`` and ``wait_ready`` from one
thread, the processor's (a call on the consumer from another thread waits while it polls); ``close`` from
any thread (a blocked ``consume`` returns within 0.1 s). A fatal librdkafka error (e.g. an idempotent
producer fenced by the broker) is logged and makes calls fail: restart the process.

On Tansu (the tests): its Fetch waits ``fetch.wait.max.ms`` even when records arrive (Kafka answers at
once), so lower it there for latency — but not on its S3 storage, where a Fetch that cannot read its
records within the wait answers empty; a JoinGroup is answered after half the session timeout.

Settings (``TRAINGUARD_QUEUE=kafka``, ``TRAINGUARD_KAFKA_*``) are in config.py; ``client_config`` passes
any librdkafka property (security.protocol, sasl.*, ssl.*) to every client.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from functools import partial
from typing import Any, Callable, Deque, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple, Union

from confluent_kafka import (
    OFFSET_INVALID,
    TIMESTAMP_NOT_AVAILABLE,
    Consumer,
    ConsumerGroupTopicPartitions,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, NewTopic, OffsetSpec

from .base import Queue, QueueFull, QueueRecord, RebalanceListener
from .common import check_consume_args, check_publish_args

log = logging.getLogger("trainguard.queue.kafka")

DEFAULT_TOPIC = "trainguard.ingest"
DEFAULT_GROUP = "trainguard-processor"
DLQ_SUFFIX = ".dlq"
HEADER_REASON = "trainguard-dlq-reason"
HEADER_TOPIC = "trainguard-dlq-topic"
HEADER_PARTITION = "trainguard-dlq-partition"
HEADER_OFFSET = "trainguard-dlq-offset"
POLL_SLICE_S = 0.1  # a blocked consume() re-checks close() this often

#: ``validate(value)`` → None when the value is acceptable, else the reason it goes to the dead-letter topic
Validator = Callable[[bytes], Optional[str]]


class KafkaQueueError(RuntimeError):
    """The broker did not take or give what was asked (delivery failed, commit refused, no broker)."""


def ingest_request_problem(value: bytes) -> Optional[str]:
    """None if ``value`` parses as a ``trainguard.v1.IngestRequest`` (what the gateway publishes and the
    processor decodes), else why not: the KafkaQueue's dead-letter check in the server."""
    from trainguard.v1 import ingest_pb2

    try:
        ingest_pb2.IngestRequest.FromString(value)
    except Exception as exc:
        return f"not a serialized trainguard.v1.IngestRequest: {type(exc).__name__}: {exc}"
    return None


def _position(msg: Message) -> Tuple[int, int]:
    """(partition, offset) of a produced or fetched message (always known for those)."""
    partition, offset = msg.partition(), msg.offset()
    return (partition if partition is not None else -1), (offset if offset is not None else -1)


class _Delivery:
    """One publish call waiting for the broker's acknowledgement of each of its values."""

    __slots__ = ("done", "error", "left", "lock", "offsets")

    def __init__(self, n: int) -> None:
        self.offsets: List[int] = [-1] * n
        self.left = n
        self.error: Optional[KafkaError] = None
        self.lock = threading.Lock()
        self.done = threading.Event()


class KafkaQueue(Queue):
    """Queue on the Kafka topic ``topic``, consumed by the consumer group ``group_id``."""

    partitioned = True
    revokes_partitions = True  # a rebalance inside consume() moves partitions to another member

    def __init__(self, bootstrap_servers: str, topic: str = DEFAULT_TOPIC, *, group_id: str = DEFAULT_GROUP,
                 partitions: int = 12, replication_factor: int = -1,
                 retention_ms: int = 7 * 86400 * 1000, max_message_bytes: int = 16 * 2**20,
                 dead_letter_topic: Optional[str] = None, validate: Optional[Validator] = None,
                 max_depth: int = 50_000, retry_after: float = 1.0, session_timeout_ms: int = 10_000,
                 delivery_timeout_s: float = 30.0, depth_refresh_s: float = 1.0,
                 client_config: Optional[Mapping[str, Any]] = None,
                 producer_config: Optional[Mapping[str, Any]] = None,
                 consumer_config: Optional[Mapping[str, Any]] = None,
                 consume: bool = True, create_topics: bool = True) -> None:
        if max_depth < 1:
            raise ValueError("max_depth must be >= 1")
        if partitions < 1:
            raise ValueError("partitions must be >= 1")
        self.topic = topic
        self.dead_letter_topic = dead_letter_topic or topic + DLQ_SUFFIX
        self.group_id = group_id
        self._validate = validate
        self._max_depth = max_depth
        self._retry_after = retry_after
        self._delivery_timeout_s = delivery_timeout_s
        self._depth_refresh_s = depth_refresh_s
        self._max_message_bytes = max_message_bytes
        common: Dict[str, Any] = {"bootstrap.servers": bootstrap_servers,
                                  "logger": logging.getLogger("trainguard.kafka.client"),
                                  "log.connection.close": False}  # idle disconnects are not news
        common.update(client_config or {})
        self._admin_config = dict(common)
        self._admin = AdminClient(self._admin_config)
        if create_topics:
            self._create_topics(partitions, replication_factor, retention_ms)

        pconf: Dict[str, Any] = {
            **common,
            "enable.idempotence": True,         # no duplicates or reordering from producer retries
            "acks": "all",
            "partitioner": "murmur2_random",    # Java's: a run id maps to the same partition everywhere
            "linger.ms": 5,
            "compression.type": "lz4",
            "message.max.bytes": max_message_bytes + 65536,  # the record plus its framing
            "message.timeout.ms": int(delivery_timeout_s * 1000),
            "error_cb": self._on_client_error,
        }
        pconf.update(producer_config or {})
        self._producer = Producer(pconf)
        self._max_buffered = int(pconf.get("queue.buffering.max.messages", 100_000))

        self._consumer: Optional[Consumer] = None
        if consume:
            cconf: Dict[str, Any] = {
                **common,
                "group.id": group_id,
                "enable.auto.commit": False,       # commit() only, after the processor's writes
                "enable.auto.offset.store": False,
                "auto.offset.reset": "earliest",   # a new group starts at the oldest retained record
                "session.timeout.ms": session_timeout_ms,
                "heartbeat.interval.ms": max(100, session_timeout_ms // 5),
                "isolation.level": "read_committed",
                "error_cb": self._on_client_error,
            }
            cconf.update(consumer_config or {})
            self._consumer = Consumer(cconf)

        # per-partition state, under _state_lock
        self._state_lock = threading.RLock()
        self._assigned: Set[int] = set()
        self._handed: Dict[int, Deque[int]] = {}   # offsets handed out and not yet committed, ascending
        self._next: Dict[int, int] = {}            # offset after the last record fetched (handed or DLQ'd)
        self._end: Dict[int, int] = {}             # best known end offset (broker, our deliveries, fetches)
        self._start: Dict[int, int] = {}           # oldest retained offset (broker)
        self._committed: Dict[int, int] = {}       # best known committed offset (broker, our commits)
        self._partitions: List[int] = []
        self._refresh_lock = threading.Lock()

        self._listener: Optional[RebalanceListener] = None
        self.dead_letters = 0  # records moved to the dead-letter topic by this process (for /metrics)
        self._closed = False
        self._closing = threading.Event()  # stops the background threads
        self._close_lock = threading.Lock()
        self._consume_lock = threading.Lock()
        self._poller = threading.Thread(target=self._serve_deliveries, name="trainguard-kafka-delivery",
                                        daemon=True)
        self._poller.start()
        self._refresher = threading.Thread(target=self._refresh_loop, name="trainguard-kafka-depth",
                                           daemon=True)
        self._refresher.start()
        if self._consumer is not None:
            self._consumer.subscribe([topic], on_assign=self._on_assign, on_revoke=self._on_revoke,
                                     on_lost=self._on_lost)

    # --- topics -----------------------------------------------------------------------------------
    def _create_topics(self, partitions: int, replication_factor: int, retention_ms: int) -> None:
        try:
            present = set(self._admin.list_topics(timeout=self._delivery_timeout_s).topics)
        except KafkaException as exc:
            raise KafkaQueueError(f"no Kafka broker answered in {self._delivery_timeout_s} s: {exc}") from exc
        config = {"retention.ms": str(retention_ms), "cleanup.policy": "delete",
                  "max.message.bytes": str(self._max_message_bytes + 65536)}
        wanted = [NewTopic(self.topic, num_partitions=partitions, replication_factor=replication_factor,
                           config=config),
                  NewTopic(self.dead_letter_topic, num_partitions=1, replication_factor=replication_factor,
                           config=config)]
        missing = [t for t in wanted if t.topic not in present]
        if not missing:
            return
        futures = self._admin.create_topics(missing, request_timeout=self._delivery_timeout_s)
        for name, future in futures.items():
            try:
                future.result()
                log.info("created Kafka topic %s", name)
            except KafkaException as exc:
                if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:  # another process made it first
                    raise KafkaQueueError(f"cannot create topic {name}: {exc}") from exc

    # --- publish ----------------------------------------------------------------------------------
    def publish(self, key: str, values: Sequence[bytes]) -> List[int]:
        check_publish_args(key, values)
        if not values:
            return []
        self._check_open()
        for value in values:
            if len(value) > self._max_message_bytes:
                raise KafkaQueueError(f"value of {len(value)} bytes exceeds max_message_bytes "
                                      f"{self._max_message_bytes}")
        if len(self._producer) + len(values) > self._max_buffered:
            raise QueueFull(f"local Kafka producer queue holds {len(self._producer)} undelivered messages "
                            f"(max {self._max_buffered})", retry_after=self._retry_after)
        depth = self._estimated_depth()
        if depth >= self._max_depth:
            raise QueueFull(f"queue holds {depth} unprocessed records (max {self._max_depth})",
                            retry_after=self._retry_after)
        delivery = _Delivery(len(values))
        raw_key = key.encode("utf-8")
        deadline = time.monotonic() + self._delivery_timeout_s
        for i, value in enumerate(values):
            while True:
                try:
                    self._producer.produce(self.topic, value=bytes(value), key=raw_key,
                                           on_delivery=partial(self._delivered, delivery, i))
                    break
                except BufferError:
                    if i == 0:  # nothing of the call produced yet: refuse it whole
                        raise QueueFull("local Kafka producer queue is full",
                                        retry_after=self._retry_after) from None
                    if time.monotonic() > deadline:  # pragma: no cover - a broker gone mid-call
                        raise KafkaQueueError("local Kafka producer queue stayed full mid-batch") from None
                    time.sleep(0.005)  # the delivery thread frees room as the broker acknowledges
        if not delivery.done.wait(self._delivery_timeout_s + 5.0):  # pragma: no cover - librdkafka's is first
            raise KafkaQueueError(f"no delivery report within {self._delivery_timeout_s + 5.0} s")
        if delivery.error is not None:
            raise KafkaQueueError(f"delivery to {self.topic} failed: {delivery.error.str()}")
        return delivery.offsets

    def _delivered(self, delivery: _Delivery, index: int, err: Optional[KafkaError], msg: Message) -> None:
        with delivery.lock:
            if err is not None:
                delivery.error = err
            else:
                partition, offset = _position(msg)
                delivery.offsets[index] = offset
                self._note_end(partition, offset + 1)
            delivery.left -= 1
            if delivery.left == 0:
                delivery.done.set()

    def _serve_deliveries(self) -> None:
        while not self._closing.is_set():
            self._producer.poll(0.1)
        self._producer.poll(0)

    def _note_end(self, partition: int, end: int) -> None:
        with self._state_lock:
            if end > self._end.get(partition, 0):
                self._end[partition] = end

    # --- consume ----------------------------------------------------------------------------------
    def consume(self, max_records: int, timeout: float) -> List[QueueRecord]:
        check_consume_args(max_records, timeout)
        consumer = self._need_consumer()
        deadline = time.monotonic() + timeout
        with self._consume_lock:
            while not self._closed:
                remaining = deadline - time.monotonic()
                first = consumer.poll(max(0.0, min(remaining, POLL_SLICE_S)))
                if first is not None:
                    batch = [first]
                    if max_records > 1:
                        batch += consumer.consume(max_records - 1, 0)
                    records = self._accept(consumer, batch)
                    if records:
                        return records
                if deadline - time.monotonic() <= 0:
                    break
        return []

    def wait_ready(self, timeout: float) -> bool:
        """Wait until the group has assigned this member its partitions; True once it has. Consumes
        nothing (a record fetched meanwhile is sought back)."""
        consumer = self._need_consumer()
        deadline = time.monotonic() + timeout
        with self._consume_lock:
            while not self._closed:
                with self._state_lock:
                    if self._assigned:
                        return True
                msg = consumer.poll(min(POLL_SLICE_S, max(0.0, deadline - time.monotonic())))
                if msg is not None and msg.error() is None:
                    consumer.seek(TopicPartition(self.topic, *_position(msg)))
                if time.monotonic() >= deadline:
                    break
        with self._state_lock:
            return bool(self._assigned)

    def _accept(self, consumer: Consumer, batch: Sequence[Message]) -> List[QueueRecord]:
        """Turn fetched messages into records; dead-letter the undecodable ones; track offsets."""
        good: List[Tuple[Message, Optional[str]]] = []
        for msg in batch:
            err = msg.error()
            if err is not None:
                if err.code() != KafkaError._PARTITION_EOF:
                    log.warning("Kafka consume error on %s: %s", self.topic, err.str())
                    if err.fatal():  # pragma: no cover - librdkafka gives up on this consumer
                        raise KafkaQueueError(f"fatal consumer error: {err.str()}")
                continue
            value = msg.value()
            reason: Optional[str] = None
            if value is None:
                reason = "no value (tombstone)"
            elif self._validate is not None:
                reason = self._validate(value)
            good.append((msg, reason))

        failed: Dict[int, int] = {}  # partition -> first offset whose dead letter was not acknowledged
        bad = [(m, r) for m, r in good if r is not None]
        if bad:
            failed = self._dead_letter(bad)
            for partition, offset in failed.items():  # fetch them again: never skip what is not safe
                consumer.seek(TopicPartition(self.topic, partition, offset))

        records: List[QueueRecord] = []
        commit_now: List[TopicPartition] = []
        with self._state_lock:
            for msg, reason in good:
                partition, offset = _position(msg)
                if partition not in self._assigned:  # pragma: no cover - revoked while we were reading
                    continue
                if partition in failed and offset >= failed[partition]:
                    continue
                self._next[partition] = offset + 1
                if offset + 1 > self._end.get(partition, 0):
                    self._end[partition] = offset + 1
                if reason is not None:
                    continue
                self._handed.setdefault(partition, deque()).append(offset)
                kind, stamp_ms = msg.timestamp()
                raw_key = msg.key()
                records.append(QueueRecord(
                    partition=partition, offset=offset,
                    key=raw_key.decode("utf-8", "replace") if isinstance(raw_key, bytes) else (raw_key or ""),
                    value=msg.value() or b"",
                    published_ns=int(stamp_ms) * 1_000_000 if kind != TIMESTAMP_NOT_AVAILABLE
                    else time.time_ns()))
            if bad:  # a dead letter with nothing handed out before it: commit past it now
                for partition in {_position(m)[0] for m, _ in bad}:
                    target = self._next.get(partition)
                    if (partition in self._assigned and not self._handed.get(partition) and target is not None
                            and target > self._committed.get(partition, -1)):
                        commit_now.append(TopicPartition(self.topic, partition, target))
        if commit_now:
            self._commit_offsets(consumer, commit_now)
        return records

    def _dead_letter(self, bad: Sequence[Tuple[Message, Optional[str]]]) -> Dict[int, int]:
        """Copy undecodable messages to the dead-letter topic and wait for the broker; returns the first
        offset per partition that could not be dead-lettered (to be fetched again)."""
        delivery = _Delivery(len(bad))
        for i, (msg, reason) in enumerate(bad):
            partition, offset = _position(msg)
            log.error("dead-lettering %s[%s]@%s to %s: %s", self.topic, partition, offset,
                      self.dead_letter_topic, reason)
            headers: List[Tuple[str, Union[str, bytes, None]]] = [
                (HEADER_REASON, (reason or "").encode("utf-8")), (HEADER_TOPIC, self.topic.encode()),
                (HEADER_PARTITION, str(partition).encode()), (HEADER_OFFSET, str(offset).encode())]
            original = msg.headers()
            if original:  # the producer's own headers travel along
                headers += list(original.items()) if isinstance(original, dict) else list(original)
            try:
                self._producer.produce(self.dead_letter_topic, value=msg.value(), key=msg.key(),
                                       headers=headers, on_delivery=partial(self._delivered_dlq, delivery, i))
            except (BufferError, KafkaException) as exc:
                log.error("cannot dead-letter %s[%s]@%s: %s", self.topic, partition, offset, exc)
                with delivery.lock:
                    delivery.offsets[i] = -2
                    delivery.left -= 1
                    if delivery.left == 0:
                        delivery.done.set()
        delivery.done.wait(self._delivery_timeout_s + 5.0)
        failed: Dict[int, int] = {}
        self.dead_letters += sum(1 for offset in delivery.offsets if offset >= 0)
        for i, (msg, _) in enumerate(bad):
            if delivery.offsets[i] < 0:
                partition, offset = _position(msg)
                failed[partition] = min(failed.get(partition, offset), offset)
        return failed

    @staticmethod
    def _delivered_dlq(delivery: _Delivery, index: int, err: Optional[KafkaError], msg: Message) -> None:
        with delivery.lock:
            delivery.offsets[index] = _position(msg)[1] if err is None else -2
            if err is not None:
                log.error("dead letter not delivered: %s", err.str())
            delivery.left -= 1
            if delivery.left == 0:
                delivery.done.set()

    # --- commit -----------------------------------------------------------------------------------
    def commit(self, records: Sequence[QueueRecord]) -> None:
        if not records:
            return
        consumer = self._need_consumer()
        tops: Dict[int, int] = {}
        for record in records:
            if record.offset > tops.get(record.partition, -1):
                tops[record.partition] = record.offset
        offsets: List[TopicPartition] = []
        with self._state_lock:
            for partition, top in tops.items():
                if partition not in self._assigned:
                    log.info("not committing %s[%s]@%s: the partition moved to another group member, which "
                             "gets its uncommitted records again", self.topic, partition, top)
                    continue
                handed = self._handed.setdefault(partition, deque())
                while handed and handed[0] <= top:
                    handed.popleft()
                # never past a record handed out and not committed; past dead letters fetched after `top`
                target = handed[0] if handed else max(self._next.get(partition, 0), top + 1)
                if target > self._committed.get(partition, -1):
                    offsets.append(TopicPartition(self.topic, partition, target))
        if offsets:
            self._commit_offsets(consumer, offsets)

    def _commit_offsets(self, consumer: Consumer, offsets: List[TopicPartition]) -> None:
        try:
            result = consumer.commit(offsets=offsets, asynchronous=False)
        except KafkaException as exc:
            raise KafkaQueueError(f"offset commit failed: {exc}") from exc
        problems = [f"[{tp.partition}]: {tp.error}" for tp in result or [] if tp.error is not None]
        if problems:
            raise KafkaQueueError("offset commit failed for " + ", ".join(problems))
        with self._state_lock:
            for tp in offsets:
                if tp.offset > self._committed.get(tp.partition, -1):
                    self._committed[tp.partition] = tp.offset

    # --- rebalance --------------------------------------------------------------------------------
    def set_rebalance_listener(self, listener: Optional[RebalanceListener]) -> None:
        self._listener = listener

    def _on_assign(self, _consumer: Consumer, partitions: List[TopicPartition]) -> None:
        with self._state_lock:
            for tp in partitions:
                self._assigned.add(tp.partition)
                self._handed[tp.partition] = deque()
                self._next.pop(tp.partition, None)
        numbers = sorted(tp.partition for tp in partitions)
        log.info("assigned %s partitions %s", self.topic, numbers)
        if self._listener is not None and numbers:
            self._listener.partitions_assigned(numbers)

    def _on_revoke(self, _consumer: Consumer, partitions: List[TopicPartition]) -> None:
        self._give_up(partitions, lost=False)

    def _on_lost(self, _consumer: Consumer, partitions: List[TopicPartition]) -> None:
        self._give_up(partitions, lost=True)

    def _give_up(self, partitions: List[TopicPartition], lost: bool) -> None:
        """Revoked partitions are told to the listener while still assigned (it may commit them), then
        forgotten; lost ones are forgotten first (nothing of them can be committed)."""
        numbers = sorted(tp.partition for tp in partitions)
        if self._listener is not None and numbers and not lost:
            try:
                self._listener.partitions_revoked(numbers, False)
            except Exception:  # the rebalance must go on: the next owner re-reads what was not committed
                log.exception("rebalance listener failed for revoked %s partitions %s", self.topic, numbers)
        with self._state_lock:
            for tp in partitions:
                self._assigned.discard(tp.partition)
                self._handed.pop(tp.partition, None)
                self._next.pop(tp.partition, None)
        log.info("%s %s partitions %s", "lost" if lost else "revoked", self.topic, numbers)
        if self._listener is not None and numbers and lost:
            try:
                self._listener.partitions_revoked(numbers, True)
            except Exception:
                log.exception("rebalance listener failed for lost %s partitions %s", self.topic, numbers)

    # --- depth ------------------------------------------------------------------------------------
    def depth(self) -> int:
        try:
            self._refresh_from_broker()
        except Exception as exc:  # the broker is away: answer from what we know
            log.warning("queue depth from the broker failed (%s); using the last known figures", exc)
        return self._depth_locked()

    def _estimated_depth(self) -> int:
        return self._depth_locked()  # no broker round trip on the publish path: the refresher keeps it fresh

    def _refresh_loop(self) -> None:
        while True:
            try:
                self._refresh_from_broker()
            except Exception as exc:
                log.debug("queue depth refresh failed: %s", exc)
            if self._closing.wait(self._depth_refresh_s):
                return

    def _depth_locked(self) -> int:
        with self._state_lock:
            total = 0
            for partition in set(self._end) | set(self._partitions):
                done = max(self._committed.get(partition, 0), self._start.get(partition, 0))
                total += max(0, self._end.get(partition, 0) - done)
            return total

    def _refresh_from_broker(self, locked: bool = False) -> None:
        if not locked:
            with self._refresh_lock:
                return self._refresh_from_broker(locked=True)
        try:
            self._refresh_locked()
        except Exception:
            # a fresh client next time: after a broker restart, librdkafka's AdminClient kept timing out on
            # the group's offsets (OffsetFetch through a stale coordinator) while new clients answered
            self._admin = AdminClient(self._admin_config)
            raise

    def _refresh_locked(self) -> None:
        timeout = min(3.0, self._delivery_timeout_s)
        meta = self._admin.list_topics(self.topic, timeout=timeout).topics.get(self.topic)
        if meta is None or meta.error is not None or not meta.partitions:
            raise KafkaQueueError(f"no metadata for topic {self.topic}: {meta.error if meta else 'absent'}")
        partitions = sorted(meta.partitions)
        tps = [TopicPartition(self.topic, p) for p in partitions]
        ends = self._list_offsets(tps, OffsetSpec.latest(), timeout)
        starts = self._list_offsets(tps, OffsetSpec.earliest(), timeout)
        committed = self._group_offsets(tps, timeout)
        with self._state_lock:
            self._partitions = partitions
            for p in partitions:
                if ends.get(p, -1) > self._end.get(p, 0):
                    self._end[p] = ends[p]
                if p in starts:
                    self._start[p] = max(0, starts[p])
                if committed.get(p, -1) > self._committed.get(p, -1):
                    self._committed[p] = committed[p]

    def _list_offsets(self, tps: Iterable[TopicPartition], spec: OffsetSpec,
                      timeout: float) -> Dict[int, int]:
        futures = self._admin.list_offsets({tp: spec for tp in tps}, request_timeout=timeout)
        return {tp.partition: int(f.result(timeout).offset) for tp, f in futures.items()}

    def _group_offsets(self, tps: List[TopicPartition], timeout: float) -> Dict[int, int]:
        # through the AdminClient, not the consumer: a Consumer call from another thread waits for the
        # thread blocked in its poll() (measured with confluent-kafka 2.16.1)
        futures = self._admin.list_consumer_group_offsets(
            [ConsumerGroupTopicPartitions(self.group_id, tps)], request_timeout=timeout)
        listed = next(iter(futures.values())).result(timeout).topic_partitions or []
        return {tp.partition: int(tp.offset) for tp in listed
                if tp.offset != OFFSET_INVALID and tp.offset >= 0}

    # --- lifecycle --------------------------------------------------------------------------------
    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            self._closing.set()
        with self._consume_lock:  # a blocked consume() leaves within POLL_SLICE_S
            if self._consumer is not None:
                try:
                    self._consumer.close()  # leaves the group; commits nothing (auto-commit is off)
                except Exception as exc:  # pragma: no cover - already closed by librdkafka
                    log.warning("closing the Kafka consumer: %s", exc)
        self._poller.join(5.0)
        self._refresher.join(1.0)  # a daemon: one refresh stuck on an absent broker must not hold close()
        left = self._producer.flush(self._delivery_timeout_s)
        if left:
            log.error("%d Kafka messages were not delivered before close", left)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("queue is closed")

    def _need_consumer(self) -> Consumer:
        if self._consumer is None:
            raise RuntimeError("this KafkaQueue was opened with consume=False")
        return self._consumer

    @staticmethod
    def _on_client_error(err: KafkaError) -> None:
        if err.fatal():
            log.error("Kafka client fatal error: %s", err.str())
        elif err.code() == KafkaError._ALL_BROKERS_DOWN:
            log.warning("Kafka client: %s", err.str())
        else:  # transport errors: librdkafka's own log (logger trainguard.kafka.client) already says them
            log.debug("Kafka client: %s", err.str())
