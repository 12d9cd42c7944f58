"""mp.spawn's parent re-raise read as the launcher's report of a worker's failure, through ``trainguard
replay``'s defaults: on ``mem-unspecified-launch-failure-after-spawn-exception-cavaface-70-1`` (tuned part;
cavalleria/cavaface#70, see its ``source.txt``) the parent's bare ``Exception: `` from ``spawn.py``'s ``join``
comes first, then the worker's ``terminate called after throwing an instance of 'c10::Error'`` / ``CUDA error:
unspecified launch failure``. Before, the re-raise (earlier, of equal severity) was what a user read first;
now the worker's CUDA error leads and the re-raise is folded into it (correlate ``_own_error_after``). Where
a test reorders or cuts the paste, each line is verbatim."""

from __future__ import annotations

from pathlib import Path
from typing import List

import pytest

from .local_import import WILD, imported, kind, lines_of, pasted, shown

CASE = "mem-unspecified-launch-failure-after-spawn-exception-cavaface-70-1"


def _lines() -> List[str]:
    return lines_of(CASE)


@pytest.mark.parametrize("run_id", ["spawn", "wild-x", "r0"])
def test_the_workers_cuda_error_leads_and_the_reraise_is_its_consequence(run_id: str) -> None:
    incidents = imported(WILD / CASE / "log.txt", run_id)
    assert shown(incidents) == ["memory/cuda-error"]
    (cuda,) = [i for i in incidents if kind(i) == "memory/cuda-error"]
    (reraise,) = [i for i in incidents if kind(i) == "process/exception"]
    assert reraise["explained_by"] == cuda["incident_id"]


def test_the_workers_error_printed_before_the_reraise_leads_too(tmp_path: Path) -> None:
    lines = _lines()
    cut = lines.index("Exception: ") + 1
    incidents = imported(pasted(tmp_path, lines[cut:] + lines[:cut]))
    assert shown(incidents) == ["memory/cuda-error"]
    reraises = [i for i in incidents if kind(i) == "process/exception"]
    assert reraises and all(i["explained_by"] for i in reraises)


def test_the_reraise_alone_is_still_a_crash(tmp_path: Path) -> None:
    lines = _lines()
    incidents = imported(pasted(tmp_path, lines[:lines.index("Exception: ") + 1]))
    assert shown(incidents) == ["process/exception"]


RELAYED = "py-spawn-process1-2"
"""Tuned: ``ProcessRaisedException: -- Process 1 terminated with the following error:`` relaying the worker's
``AttributeError`` (its traceback and exception line inside the re-raise)."""


def test_a_reraise_relaying_the_workers_exception_is_that_workers_error(tmp_path: Path) -> None:
    # another rank's watchdog timeout printed after it (bench/wild/stress.py's wd_after, PEER_TIMEOUT): the
    # worker's AttributeError, relayed by join, is the cause and the timeout its consequence. Before, the
    # re-raise was read as a launcher's word that some worker failed (naming no rank), and folded into the
    # timeout as if the timeout were the worker's own error
    from bench.wild import stress

    lines = (WILD / RELAYED / "log.txt").read_text(encoding="utf-8").splitlines()
    incidents = imported(pasted(tmp_path, lines + stress.PEER_TIMEOUT))
    assert shown(incidents) == ["process/exception"]
    (crash,) = [i for i in incidents if not i.get("explained_by")]
    assert crash["lead_rank"] == 1
    assert all(i["explained_by"] == crash["incident_id"] for i in incidents if i is not crash)
    # alone it is that crash too (as before)
    assert shown(imported(WILD / RELAYED / "log.txt")) == ["process/exception"]
