"""mp.spawn's ``ProcessExitedException: process N terminated with exit code 1`` read as the launcher's report of
a worker's exit, through ``trainguard replay``'s defaults, when the worker's own traceback is printed AFTER
the parent's (the streams interleave either way). ``proc-spawn-exit1-after-training-vits-284-1`` (tuned part;
its worker printed nothing) gives the parent's traceback; the workers' tracebacks are tuned pastes too
(``mem-oom-cuda-error-backward-1``, ``py-nograd-1``), each line verbatim. Before, detectors/process.py kept only the
exception's type string as its evidence, so correlation could not see a launcher exit report and the exit
stayed an incident of its own, shown before the worker's OOM. Now it carries the classifier's facts (rule
``launcher.signal``; the spawn index is a local rank), as the same line printed as log text does."""

from __future__ import annotations

from pathlib import Path

import pytest

from .local_import import WILD, imported, lines_of, pasted, shown
from .local_import import kind as kind_of

PARENT = "proc-spawn-exit1-after-training-vits-284-1"
WORKERS = {"memory/oom": "mem-oom-cuda-error-backward-1", "process/exception": "py-nograd-1"}


def test_the_spawn_exit_alone_is_still_the_exit() -> None:
    assert shown(imported(WILD / PARENT / "log.txt")) == ["process/exit"]


@pytest.mark.parametrize("kind", sorted(WORKERS))
def test_the_workers_error_printed_after_the_spawn_exit_leads(tmp_path: Path, kind: str) -> None:
    incidents = imported(pasted(tmp_path, lines_of(PARENT) + lines_of(WORKERS[kind])))
    assert shown(incidents) == [kind]
    (cause,) = [i for i in incidents if kind_of(i) == kind]
    exits = [i for i in incidents if kind_of(i) == "process/exit"]
    assert exits and all(i["explained_by"] == cause["incident_id"] for i in exits)


@pytest.mark.parametrize("kind", sorted(WORKERS))
def test_the_workers_error_printed_before_the_spawn_exit_leads_too(tmp_path: Path, kind: str) -> None:
    incidents = imported(pasted(tmp_path, lines_of(WORKERS[kind]) + lines_of(PARENT)))
    assert shown(incidents) == [kind]


def test_the_spawn_exit_evidence_is_the_launchers_report() -> None:
    (exit_,) = imported(WILD / PARENT / "log.txt")
    values = [ev["value"] for ev in exit_["evidence"] if isinstance(ev.get("value"), dict)]
    assert values, exit_["evidence"]
    (value,) = values
    assert value["rule"] == "launcher.signal"
    assert value["facts"] == {"exitcode": 1, "rank": 0, "local_rank": 0}
    assert value["exc_type"].endswith("ProcessExitedException")


def test_a_spawn_index_is_a_local_rank_so_any_ranks_error_may_be_that_workers(tmp_path: Path) -> None:
    # SYNTHETIC: vits-284's last line with the process index 3 (on rank 0's stream, as a one-stream paste
    # is). mp.spawn's index is the worker's on its node (classify.torchrun gives it as ``local_rank``), and
    # error text names global ranks, so the worker error printed on this stream is still that exit's cause.
    # Without ``local_rank`` the report named global rank 3, whose own error the paste does not show.
    lines = lines_of(PARENT)
    assert lines[-1].endswith("process 0 terminated with exit code 1")
    lines[-1] = lines[-1].replace("process 0 ", "process 3 ")
    incidents = imported(pasted(tmp_path, lines + lines_of(WORKERS["memory/oom"])))
    assert shown(incidents) == ["memory/oom"]
    assert shown(imported(pasted(tmp_path, lines))) == ["process/exit"]
