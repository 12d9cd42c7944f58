"""The error-text classifier (trainguard_engine.classify) on real captured texts, and its wiring into the
pipeline (detectors/process.py): exceptions and log records whose text is comm/* or memory/* open an
incident of that kind with the parsed facts.

Texts used here:

* every ``tests/fixtures/tracebacks/*.txt`` (real captures, H200 CUDA OOM and NCCL watchdog included, and
  the ``synthetic_from_source_*`` ones);
* real CPU captures made for this test with torch 2.13.0+cpu (``.venv``), embedded below verbatim (a few
  lines each): a torchrun job whose rank 1 SIGKILLs itself after a barrier while rank 0 enters all_reduce
  (``python -m torch.distributed.run --nproc_per_node 2 --max-restarts 0 killed.py``), a gloo
  ``monitored_barrier(timeout=2 s)`` that rank 2 of 3 never reaches, ``init_process_group`` of world size 2
  with one rank (3 s timeout), a ``TCPStore`` client to a closed port (3 s timeout), and
  ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` with rank 0 calling all_reduce(float) and rank 1 broadcast(int64);
* real captures on one NVIDIA H200 (torch 2.11.0+cu130, NCCL 2.28.9) made for this test, embedded below
  (trimmed): an ``nn.Embedding(100, 16)`` fed id 100 and a ``cross_entropy`` target of 10 for 10 classes on
  CUDA (device-side asserts), a Triton kernel storing 2**40 elements past its tensor (illegal memory
  access), two NCCL ranks both on GPU 0 (``ncclInvalidUsage: Duplicate GPU detected``), and the single-GPU
  NCCL watchdog case of ``tests/fixtures/tracebacks/generate.py`` with ``TORCH_NCCL_DESYNC_DEBUG=1``
  (the desync report);
* texts in the formats PyTorch and NCCL print (TraceUtils.h's desync report, NCCLUtils' error strings,
  CUDACachingAllocator's OOM variants, ATen kernel asserts, the NVIDIA driver's Xid lines), marked
  ``FROM_SOURCE``.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import re
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pytest

from trainguard.core.tracebacks import parse_traceback_text
from trainguard_engine import _native
from trainguard_engine import classify as classify_mod
from trainguard_engine.catalogue import KINDS, DetectionSettings, kind
from trainguard_engine.classify import (
    FALLBACKS,
    FIRST_RULE,
    RULE_DOCS,
    RULES,
    Classification,
    classify_chain,
    classify_exception,
    classify_text,
    format_size,
    parse_size,
    rules_table,
)
from trainguard_engine.detectors import process
from trainguard_engine.incidents import apply
from trainguard_engine.pipeline import Pipeline
from trainguard_engine.state import RunState

TRACEBACKS = Path(__file__).resolve().parents[1] / "fixtures" / "tracebacks"
REPO = Path(__file__).resolve().parents[2]
GiB, MiB = 1024**3, 1024**2


def fixture(name: str) -> str:
    return (TRACEBACKS / name).read_text(encoding="utf-8")


def size(text: str) -> int:
    """An independent reading of a PyTorch size ("20.00 MiB") for the assertions."""
    number, unit = text.split()
    return round(float(number) * {"bytes": 1, "KiB": 1024, "MiB": MiB, "GiB": GiB}[unit])


def classified(text: str) -> Classification:
    found = classify_text(text)
    assert found is not None, text[:200]
    assert found.kind in KINDS  # always a catalogue row
    json.dumps(dict(found.facts), allow_nan=False)  # JSON-ready
    return found


# ------------------------------------------------------------------------------------------------------
# Real CPU captures (torch 2.13.0+cpu), verbatim

TORCHRUN_SIGKILL = "\n".join([
    '[rank0]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:8620: Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the application. Check the logs of the remote worker before reporting an error. GLHF! 🏖️',
    'W1129 09:31:20.107000 15483 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 15512 closing signal SIGTERM',
    'E1129 09:31:20.124000 15483 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: -9) local_rank: 1 (pid: 15513) of binary: /work/main/.venv/bin/python',
    'Traceback (most recent call last):',
    '  File "<frozen runpy>", line 198, in _run_module_as_main',
    '  File "<frozen runpy>", line 88, in _run_code',
    '  File "/work/main/.venv/lib/python3.11/site-packages/torch/distributed/run.py", line 1032, in <module>',
    '    main()',
    '  File "/work/main/.venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/errors/__init__.py", line 367, in wrapper',
    '    return f(*args, **kwargs)',
    '           ^^^^^^^^^^^^^^^^^^',
    '  File "/work/main/.venv/lib/python3.11/site-packages/torch/distributed/run.py", line 1028, in main',
    '    run(args)',
    '  File "/work/main/.venv/lib/python3.11/site-packages/torch/distributed/run.py", line 1019, in run',
    '    elastic_launch(',
    '  File "/work/main/.venv/lib/python3.11/site-packages/torch/distributed/launcher/api.py", line 194, in __call__',
    '    return launch_agent(',
    '           ^^^^^^^^^^^^^',
    '  File "/work/main/.venv/lib/python3.11/site-packages/torch/distributed/launcher/api.py", line 383, in launch_agent',
    '    raise ChildFailedError(',
    'torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ',
    '============================================================',
    'killed.py FAILED',
    '------------------------------------------------------------',
    'Failures:',
    '[1]:',
    '  time      : 2026-11-29_09:31:20',
    '  host      : localhost',
    '  rank      : 0 (local_rank: 0)',
    '  exitcode  : -15 (pid: 15512)  (SIGTERM)',
    '  error_file: /tmp/torchelastic_ujtbf4fk/6ef5f1a9-3f08-4476-a65d-29cd75c5ecca_6wwznb1l/attempt_0/0/error.json',
    '  traceback : Traceback (most recent call last):',
    '    File "/work/main/.venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/errors/__init__.py", line 367, in wrapper',
    '      return f(*args, **kwargs)',
    '             ^^^^^^^^^^^^^^^^^^',
    '    File "/tmp/cap/killed.py", line 10, in main',
    '      dist.all_reduce(torch.ones(4))',
    '    File "/work/main/.venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", line 83, in wrapper',
    '      return func(*args, **kwargs)',
    '             ^^^^^^^^^^^^^^^^^^^^^',
    '    File "/work/main/.venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 3252, in all_reduce',
    '      work.wait()',
    '  RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:8620: Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the application. Check the logs of the remote worker before reporting an error. GLHF! 🏖️',
    '  ',
    '------------------------------------------------------------',
    'Root Cause (first observed failure):',
    '[0]:',
    '  time      : 2026-11-29_09:31:20',
    '  host      : localhost',
    '  rank      : 1 (local_rank: 1)',
    '  exitcode  : -9 (pid: 15513)  (SIGKILL)',
    '  error_file: <N/A>',
    '  traceback : Signal 9 (SIGKILL) received by PID 15513',
    '============================================================',
])


MONITORED_BARRIER_RANK0 = "\n".join([
    '[rank0]:[E1129 09:31:13.358995194 ProcessGroupGloo.cpp:67] [Rank 0]: Rank 2 failed to pass monitoredBarrier in 2000 ms',
    '[rank0]: Traceback (most recent call last):',
    '[rank0]:   File "/tmp/cap/monitored.py", line 6, in <module>',
    '[rank0]:     dist.monitored_barrier(timeout=datetime.timedelta(seconds=2))',
    '[rank0]:   File "/work/main/.venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 5435, in monitored_barrier',
    '[rank0]:     return group_to_use.monitored_barrier(  # type:ignore[attr-defined]',
    '[rank0]:            ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^',
    '[rank0]: RuntimeError: [Rank 0]: Rank 2 failed to pass monitoredBarrier in 2000 ms',
    '[rank0]:  Original exception: ',
    '[rank0]: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 2000ms for recv operation to complete',
])


MONITORED_BARRIER_RANK1 = "\n".join([
    '[rank1]:[E1129 09:31:13.348758465 ProcessGroupGloo.cpp:67] Rank 1 successfully reached monitoredBarrier, but received errors while waiting for send/recv from rank 0. Please check rank 0 logs for faulty rank.',
    '[rank1]: Traceback (most recent call last):',
    '[rank1]:   File "/tmp/cap/monitored.py", line 6, in <module>',
    '[rank1]:     dist.monitored_barrier(timeout=datetime.timedelta(seconds=2))',
    '[rank1]:   File "/work/main/.venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 5435, in monitored_barrier',
    '[rank1]:     return group_to_use.monitored_barrier(  # type:ignore[attr-defined]',
    '[rank1]:            ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^',
    '[rank1]: RuntimeError: Rank 1 successfully reached monitoredBarrier, but received errors while waiting for send/recv from rank 0. Please check rank 0 logs for faulty rank.',
    '[rank1]:  Original exception: ',
    '[rank1]: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:16273. This is typically caused by a remote worker crashing. Check the logs of the remote worker before reporting an error. GLHF! 🏖️',
])


STORE_CLIENTS = "\n".join([
    'Traceback (most recent call last):',
    '  File "/work/main/.venv/lib/python3.11/site-packages/torch/distributed/rendezvous.py", line 199, in _create_c10d_store',
    '    return TCPStore(',
    '           ^^^^^^^^^',
    'torch.distributed.DistStoreError: Timed out after 4 seconds waiting for clients. 1/2 clients joined.',
])


STORE_CONNECT_TIMEOUT = "\n".join([
    '[E1129 09:31:01.705067496 socket.cpp:1028] [c10d] The client socket has timed out after 3000ms while trying to connect to (127.0.0.1, 1).',
    '[W1129 09:31:01.705425656 TCPStore.cpp:340] [c10d] TCP client failed to connect/validate to host 127.0.0.1:1 - retrying (try=0, timeout=3000ms, delay=1353ms): The client socket has timed out after 3000ms while trying to connect to (127.0.0.1, 1).',
    'Traceback (most recent call last):',
    '  File "/tmp/cap/store_refused.py", line 2, in <module>',
    '    dist.TCPStore("127.0.0.1", 1, world_size=2, is_master=False, timeout=datetime.timedelta(seconds=3))',
    'torch.distributed.DistNetworkError: The client socket has timed out after 3000ms while trying to connect to (127.0.0.1, 1).',
])


OP_TYPE_MISMATCH = "\n".join([
    '[rank0]: RuntimeError: Detected mismatch between collectives on ranks. Rank 0 is running collective: CollectiveFingerPrint(SequenceNumber=0, OpType=ALLREDUCE, TensorShape=[4], TensorDtypes=Float, TensorDeviceTypes=TensorOptions(dtype=float (default), device=cpu, layout=Strided (default), requires_grad=false (default), pinned_memory=false (default), memory_format=(nullopt))), but Rank 1 is running collective: CollectiveFingerPrint(SequenceNumber=0, OpType=BROADCAST, TensorShape=[4], TensorDtypes=Long, TensorDeviceTypes=TensorOptions(dtype=float (default), device=cpu, layout=Strided (default), requires_grad=false (default), pinned_memory=false (default), memory_format=(nullopt))).Collectives differ in the following aspects:   Op type: ALLREDUCEvs BROADCAST  Tensor Tensor dtypes: Floatvs Long',
])


# ------------------------------------------------------------------------------------------------------
# Real H200 captures (torch 2.11.0+cu130, NCCL 2.28.9, one GPU), verbatim, trimmed to the lines shown

GPU_EMBEDDING_ASSERT = "\n".join([
    '/pytorch/aten/src/ATen/native/cuda/Indexing.cu:1515: indexSelectSmallIndex: block: [0,0,0], thread: [0,0,0] Assertion `srcIndex < srcSelectDimSize` failed.',
    '/pytorch/aten/src/ATen/native/cuda/Indexing.cu:1515: indexSelectSmallIndex: block: [0,0,0], thread: [15,0,0] Assertion `srcIndex < srcSelectDimSize` failed.',
    'Traceback (most recent call last):',
    '  File "/work/main/.scratch_classify/cuda_errors.py", line 61, in <module>',
    '    globals()[name](*args)',
    '  File "/work/main/.scratch_classify/cuda_errors.py", line 15, in embedding_assert',
    '    torch.cuda.synchronize()',
    '  File "/opt/torch/.venv/lib/python3.12/site-packages/torch/cuda/__init__.py", line 1162, in synchronize',
    '    return torch._C._cuda_synchronize()',
    '           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^',
    'torch.AcceleratorError: CUDA error: device-side assert triggered',
    "Search for `cudaErrorAssert' in https://docs.nvidia.com/cuda/cuda-runtime-api/group__CUDART__TYPES.html for more information.",
    'CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below might be incorrect.',
    'For debugging consider passing CUDA_LAUNCH_BLOCKING=1',
    'Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.',
    '',
])


GPU_NLL_ASSERT = "\n".join([
    '/pytorch/aten/src/ATen/native/cuda/Loss.cu:245: nll_loss_forward_reduce_cuda_kernel_2d: block: [0,0,0], thread: [3,0,0] Assertion `t >= 0 && t < n_classes` failed.',
    'Traceback (most recent call last):',
    '  File "/work/main/.scratch_classify/cuda_errors.py", line 61, in <module>',
    '    globals()[name](*args)',
    '  File "/work/main/.scratch_classify/cuda_errors.py", line 21, in nll_assert',
    '    torch.cuda.synchronize()',
    '  File "/opt/torch/.venv/lib/python3.12/site-packages/torch/cuda/__init__.py", line 1162, in synchronize',
    '    return torch._C._cuda_synchronize()',
    '           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^',
    'torch.AcceleratorError: CUDA error: device-side assert triggered',
    "Search for `cudaErrorAssert' in https://docs.nvidia.com/cuda/cuda-runtime-api/group__CUDART__TYPES.html for more information.",
    'CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below might be incorrect.',
    'For debugging consider passing CUDA_LAUNCH_BLOCKING=1',
    'Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.',
    '',
])


GPU_ILLEGAL_ACCESS = "\n".join([
    'Traceback (most recent call last):',
    '  File "/work/main/.scratch_classify/cuda_errors.py", line 61, in <module>',
    '    globals()[name](*args)',
    '  File "/work/main/.scratch_classify/cuda_errors.py", line 34, in illegal_access',
    '    torch.cuda.synchronize()',
    '  File "/opt/torch/.venv/lib/python3.12/site-packages/torch/cuda/__init__.py", line 1162, in synchronize',
    '    return torch._C._cuda_synchronize()',
    '           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^',
    'torch.AcceleratorError: CUDA error: an illegal memory access was encountered',
    "Search for `cudaErrorIllegalAddress' in https://docs.nvidia.com/cuda/cuda-runtime-api/group__CUDART__TYPES.html for more information.",
    'CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below might be incorrect.',
    'For debugging consider passing CUDA_LAUNCH_BLOCKING=1',
    'Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.',
    '',
])


GPU_NCCL_DUPLICATE_GPU = "\n".join([
    '[rank0]: Traceback (most recent call last):',
    '[rank0]:   File "/work/main/.scratch_classify/cuda_errors.py", line 61, in <module>',
    '[rank0]:     globals()[name](*args)',
    '[rank0]:   File "/work/main/.scratch_classify/cuda_errors.py", line 42, in nccl_duplicate_gpu',
    '[rank0]:     dist.all_reduce(t)',
    '[rank0]:   File "/opt/torch/.venv/lib/python3.12/site-packages/torch/distributed/c10d_logger.py", line 83, in wrapper',
    '[rank0]:     return func(*args, **kwargs)',
    '[rank0]:            ^^^^^^^^^^^^^^^^^^^^^',
    '[rank0]:   File "/opt/torch/.venv/lib/python3.12/site-packages/torch/distributed/distributed_c10d.py", line 3068, in all_reduce',
    '[rank0]:     work = group.allreduce([tensor], opts)',
    '[rank0]:            ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^',
    '[rank0]: torch.distributed.DistBackendError: NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.cpp:93, invalid usage (run with NCCL_DEBUG=WARN for details), NCCL version 2.28.9',
    '[rank0]: ncclInvalidUsage: This usually reflects invalid usage of NCCL library.',
    '[rank0]: Last error:',
    '[rank0]: Duplicate GPU detected : rank 0 and rank 1 both on CUDA device 60',
    '[rank0]:[W1129 09:53:31.161181915 ProcessGroupNCCL.cpp:1575] Warning: WARNING: destroy_process_group() was not called before program exit, which can leak resources. For more info, please see https://pytorch.org/docs/stable/distributed.html#shutdown (function operator())',
])


GPU_NCCL_DESYNC = "\n".join([
    '[rank0]:[E1129 09:53:41.446792636 ProcessGroupNCCL.cpp:689] [Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=2, OpType=ALLREDUCE, NumelIn=1048576, NumelOut=1048576, Timeout(ms)=5000) ran for 5083 milliseconds before timing out.',
    '[rank0]:[E1129 09:53:41.447616734 ProcessGroupNCCL.cpp:2495] Rank 0',
    '\t - [0] Timeout at collective: ALLREDUCE, #2',
    '\t - To our best knowledge, the lagging/dead/mismatched ranks that caused the desync are:',
    "\t   - [0] joined but didn't finish collective #2 (count from 1)",
    "\t - Snapshot of ranks' latest states:",
    '\t   #2 started ranks:',
    '\t     [0] started ALLREDUCE',
    '[rank0]:[E1129 09:53:41.447634358 ProcessGroupNCCL.cpp:2303] [PG ID 0 PG GUID 0(default_pg) Rank 0]  failure detected by watchdog at work sequence id: 2 PG status: last enqueued work: 2, last completed work: 1',
    '[rank0]:[E1129 09:53:46.783813544 ProcessGroupNCCL.cpp:733] Stack trace of the failed collective: ',
    '#0 all_reduce from /opt/torch/.venv/lib/python3.12/site-packages/torch/distributed/distributed_c10d.py:3068',
    '#1 wrapper from /opt/torch/.venv/lib/python3.12/site-packages/torch/distributed/c10d_logger.py:83',
    '#2 nccl_desync from /work/main/.scratch_classify/cuda_errors.py:54',
    '#3 <module> from /work/main/.scratch_classify/cuda_errors.py:61',
    '',
    '[rank0]:[E1129 09:53:46.783909297 ProcessGroupNCCL.cpp:2636] [PG ID 0 PG GUID 0(default_pg) Rank 0] First PG on this rank to signal dumping.',
])


# ------------------------------------------------------------------------------------------------------
# Every fixture text, classified

FIXTURES: Dict[str, Tuple[str, str]] = {
    "anomaly_nan_backward.txt": ("gradient/nan-source", "autograd.anomaly-nan"),
    "chained_cause_context.txt": ("process/exception", "model.shape-mismatch"),
    "dataloader_worker_error.txt": ("process/exception", "dataloader.worker"),
    "device_mismatch_meta.txt": ("process/exception", "model.device-mismatch"),
    "different_site_rank0.txt": ("process/exception", "model.shape-mismatch"),
    "embedding_index_error.txt": ("process/exception", "model.index-out-of-range"),
    # SIGABRT by the decision path (134/SIGABRT: OOM or a CUDA error), at the low confidence of a bare dump
    "faulthandler_abort.txt": ("memory/oom-or-cuda-error", "python.fatal-error"),
    "gloo_mismatch_detail_rank0.txt": ("comm/mismatch", "c10d.collective-mismatch"),
    "gloo_mismatch_detail_rank1.txt": ("comm/mismatch", "c10d.collective-mismatch"),
    "gloo_size_mismatch_enforce.txt": ("comm/mismatch", "gloo.size-mismatch"),
    # the survivor's view of a peer that aborted (the enforce failure above): a lost peer, not a timeout
    "gloo_size_mismatch_peer.txt": ("comm/rank-lost", "gloo.peer-lost"),
    # a live straggler: the others' recv/send timed out
    "gloo_timeout_rank0.txt": ("comm/timeout", "gloo.timeout"),
    "gloo_timeout_rank1.txt": ("comm/timeout", "gloo.timeout"),
    "gloo_timeout_rank2.txt": ("comm/timeout", "gloo.timeout"),
    "gpu_cuda_oom_a.txt": ("memory/oom", "cuda.oom"),
    "gpu_cuda_oom_b.txt": ("memory/oom", "cuda.oom"),
    "gpu_nccl_watchdog_timeout.txt": ("comm/timeout", "nccl.watchdog-timeout"),
    "recursion_error.txt": ("process/exception", "python.exception"),
    "same_failure_a_rank0.txt": ("process/exception", "model.shape-mismatch"),
    "same_failure_a_rank1.txt": ("process/exception", "model.shape-mismatch"),
    "same_failure_a_rank2.txt": ("process/exception", "model.shape-mismatch"),
    "same_failure_a_rank3.txt": ("process/exception", "model.shape-mismatch"),
    "same_failure_b_rank0.txt": ("process/exception", "model.shape-mismatch"),
    "same_failure_b_rank1.txt": ("process/exception", "model.shape-mismatch"),
    "same_failure_b_rank2.txt": ("process/exception", "model.shape-mismatch"),
    "same_failure_b_rank3.txt": ("process/exception", "model.shape-mismatch"),
    "shape_mismatch_linear.txt": ("process/exception", "model.shape-mismatch"),
    "spawn_process_raised.txt": ("process/exception", "python.exception"),
    "synthetic_from_source_cuda_oom_legacy.txt": ("memory/oom", "cuda.oom"),
    "synthetic_from_source_cuda_oom_rank0.txt": ("memory/oom", "cuda.oom"),
    "synthetic_from_source_cuda_oom_rank3.txt": ("memory/oom", "cuda.oom"),
    "synthetic_from_source_nccl_watchdog_rank1.txt": ("comm/timeout", "nccl.watchdog-timeout"),
    "synthetic_from_source_nccl_watchdog_rank5.txt": ("comm/timeout", "nccl.watchdog-timeout"),
    "torchrun_two_ranks.txt": ("process/exception", "torchrun.child-failed"),
}


def test_every_fixture_is_in_the_table() -> None:
    assert sorted(p.name for p in TRACEBACKS.glob("*.txt")) == sorted(FIXTURES)


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_fixture_texts_are_classified(name: str) -> None:
    found = classified(fixture(name))
    assert (found.kind, found.rule) == FIXTURES[name]
    assert found.headline and found.lines and 0 < found.confidence <= 1
    assert all(line.strip() and len(line) <= classify_mod.MAX_LINE_CHARS for line in found.lines)


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_the_exception_python_printed_classifies_like_the_whole_text(name: str) -> None:
    """What the SDK sends for these failures: the outermost exception's type and message."""
    parsed = [e for e in parse_traceback_text(fixture(name)) if e.relation == ""]
    if not parsed:
        pytest.skip("no exception printed (a faulthandler dump)")
    exc = parsed[-1]
    found = classify_exception(exc.exc_type, exc.message)
    expected_kind, expected_rule = FIXTURES[name]
    if expected_rule == "torchrun.child-failed":
        expected_kind = "process/exception"  # the launcher's own exception: its message is the summary
    assert found.kind == expected_kind


