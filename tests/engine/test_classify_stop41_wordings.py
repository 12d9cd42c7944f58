"""Wordings of real pastes the classifier reads since stop 41 (hL), each a class of pastes, the lines cut from
tuned wild-corpus logs (tests/fixtures/wild/<id>/source.txt names each thread) -- found on the 46 logs of
e4e97de, which were labelled and recorded before any of these rules existed:

* a device-side assert whose kernel part is a lambda's signature holding ``::`` (torch 1.2-1.7's IndexKernel:
  ``IndexKernel.cu:60: lambda [](int)->auto::operator()(int)->auto: block: [..], thread: [..] Assertion ...``);
* NCCL's ``WARN Call to connect failed : ...`` is a set-up failure (comm/init-failure), also in NCCL < 2.3's
  debug line without the word NCCL (``[0] include/socket.h:360 WARN Call to connect failed``);
* an NCCL ``internal error`` whose ``Last error:`` is the socket set-up (``Bootstrap : no socket interface
  found``, ``ncclSocketInit: connecting to address with family N``) is comm/init-failure, as a failed connect
  under ``unhandled system error`` already was;
* vLLM's / SGLang's own NCCL wrapper's ``NCCL error: <ncclGetErrorString>`` (no site, no version) is that
  NCCL error;
* the heartbeat monitor's kill, ``Terminating the process ... due to ProcessGroupNCCL watchdog hang``, is the
  hang it reports (comm/timeout, as its ``watchdog got stuck for N seconds`` line);
* the elastic agent's ``Received Signals.SIGINT death signal`` (torch >= 2.2 names the signal) is that signal's
  exit, as ``Received 2 death signal`` was;
* ``colossalai run``'s last line, ``Error: failed to run torchrun ... on <host>[, is localhost: ..., exception:
  Encountered a bad command exit code!]``, is a process exit (no rank);
* Ray's memory monitor killing workers for host RAM (``N Workers (tasks / actors) killed due to memory pressure
  (OOM)``, ``Task was killed due to the node running low on memory``) is process/killed, as the kernel's OOM
  killer (found on f141fc2's second fresh batch, tuned side)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainguard_engine.classify import classify_text

WILD = Path(__file__).resolve().parents[1] / "fixtures" / "wild"


def _lines(case_id: str, first: str, count: int = 1) -> str:
    """``count`` lines of a corpus log from the first one holding ``first``."""
    lines = (WILD / case_id / "log.txt").read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        if first in line:
            return "\n".join(lines[i:i + count])
    raise AssertionError(f"{case_id}: no line with {first!r}")


@pytest.mark.parametrize("case_id", ["mem-cuda-assert-lambda-index-kernel-mmdet-3742-1",
                                     "mem-cuda-assert-then-traceback-nondist-sipmask-7-1"])
def test_a_lambda_kernels_device_assert_is_a_cuda_error(case_id: str) -> None:
    found = classify_text(_lines(case_id, "Assertion `"))
    assert found is not None and found.kind == "memory/cuda-error" and found.rule == "cuda.device-assert"
    assert found.facts["kernel"] == "lambda [](int)->auto::operator()(int)->auto"
    assert found.facts["index_out_of_range"] is True


def test_a_kernel_site_still_ends_at_its_colon_space() -> None:
    found = classify_text("/pytorch/aten/src/ATen/native/cuda/Indexing.cu:1284: indexSelectLargeIndex: block: "
                          "[0,0,0], thread: [1,0,0] Assertion `srcIndex < srcSelectDimSize` failed.")
    assert found is not None and found.facts["kernel"] == "indexSelectLargeIndex"


@pytest.mark.parametrize("text", [
    _lines("comm-init-nccl22-connect-timed-out-bootstrap-tests-15-1", "Call to connect failed"),
    _lines("comm-init-nccl2-connect-refused-starred-nccl-111-1", "Call to connect failed"),
    "node1:9:21 [0] misc/socket.cc:484 NCCL WARN Call to connect failed : Connection refused",
])
def test_ncclss_connect_failure_is_a_set_up_failure(text: str) -> None:
    found = classify_text(text)
    assert found is not None and found.kind == "comm/init-failure" and found.rule == "nccl.debug"


def test_the_connect_failure_wins_over_the_closed_connections_after_it() -> None:
    text = (WILD / "comm-init-nccl22-connect-timed-out-bootstrap-tests-15-1" / "log.txt").read_text(
        encoding="utf-8")
    assert "Connection closed by remote peer" in text
    found = classify_text(text)
    assert found is not None and found.kind == "comm/init-failure"


def test_prose_about_a_connect_is_no_nccl_line() -> None:
    found = classify_text("I see WARN Call to connect failed in my terminal sometimes")
    assert found is None or found.kind != "comm/init-failure"


@pytest.mark.parametrize("text", [
    _lines("comm-init-no-socket-interface-barrier-sigterm-mftcoder-31-1", "torch.distributed.DistBackendError",
           4),
    "ncclInternalError: Internal check failed.\nLast error:\n"
    "ncclSocketInit: connecting to address  with family 59936 is neither AF_INET(2) nor AF_INET6(10)",
])
def test_an_internal_error_from_the_socket_set_up_is_an_init_failure(text: str) -> None:
    found = classify_text(text)
    assert found is not None and found.kind == "comm/init-failure" and found.rule == "nccl.error"


def test_an_internal_error_with_no_set_up_detail_stays_a_comm_failure() -> None:
    found = classify_text("torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1207, internal "
                          "error, NCCL version 2.14.3\nncclInternalError: Internal check failed.")
    assert found is not None and found.kind == "comm/failure"


@pytest.mark.parametrize("text, kind, code", [
    (_lines("comm-init-nccl-internal-error-vllm-mq-engine-ib-1591-1", "NCCL error: internal error"),
     "comm/failure", "ncclInternalError"),
    ("RuntimeError: NCCL error: unhandled cuda error (run with NCCL_DEBUG=INFO for details)", None,
     "ncclUnhandledCudaError"),
    ("RuntimeError: NCCL error: remote process exited or there was a network error", "comm/rank-lost",
     "ncclRemoteError"),
])
def test_a_wrappers_bare_nccl_error_is_that_nccl_error(text: str, kind: str, code: str) -> None:
    found = classify_text(text)
    assert found is not None and found.rule == "nccl.error" and found.facts["code"] == code
    assert kind is None or found.kind == kind


def test_a_bare_nccl_error_needs_ncclss_own_words() -> None:
    found = classify_text("NCCL error: my own message about something")
    assert found is None or found.rule != "nccl.error"


def test_the_heartbeat_monitors_kill_for_a_watchdog_hang_is_a_timeout() -> None:
    line = _lines("comm-timeout-watchdog-hang-terminate-at-exit-swift-7992-1", "watchdog hang")
    found = classify_text(line)
    assert found is not None and found.kind == "comm/timeout" and found.rule == "nccl.heartbeat-stuck"
    assert found.facts["watchdog_hang"] is True and found.facts.get("pg_rank") == 2


@pytest.mark.parametrize("line, signal, kind", [
    (_lines("proc-terminated-ctrl-c-sigint-agent-f5-tts-728-1", "death signal"), 2, "process/terminated"),
    ("W0128 10:15:38.077000 1 torch/distributed/elastic/agent/server/api.py:741] Received Signals.SIGTERM death "
     "signal, shutting down workers", 15, "process/terminated"),
    ("[2024-02-01 10:00:00,000] torch.distributed.elastic.agent.server.api: [WARNING] Received 15 death signal, "
     "shutting down workers", 15, "process/terminated"),
])
def test_the_agents_named_death_signal_is_that_signal(line: str, signal: int, kind: str) -> None:
    found = classify_text(line)
    assert found is not None and found.kind == kind and found.facts["signal"] == signal


@pytest.mark.parametrize("line", [
    _lines("proc-exit-colossalai-run-failed-one-line-2441-1", "Error: failed to run"),
    _lines("proc-exit1-summary-colossalai-run-2642-1", "Error: failed to run"),
])
def test_colossalai_runs_failed_command_is_a_process_exit(line: str) -> None:
    found = classify_text(line)
    assert found is not None and found.kind == "process/exit" and found.rule == "launcher.signal"
    assert found.facts == {"launcher": "torchrun", "host": "127.0.0.1"}


def test_failing_to_run_something_in_prose_is_not_a_runner() -> None:
    found = classify_text("Error: failed to run my script on the cluster, any idea?")
    assert found is None or found.rule != "launcher.signal"


@pytest.mark.parametrize("text, workers", [
    (_lines("proc-killed-raylet-memory-pressure-flower-sim-2157-1", "killed due to memory pressure"), 4),
    (_lines("proc-killed-raylet-memory-pressure-wrapped-wmpo-3-1", "killed due to memory pressure", 2), 2),
    ("ray.exceptions.OutOfMemoryError: Task was killed due to the node running low on memory.", None),
])
def test_rays_memory_monitor_kill_is_a_kill_for_host_memory(text: str, workers: int) -> None:
    found = classify_text(text)
    assert found is not None and found.kind == "process/killed" and found.facts["killer"] == "ray-memory-monitor"
    assert found.facts.get("workers_killed") == workers


def test_a_ray_worker_that_crashed_for_other_reasons_is_no_memory_kill() -> None:
    found = classify_text("(raylet) A worker died or was killed while executing a task by an unexpected system "
                          "error. Worker exit type: SYSTEM_ERROR Worker exit detail: Worker unexpectedly exits")
    assert found is None or found.facts.get("killer") != "ray-memory-monitor"
