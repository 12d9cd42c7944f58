"""The queue between the gateway and the processor: base contract, memory, SQLite and Kafka implementations.

:func:`open_queue` picks the one the settings name (``TRAINGUARD_QUEUE``: ``sqlite``, the embedded default,
or ``kafka``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict

from .base import Queue

AUTO_PARTITIONS = 16
"""The embedded queue's partitions when ``queue_partitions`` is 0 (auto) and ``processor_workers`` is set:
enough for as many workers as a host has cores, few enough that a worker's share is many runs."""
if TYPE_CHECKING:
    from ..config import Settings


def open_queue(settings: Settings, data_dir: Path, consume: bool = True) -> Queue:
    """The queue ``settings.queue`` selects, configured from ``settings``; ``consume=False`` for a process
    that only publishes (a Kafka gateway does not join the processors' consumer group; an embedded queue's
    publish-only handle asks only an explicit ``queue_partitions``: what auto would derive from
    ``processor_workers`` is the processor's to decide, from its own)."""
    if settings.queue == "kafka":
        from .kafka import KafkaQueue, ingest_request_problem  # confluent-kafka only when asked for

        client_config: Dict[str, Any] = json.loads(settings.kafka_client_config or "{}")
        if not isinstance(client_config, dict):
            raise ValueError("TRAINGUARD_KAFKA_CLIENT_CONFIG must be a JSON object of librdkafka properties")
        return KafkaQueue(
            settings.kafka_bootstrap_servers, settings.kafka_topic, group_id=settings.kafka_group_id,
            partitions=settings.kafka_partitions, replication_factor=settings.kafka_replication_factor,
            retention_ms=settings.kafka_retention_ms,
            # a published value is one run's share of a request: at most the request's size
            max_message_bytes=max(2**20, 2 * settings.max_batch_bytes),
            dead_letter_topic=settings.kafka_dead_letter_topic or None, validate=ingest_request_problem,
            max_depth=settings.max_queue_depth, retry_after=settings.retry_after_s,
            session_timeout_ms=settings.kafka_session_timeout_ms,
            delivery_timeout_s=settings.kafka_delivery_timeout_s, client_config=client_config,
            create_topics=settings.kafka_create_topics, consume=consume)
    from .sqlite import QUEUE_DB, SqliteQueue

    asked = embedded_partitions(settings) if consume else settings.queue_partitions or None
    return SqliteQueue(data_dir / QUEUE_DB, max_depth=settings.max_queue_depth,
                       retry_after=settings.retry_after_s, lanes=settings.queue_lanes, partitions=asked)


def embedded_partitions(settings: Settings) -> int:
    """The partitions asked of the embedded queue: ``queue_partitions``, or when 0 (auto) 16 with
    ``processor_workers`` and 1 without (the queue file keeps the count it first had above 1:
    queue/sqlite.py)."""
    if settings.queue_partitions:
        return settings.queue_partitions
    return AUTO_PARTITIONS if settings.processor_workers > 0 else 1