def _said(text: str, pattern: str) -> int:
    """A size exactly as the text prints it, read independently of the classifier."""
    match = re.search(pattern, text)
    assert match is not None, pattern
    return size(match.group(1))


_SZ = r"(\d+\.\d+ [KMG]iB|\d+ bytes)"


@pytest.mark.parametrize("name", ["gpu_cuda_oom_a.txt", "gpu_cuda_oom_b.txt", "synthetic_from_source_cuda_oom_rank0.txt",
                                  "synthetic_from_source_cuda_oom_rank3.txt"])
def test_cuda_oom_current_format_amounts(name: str) -> None:
    text = fixture(name)
    facts = classified(text).facts
    assert facts["format"] == "current" and facts["backend"] == "CUDA"
    assert facts["device"] == int(re.search(r"GPU (\d+) has a total", text).group(1))  # type: ignore[union-attr]
    assert facts["requested"] == _said(text, r"Tried to allocate " + _SZ)
    assert facts["capacity"] == _said(text, r"total capacity of " + _SZ)
    assert facts["free"] == _said(text, r"of which " + _SZ + " is free")
    assert facts["process_in_use"] == _said(text, r"this process has " + _SZ + " memory in use")
    assert facts["allocated"] == _said(text, r"Of the allocated memory " + _SZ)
    assert facts["reserved_unallocated"] == _said(text, _SZ + " is reserved by PyTorch but unallocated")
    assert facts["reserved"] == facts["allocated"] + facts["reserved_unallocated"]


