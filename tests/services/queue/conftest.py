"""Fixtures of the queue suites: a real Kafka-protocol broker (Tansu, memory storage) for the session."""

from __future__ import annotations

from typing import Iterator

import pytest

from tests.support.kafka import ReadyKafkaQueues, Tansu


@pytest.fixture(scope="session")
def tansu(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tansu]:
    """One Tansu broker on a free 127.0.0.1 port, memory storage, shared by the session's Kafka tests
    (each test uses its own topic and consumer group)."""
    broker = Tansu(tmp_path_factory.mktemp("tansu") / "tansu.log").start()
    yield broker
    broker.stop(kill=True)  # memory storage: nothing to keep (SIGTERM takes Tansu ~5 s)


@pytest.fixture(scope="session")
def kafka_queues(tansu: Tansu) -> Iterator[ReadyKafkaQueues]:
    """KafkaQueues opened ahead on the session's broker (see ReadyKafkaQueues)."""
    queues = ReadyKafkaQueues(tansu.bootstrap, prefix="contract", ahead=6)
    yield queues
    queues.close()
