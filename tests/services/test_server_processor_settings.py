"""``trainguard serve`` applies the processor's settings: its garbage-collection policy (config.py
``processor_gc_gen0_threshold`` / ``processor_gc_pause``; the policy and its figures: processor/embedded.py
GC_GEN0_THRESHOLD) and its metric write-behind (``processor_metric_write_chunks`` /
``processor_metric_write_delay_s``): an operator's values reach the running processor, the defaults stay the
documented ones."""

from __future__ import annotations

import gc
import logging
from pathlib import Path
from typing import Dict, Iterator, Optional, Tuple

import pytest

from trainguard_server.config import Settings, auto_workers, cgroup_cpu_limit
from trainguard_server.processor.embedded import GC_GEN0_THRESHOLD
from trainguard_server.queue import AUTO_PARTITIONS
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


def test_workers_reach_the_processor_with_the_configured_collector(tmp_path: Path,
                                                                    kept_threshold: Tuple[int, int, int]) -> None:
    """TRAINGUARD_PROCESSOR_WORKERS runs the partitions' pipelines in that many processes, which take the
    operator's collector threshold (hR F6: the pool was built before tune_gc and took the interpreter's 700)."""
    server = _serve(tmp_path, processor_workers=2, processor_gc_gen0_threshold=123_456,
                    processor_pool_isolate_after=5, processor_pool_left_out_s=7.5,
                    processor_pool_call_timeout_s=90.0, processor_uncommitted_max_mb=3)
    try:
        assert server.processor is not None and server.processor.pool is not None
        assert server.processor.pool_isolate_after == 5 and server.processor.poisoned_runs.hold_s == 7.5
        assert server.processor.pool.call_timeout_s == 90.0
        assert server.processor.uncommitted_max_bytes == 3 * 1024 * 1024
        assert len(server.processor.pool.workers) == 2 and server.queue.partitions == AUTO_PARTITIONS
        assert server.processor.pool._args[2] == 123_456  # (settings, pause_gc, gc_threshold) sent to each
    finally:
        server.stop()


@pytest.mark.parametrize("partitions, workers, said", [
    (1, 2, "processor_workers=2 is ignored: the queue has one partition"),
    (4, 5, "processor_workers=5: only 4 have work"),
    (4, 4, None)])
def test_workers_that_cannot_all_work_are_said(tmp_path: Path, kept_threshold: Tuple[int, int, int],
                                               caplog: pytest.LogCaptureFixture, partitions: int, workers: int,
                                               said: Optional[str]) -> None:
    with caplog.at_level(logging.WARNING, logger="trainguard.server"):
        server = _serve(tmp_path, processor_workers=workers, queue_partitions=partitions)
    try:
        warned = [r.getMessage() for r in caplog.records if "processor_workers" in r.getMessage()]
        assert warned == ([] if said is None else [warned[0]]) and (said is None or said in warned[0]), warned
        assert server.processor is not None and (server.processor.pool is None) == (partitions == 1)
    finally:
        server.stop()


def test_auto_workers_over_a_queue_made_one_partition_are_no_warning(
        tmp_path: Path, kept_threshold: Tuple[int, int, int], caplog: pytest.LogCaptureFixture) -> None:
    """Nobody asked for workers: auto's pick over TRAINGUARD_QUEUE_PARTITIONS=1 runs the pipeline in the
    thread and says so at INFO, not as a warning about a setting the operator never made (hR7's F3.4)."""
    with caplog.at_level(logging.INFO, logger="trainguard.server"):
        server = _serve(tmp_path, processor_workers=-1, queue_partitions=1)
    try:
        assert server.settings.processor_workers_auto and server.processor is not None
        assert server.processor.pool is None
        said = [r for r in caplog.records if "processor_workers" in r.getMessage()]
        assert all(r.levelno < logging.WARNING for r in said), [r.getMessage() for r in said]
        assert len(said) == (1 if server.settings.processor_workers > 0 else 0)
    finally:
        server.stop()


@pytest.mark.parametrize("cores, workers", [(1, 0), (2, 2), (3, 2), (4, 2), (5, 3), (16, 14), (64, 16)])
def test_auto_workers_leave_two_cores_but_take_two_from_two_cores(cores: int, workers: int) -> None:
    assert auto_workers(cores) == workers


def test_the_default_is_auto_over_the_embedded_queue_and_none_over_kafka_or_flink(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRAINGUARD_PROCESSOR_WORKERS", raising=False)  # the suite's pin (tests/conftest.py)
    assert Settings().processor_workers == auto_workers()
    assert Settings(queue="kafka").processor_workers == 0
    assert Settings(processor_runtime="flink").processor_workers == 0
    assert Settings(queue="kafka", processor_workers=3).processor_workers == 3  # asked for: kept


def test_minus_one_is_auto_for_this_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINGUARD_PROCESSOR_WORKERS", "-1")
    assert Settings().processor_workers == auto_workers()
    monkeypatch.setenv("TRAINGUARD_PROCESSOR_WORKERS", "3")
    assert Settings().processor_workers == 3
    monkeypatch.setenv("TRAINGUARD_PROCESSOR_WORKERS", "-2")
    with pytest.raises(ValueError, match="greater than or equal to -1"):
        Settings()


@pytest.mark.parametrize("files, cores", [
    ({"cpu.max": "max 100000\n"}, None),  # v2, no quota
    ({"cpu.max": "150000 100000\n"}, 2),  # --cpus 1.5: 2 cores' worth, rounded up
    ({"cpu.max": "400000 100000\n"}, 4),
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),  # v1, no quota
    ({"cpu/cpu.cfs_quota_us": "50000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 1),
    ({"cpu.max": "garbage\n"}, None),
    ({}, None),
    # the process's own cgroup below the root (a systemd unit's CPUQuota=300%, docker --cgroupns=host)
    ({"cpu.max": "max 100000\n", "system.slice/tg.service/cpu.max": "300000 100000\n",
      "@proc": "0::/system.slice/tg.service\n"}, 3),
    # a quota on a parent, none on the leaf: the lowest on the way up counts
    ({"cpu.max": "max 100000\n", "kubepods/cpu.max": "200000 100000\n", "kubepods/pod1/cpu.max": "max 100000\n",
      "@proc": "0::/kubepods/pod1\n"}, 2),
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n",
      "cpu/docker/abc/cpu.cfs_quota_us": "400000\n", "cpu/docker/abc/cpu.cfs_period_us": "100000\n",
      "@proc": "4:cpu,cpuacct:/docker/abc\n3:memory:/docker/abc\n"}, 4)])
def test_a_containers_cpu_quota_caps_the_cores_auto_sees(tmp_path: Path, files: Dict[str, str],
                                                         cores: Optional[int]) -> None:
    root, proc = tmp_path / "cgroup", tmp_path / "proc-self-cgroup"
    for name, text in files.items():
        path = proc if name == "@proc" else root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert cgroup_cpu_limit(root, proc) == cores