def test_real_h200_oom_facts_and_headline() -> None:
    found = classified(fixture("gpu_cuda_oom_a.txt"))
    assert found.facts["requested"] == 256 * GiB
    assert found.facts["other_processes"] == [{"pid": 446, "bytes": size("1.16 GiB")}]
    assert found.headline == "CUDA OOM on GPU 0: tried to allocate 256.00 GiB with 102.12 GiB free of 139.80 GiB"
    assert "exceeds the GPU's capacity" in found.note  # 256 GiB asked of a 139.80 GiB GPU
    assert found.lines[0].startswith("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 256.00 GiB")
    rank0 = classified(fixture("synthetic_from_source_cuda_oom_rank0.txt"))
    assert rank0.headline == "CUDA OOM on GPU 0: tried to allocate 20.00 MiB with 3.19 MiB free of 79.15 GiB"
    assert rank0.facts["rank"] == 0  # from the [rank0]: prefix
    assert classified(fixture("synthetic_from_source_cuda_oom_rank3.txt")).facts["device"] == 3


def test_cuda_oom_older_format_amounts() -> None:
    text = fixture("synthetic_from_source_cuda_oom_legacy.txt")
    facts = classified(text).facts
    assert facts["format"] == "legacy" and facts["device"] == 0
    assert facts["requested"] == 2 * GiB
    assert facts["capacity"] == size("15.78 GiB") and facts["allocated"] == size("13.12 GiB")
    assert facts["free"] == size("1.05 GiB") and facts["reserved"] == size("13.89 GiB")
    assert facts["reserved_unallocated"] == size("13.89 GiB") - size("13.12 GiB")
    # the brief's example of the older format, and the oldest "cached" wording
    old = classified("RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total capacity; "
                     "14.12 GiB already allocated; 19.94 MiB free; 14.27 GiB reserved in total by PyTorch)").facts
    assert (old["capacity"], old["allocated"], old["free"], old["reserved"]) == (
        size("15.78 GiB"), size("14.12 GiB"), size("19.94 MiB"), size("14.27 GiB"))
    cached = classified("RuntimeError: CUDA out of memory. Tried to allocate 12.00 MiB (GPU 1; 11.17 GiB total "
                        "capacity; 10.62 GiB already allocated; 145.81 MiB free; 10.66 GiB cached)").facts
    assert cached["device"] == 1 and cached["reserved"] == size("10.66 GiB")


