"""Queue contract: ``publish`` is durable when it returns; ``consume`` hands out records in order per key;
``commit`` marks records done so they are never handed out again (at-least-once delivery).

Fairness between keys (runs): a key's records are in one *lane* -- a Kafka partition, or in the embedded
queues (SQLite, memory) one of ``lanes`` sub-streams, chosen by a stable hash of the key
(:func:`.common.lane_of`), of their one partition -- or of partition ``lane % partitions`` when they have
several (``TRAINGUARD_QUEUE_PARTITIONS``: the lanes are served as one, the partitions only tell the
processor which detection state a record belongs to). A lane's records are handed out in offset order;
the embedded queues hand out round-robin over the lanes that hold records (one record from each in turn),
so a key with a backlog delays another key's next record by at most one ``consume`` call, whatever its
backlog (tenant isolation: one noisy run does not hold back another run's alert). Kafka serves its
partitions as librdkafka fetches them: fair across partitions, not record by record. ``commit`` covers what
came before a record in its lane only.

Implementations: a SQLite table (:mod:`.sqlite`, the embedded default), Apache Kafka (:mod:`.kafka`: a
topic partitioned by run id, a consumer group) and an in-memory deque for tests (:mod:`.memory`); their
shared argument checks are in :mod:`.common`. All pass tests/services/queue/test_queue_contract.py.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import List, NamedTuple, Optional, Protocol, Sequence


class QueueRecord(NamedTuple):
    """One published message. ``value`` is a serialized ``trainguard.v1.IngestRequest``. Immutable; a
    NamedTuple, not a frozen dataclass, because a consumer builds one per record: 0.21 us against 0.69
    (whose ``__init__`` sets each field through ``object.__setattr__``), measured on 6,432 records
    (bench/results/processor_store_issue15_stop41.txt)."""

    partition: int
    offset: int
    key: str            # run id: records with one key are consumed in publish order
    value: bytes
    published_ns: int   # when the gateway published it (for processing-lag figures)
    lane: int = 0       # the key's lane in its partition (common.lane_of; Kafka: 0, a partition is one lane)


class QueueFull(Exception):
    """Backpressure: the queue holds more unconsumed data than allowed; retry after ``retry_after`` s."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RebalanceListener(Protocol):
    """Told when this consumer gains or loses partitions (a consumer group rebalanced). Called on the
    consuming thread, from inside :meth:`Queue.consume`; ``revoked`` runs while the partitions are still
    this consumer's, so it may :meth:`Queue.commit` their records; ``lost`` partitions are already another
    member's (a session timed out): nothing of them may be committed."""

    def partitions_assigned(self, partitions: Sequence[int]) -> None: ...

    def partitions_revoked(self, partitions: Sequence[int], lost: bool) -> None: ...


class Queue(ABC):
    """A durable, ordered-per-key log of ingest batches with one consumer group."""

    partitioned: bool = False
    """True when the queue has several partitions: a consumer then keeps state per partition and learns
    of its partitions through :meth:`set_rebalance_listener` -- over Kafka they move between the members
    of a consumer group; the embedded queues with ``partitions`` above 1 assign all of them to their one
    consumer, once, and never revoke them (:class:`.common.StaticPartitions`). False: one partition (0),
    always this consumer's."""

    identity: str = ""
    """Which queue (file, instance) the offsets belong to: a random id made when the queue was created (the
    embedded queues), "" when unknown (Kafka: a topic deleted and made again numbers from 0 too, unseen
    here). A processor saves it with the offsets its snapshot covers and ignores a cover saved for another
    queue (processor/embedded.py OFFSETS_PREFIX): a queue file moved aside or restored from a backup numbers
    its records anew, and a stale cover would skip them."""

    revokes_partitions: bool = False
    """True when a later :meth:`consume` may revoke partitions this consumer holds records of (a consumer
    group rebalancing: Kafka), so a processing round must not consume again before its records are through;
    False (the embedded queues: one partition, or static partitions never revoked): a round may take more
    records while it has room (processor/embedded.py ``_round``)."""

    lanes: int = 1
    """Lanes per partition (records of a lane are handed out in offset order; the embedded queues serve
    their many lanes round-robin; Kafka: 1, a partition is one lane)."""

    def set_rebalance_listener(self, listener: Optional[RebalanceListener]) -> None:
        """Report partition assignments and revocations to ``listener`` (a queue that is not
        ``partitioned`` -- one partition, 0 -- has nothing to report)."""

    @abstractmethod
    def publish(self, key: str, values: Sequence[bytes]) -> List[int]:
        """Append ``values`` under ``key``; returns their offsets once they are durable.

        Raises QueueFull when over capacity (nothing of the call is stored then).
        """

    @abstractmethod
    def consume(self, max_records: int, timeout: float) -> List[QueueRecord]:
        """Up to ``max_records`` records not yet committed and not yet handed out to this consumer,
        waiting up to ``timeout`` s for the first one: each lane's in offset order, the lanes that hold
        records served in turn (see the module's docstring). After a restart, everything uncommitted is
        handed out again."""

    @abstractmethod
    def commit(self, records: Sequence[QueueRecord]) -> None:
        """Mark ``records`` (and everything before them in their lane of their partition) as processed."""

    @abstractmethod
    def depth(self) -> int:
        """Records published and not yet committed."""

    def close(self) -> None:
        """Release resources; published data stays (for durable implementations)."""
