"""Pastes cut or wrapped where the classifier used to need the whole line (issue 17, stop 34), each a class of
real pastes, the text from tuned wild-corpus logs (tests/fixtures/wild/<id>/source.txt names each thread):

* the NCCL watchdog's message quoted without its start (``WorkNCCL(SeqNum=.., OpType=ALLREDUCE,
  Timeout(ms)=1800000) ran for 1807734 millisecond``, an issue title) is a collective timeout;
* a kernel's device-side assertion with its ``failed.`` wrapped to the next line (or that line not passed on),
  with the legacy THC kernel's whole C++ signature, or with no kernel name at all (a Windows build path) is
  memory/cuda-error;
* one entry of torchrun's failure summary without the summary's header (``rank      : 1``, ``exitcode  : 1
  (pid: N)``) is that rank's process/exit;
* a wrapper's ``NCCL Error 3: internal error ...`` (ncclResult_t's number) is that NCCL error;
* legacy THC's ``cuda runtime error (2) : out of memory`` and ``CUDA error:out of memory`` are an OOM;
* Slurm's ``*** STEP N ON host CANCELLED AT ... ***`` is the scheduler's SIGTERM (process/terminated)."""

from __future__ import annotations

from pathlib import Path

from trainguard_engine.classify import classify_exception, classify_text

WILD = Path(__file__).resolve().parents[1] / "fixtures" / "wild"


def _log(case_id: str) -> str:
    return (WILD / case_id / "log.txt").read_text(encoding="utf-8")


def test_a_watchdog_message_without_its_start_is_a_collective_timeout() -> None:
    title = _log("comm-watchdog-title-truncated-dfine-118-1")
    found = classify_text(title)
    assert found is not None and found.kind == "comm/timeout" and found.rule == "nccl.watchdog-timeout"
    assert found.facts["op_type"] == "ALLREDUCE" and found.facts["seq_num"] == 5125
    assert found.facts["ran_for_ms"] == 1807734 and found.facts["timeout_ms"] == 1800000
    # a work descriptor without its timeout, or a 'ran for' of anything else, is no timeout
    assert classify_text("WorkNCCL(SeqNum=5125, OpType=ALLREDUCE) ran for 1807734 millisecond") is None
    assert classify_text("the epoch (12 of 90) ran for 1807734 milliseconds") is None


def test_device_asserts_wrapped_with_a_signature_or_without_a_kernel() -> None:
    for case, kernel in (("mem-index-assert-wrapped-failed-genhpf-17-1", "indexSelectLargeIndex"),
                         ("mem-thc-index-assert-small-flowtron-31-1", "indexSelectSmallIndex"),
                         ("mem-thc-index-assert-windows-flowtron-52-1", "a kernel")):
        found = classify_text(_log(case))
        assert found is not None and found.kind == "memory/cuda-error", case
        assert found.rule == "cuda.device-assert" and found.facts["kernel"] == kernel, case
        assert found.facts["index_out_of_range"] is True, case
    wrapped_line = _log("mem-index-assert-wrapped-failed-genhpf-17-1").splitlines()[-2]  # 'failed.' not in it
    alone = classify_text(wrapped_line)
    assert "failed" not in wrapped_line and alone is not None and alone.rule == "cuda.device-assert"
    # a C++ assert outside a kernel (no .cu site with block/thread) stays no device-side assert
    assert classify_text("python: foo.cpp:12: int main(): Assertion `x > 0` failed.") is None