FROM_SOURCE_OOM_VARIANTS = [
    # torch 2.1's "capacty" typo, two other processes, no "Including non-PyTorch memory" sentence
    ("torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 448.00 MiB. GPU 1 has a total capacty of "
     "79.10 GiB of which 364.31 MiB is free. Process 175080 has 1.46 GiB memory in use. Process 175356 has 77.26 GiB "
     "memory in use. Of the allocated memory 72.12 GiB is allocated by PyTorch, and 3.78 GiB is reserved by PyTorch "
     "but unallocated.", {"device": 1, "capacity": size("79.10 GiB"), "allocated": size("72.12 GiB"),
                          "other_processes": [{"pid": 175080, "bytes": size("1.46 GiB")},
                                              {"pid": 175356, "bytes": size("77.26 GiB")}]}),
    # CUDA graphs' private pools
    ("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 79.15 GiB of which 3.19 MiB is "
     "free. Of the allocated memory 70.00 GiB is allocated by PyTorch, with 8.00 GiB allocated in private pools "
     "(e.g., CUDA Graphs), and 120.30 MiB is reserved by PyTorch but unallocated.",
     {"private_pools": 8 * GiB, "reserved_unallocated": size("120.30 MiB"),
      "reserved": 78 * GiB + size("120.30 MiB")}),
    ("0 bytes free: CUDA out of memory. Tried to allocate 730.00 MiB. GPU 0 has a total capacity of 8.00 GiB of which "
     "0 bytes is free.", {"free": 0, "capacity": 8 * GiB, "requested": size("730.00 MiB")}),
]


@pytest.mark.parametrize(("text", "expected"), FROM_SOURCE_OOM_VARIANTS)
def test_cuda_oom_variants(text: str, expected: Dict[str, Any]) -> None:
    found = classified(text)
    assert found.kind == "memory/oom"
    for key, value in expected.items():
        assert found.facts[key] == value, key


def test_nccl_watchdog_real_h200_facts() -> None:
    found = classified(fixture("gpu_nccl_watchdog_timeout.txt"))
    facts = found.facts
    assert (facts["rank"], facts["seq_num"], facts["op_type"]) == (0, 2, "ALLREDUCE")
    assert (facts["numel_in"], facts["numel_out"], facts["timeout_ms"], facts["ran_for_ms"]) == (
        1048576, 1048576, 5000, 5069)
    assert (facts["pg_id"], facts["pg_desc"]) == (0, "default_pg")
    assert (facts["last_enqueued"], facts["last_completed"]) == (2, 1)  # "PG status" line merged in
    assert facts["collective_stack"][0].startswith("all_reduce from ")  # the flight recorder's stack
    assert facts["collective_call_site"].endswith("cuda_cases.py:26")  # the user's call, not torch's
    assert found.headline == "NCCL watchdog timeout on rank 0: ALLREDUCE SeqNum 2 ran 5069 ms"
    assert found.lines[0].endswith("ran for 5069 milliseconds before timing out.")
    assert any("last completed work: 1" in line for line in found.lines)


@pytest.mark.parametrize(("name", "rank", "seq", "numel", "ran"), [
    ("synthetic_from_source_nccl_watchdog_rank1.txt", 1, 5, 1048576, 600012),
    ("synthetic_from_source_nccl_watchdog_rank5.txt", 5, 781, 262144, 600087),
])
def test_nccl_watchdog_source_format_facts(name: str, rank: int, seq: int, numel: int, ran: int) -> None:
    found = classified(fixture(name))
    assert found.facts["rank"] == rank and found.facts["seq_num"] == seq
    assert found.facts["numel_in"] == found.facts["numel_out"] == numel
    assert found.facts["timeout_ms"] == 600000 and found.facts["ran_for_ms"] == ran
    assert found.headline == f"NCCL watchdog timeout on rank {rank}: ALLREDUCE SeqNum {seq} ran {ran} ms"


def test_each_line_of_the_watchdog_dump_on_its_own() -> None:
    """How an agent's log tailer sees it: one line at a time. The watchdog lines classify; the teardown
    boilerplate ("Some NCCL operations have failed or timed out", "we are taking the entire process down")
    is the same kind at a lower confidence (real pastes often keep only it), "terminate called ..." says
    nothing."""
    lines = fixture("gpu_nccl_watchdog_timeout.txt").splitlines()
    found = [classify_text(line) for line in lines]
    kinds = [c.kind if c else None for c in found]
    assert kinds[0] == "comm/timeout"
    teardown = [c for line, c in zip(lines, found) if "Some NCCL operations have failed" in line
                or "we are taking the entire process down" in line]
    assert len(teardown) == 2
    assert all(c is not None and c.rule == "nccl.watchdog-teardown" and c.kind == "comm/timeout"
               and c.confidence < found[0].confidence for c in teardown)  # type: ignore[union-attr]
    assert [k for line, k in zip(lines, kinds) if line.startswith("terminate called")] == [None]
    assert {k for k in kinds if k} == {"comm/timeout"}


def test_collective_mismatch_facts() -> None:
    found = classified(fixture("gloo_mismatch_detail_rank0.txt"))
    assert found.facts["ranks"] == [0, 1] and found.facts["rank"] == 0
    a, b = found.facts["collectives"]
    assert (a["rank"], a["op_type"], a["tensor_shape"], a["dtypes"], a["seq_num"]) == (0, "ALLREDUCE", [4], "Float", 0)
    assert (b["rank"], b["op_type"], b["tensor_shape"]) == (1, "ALLREDUCE", [8])
    assert found.facts["differences"] == [{"aspect": "Tensor shapes", "values": ["4", "8"]}]
    assert found.headline == "Collective mismatch at collective #0: rank 0 vs rank 1: tensor shapes 4 vs 8"
    op = classified(OP_TYPE_MISMATCH)
    assert [c["op_type"] for c in op.facts["collectives"]] == ["ALLREDUCE", "BROADCAST"]
    assert [c["dtypes"] for c in op.facts["collectives"]] == ["Float", "Long"]
    assert [d["aspect"] for d in op.facts["differences"]] == ["Op type", "Tensor dtypes"]
    size_mismatch = classified(fixture("gloo_size_mismatch_enforce.txt"))
    assert (size_mismatch.facts["received_bytes"], size_mismatch.facts["expected_bytes"]) == (8, 4)


def test_gloo_timeouts_and_lost_peers() -> None:
    for rank, op in ((0, "send"), (1, "recv"), (2, "recv")):
        found = classified(fixture(f"gloo_timeout_rank{rank}.txt"))
        assert (found.facts["rank"], found.facts["op"], found.facts["timeout_ms"]) == (rank, op, 2000)
    peer = classified(fixture("gloo_size_mismatch_peer.txt"))
    assert peer.facts["peer"] == "127.0.0.1:64660" and peer.facts["rank"] == 1
    assert peer.facts["error"] == "Connection reset by peer"
    barrier = classified(MONITORED_BARRIER_RANK0)
    assert (barrier.kind, barrier.facts["lagging_ranks"], barrier.facts["rank"]) == ("comm/timeout", [2], 0)
    assert "gloo.timeout" in barrier.also  # its "Original exception" is a recv timeout, merged under it
    survivor = classified(MONITORED_BARRIER_RANK1)
    assert (survivor.kind, survivor.facts["rank"], survivor.facts["peer_rank"]) == ("comm/rank-lost", 1, 0)


def test_real_h200_cuda_errors() -> None:
    embedding = classified(GPU_EMBEDDING_ASSERT)
    assert (embedding.kind, embedding.rule) == ("memory/cuda-error", "cuda.device-assert")
    assert embedding.facts["kernel"] == "indexSelectSmallIndex" and embedding.facts["index_out_of_range"]
    assert embedding.facts["source"] == "/pytorch/aten/src/ATen/native/cuda/Indexing.cu:1515"
    assert "cuda.error" in embedding.also and "index out of range" in embedding.note
    nll = classified(GPU_NLL_ASSERT)
    assert nll.facts["assertion"] == "t >= 0 && t < n_classes" and nll.facts["index_out_of_range"]
    illegal = classified(GPU_ILLEGAL_ACCESS)
    assert (illegal.rule, illegal.facts["error_class"]) == ("cuda.error", "illegal-memory-access")
    assert illegal.headline == "CUDA error: an illegal memory access was encountered"
    # what the SDK sends: torch.AcceleratorError and its message (the kernel's assert line went to stderr)
    exc = [e for e in parse_traceback_text(GPU_EMBEDDING_ASSERT) if e.relation == ""][-1]
    assert exc.exc_type == "torch.AcceleratorError"
    sent = classify_exception(exc.exc_type, exc.message)
    assert (sent.kind, sent.facts["error_class"]) == ("memory/cuda-error", "device-side-assert")


