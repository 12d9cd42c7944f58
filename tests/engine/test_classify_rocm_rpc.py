"""Classes of real pastes read since stop 35 (issue 17), the lines cut from tuned wild-corpus logs
(tests/fixtures/wild/<id>/source.txt names each thread):

* a kernel fault as ROCm prints it (``rocm.gpu-fault``): HIP's ``Device-side assertion `...' failed.``, the
  HSA runtime's ``Memory access fault by GPU node-N ...``, a queue ``aborting with error :
  HSA_STATUS_ERROR_*`` -- memory/cuda-error, the assertion winning over the fault that follows it;
* TensorPipe's RPC agent errors (``rpc.tensorpipe-agent``): a refused connection or a failed first request
  (``#0``, ``init_rpc``'s round) is comm/init-failure, a later EOF / reset a lost peer;
* ROCm's out-of-memory statuses (``HIP_ERROR_OutOfMemory``, ``hipErrorOutOfMemory``) are an OOM, as CUDA's are."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainguard_engine.classify import classify_text

WILD = Path(__file__).resolve().parents[1] / "fixtures" / "wild"


def _log(case_id: str) -> str:
    return (WILD / case_id / "log.txt").read_text(encoding="utf-8")


def _line(case_id: str, needle: str) -> str:
    return next(line for line in _log(case_id).splitlines() if needle in line)


def test_hips_device_side_assertion_is_a_device_assert() -> None:
    found = classify_text(_line("mem-hip-device-assert-vectoradd-hip-3368-1", "Device-side assertion"))
    assert found is not None and found.kind == "memory/cuda-error" and found.rule == "rocm.gpu-fault"
    assert found.facts["error_class"] == "device-side-assert"
    assert found.facts["kernel"] == "vectoradd_float" and found.facts["source"] == "vectoradd_hip.cpp:50"


def test_the_assertion_wins_over_the_queue_abort_after_it() -> None:
    found = classify_text(_log("mem-hip-device-assert-vectoradd-hip-3368-1"))
    assert found is not None and found.facts["error_class"] == "device-side-assert", found


@pytest.mark.parametrize("case_id, address", [("mem-hip-memory-access-fault-training-rocm-1535-1", "0x7fc133800000"),
                                              ("mem-hip-assert-memory-access-fault-hip-2482-1", "(nil)")])
def test_the_hsa_memory_access_fault_is_an_illegal_memory_access(case_id: str, address: str) -> None:
    found = classify_text(_line(case_id, "Memory access fault"))
    assert found is not None and found.kind == "memory/cuda-error", found
    assert found.facts["error_class"] == "illegal-memory-access" and found.facts["address"] == address
    assert found.facts["reason"].startswith("Page not present")


def test_a_queue_aborted_with_an_hsa_error_even_inside_a_json_line() -> None:
    line = _line("mem-hip-hsa-exception-jsonl-milabench-397-1", "HSA_STATUS_ERROR")
    found = classify_text(line)
    assert found is not None and found.kind == "memory/cuda-error", found
    assert found.facts["error"] == "HSA_STATUS_ERROR_EXCEPTION" and found.facts["code"] == "0x1016"
    assert found.facts["error_class"] == "hardware-exception"


def test_prose_about_device_side_assertions_is_not_one() -> None:
    assert classify_text("Compile with `TORCH_USE_HIP_DSA` to enable device-side assertions.") is None
    assert classify_text("the memory access fault by GPU node-1 happened again yesterday") is None


def test_a_refused_rpc_connection_is_an_init_failure() -> None:
    found = classify_text(_line("comm-init-rpc-tensorpipe-econnrefused-201-1", "RPC agent"))
    assert found is not None and found.kind == "comm/init-failure" and found.rule == "rpc.tensorpipe-agent"
    assert found.facts["peer"] == "Test1" and found.facts["at"] == "connect"


def test_a_failed_first_request_is_init_rpcs_round() -> None:
    found = classify_text(_line("comm-init-rpc-tensorpipe-reset-85607-1", "outgoing request #0"))
    assert found is not None and found.kind == "comm/init-failure", found
    assert found.facts["at"] == "first request (init_rpc)"


@pytest.mark.parametrize("line", [
    _line("comm-rank-lost-rpc-tensorpipe-eof-pippy-806-1", "from worker0: eof"),
    "[W tensorpipe_agent.cpp:596] RPC agent for worker1 encountered error when sending response to request #36 "
    "to worker0: ECONNRESET: connection reset by peer",
    "[W tensorpipe_agent.cpp:916] RPC agent for 3 encountered error when sending outgoing request #12 to 0: "
    "async error on socket: Connection reset by peer",
])
def test_a_later_eof_or_reset_is_a_lost_peer(line: str) -> None:
    found = classify_text(line)
    assert found is not None and found.kind == "comm/rank-lost", (line, found)
    assert found.facts["peer"] in ("worker0", "0")


@pytest.mark.parametrize("line", [
    _line("mem-oom-tf-rocm-hip-error-outofmemory-keras-13889-1", "HIP_ERROR_OutOfMemory"),
    "RuntimeError: HIP error: hipErrorOutOfMemory",
])
def test_rocms_out_of_memory_status_is_an_oom(line: str) -> None:
    found = classify_text(line)
    assert found is not None and found.kind == "memory/oom", (line, found)
