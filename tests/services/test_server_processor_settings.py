"""``trainguard serve`` applies the processor's settings: its garbage-collection policy (config.py
``processor_gc_gen0_threshold`` / ``processor_gc_pause``; the policy and its figures: processor/embedded.py
GC_GEN0_THRESHOLD) and its metric write-behind (``processor_metric_write_chunks`` /
``processor_metric_write_delay_s``): an operator's values reach the running processor, the defaults stay the
documented ones."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Iterator, Tuple

import pytest

from trainguard_server.config import Settings
from trainguard_server.processor.embedded import GC_GEN0_THRESHOLD
from trainguard_server.server import EmbeddedServer


@pytest.fixture
def kept_threshold() -> Iterator[Tuple[int, int, int]]:
    """The interpreter's thresholds, put back after the test (tune_gc is process-wide)."""
    before = gc.get_threshold()
    gc.set_threshold(700, before[1], before[2])
    yield before
    gc.set_threshold(*before)


def _serve(tmp_path: Path, **values: object) -> EmbeddedServer:
    server = EmbeddedServer(Settings(data_dir=tmp_path, http_port=0, grpc_port=0, **values))  # type: ignore[arg-type]
    server.start()
    return server


def test_defaults_are_the_documented_policy(tmp_path: Path, kept_threshold: Tuple[int, int, int]) -> None:
    assert Settings().processor_gc_gen0_threshold == GC_GEN0_THRESHOLD
    server = _serve(tmp_path)
    try:
        assert server.processor is not None and server.processor.pause_gc is True
        assert gc.get_threshold()[0] == GC_GEN0_THRESHOLD
    finally:
        server.stop()


def test_operator_values_reach_the_processor(tmp_path: Path, kept_threshold: Tuple[int, int, int]) -> None:
    server = _serve(tmp_path, processor_gc_gen0_threshold=123_456, processor_gc_pause=False)
    try:
        assert server.processor is not None and server.processor.pause_gc is False
        assert gc.get_threshold()[0] == 123_456
    finally:
        server.stop()


def test_the_metric_write_behind_is_off_by_default(tmp_path: Path, kept_threshold: Tuple[int, int, int]) -> None:
    """A run's record becomes visible when its chunk's output is applied: with its points held a client could
    list the run and read no metrics (two end-to-end tests did, stop 43), so by default every chunk writes its
    own points."""
    server = _serve(tmp_path)
    try:
        assert server.processor is not None and server.processor.metric_write_chunks == 1
    finally:
        server.stop()


def test_the_metric_write_behind_settings_reach_the_processor(tmp_path: Path,
                                                               kept_threshold: Tuple[int, int, int]) -> None:
    server = _serve(tmp_path, processor_metric_write_chunks=9, processor_metric_write_delay_s=0.25)
    try:
        assert server.processor is not None
        assert (server.processor.metric_write_chunks, server.processor.metric_write_delay_s) == (9, 0.25)
    finally:
        server.stop()


def test_zero_keeps_the_interpreters_threshold(tmp_path: Path, kept_threshold: Tuple[int, int, int]) -> None:
    server = _serve(tmp_path, processor_gc_gen0_threshold=0)
    try:
        assert gc.get_threshold()[0] == 700
    finally:
        server.stop()