def test_real_h200_nccl_duplicate_gpu_and_desync_report() -> None:
    duplicate = classified(GPU_NCCL_DUPLICATE_GPU)
    assert (duplicate.kind, duplicate.rule) == ("comm/init-failure", "nccl.error")
    assert (duplicate.facts["code"], duplicate.facts["nccl_version"], duplicate.facts["rank"]) == (
        "ncclInvalidUsage", "2.28.9", 0)
    assert duplicate.facts["duplicate_gpu"] and "set_device(local_rank)" in duplicate.note
    assert "Duplicate GPU detected : rank 0 and rank 1 both on CUDA device 60" in duplicate.lines
    desync = classified(GPU_NCCL_DESYNC)
    assert (desync.rule, desync.facts["ran_for_ms"]) == ("nccl.watchdog-timeout", 5083)
    assert desync.facts["lagging_ranks"] == desync.facts["joined_not_finished"] == [0]
    assert desync.facts["lagging_collective"] == 2 and desync.facts["last_completed"] == 1
    assert desync.facts["collective_call_site"].endswith("cuda_errors.py:54")
    assert "- [0] joined but didn't finish collective #2 (count from 1)" in desync.lines
    assert desync.headline.endswith("; lagging rank(s) 0")
    report = classified("\n".join(GPU_NCCL_DESYNC.splitlines()[1:8]))  # the report's own log record
    assert (report.kind, report.rule, report.facts["lagging_ranks"]) == ("comm/timeout", "c10d.desync-report", [0])


def test_rendezvous_failures_from_real_captures() -> None:
    clients = classified(STORE_CLIENTS)
    assert clients.kind == "comm/init-failure"
    assert (clients.facts["joined"], clients.facts["world_size"], clients.facts["missing"]) == (1, 2, 1)
    assert clients.headline == "Rendezvous timed out after 4 s: 1/2 ranks joined"
    connect = classified(STORE_CONNECT_TIMEOUT)
    assert connect.kind == "comm/init-failure"
    assert (connect.facts["host"], connect.facts["port"], connect.facts["timeout_ms"]) == ("127.0.0.1", 1, 3000)


# ------------------------------------------------------------------------------------------------------
# torchrun's ChildFailedError summary


def test_torchrun_summary_names_the_root_cause_rank() -> None:
    found = classified(fixture("torchrun_two_ranks.txt"))
    facts = found.facts
    assert facts["root_cause_rank"] == 0 and facts["failed_ranks"] == [0, 1]
    assert facts["job"] == "/tmp/tg-tracebacks-whow4vea/torchrun/job.py"
    assert facts["first_failure_time"] == "2026-11-29_08:39:49"
    assert facts["root_cause_exitcode"] == 1 and facts["root_cause_local_rank"] == 0
    assert facts["root_cause_error"] == "RuntimeError: mat1 and mat2 shapes cannot be multiplied (4x8 and 16x2)"
    assert facts["root_cause_error_file"].endswith("/attempt_0/0/error.json")
    assert facts["root_cause_rule"] == "model.shape-mismatch"  # the root cause's own classification
    by_rank = {f["rank"]: f for f in facts["failures"]}
    assert by_rank[1]["exitcode"] == 1 and by_rank[1]["pid"] == 9978
    assert by_rank[1]["error"] == "RuntimeError: mat1 and mat2 shapes cannot be multiplied (4x9 and 16x2)"
    assert by_rank[1]["error_file"].endswith("/attempt_0/1/error.json")
    assert found.headline.startswith("torchrun: rank 0 failed first (RuntimeError: mat1 and mat2 shapes")
    assert "rank      : 0 (local_rank: 0)" in found.lines and "exitcode  : 1 (pid: 9977)" in found.lines


def test_torchrun_summary_with_a_sigkilled_root_cause() -> None:
    found = classified(TORCHRUN_SIGKILL)
    facts = found.facts
    assert found.kind == "process/killed"  # the root cause's exit by the decision path, not the survivor's error
    assert "gloo.peer-lost" in found.also
    assert facts["root_cause_rank"] == 1 and facts["failed_ranks"] == [0, 1]
    assert (facts["root_cause_exitcode"], facts["root_cause_signal"], facts["root_cause_signal_name"]) == (
        -9, 9, "SIGKILL")
    assert facts["root_cause_error"] == "Signal 9 (SIGKILL) received by PID 15513"
    assert "root_cause_error_file" not in facts  # "<N/A>": no error file for a killed process
    survivor = next(f for f in facts["failures"] if f["rank"] == 0)
    assert (survivor["exitcode"], survivor["signal"], survivor["signal_name"]) == (-15, 15, "SIGTERM")
    assert "Connection reset by peer" in survivor["error"]
    assert found.headline == "torchrun: rank 1 failed first (Signal 9 (SIGKILL) received by PID 15513); 2 ranks failed"


def test_torchrun_worker_failed_line() -> None:
    found = classified("E1129 09:31:20.124000 15483 torch/distributed/elastic/multiprocessing/api.py:1002] failed "
                       "(exitcode: -9) local_rank: 1 (pid: 15513) of binary: /work/main/.venv/bin/python")
    assert (found.kind, found.facts["local_rank"], found.facts["exitcode"]) == ("process/killed", 1, -9)


# ------------------------------------------------------------------------------------------------------
# Texts in the formats PyTorch / NCCL / the driver print (FROM_SOURCE)

