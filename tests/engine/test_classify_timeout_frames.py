"""The NCCL watchdog's timeout stack without its message line (classify/nccl.py ``_timeout_frame``): a c10
stack of ``WorkNCCL::checkTimeout`` raising is a collective timeout, and it names no rank. Lines cut from
tuned wild-corpus logs (tests/fixtures/wild/<id>/source.txt names each thread)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainguard_engine.catalogue import DetectionSettings
from trainguard_engine.classify import classify_text
from trainguard_engine.detectors.process import on_log
from trainguard_engine.state import RankState, RunState

WILD = Path(__file__).resolve().parents[1] / "fixtures" / "wild"
FRAME = ("frame #1: c10d::ProcessGroupNCCL::WorkNCCL::checkTimeout(std::optional<std::chrono::duration<long, "
         "std::ratio<1l, 1000l> > >) + 0x1e6 (0x7f32040db6e6 in /opt/conda/lib/python3.10/site-packages/torch/"
         "lib/libtorch_cuda.so)")


def test_the_frames_of_a_cut_watchdog_stack_are_a_timeout() -> None:
    # NeMo/Lightning: only the watchdog's C++ stack survives the cut (terminal-wrapped lines)
    text = (WILD / "comm-watchdog-frames-only-wrapped-lightning-20832-1" / "log.txt").read_text(encoding="utf-8")
    found = classify_text(text)
    assert found is not None and found.kind == "comm/timeout" and found.rule == "nccl.watchdog-teardown"
    assert found.facts.get("from_frames") is True and "rank" not in found.facts


@pytest.mark.parametrize("line", [
    FRAME,
    "Exception raised from checkTimeout at ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:525 (most recent "
    "call first):",
])
def test_the_timeout_checks_stack_lines(line: str) -> None:
    found = classify_text(line)
    assert found is not None and found.kind == "comm/timeout"


@pytest.mark.parametrize("line", [
    "NVRM: _threadNodeCheckTimeout: API_GPU_ATTACHED_SANITY_CHECK failed!",
    "def checkTimeout(self): the function name in a prose sentence",
])
def test_other_check_timeouts_are_not(line: str) -> None:
    found = classify_text(line)
    assert found is None or found.kind != "comm/timeout"


def test_a_stack_alone_leads_no_rank_and_the_named_line_does() -> None:
    run = RunState(project="p", run_id="r")
    run.ranks[0] = RankState(rank=0)
    stack = on_log(run, run.ranks[0], {"event_id": "e1"}, {"message": FRAME}, 1, 1, DetectionSettings())
    assert stack is not None and (stack.category, stack.subtype) == ("comm", "timeout")
    assert stack.rank == -1 and stack.evidence[0].rank == 0  # who printed it stays on the evidence
    named = on_log(run, run.ranks[0], {"event_id": "e2"}, {"message": "[Rank 6] Watchdog caught collective "
                   "operation timeout: WorkNCCL(SeqNum=880, OpType=BROADCAST, Timeout(ms)=1800000) ran for "
                   "1800113 milliseconds before timing out."}, 2, 2, DetectionSettings())
    assert named is not None and named.rank == 6


def test_the_stack_after_its_message_adds_nothing() -> None:
    run = RunState(project="p", run_id="r")
    run.ranks[0] = RankState(rank=0)
    from trainguard_engine.correlate import route
    from trainguard_engine.incidents import apply

    settings = DetectionSettings()
    message = on_log(run, run.ranks[0], {"event_id": "e1"}, {"message": "[rank1]:[E1129 13:47:34.592695119 "
                     "ProcessGroupNCCL.cpp:2119] [Rank 1] Watchdog caught collective operation timeout: "
                     "WorkNCCL(SeqNum=12, OpType=ALLREDUCE, Timeout(ms)=10000) ran for 10041 milliseconds before "
                     "timing out."}, 1, 1, settings)
    assert message is not None
    apply(run, route(run, message, settings), settings)
    assert on_log(run, run.ranks[0], {"event_id": "e2"}, {"message": FRAME}, 1, 2, settings) is None
