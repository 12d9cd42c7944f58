"""The rank an error is about is the one its text names, whichever stream printed it (issue 17: a pasted
log is read as rank 0's). Lines cut from tests/fixtures/wild (source.txt names each thread)."""

from __future__ import annotations

from trainguard_engine.catalogue import DetectionSettings
from trainguard_engine.classify import classify_text
from trainguard_engine.detectors.process import on_exception, on_log
from trainguard_engine.state import RankState, RunState


def _run() -> RunState:
    run = RunState(project="p", run_id="r")
    run.ranks[0] = RankState(rank=0)
    return run


def test_a_watchdog_line_of_rank_3_read_as_rank_0_is_rank_3s() -> None:
    run = _run()
    line = ("[E ProcessGroupNCCL.cpp:458] [Rank 3] Watchdog caught collective operation timeout: "
            "WorkNCCL(SeqNum=96120, OpType=ALLREDUCE, Timeout(ms)=1800000) ran for 25624887 milliseconds "
            "before timing out.")
    found = on_log(run, run.ranks[0], {"event_id": "e1"}, {"message": line}, 10, 1, DetectionSettings())
    assert found is not None and found.rank == 3 and found.evidence[0].rank == 0  # who printed it stays


def test_spawn_names_the_process_that_failed() -> None:
    text = ("torch.multiprocessing.spawn.ProcessRaisedException: \n\n-- Process 1 terminated with the following "
            "error:\nTraceback (most recent call last):\n  File \"train.py\", line 3, in f\n    x()\n"
            "RuntimeError: mat1 and mat2 shapes cannot be multiplied (4x3 and 4x5)")
    found = classify_text(text)
    assert found is not None and found.facts["rank"] == 1
    run = _run()
    body = {"type": "torch.multiprocessing.spawn.ProcessRaisedException", "message": text.split(": ", 1)[1]}
    finding = on_exception(run, run.ranks[0], {"event_id": "e2"}, body, "f" * 32, 5, 1, DetectionSettings())
    assert finding is not None and finding.rank == 1


def test_a_line_that_names_no_rank_stays_with_its_stream() -> None:
    run = _run()
    run.ranks[2] = RankState(rank=2)
    line = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB"
    found = on_log(run, run.ranks[2], {"event_id": "e3"}, {"message": line}, 7, 1, DetectionSettings())
    assert found is not None and found.rank == 2


def test_faulthandlers_abort_on_a_cpu_only_rank_is_not_a_cuda_error() -> None:
    from trainguard_engine.diagnosis import observe_start

    text = "Fatal Python error: Aborted\n\nCurrent thread 0x00007f (most recent call first):\n  File \"t.py\", line 3"
    body = {"type": "Fatal Python error", "message": "Aborted", "traceback": text}
    for torch_build, kind in (("2.13.0+cpu", "process/exit"), ("2.11.0+cu130", "memory/oom-or-cuda-error")):
        run = _run()
        observe_start(run.ranks[0], {"torch": torch_build})
        finding = on_exception(run, run.ranks[0], {"event_id": "e4"}, body, "a" * 32, 9, 1, DetectionSettings())
        assert finding is not None and f"{finding.category}/{finding.subtype}" == kind, torch_build