FROM_SOURCE: List[Tuple[str, str, str, Dict[str, Any]]] = [
    # NCCLUtils: "NCCL error in: <site>, <ncclGetErrorString>, NCCL version" + getNcclErrorDetailStr
    ("NCCL error in: /opt/pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1275, unhandled system error (run "
     "with NCCL_DEBUG=INFO for details), NCCL version 2.18.1\nncclSystemError: System call (e.g. socket, malloc) or "
     "external library call failed or device error. \nLast error:\nsocketStartConnect: Connect to 172.17.0.2<33621> "
     "failed : Software caused connection abort",
     "comm/init-failure", "nccl.error", {"code": "ncclSystemError", "nccl_version": "2.18.1"}),
    ("[E ProcessGroupNCCL.cpp:852] [Rank 16] NCCL watchdog thread terminated with exception: NCCL error: remote process "
     "exited or there was a network error, NCCL version 2.19.3\nncclRemoteError: A call failed possibly due to a "
     "network error or a remote process exiting prematurely.\nLast error:\nNET/IB : Got completion from peer "
     "10.42.0.2<47534> with error 5, opcode 48, len 32764, vendor err 244",
     "comm/rank-lost", "nccl.error", {"code": "ncclRemoteError", "last_error": "NET/IB : Got completion from peer "
                                      "10.42.0.2<47534> with error 5, opcode 48, len 32764, vendor err 244"}),
    ("RuntimeError: NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:219, invalid usage (run with "
     "NCCL_DEBUG=WARN for details), NCCL version 2.14.3\nncclInvalidUsage: This usually reflects invalid usage of NCCL "
     "library.", "comm/mismatch", "nccl.error", {"code": "ncclInvalidUsage"}),
    ("torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1691, "
     "unhandled cuda error (run with NCCL_DEBUG=INFO for details), NCCL version 2.19.3\nncclUnhandledCudaError: Call "
     "to CUDA function failed.", "comm/failure", "nccl.error", {"code": "ncclUnhandledCudaError"}),
    ("NCCL error in: x.cpp:1, unhandled system error (run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5\n"
     "ncclSystemError: System call (e.g. socket, malloc) or external library call failed or device error. \nLast "
     "error:\nNET/IB : ibv_poll_cq failed", "comm/failure", "nccl.error", {"code": "ncclSystemError"}),
    ("ncclInternalError: Internal check failed.", "comm/failure", "nccl.error", {"code": "ncclInternalError"}),
    ("NCCL communicator was aborted on rank 3.", "comm/failure", "nccl.comm-aborted", {"rank": 3}),
    # TraceUtils.h: retrieveDesyncReport
    ("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=BROADCAST, NumelIn=10, "
     "NumelOut=10, Timeout(ms)=1800000) ran for 1800493 milliseconds before timing out.\n\t - [0] Timeout at "
     "collective: BROADCAST, #7\n\t - To our best knowledge, ranks [1, 3] are the lagging ranks that caused this "
     "timeout. They never joined any collectives",
     "comm/timeout", "nccl.watchdog-timeout", {"lagging_ranks": [1, 3], "never_joined": True, "seq_num": 7}),
    ("\t - [0] Timeout at collective: ALLREDUCE, #12\n\t - To our best knowledge, the lagging/dead/mismatched ranks "
     "that caused the desync are:\n\t   - [3] joined but didn't finish collective #12 (count from 1)\n\t     [2] "
     "finished collective #12, but didn't join collective #13 (count from 1)",
     "comm/timeout", "c10d.desync-report", {"lagging_ranks": [2, 3], "joined_not_finished": [3],
                                             "finished_not_joined_next": [2], "lagging_collective": 12,
                                             "rank": 0}),
    ("[rank0]:[E ProcessGroupNCCL.cpp:1316] [PG 0 Rank 0] Received a dump signal due to a collective timeout from  "
     "rank 3 and we will try our best to dump the debug info. Last enqueued NCCL work: 44, last completed NCCL "
     "work: 43.", "comm/timeout", "nccl.dump-signal", {"timed_out_rank": 3, "rank": 0, "last_completed": 43}),
    # c10d rendezvous
    ("RuntimeError: The server socket has failed to listen on any local network address. port: 29500, useIpv6: 0, "
     "code: -98, name: EADDRINUSE, message: address already in use", "comm/init-failure", "c10d.rendezvous",
     {"port": 29500}),
    ("torch.distributed.DistNetworkError: The client socket has failed to connect to [node-3.cluster]:29500 (errno: "
     "111 - Connection refused).", "comm/init-failure", "c10d.rendezvous",
     {"host": "node-3.cluster", "port": 29500, "errno": 111, "error": "Connection refused"}),
    ("torch.distributed.DistStoreError: wait timeout after 30000ms, keys: /default_pg//cuda//0", "comm/init-failure",
     "c10d.rendezvous", {"timeout_ms": 30000}),
    ("torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError", "comm/init-failure", "c10d.rendezvous",
     {"error": "RendezvousTimeoutError"}),
    ("torch.distributed.DistNetworkError: Failed to recv, got 0 bytes. Connection was likely closed. Did the remote "
     "server shutdown or crash?", "comm/rank-lost", "gloo.peer-lost", {"store": True}),
    # CUDA errors
    ("RuntimeError: CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be asynchronously "
     "reported at some other API call, so the stacktrace below might be incorrect.\nFor debugging consider passing "
     "CUDA_LAUNCH_BLOCKING=1", "memory/cuda-error", "cuda.error", {"error_class": "illegal-memory-access"}),
    ("RuntimeError: CUDA error: uncorrectable ECC error encountered", "memory/cuda-error", "cuda.error",
     {"error_class": "ecc"}),
    ("../aten/src/ATen/native/cuda/Indexing.cu:1289: indexSelectLargeIndex: block: [172,0,0], thread: [64,0,0] "
     "Assertion `srcIndex < srcSelectDimSize` failed.\nRuntimeError: CUDA error: device-side assert triggered",
     "memory/cuda-error", "cuda.device-assert", {"kernel": "indexSelectLargeIndex", "index_out_of_range": True}),
    ("/pytorch/aten/src/ATen/native/cuda/Loss.cu:250: nll_loss_forward_reduce_cuda_kernel_2d: block: [0,0,0], "
     "thread: [5,0,0] Assertion `t >= 0 && t < n_classes` failed.", "memory/cuda-error", "cuda.device-assert",
     {"assertion": "t >= 0 && t < n_classes", "index_out_of_range": True}),
    ("RuntimeError: CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm( handle, opa, opb, m, n, k, "
     "&alpha, a, lda, b, ldb, &beta, c, ldc)`", "memory/cuda-error", "cuda.error", {}),
    ("[12345.678] NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus.", "memory/cuda-error",
     "nvidia.xid", {"xid": 79, "pci": "0000:3b:00"}),
    ("RuntimeError: CUDA error: out of memory", "memory/oom", "cuda.oom-plain", {}),
    ("RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`", "memory/oom",
     "cuda.oom-plain", {}),
    ("NCCL WARN Cuda failure 'out of memory'", "memory/oom", "cuda.oom-plain", {}),
    # model-side (process/exception with the rule and facts naming what it is)
    ("RuntimeError: Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!",
     "process/exception", "model.device-mismatch", {"devices": ["cuda:0", "cpu"], "meta": False}),
    ("RuntimeError: Expected all tensors to be on the same device, but got mat1 is on cpu, different from other "
     "tensors on cuda:0 (when checking argument in method wrapper_CUDA_addmm)", "process/exception",
     "model.device-mismatch", {"argument": "mat1"}),
    ("IndexError: Target 10 is out of bounds.", "process/exception", "model.index-out-of-range", {"target": 10}),
    ("IndexError: index 7 is out of bounds for dimension 0 with size 5", "process/exception",
     "model.index-out-of-range", {"index": 7, "dim": 0, "size": 5}),
    ("RuntimeError: The size of tensor a (3) must match the size of tensor b (4) at non-singleton dimension 1",
     "process/exception", "model.shape-mismatch", {"shapes": ["3", "4"], "dim": 1}),
    ("RuntimeError: DataLoader worker (pid 4567) is killed by signal: Killed. ", "process/killed",
     "dataloader.worker", {"pids": [4567], "signal": "Killed"}),
    ("RuntimeError: DataLoader worker (pid 4567) is killed by signal: Bus error. ", "process/exit",
     "dataloader.worker", {"pids": [4567], "signal": "Bus error"}),
    ("subprocess.CalledProcessError: Command '['/usr/bin/python', '-u', 'train.py', '--local_rank=7']' died "
     "with <Signals.SIGSEGV: 11>.", "process/exit", "launcher.signal", {"signal": 11, "rank": 7}),
    ("W0409 07:28:49.530000 1359 torch/distributed/elastic/agent/server/api.py:719] Received 15 death signal, "
     "shutting down workers", "process/terminated", "launcher.signal", {"signal": 15}),
    ("torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:275, "
     "unhandled cuda error (run with NCCL_DEBUG=INFO for details), NCCL version 2.20.5\nncclUnhandledCudaError: Call "
     "to CUDA function failed.\nLast error:\nCuda failure 'an illegal memory access was encountered'",
     "memory/cuda-error", "cuda.error", {}),
    ("RuntimeError: NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1275, internal error, NCCL "
     "version 2.14.3\nncclInternalError: Internal check failed.\nLast error:\nNet : Connection closed by remote "
     "peer 10.0.0.2<40372>", "comm/rank-lost", "nccl.error", {"code": "ncclInternalError"}),
    ("node-8x-v100-nvlink-1:39719:39719 [3] init.cu:1197 NCCL WARN Mismatched collective detected, please check "
     "your collective calls at and around rank 11.", "comm/mismatch", "nccl.debug", {"rank": 11}),
    ("worker0:15:91 [3] include/socket.h 398 NCCL WARN Call to write failed : Connection reset by peer.",
     "comm/rank-lost", "nccl.debug", {}),
    ("THCudaCheck FAIL file=/pytorch/torch/lib/THC/generic/THCStorage.cu line=66 error=2 : out of memory",
     "memory/oom", "cuda.oom-plain", {}),
    ("RuntimeError: merge_sort: failed to synchronize: cudaErrorIllegalAddress: an illegal memory access was "
     "encountered", "memory/cuda-error", "cuda.error", {"error_class": "illegal-memory-access"}),
    ("[2023-07-10 04:26:35,999] [ERROR] [launch.py:324:sigkill_handler] ['/usr/bin/python3', '-u', 'train.py', "
     "'--local_rank=1', '--deepspeed'] exits with return code = -11", "process/exit", "launcher.signal",
     {"signal": 11, "rank": 1}),
    ("  traceback : Signal 11 (SIGSEGV) received by PID 6421", "process/exit", "launcher.signal", {"signal": 11}),
    ("*** SIGTERM (@0x297b) received by PID 18396 (TID 0x7f2c8c464700) from PID 10619; stack trace: ***",
     "process/terminated", "launcher.signal", {"signal": 15}),
    ("Segmentation fault (core dumped)", "process/exit", "launcher.signal", {"signal": 11}),
    ("[rank2]:[E424 01:11:21.160832730 ProcessGroupNCCL.cpp:629] [Rank 2] Watchdog caught collective operation "
     "timeout: WorkNCCL(SeqNum=4, OpTy\npe=BROADCAST, NumelIn=112, NumelOut=112, Timeout(ms)=1800000) ran for 1800010 "
     "milliseconds before timing out.", "comm/timeout", "nccl.watchdog-timeout", {"seq_num": 4, "rank": 2}),
    ("CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below might be "
     "incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1", "memory/cuda-error", "cuda.error-cut", {}),
    ("ERROR: Unexpected bus error encountered in worker. This might be caused by insufficient shared memory (shm).",
     "process/exit", "dataloader.worker", {"signal": "bus error"}),
]


@pytest.mark.parametrize(("text", "expected_kind", "rule", "facts"), FROM_SOURCE,
                         ids=[f"{i}-{r}" for i, (_t, _k, r, _f) in enumerate(FROM_SOURCE)])
def test_source_format_texts(text: str, expected_kind: str, rule: str, facts: Dict[str, Any]) -> None:
    found = classified(text)
    assert (found.kind, found.rule) == (expected_kind, rule)
    for key, value in facts.items():
        assert found.facts[key] == value, key


