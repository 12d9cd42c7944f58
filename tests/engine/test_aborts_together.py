"""Ranks a launcher reports aborted by a bare SIGABRT are the NCCL watchdog's teardown after a collective
timeout (detectors/process.py ``_aborted_together``, setting ``aborts_together_timeout_ranks``: one rank's abort
already, by default; only several together at 2; never on a CPU-only rank). Real lines of tuned wild-corpus logs (``tests/fixtures/wild/<id>/source.txt``
names each thread)."""

from __future__ import annotations

from pathlib import Path
from typing import List, Sequence, Tuple

from trainguard_engine.catalogue import DetectionSettings
from trainguard_engine.classify import classify_exception
from trainguard_engine.detectors.process import aborted_ranks, on_exception, on_log
from trainguard_engine.incidents import apply
from trainguard_engine.state import RankState, RunState

WILD = Path(__file__).resolve().parents[1] / "fixtures" / "wild"


def _log(case: str) -> str:
    return (WILD / case / "log.txt").read_text(encoding="utf-8")


def _kinds(lines: Sequence[Tuple[int, str]], settings: DetectionSettings) -> List[str]:
    """The incidents' kinds after each (rank, log line) is read by that rank, in order."""
    run = RunState(project="p", run_id="r")
    for i, (r, line) in enumerate(lines):
        rank = run.ranks.setdefault(r, RankState(rank=r))
        finding = on_log(run, rank, {"event_id": f"e{i}"}, {"message": line}, -1, 1_000 + i, settings)
        if finding is not None:
            apply(run, finding, settings)
    return [f"{st.record.category}/{st.record.subtype}" for st in run.incidents.values()]


def _signal_lines(case: str) -> List[str]:
    return [line for line in _log(case).splitlines() if "Signal 6 (SIGABRT) received by PID" in line]


def test_two_ranks_aborting_together_are_a_collective_timeout() -> None:
    # picotron: the tail of torchrun's summary, ranks 7 and 0 ended by SIGABRT (the thread: watchdog timeouts)
    first, *_rest, root = _signal_lines("comm-watchdog-summary-only-picotron-1")
    settings = DetectionSettings(aborts_together_timeout_ranks=2)
    assert _kinds([(7, first)], settings) == ["memory/oom-or-cuda-error"]  # one rank alone: no inference at 2
    assert _kinds([(7, first), (0, root)], settings) == ["comm/timeout"]  # the same incident, re-read
    assert _kinds([(7, first), (0, root)], DetectionSettings(aborts_together_timeout_ranks=0)) == [
        "memory/oom-or-cuda-error"]  # off
    assert _kinds([(7, first), (0, root)], DetectionSettings(aborts_together_timeout_ranks=3)) == [
        "memory/oom-or-cuda-error"]
    # the same rank twice is one rank
    assert _kinds([(0, first), (0, root)], settings) == ["memory/oom-or-cuda-error"]


def test_one_ranks_bare_abort_is_a_collective_timeout_by_default() -> None:
    # nccl#1439 ('ALLREDUCE timeout'): torchrun's summary names rank 1 alone, ended by SIGABRT
    (line,) = _signal_lines("comm-childfailed-sigabrt-title-allreduce-nccl-1439-1")
    assert DetectionSettings().aborts_together_timeout_ranks == 1
    assert _kinds([(1, line)], DetectionSettings()) == ["comm/timeout"]
    # mp.spawn's wording (ALAE#61, the issue title) and torchrun's per-worker line (protenix-style glog form)
    spawn = _log("proc-spawn-sigabrt-title-alae-1").strip()
    assert _kinds([(0, spawn)], DetectionSettings()) == ["comm/timeout"]
    worker = ("E0603 04:19:17.163000 104 site-packages/torch/distributed/elastic/multiprocessing/api.py:874] "
              "failed (exitcode: -6) local_rank: 1 (pid: 107) of binary: /root/miniconda3/bin/python3.11")
    assert _kinds([(0, worker)], DetectionSettings()) == ["comm/timeout"]
    # an exit code that is no abort, and a SIGBUS, are not the watchdog
    assert _kinds([(0, worker.replace("-6", "1"))], DetectionSettings()) != ["comm/timeout"]


def test_a_cpu_only_ranks_abort_is_no_watchdog_teardown() -> None:
    from trainguard_engine.diagnosis import observe_start

    (line,) = _signal_lines("comm-childfailed-sigabrt-title-allreduce-nccl-1439-1")
    run = RunState(project="p", run_id="r")
    rank = run.ranks.setdefault(0, RankState(rank=0))
    observe_start(rank, {"torch": "2.13.0+cpu"})
    finding = on_log(run, rank, {"event_id": "e"}, {"message": line}, -1, 1, DetectionSettings())
    assert finding is not None and finding.category != "comm"


def test_a_summary_listing_several_aborted_ranks_is_a_collective_timeout() -> None:
    text = _log("mem-abort-torchrun-table-mmseg-1")
    summary = text[text.index("torch.distributed.elastic.multiprocessing.errors.ChildFailedError"):]
    exc_type, _, message = summary.partition(": ")
    found = classify_exception(exc_type, message)
    assert found.rule == "torchrun.child-failed" and aborted_ranks(found.rule, found.facts, 0) == [0, 1, 2]
    run = RunState(project="p", run_id="r")
    rank = run.ranks[0] = RankState(rank=0)
    finding = on_exception(run, rank, {"event_id": "e"}, {"type": exc_type, "message": message},
                           "fp", -1, 1_000, DetectionSettings())
    assert finding is not None and (finding.category, finding.subtype) == ("comm", "timeout")
    assert finding.values["detail"].startswith("Collective timeout (inferred): 3 ranks (0, 1, 2)")


def test_other_evidence_on_the_abort_incident_keeps_it() -> None:
    # an exit code 1 is no bare abort: a run whose abort incident holds it is not re-read
    assert aborted_ranks("torchrun.worker-failed", {"exitcode": 1, "rank": 3}, 0) == []
    assert aborted_ranks("launcher.signal", {"signal": 6}, 5) == [5]
    assert aborted_ranks("launcher.signal", {"signal": 7, "rank": 2}, 5) == []  # SIGBUS is not the watchdog
    assert aborted_ranks("torchrun.child-failed", {"root_cause_rule": "cuda.oom",
                                                   "failures": [{"rank": 0, "signal": 6}]}, 0) == []


def test_a_single_process_report_of_an_abort_is_no_ranks_teardown() -> None:
    # a debugger's, an IDE's run console's report of ONE process: no launcher's worker rank, no watchdog inferred
    for line in ("Program received signal SIGABRT, Aborted.",
                 "Process finished with exit code 134 (interrupted by signal 6: SIGABRT)"):
        kinds = _kinds([(0, line)], DetectionSettings())
        assert kinds and "comm/timeout" not in kinds, line
    # the same signal from a launcher's worker line is (test_one_ranks_bare_abort_is_a_collective_timeout...)
    assert aborted_ranks("launcher.signal", {"signal": 6, "reporter": "gdb"}, 0) == []
