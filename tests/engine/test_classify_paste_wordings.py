"""Wordings of real pastes the classifier reads since stop 32 (issue 17), each a class of pastes, the lines cut
from tuned wild-corpus logs (tests/fixtures/wild/<id>/source.txt names each thread):

* a death by SIGBUS reported in text (a launcher's exit code -7/135, faulthandler's ``Bus error``) is
  ``process/exit`` -- shared memory or a mapped file, not the exit path's "OOM or a CUDA error" of SIGABRT;
* gloo's ``Application timeout caused pair closure`` is a collective timeout;
* a NaN loss with its value quoted as prose quotes it (```NaN` losses``, ``loss is `nan```);
* an IDE's run console, ``Process finished with exit code 139 (interrupted by signal 11: SIGSEGV)``, also
  pasted as its status alone (``139 (interrupted by signal 11:SIGSEGV)``);
* NCCL's ``Cuda failure 700 'an illegal memory access was encountered'`` (the error's number before its text,
  NCCL >= 2.19) is the CUDA fault it names; a ``Cuda failure`` naming no device fault (``'invalid argument'``)
  stays NCCL's own failure;
* Caffe's CUDA_CHECK through glog (``Check failed: error == cudaSuccess (74 vs. 0)  misaligned address``), a
  CUDA runtime enum naming a device fault whatever follows it (thrust's message retyped with spaces and broken
  after ``cudaErrorIllegalAddress``, or with full-width colons in Chinese prose) and Paddle's DataLoader
  ``Unexpected BUS error encountered in DataLoader worker`` (stop 39)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainguard_engine.classify import classify_text

WILD = Path(__file__).resolve().parents[1] / "fixtures" / "wild"


def _first_line(case_id: str, needle: str) -> str:
    for line in (WILD / case_id / "log.txt").read_text(encoding="utf-8").splitlines():
        if needle in line:
            return line
    raise AssertionError(f"{case_id}: no line with {needle!r}")


@pytest.mark.parametrize("line, rule", [
    (_first_line("proc-sigbus-elastic-7-title-muren-1", "exitcode: -7"), "torchrun.worker-failed"),
    ("Fatal Python error: Bus error", "python.fatal-error"),
    ("  traceback : Signal 7 (SIGBUS) received by PID 6421", "launcher.signal"),
    ("[launch.py:321:sigkill_handler] Killing subprocess 5567 exits with return code = 135", "launcher.signal"),
])
def test_a_bus_error_death_is_a_process_exit_not_a_cuda_error(line: str, rule: str) -> None:
    found = classify_text(line)
    assert found is not None and found.kind == "process/exit", (line, found)


def test_an_abort_stays_the_exit_paths_oom_or_cuda_error() -> None:
    found = classify_text("ERROR:torch.distributed.elastic.multiprocessing.api:failed (exitcode: -6) local_rank: 0 "
                          "(pid: 3311) of binary: /usr/bin/python")
    assert found is not None and found.kind == "memory/oom-or-cuda-error"


def test_gloos_pair_closure_is_a_timeout() -> None:
    line = _first_line("comm-gloo-pair-closure-spawn-bcnet-53-1", "pair closure")
    found = classify_text(line)
    assert found is not None and found.kind == "comm/timeout" and found.facts["backend"] == "gloo"


@pytest.mark.parametrize("line", [
    _first_line("num-megatron-llm-nan-prose-falcon-33-1", "losses"),
    "the loss is `nan` after the first epoch",
])
def test_a_quoted_nan_loss_is_the_loss_going_non_finite(line: str) -> None:
    found = classify_text(line)
    assert found is not None and found.kind == "loss/non_finite"


@pytest.mark.parametrize("line", ["I got `banana` losses", "nan`s losses of finance"])
def test_quotes_do_not_make_other_words_nan(line: str) -> None:
    found = classify_text(line)
    assert found is None or found.kind != "loss/non_finite"


@pytest.mark.parametrize("line, kind", [
    (_first_line("proc-segv-pycharm-139-radardistill-5-1", "exit code 139"), "process/exit"),
    ("Process finished with exit code 137 (interrupted by signal 9: SIGKILL)", "process/killed"),
    (_first_line("proc-segv-139-after-tqdm-s2c-8-1", "interrupted by signal"), "process/exit"),
])
def test_an_ides_signal_exit_is_that_signals(line: str, kind: str) -> None:
    found = classify_text(line)
    assert found is not None and found.kind == kind and found.rule == "launcher.signal"


def test_bashs_padded_segfault_report_with_a_long_command_is_a_segfault_exit() -> None:
    # COMG_model#9: 'train_iu_xray.sh: line 21: 1749424 Segmentation fault      (core dumped) python main_train.py
    # ...' -- bash pads the signal's name to a column, and the command line runs past 500 characters
    line = _first_line("proc-segv-bash-script-line-comg-9-1", "Segmentation fault")
    assert len(line) > 500
    found = classify_text(line)
    assert found is not None and found.kind == "process/exit" and found.facts["signal_name"] == "SIGSEGV"
    assert classify_text("a segmentation fault (the kind that dumps core) is rare here") is None


def test_nccls_numbered_cuda_failure_is_the_fault_it_names() -> None:
    # pytorch#131755: NCCL 2.2x's 'include/alloc.h:125 NCCL WARN Cuda failure 700 '...'' alone in the paste
    line = _first_line("mem-nccl-warn-cuda-failure-700-nan-check-131755-1", "NCCL WARN Cuda failure 700")
    found = classify_text(line)
    assert found is not None and found.kind == "memory/cuda-error" and found.rule == "cuda.error"
    assert found.facts["error_class"] == "illegal-memory-access"
    # a CUDA call NCCL made that names no device fault is NCCL's failure (nccl.error's reading), numbered or not
    text = (WILD / "comm-nccl-unhandled-cuda-1" / "log.txt").read_text(encoding="utf-8")
    assert "Cuda failure 1 'invalid argument'" in text
    for pasted in (text, text.replace("Cuda failure 1 '", "Cuda failure '")):
        found = classify_text(pasted)
        assert found is not None and found.kind == "comm/failure" and found.rule == "nccl.error"


def test_nccls_own_cuda_failure_naming_no_device_fault_is_nccls_failure() -> None:
    # pytorch#130113: 'transport/nvls.cc:246 NCCL WARN Cuda failure 3 'initialization error'' while NVLS is set
    # up -- not a device fault (cuda.error leaves it), NCCL's unhandled CUDA error (nccl.debug)
    line = _first_line("comm-unhandled-cuda-nvls-initialization-error-ddp-130113-1", "NCCL WARN Cuda failure")
    found = classify_text(line)
    assert found is not None and found.kind == "comm/failure" and found.rule == "nccl.debug"
    assert found.facts["cuda_error"] == "initialization error"


def test_deepspeeds_cublas_kernel_execution_error_is_a_cuda_library_error() -> None:
    # index-tts#424: DeepSpeed's cublas_wrappers print '!!!! kernel execution error. (m: .., n: .., k: ..,
    # error: 13)' (cuBLAS status 13 EXECUTION_FAILED, 14 INTERNAL_ERROR); an allocation failure (3) is not read
    case = "mem-ds-cublas-kernel-execution-error-13-14-indextts-424-1"
    for needle, status in (("error: 13)", "CUBLAS_STATUS_EXECUTION_FAILED"),
                           ("error: 14)", "CUBLAS_STATUS_INTERNAL_ERROR")):
        found = classify_text(_first_line(case, needle))
        assert found is not None and found.kind == "memory/cuda-error" and found.facts["error"] == status
    assert classify_text("!!!! kernel execution error. (m: 64, n: 64, k: 64, error: 3) ") is None


def test_an_old_nccl_error_without_its_version_and_invalid_usage_are_read() -> None:
    # torch 1.0's 'what():  NCCL error in: .../NCCLUtils.hpp:29, unhandled cuda error' (no NCCL version;
    # pytorch#12744, its CI stamp column dropped by the reader), and NCCL's 'ncclInvalidUsage:' code line (no
    # 'Error' in its name) with its 'Duplicate GPU detected' last error alone (verl#161's lines 2-4)
    line = _first_line("comm-unhandled-cuda-terminate-ci-stamps-c10d-12744-1", "what():")
    found = classify_text(line.split(" ", 3)[3])
    assert found is not None and found.kind == "comm/failure" and found.facts["code"] == "ncclUnhandledCudaError"
    vague = classify_text("  what():  NCCL error in: x.cpp:29, something else")
    assert vague is None or vague.rule == "vocab.comm"  # no specific rule; the general vocabulary's NCCL failure
    lines = (WILD / "comm-init-duplicate-gpu-quoted-ray-verl-161-1" / "log.txt").read_text().splitlines()
    found = classify_text("\n".join(lines[1:]))
    assert found is not None and found.kind == "comm/init-failure" and found.facts["code"] == "ncclInvalidUsage"


def test_a_c10_stack_raised_in_libc10_cuda_is_a_cuda_oom_or_error() -> None:
    # mmdet: only the C++ frames of a c10::Error thrown from libc10_cuda inside TensorImpl::release_resources
    text = (WILD / "mem-abort-c10-release-mmdet-1" / "log.txt").read_text(encoding="utf-8")
    found = classify_text(text)
    assert found is not None and found.kind == "memory/oom-or-cuda-error" and found.facts["from_frames"]
    single = classify_text(_first_line("mem-abort-c10-release-mmdet-1", "libc10_cuda.so"))  # read line by line
    assert single is not None and single.kind == "memory/oom-or-cuda-error"
    check = classify_text("frame #2: c10::cuda::c10_cuda_check_implementation(int, char const*, char const*, int, "
                          "bool) + 0x118 (0x7ff69c544a18 in /env/lib/python3.10/site-packages/torch/lib/libc10_cuda.so)")
    assert check is not None and check.kind == "memory/cuda-error"


def test_a_deep_libc10_cuda_frame_is_not_where_the_error_was_raised() -> None:
    found = classify_text("frame #7: <unknown function> + 0x13652 (0x7fa72b58e652 in /env/torch/lib/libc10_cuda.so)")
    assert found is None


@pytest.mark.parametrize("line", [
    _first_line("comm-watchdog-allgather-base-wrapped-torchtune-1165-1", "Timeout at NCCL work"),
    _first_line("comm-watchdog-reducescatter-1", "either an error or timeout"),
    "[rank1]:[E1002 18:16:40.662691402 ProcessGroupNCCL.cpp:756] [Rank 1] Work WorkNCCL(SeqNum=2521, "
    "OpType=ALLREDUCE, NumelIn=160672064, NumelOut=160672064, Timeout(ms)=600000) timed out in blocking wait.",
])
def test_processgroupnccls_other_timeout_lines_alone_are_a_timeout(line: str) -> None:
    found = classify_text(line)
    assert found is not None and found.kind == "comm/timeout"


@pytest.mark.parametrize("line", ["Bus error (core dumped)",
                                  "/bin/bash: line 1: 12345 Bus error               (core dumped) python train.py"])
def test_a_shells_bus_error_is_a_process_exit(line: str) -> None:
    found = classify_text(line)
    assert found is not None and found.kind == "process/exit" and found.facts["signal"] == 7


def test_a_shells_abort_is_still_left_to_the_exit_path() -> None:
    assert classify_text("Aborted (core dumped)") is None


def test_an_extensions_cuda_runtime_error_after_a_bare_exception_type() -> None:
    # diffvg: 'RuntimeError' alone on a line, then 'CUDA Runtime Error: an illegal memory access ... at scene.cpp'
    text = (Path(__file__).resolve().parents[1] / "fixtures" / "wild" /
            "mem-illegal-access-split-exception-diffvg-3-1" / "log.txt").read_text(encoding="utf-8")
    found = classify_text(text)
    assert found is not None and found.kind == "memory/cuda-error"
    assert found.facts["error_class"] == "illegal-memory-access"
    assert classify_text("no CUDA runtime error was raised") is None


def test_caffes_cuda_check_through_glog_is_the_cuda_error_it_names() -> None:
    # n3011/Inception_v3_GoogLeNet#2 (tuned): 'Check failed: error == cudaSuccess (74 vs. 0)  misaligned address'
    line = _first_line("mem-caffe-misaligned-check-failed-inception-v3-2-1", "Check failed")
    found = classify_text(line)
    assert found is not None and found.kind == "memory/cuda-error" and found.rule == "cuda.error"
    assert found.facts["error_class"] == "misaligned-address"
    oom = classify_text("F0101 00:00:00.000000 1 syncedmem.cpp:56] Check failed: error == cudaSuccess (2 vs. 0)"
                        "  out of memory")
    assert oom is None or oom.kind != "memory/cuda-error"  # an allocation failure is the OOM rules' to read


@pytest.mark.parametrize("case_id, needle", [
    ("mem-thrust-copy-if-illegal-address-split-crowddet-26-1", "cudaErrorIllegalAddress"),
    ("mem-thrust-transform-illegal-address-fullwidth-prose-semseg-45-1", "cudaErrorIllegalAddress"),
])
def test_a_cuda_enum_naming_a_device_fault_is_read_however_its_text_follows(case_id: str, needle: str) -> None:
    text = (WILD / case_id / "log.txt").read_text(encoding="utf-8")
    found = classify_text(text)
    assert found is not None and found.kind == "memory/cuda-error", found
    assert found.facts["error_class"] == "illegal-memory-access"
    assert classify_text("merge_sort: failed to synchronize: cudaErrorInvalidValue ") is None  # names no fault


def test_paddles_dataloader_bus_error_is_a_process_exit() -> None:
    line = _first_line("proc-paddle-dl-bus-error-repeated-ppocr-9391-1", "BUS error")
    found = classify_text(line)
    assert found is not None and found.kind == "process/exit" and found.rule == "dataloader.worker"
    assert found.facts["signal"] == "bus error"
