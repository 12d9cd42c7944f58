"""The Flink job's workers take the operator's young-generation GC threshold (hR's review, stop 43: the run
stage's ``open`` called ``tune_gc()`` with the default, whatever ``processor_gc_gen0_threshold`` said):
``flink_main.py --gc-gen0-threshold`` (default: serve's ``TRAINGUARD_PROCESSOR_GC_GEN0_THRESHOLD``) reaches
``build_job`` and every run-stage worker's ``tune_gc``. PyFlink is not installed here (its own venv:
requirements/flink.txt), so the job module is imported over a stand-in of the few PyFlink names it uses at
import; the graph's calls are recorded, not run."""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any, Iterator, List
from unittest import mock

import pytest

from trainguard_server.processor import embedded
from trainguard_server.processor.flink_main import GC_GEN0_ENV, build_parser, gc_gen0_default

JOB = "trainguard_server.processor.flink_job"


def test_the_parser_takes_serves_setting_then_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(GC_GEN0_ENV, raising=False)
    assert build_parser().parse_args(["--kafka", "k:9092"]).gc_gen0_threshold == embedded.GC_GEN0_THRESHOLD
    monkeypatch.setenv(GC_GEN0_ENV, "120000")
    assert gc_gen0_default() == 120_000
    assert build_parser().parse_args(["--kafka", "k:9092"]).gc_gen0_threshold == 120_000
    assert build_parser().parse_args(["--kafka", "k", "--gc-gen0-threshold", "0"]).gc_gen0_threshold == 0
    for bad in ("many", "-1"):
        monkeypatch.setenv(GC_GEN0_ENV, bad)
        with pytest.raises(SystemExit, match=GC_GEN0_ENV):
            gc_gen0_default()


class _Function:
    """Stand-in of PyFlink's function base classes."""


def _pyflink() -> dict[str, types.ModuleType]:
    """The PyFlink modules flink_job imports, with the names it uses at import time."""
    root, common = types.ModuleType("pyflink"), types.ModuleType("pyflink.common")
    datastream, state = types.ModuleType("pyflink.datastream"), types.ModuleType("pyflink.datastream.state")
    common.Types = mock.MagicMock()  # type: ignore[attr-defined]
    for name in ("DataStream", "OutputTag", "RuntimeContext", "TimeDomain"):
        setattr(datastream, name, mock.MagicMock())
    datastream.KeyedProcessFunction = _Function  # type: ignore[attr-defined]
    state.ValueStateDescriptor = mock.MagicMock()  # type: ignore[attr-defined]
    return {"pyflink": root, "pyflink.common": common, "pyflink.datastream": datastream,
            "pyflink.datastream.state": state}


@pytest.fixture
def job(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    for name, module in _pyflink().items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.delitem(sys.modules, JOB, raising=False)
    try:
        yield importlib.import_module(JOB)
    finally:
        sys.modules.pop(JOB, None)  # the stand-in's module is never seen by another test


def _run_stage_threshold(job: Any, monkeypatch: pytest.MonkeyPatch, **kwargs: Any) -> List[int]:
    """Build the graph with ``kwargs``, open its run-stage function as a worker does: tune_gc's arguments."""
    calls: List[int] = []
    monkeypatch.setattr(job, "tune_gc", lambda threshold: calls.append(threshold))
    monkeypatch.setattr(job, "RunStage", mock.MagicMock())
    records = mock.MagicMock()
    job.build_job(records, mock.MagicMock(), source_parallelism=1, **kwargs)
    process = records.flat_map.return_value.name.return_value.set_parallelism.return_value.key_by.return_value.process
    (function,), _ = process.call_args
    assert isinstance(function, job._RunFunction)
    function.open(mock.MagicMock())
    return calls


def test_the_run_stage_workers_tune_gc_with_the_threshold_given(job: Any,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    assert _run_stage_threshold(job, monkeypatch, gc_gen0_threshold=123_456) == [123_456]
    assert _run_stage_threshold(job, monkeypatch, gc_gen0_threshold=0) == [0]  # 0: the interpreter's kept
    assert _run_stage_threshold(job, monkeypatch) == [embedded.GC_GEN0_THRESHOLD]