def test_a_failure_entry_without_its_summary_header_is_that_ranks_exit() -> None:
    found = classify_text(_log("proc-exit1-table-tail-rank1-lcl-11-1"))
    assert found is not None and found.kind == "process/exit" and found.rule == "torchrun.worker-failed"
    assert found.facts["rank"] == 1 and found.facts["exitcode"] == 1
    # the exit-code field alone (a reader passing lines one by one; the rank is then the line's stream)
    alone = classify_text("  exitcode  : 1 (pid: 8181)")
    assert alone is not None and alone.kind == "process/exit" and "rank" not in alone.facts
    assert classify_text("  exitcode  : 1") is None  # without torchrun's pid: not its field
    # the same fields of a signal death are launcher.signal's (its 'Signal 6 ... received by PID' line)
    entry = ("  rank      : 0 (local_rank: 0)\n  exitcode  : -6 (pid: 104478)\n  error_file: <N/A>\n"
             "  traceback : Signal 6 (SIGABRT) received by PID 104478\n")
    aborted = classify_text(entry)
    assert aborted is not None and aborted.rule == "launcher.signal"


def test_torchrun_s_worker_line_cut_after_its_exit_code_is_still_that_exit() -> None:
    # raisf's paste (tuned): 'ERROR:torch.distributed.elastic.multiprocessing.api:failed (exitcode: -9) local_rank:
    # 0 (pid: 5343) of binary: ...' -- wrapped at 80 columns, the first piece ends at 'local_'
    line = _log("proc-killed-elastic-9-title-only-raisf-1").splitlines()[0]
    whole = classify_text(line)
    assert whole is not None and whole.kind == "process/killed" and whole.facts["local_rank"] == 0
    cut = classify_text(line[:80])
    assert cut is not None and (cut.kind, cut.rule) == ("process/killed", "torchrun.worker-failed")
    assert cut.facts == {"exitcode": -9}  # no rank: the line did not get that far
    assert classify_text("failed (exitcode: ") is None


def test_a_wrappers_numbered_nccl_error_is_that_nccl_error() -> None:
    # prime-rl#1098: 'RuntimeError: NCCL Error 3: internal error - please report this' (ncclResult_t 3)
    first = _log("comm-internal-error-then-watchdog-wrapped63-primerl-1098-1").splitlines()[0]
    exc_type, _, message = first.partition(": ")
    found = classify_exception(exc_type, message)
    assert found.kind == "comm/failure" and found.rule == "nccl.error"
    assert found.facts["code"] == "ncclInternalError"
    remote = classify_exception("RuntimeError", "NCCL Error 6: remote process exited or there was a network error")
    assert remote.kind == "comm/rank-lost"
    # a number that is no ncclResult_t error (7: in progress) is no NCCL failure
    assert classify_exception("RuntimeError", "NCCL Error 7: operation in progress").rule != "nccl.error"


def test_more_out_of_memory_wordings_are_an_oom() -> None:
    # neural-motifs#58 (legacy THC's exception) and CR-GAN#8 (the runtime's wording typed without its space)
    for case in ("mem-oom-thc-random-title-neuralmotifs-58-1", "mem-oom-no-space-quoted-prose-crgan-8-1"):
        found = classify_text(_log(case))
        assert found is not None and found.kind == "memory/oom" and found.rule == "cuda.oom-plain", case
    assert classify_exception("RuntimeError", "CUDA driver error: out of memory").kind == "memory/oom"
    # another cuda runtime error number is no OOM
    assert classify_exception("RuntimeError", "cuda runtime error (700) : an illegal memory access was "
                                              "encountered at x.cu:1").kind == "memory/cuda-error"


def test_a_slurm_cancellation_is_the_schedulers_sigterm() -> None:
    # myria3d#123: the step's cancellation glued to a tqdm line
    line = next(ln for ln in _log("proc-slurm-step-cancelled-ddp-prep-myria3d-123-1").splitlines()
                if "CANCELLED AT" in ln)
    found = classify_text(line)
    assert found is not None and found.kind == "process/terminated" and found.facts["slurm_job"] == "6053.0"
    limit = classify_text("slurmstepd: error: *** JOB 494583 ON node7 CANCELLED AT 2024-04-20T09:09:37 DUE TO "
                          "TIME LIMIT ***")
    assert limit is not None and limit.facts["reason"] == "time limit"
    assert classify_text("the order was cancelled at noon") is None
