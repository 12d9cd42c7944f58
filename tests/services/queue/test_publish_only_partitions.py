"""A publish-only handle of the embedded queue (a gateway-only process: ``open_queue(consume=False)``) never
decides the file's partition count from ``processor_workers`` (auto): the processor's handle does, from its own -- so a
gateway whose machine or container gives auto workers cannot partition the queue of a processor pinned to the
in-thread pipeline (hR7's F3.1, stop 50), and it says nothing about a count it did not ask for."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from trainguard_server.config import Settings
from trainguard_server.queue import open_queue
from trainguard_server.queue.sqlite import SqliteQueue


def _opened(settings: Settings, data_dir: Path, consume: bool) -> SqliteQueue:
    queue = open_queue(settings, data_dir, consume=consume)
    assert isinstance(queue, SqliteQueue)
    return queue


def test_a_gateway_first_with_auto_workers_leaves_a_pinned_processor_one_partition(tmp_path: Path) -> None:
    gateway = _opened(Settings(processor_workers=2), tmp_path, consume=False)  # what auto gives on 2 cores
    try:
        assert gateway.partitions == 1 and not gateway.partitioned
        processor = _opened(Settings(processor_workers=0), tmp_path, consume=True)
        assert processor.partitions == 1 and not processor.partitioned
        processor.close()
    finally:
        gateway.close()


def test_a_gateway_opening_a_partitioned_file_takes_its_count_without_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    processor = _opened(Settings(processor_workers=2), tmp_path, consume=True)
    try:
        assert processor.partitions == 16
        with caplog.at_level(logging.WARNING):
            gateway = _opened(Settings(processor_workers=0), tmp_path, consume=False)
        assert gateway.partitions == 16 and gateway.partitioned
        assert not [r for r in caplog.records if "partitions" in r.getMessage()], caplog.text
        gateway.close()
    finally:
        processor.close()


def test_a_consuming_handle_still_warns_of_a_count_it_cannot_have(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    _opened(Settings(processor_workers=2), tmp_path, consume=True).close()
    with caplog.at_level(logging.WARNING):
        again = _opened(Settings(processor_workers=0, queue_partitions=4), tmp_path, consume=True)
    assert again.partitions == 16
    assert "holds 16 partitions" in caplog.text and "the 4 asked for now are ignored" in caplog.text
    again.close()


def test_a_gateway_asked_for_partitions_explicitly_still_makes_them(tmp_path: Path) -> None:
    """TRAINGUARD_QUEUE_PARTITIONS is the operator's, the same for every process: a gateway that opens the
    file first with it stores it (tests/services/e2e/test_partitioned_embedded.py queues through one)."""
    gateway = _opened(Settings(processor_workers=0, queue_partitions=4), tmp_path, consume=False)
    try:
        assert gateway.partitions == 4 and gateway.partitioned
    finally:
        gateway.close()