def test_headlines_name_what_was_parsed() -> None:
    assert classified(FROM_SOURCE[1][0]).headline.startswith("ncclRemoteError on rank 16: NET/IB : Got completion")
    assert classified(FROM_SOURCE[7][0]).headline == \
        "NCCL watchdog timeout on rank 0: BROADCAST SeqNum 7 ran 1800493 ms; lagging rank(s) 1, 3"
    assert classified(FROM_SOURCE[17][0]).headline == \
        "CUDA device-side assert in indexSelectLargeIndex: srcIndex < srcSelectDimSize"


# ------------------------------------------------------------------------------------------------------
# Robustness


def test_prefixed_and_interleaved_ranks_and_crlf() -> None:
    a = fixture("synthetic_from_source_nccl_watchdog_rank1.txt").splitlines()
    b = fixture("gloo_timeout_rank2.txt").splitlines()
    mixed = "\r\n".join(x for pair in zip(a, b) for x in pair)
    found = classified(mixed)
    assert found.rule == "nccl.watchdog-timeout" and found.facts["rank"] == 1
    assert "gloo.timeout" in found.also


NOT_CLASSIFIED = [
    "", "INFO: epoch 3 loss 0.25 lr 1e-4", "ConnectionResetError: [Errno 104] Connection reset by peer",
    "requests.exceptions.ReadTimeout: HTTPSConnectionPool(host='s3.amazonaws.com', port=443): Read timed out.",
    "[W socket.cpp:436] [c10d] The server socket cannot be initialized on [::]:29500 (errno: 97 - Address family "
    "not supported by protocol).", "terminate called after throwing an instance of 'c10::DistBackendError'",
]
"""(The watchdog's "we are taking the entire process down" was here; it is the teardown rule's now: see
test_each_line_of_the_watchdog_dump_on_its_own.)"""


@pytest.mark.parametrize("text", NOT_CLASSIFIED)
def test_plain_text_is_not_classified(text: str) -> None:
    assert classify_text(text) is None


@pytest.mark.parametrize("unit", ["x", "[", "1", " ", "Tried to allocate ", "CUDA error: ", "by peer ",
                                  "Watchdog caught collective operation timeout: ", "NCCL error in: ", "_STATUS_",
                                  "Assertion `", "failed (exitcode: ", "[Rank 1] ", "Timed out waiting ",
                                  "Traceback (most recent call last):"])
def test_a_one_megabyte_line_returns(unit: str) -> None:
    """Every regex sees a bounded window around a literal needle: no catastrophic backtracking. (No timing
    assertion; a quadratic pattern would not return within the suite's patience.)"""
    line = unit * (1_000_000 // len(unit))
    found = classify_text(line)
    assert found is None or found.kind in KINDS
    if unit == "x":
        assert found is None


def test_a_huge_text_keeps_its_head_and_tail() -> None:
    tail = fixture("gpu_nccl_watchdog_timeout.txt")
    text = "noise line\n" * 400_000 + tail
    assert len(text) > classify_mod.MAX_TEXT_CHARS
    assert classified(text).rule == "nccl.watchdog-timeout"


def test_sizes() -> None:
    for text in ("20.00 MiB", "3.19 MiB", "139.80 GiB", "512 bytes", "1024 bytes", "1.72 MiB", "1.50 KiB"):
        assert format_size(parse_size(text) or 0) == text
    assert parse_size("2 GB") == 2_000_000_000 and parse_size("nope") is None


# ------------------------------------------------------------------------------------------------------
# classify_exception, the type rules, chains, and the catalogue


def test_classify_exception_always_answers_and_text_beats_type() -> None:
    assert classify_exception("ValueError", "bad value").kind == "process/exception"
    assert classify_exception("ValueError", "bad value").rule == "python.exception"
    assert classify_exception("KeyboardInterrupt", "").kind == "process/terminated"
    assert classify_exception("torch.OutOfMemoryError", "").kind == "memory/oom"
    assert classify_exception("MemoryError", "out of memory").kind == "process/exception"  # host memory
    assert classify_exception("torch.distributed.DistStoreError", "something odd").kind == "comm/init-failure"
    assert classify_exception("torch.distributed.DistBackendError", "weird").kind == "comm/failure"
    lost = classify_exception("torch.distributed.DistNetworkError",
                              "Failed to recv, got 0 bytes. Connection was likely closed.")
    assert lost.kind == "comm/rank-lost"  # the message says more than the type


def test_a_wrapper_exception_does_not_hide_an_oom_in_its_chain() -> None:
    oom = fixture("gpu_cuda_oom_a.txt").rstrip().splitlines()[-1].split(": ", 1)[1]
    found = classify_chain("RuntimeError", "training step 12 failed",
                           [{"type": "torch.OutOfMemoryError", "message": oom, "relation": "cause"}])
    assert found.kind == "memory/oom" and found.facts["via_chain"] == "torch.OutOfMemoryError"
    assert classify_chain("RuntimeError", "x", [{"type": "ValueError", "message": "y"}]).kind == "process/exception"


def test_every_rule_is_documented_and_its_kinds_are_catalogue_rows() -> None:
    assert set(RULE_DOCS) == {FIRST_RULE, *(name for name, _rule in RULES), *FALLBACKS}
    table = rules_table()
    order = [line.split("`")[1] for line in table.splitlines()[2:]]
    assert order == [FIRST_RULE, *(name for name, _rule in RULES), *FALLBACKS]  # the order they are tried
    sys.path.insert(0, str(REPO / "tools"))
    try:
        tool = importlib.import_module("classifier_table")
    finally:
        sys.path.remove(str(REPO / "tools"))
    text = (REPO / "docs" / "classifier.md").read_text(encoding="utf-8")
    assert tool.rendered(text) == text, "docs/classifier.md is stale: run python tools/classifier_table.py"
    for name in ("memory/cuda-error", "comm/timeout", "comm/mismatch", "comm/rank-lost", "comm/init-failure"):
        assert KINDS[name].detected and KINDS[name].title == "{detail}"


# ------------------------------------------------------------------------------------------------------
# Wiring: detectors/process.py and the pipeline

T0 = 1_800_000_000_000_000_000


def envelope(payload_kind: str, payload: Dict[str, Any], *, rank: int = 0, step: int = 10, t: int = 0,
             event_id: Optional[str] = None, run_id: str = "run-text") -> Dict[str, Any]:
    return {"project": "demo", "run_id": run_id, "rank": rank, "world_size": 2, "host": f"node{rank}",
            "pid": 100 + rank, "step": step, "time_unix_nano": T0 + t * 1_000_000,
            "event_id": event_id or f"{payload_kind}-{rank}-{step}-{t}", "severity": "ERROR",
            payload_kind: payload}


def exception_payload(text: str) -> Dict[str, Any]:
    """The ExceptionEvent the SDK would have sent for the outermost exception printed in ``text``."""
    exc = [e for e in parse_traceback_text(text) if e.relation == ""][-1]
    fp = exc.fingerprint()
    return {"type": exc.exc_type, "message": exc.message, "handled": False, "mechanism": "excepthook",
            "frames": [dataclasses.asdict(f) for f in exc.frames], "traceback": text,
            "fingerprint": fp.hash, "fingerprint_version": fp.version, "message_template": fp.message_template}


def exit_payload(code: int, signal: int = 0) -> Dict[str, Any]:
    return {"phase": "EXIT", "exit_code": code, "signal": signal, "reason": "signal" if signal else "exception"}


def log_payload(message: str) -> Dict[str, Any]:
    return {"logger": "stderr", "level": "ERROR", "message": message, "source": "stderr"}


def only(pipeline: Pipeline) -> Any:
    (incident,) = pipeline.incidents()
    return incident


def test_pipeline_real_oom_exception_is_one_memory_oom_incident_with_its_facts() -> None:
    text = fixture("gpu_cuda_oom_a.txt")
    pipeline = Pipeline(DetectionSettings())
    pipeline.process([envelope("exception", exception_payload(text), rank=0, t=1),
                      envelope("exception", exception_payload(text), rank=1, t=2),
                      envelope("lifecycle", exit_payload(1), rank=0, t=3),
                      envelope("lifecycle", exit_payload(1), rank=1, t=4)])
    incident = only(pipeline)
    assert (incident.category, incident.subtype) == ("memory", "oom")
    assert incident.title == "CUDA OOM on GPU 0: tried to allocate 256.00 GiB with 102.12 GiB free of 139.80 GiB"
    assert incident.ranks == [0, 1] and incident.lead_rank == 0 and incident.count == 2
    assert [e.rule for e in incident.evidence] == ["exception.uncaught", "exception.uncaught", "exit.code",
                                                   "exit.code"]
    value = incident.evidence[0].value
    assert value["rule"] == "cuda.oom" and value["exc_type"] == "torch.OutOfMemoryError"
    assert value["facts"]["requested"] == 256 * GiB and value["facts"]["device"] == 0
    assert value["lines"][0].startswith("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 256.00 GiB")
    assert incident.fingerprint and sorted(incident.checks) == sorted(kind("memory", "oom").checklist())
    assert "exceeds the GPU's capacity" in incident.summary
    assert pipeline.runs()[0].status == "failed"
    restored = Pipeline.restore(pipeline.snapshot(), DetectionSettings())
    assert restored.incidents() == pipeline.incidents()


def test_pipeline_plain_exception_stays_process_exception_with_the_model_hint() -> None:
    pipeline = Pipeline(DetectionSettings())
    pipeline.process([envelope("exception", exception_payload(fixture("shape_mismatch_linear.txt"))),
                      envelope("lifecycle", exit_payload(1), t=1)])
    incident = only(pipeline)
    assert (incident.category, incident.subtype) == ("process", "exception")
    assert incident.title == "Crashed: RuntimeError: mat1 and mat2 shapes cannot be multiplied (4x16 and 8x4)"
    assert "model.shape-mismatch" in incident.summary and incident.evidence[0].value == "RuntimeError"


def test_pipeline_torchrun_launcher_exception_names_the_root_cause() -> None:
    pipeline = Pipeline(DetectionSettings())
    pipeline.process([envelope("exception", exception_payload(fixture("torchrun_two_ranks.txt")))])
    incident = only(pipeline)
    assert (incident.category, incident.subtype) == ("process", "exception")
    assert incident.title.startswith("Crashed: torchrun: rank 0 failed first (RuntimeError: mat1 and mat2")
    assert "torchrun.child-failed" in incident.summary


def test_pipeline_nccl_watchdog_exception_then_abort_is_one_timeout_incident() -> None:
    text = fixture("synthetic_from_source_nccl_watchdog_rank1.txt")
    pipeline = Pipeline(DetectionSettings())
    pipeline.process([envelope("exception", exception_payload(text), rank=1),
                      envelope("lifecycle", exit_payload(-6), rank=1, t=1)])  # SIGABRT after terminate()
    incident = only(pipeline)  # the abort is evidence on the timeout, not a memory/oom-or-cuda-error incident
    assert (incident.category, incident.subtype) == ("comm", "timeout")
    assert incident.title == "NCCL watchdog timeout on rank 1: ALLREDUCE SeqNum 5 ran 600012 ms"
    assert [e.rule for e in incident.evidence] == ["exception.uncaught", "exit.code"]


def _run_with_log(*messages: Tuple[int, str], settings: Optional[DetectionSettings] = None) -> RunState:
    """Detector-level: process.on_log folded with the incident lifecycle, as the pipeline does."""
    settings = settings or DetectionSettings()
    run = RunState(project="demo", run_id="run-log")
    for i, (rank_no, message) in enumerate(messages):
        rank = run.rank_state(rank_no, settings)
        assert rank is not None
        event = envelope("log", log_payload(message), rank=rank_no, t=i)
        finding = process.on_log(run, rank, event, event["log"], 10, T0 + i, settings)
        if finding is not None:
            apply(run, finding, settings)
    return run


WATCHDOG_LINE = fixture("gpu_nccl_watchdog_timeout.txt").splitlines()[0]


def test_log_line_with_the_real_nccl_watchdog_opens_a_timeout_incident() -> None:
    run = _run_with_log((0, WATCHDOG_LINE), (0, WATCHDOG_LINE), (1, WATCHDOG_LINE.replace("[Rank 0]", "[Rank 1]")))
    (st,) = run.incidents.values()
    incident = st.record
    assert st.key == "text:comm/timeout" and (incident.category, incident.subtype) == ("comm", "timeout")
    assert incident.title == "NCCL watchdog timeout on rank 0: ALLREDUCE SeqNum 2 ran 5069 ms"
    assert incident.ranks == [0, 1] and incident.count == 2  # the repeated identical line added nothing
    assert [e.rule for e in incident.evidence] == ["log.text", "log.text"]
    assert incident.evidence[0].value["facts"]["ran_for_ms"] == 5069
    assert incident.evidence[0].value["lines"] == [WATCHDOG_LINE.split("]:", 1)[1]]
    # the abort that follows is evidence on it, not a separate memory/oom-or-cuda-error incident
    rank0 = run.ranks[0]
    finding = process.on_exit(run, rank0, exit_payload(-6), 10, T0 + 10, "exit-0", DetectionSettings())
    assert finding is not None and finding.key == "text:comm/timeout" and not finding.counts
    # so is a communication exit (255); a SIGKILL is its own incident
    finding = process.on_exit(run, rank0, exit_payload(255), 10, T0 + 11, "exit-1", DetectionSettings())
    assert finding is not None and finding.key == "text:comm/timeout"
    finding = process.on_exit(run, rank0, exit_payload(137, 9), 10, T0 + 12, "exit-2", DetectionSettings())
    assert finding is not None and finding.key == "exit:process/killed"
    assert "reported an error before" in finding.summary


def test_handled_exceptions_open_nothing_unless_configured() -> None:
    payload = dict(exception_payload(fixture("gpu_cuda_oom_b.txt")), handled=True)
    assert Pipeline(DetectionSettings()).process([envelope("exception", payload)]).incidents == []
    strict = Pipeline(DetectionSettings(incident_on_handled_exceptions=True))
    strict.process([envelope("exception", payload)])
    incident = only(strict)
    assert (incident.category, incident.subtype) == ("memory", "oom")
    assert incident.evidence[0].rule == "exception.handled"


def test_log_lines_thresholds_and_switch() -> None:
    assert not _run_with_log((0, "INFO: step 10 loss 0.2")).incidents
    generic = "init_process_group: connection refused while contacting the master"  # confidence 0.55
    assert not _run_with_log((0, generic)).incidents
    assert _run_with_log((0, generic), settings=DetectionSettings(log_min_confidence=0.5)).incidents
    assert not _run_with_log((0, WATCHDOG_LINE), settings=DetectionSettings(log_text_incidents=False)).incidents
    shape = fixture("shape_mismatch_linear.txt")
    assert not _run_with_log((0, shape)).incidents  # a process/* text in a log opens nothing


def test_survivor_and_cause_are_separate_kinds() -> None:
    """gloo: rank 0 aborts on a size mismatch (printed by C++, a log line), rank 1 sees its peer vanish."""
    run = _run_with_log((0, fixture("gloo_size_mismatch_enforce.txt")), (1, fixture("gloo_size_mismatch_peer.txt")))
    kinds = {st.key: st.record for st in run.incidents.values()}
    assert set(kinds) == {"text:comm/mismatch", "text:comm/rank-lost"}
    assert kinds["text:comm/mismatch"].ranks == [0] and kinds["text:comm/rank-lost"].ranks == [1]
    assert kinds["text:comm/rank-lost"].title.startswith("Peer connection lost on rank 1: gloo connection reset")


ROUTES_LOGS = "on_log" in _native.source_path("pipeline").read_text()  # (compiled: no getsource)


@pytest.mark.skipif(not ROUTES_LOGS, reason="pipeline.py does not route log events to process.on_log yet")
def test_pipeline_log_event_with_the_real_nccl_watchdog_line() -> None:
    pipeline = Pipeline(DetectionSettings())
    pipeline.process([envelope("log", log_payload(WATCHDOG_LINE), rank=0),
                      envelope("lifecycle", exit_payload(-6), rank=0, t=1)])
    incident = only(pipeline)
    assert (incident.category, incident.subtype) == ("comm", "timeout")
    assert incident.title == "NCCL watchdog timeout on rank 0: ALLREDUCE SeqNum 2 ran 5069 ms"
    assert [e.rule for e in incident.evidence] == ["log.text", "exit.code"]


@pytest.mark.parametrize(("text", "kind", "rule"), [
    # the message formats of the libraries (the wild corpus has none of these wordings yet)
    ("RuntimeError: Triton Error [CUDA]: an illegal memory access was encountered", "memory/cuda-error",
     "cuda.error"),
    ("RuntimeError: CUDA driver error: invalid argument", "memory/cuda-error", "cuda.error"),
    ("CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory access was encountered", "memory/cuda-error", "cuda.error"),
    ("RuntimeError: [Rank 0] Caught collective operation timeout: WorkNCCL(SeqNum=3, OpType=ALLREDUCE, "
     "NumelIn=1, NumelOut=1, Timeout(ms)=60000) ran for 60012 milliseconds before timing out.", "comm/timeout",
     "nccl.watchdog-timeout"),
    ("train.sh: line 3: 1234 Illegal instruction     (core dumped) python train.py", "process/exit",
     "launcher.signal"),
    ("Program received signal SIGSEGV, Segmentation fault.", "process/exit", "launcher.signal"),
])
def test_other_wordings_of_known_failures(text: str, kind: str, rule: str) -> None:
    found = classify_text(text)
    assert found is not None and (found.kind, found.rule) == (kind, rule)
