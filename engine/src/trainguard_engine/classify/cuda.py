"""Classifier rules for CUDA (and HIP/XPU/MPS) text: out-of-memory in every known wording, device-side
asserts, NVIDIA Xid kernel-log lines, CUDA / cuBLAS / cuDNN errors."""

from __future__ import annotations

import re
from typing import Any, Iterator, Mapping, Optional, Tuple

from .text import (
    MAX_HITS,
    Facts,
    _Hit,
    _search,
    _shorten,
    _Text,
)
from .vocab import _RECOVERED

# ----------------------------------------------------------------------------------------------------
# Sizes


_SIZE_UNITS = {"bytes": 1, "b": 1, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
               "pib": 1024**5, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4, "pb": 1000**5}
_SIZE_RE = re.compile(r"(\d+(?:\.\d+)?)\s?(bytes|[KMGTP]i?B|B)\b")


def _sz(name: str) -> str:
    return rf"(?P<{name}>\d+(?:\.\d+)?\s?(?:bytes|[KMGTP]i?B|B))"


def parse_size(text: str) -> Optional[int]:
    """``"20.00 MiB"`` → 20971520 (binary units as PyTorch prints them; KB/MB/GB decimal); None if not
    a size."""
    match = _SIZE_RE.fullmatch(text.strip())
    if match is None:
        return None
    return round(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


def format_size(size: int) -> str:
    """Bytes as PyTorch's caching allocator prints them (``"20.00 MiB"``, ``"512 bytes"``)."""
    if size <= 1024:
        return f"{size} bytes"
    if size <= 1024**2:
        return f"{size / 1024:.2f} KiB"
    if size <= 1024**3:
        return f"{size / 1024**2:.2f} MiB"
    return f"{size / 1024**3:.2f} GiB"


# ----------------------------------------------------------------------------------------------------
# Memory and CUDA


_OOM_START_RE = re.compile(r"(?P<backend>CUDA|HIP|XPU|MPS|NPU|MLU|MUSA)(?: backend)? out of memory")
"""PyTorch's caching allocator's words on every backend that reuses them: CUDA, HIP, XPU, MPS, and the
out-of-tree ones (Ascend's torch_npu ``NPU out of memory. Tried to allocate 386.00 MiB (NPU 2; 60.97 GiB
total capacity; ...)``, hiyouga/LlamaFactory#5491; Cambricon's ``MLU``, Moore Threads' ``MUSA``)."""
_OOM_REQUEST_RE = re.compile(r"Tried to allocate " + _sz("requested"))
_OOM_DEVICE_RE = re.compile(r"GPU (?P<device>\d+) has a total capac(?:i)?ty of " + _sz("capacity")
                            + r" of which " + _sz("free") + r" is free")
_OOM_PROCESS_RE = re.compile(r"Process (?P<pid>\d+) has " + _sz("size") + r" memory in use")
_OOM_THIS_RE = re.compile(r"Including non-PyTorch memory, this process has " + _sz("size")
                          + r" memory in use")
_OOM_ALLOC_RE = re.compile(
    r"Of the allocated memory " + _sz("allocated") + r" is allocated by PyTorch,\s?(?:with "
    + _sz("private") + r" allocated in private pools \(e\.g\., CUDA Graphs\),\s?)?and " + _sz("unalloc")
    + r" is reserved by PyTorch but unallocated")
_OOM_LEGACY_DEVICE_RE = re.compile(r"\((?:GPU|NPU|MLU|MUSA) (?P<device>\d+); ")
_OOM_LEGACY_FIELDS = (
    ("capacity", re.compile(_sz("v") + r" total capacity")),
    ("allocated", re.compile(_sz("v") + r" already allocated")),
    ("free", re.compile(r"; " + _sz("v") + r" free")),
    ("reserved", re.compile(_sz("v") + r" (?:reserved in total by PyTorch|cached)")),
)
_OOM_MPS_RE = re.compile(r"MPS allocated: (?P<allocated>[\d.]+ ?[KMGT]?i?B), other allocations: "
                         r"(?P<other>[\d.]+ ?[KMGT]?i?B), max allowed: (?P<max>[\d.]+ ?[KMGT]?i?B)")


def _size_of(match: re.Match[str], group: str) -> Optional[int]:
    text = match.group(group)
    return parse_size(text) if text else None


def _rule_cuda_oom(t: _Text) -> Optional[_Hit]:
    for pos in t.find_all("out of memory"):
        found = _search(_OOM_START_RE, t, pos, before=40, after=80)
        if found is None:
            continue
        offset, start = found
        begin = offset + start.start()
        nxt = t.lower.find("out of memory", begin + len(start.group(0)), begin + 2000)
        block = t.text[begin: nxt if nxt > 0 else begin + 2000]
        facts: Facts = {"backend": start.group("backend")}
        if (m := _OOM_REQUEST_RE.search(block)) is not None:
            facts["requested"] = _size_of(m, "requested")
        if (m := _OOM_DEVICE_RE.search(block)) is not None:
            facts.update(format="current", device=int(m.group("device")),
                         capacity=_size_of(m, "capacity"), free=_size_of(m, "free"))
            others = [{"pid": int(p.group("pid")), "bytes": _size_of(p, "size")}
                      for p in list(_OOM_PROCESS_RE.finditer(block))[:16]]
            if others:
                facts["other_processes"] = others
            if (m := _OOM_THIS_RE.search(block)) is not None:
                facts["process_in_use"] = _size_of(m, "size")
            if (m := _OOM_ALLOC_RE.search(block)) is not None:
                allocated, unalloc = _size_of(m, "allocated"), _size_of(m, "unalloc")
                private = _size_of(m, "private") if m.group("private") else 0
                facts.update(allocated=allocated, reserved_unallocated=unalloc)
                if private:
                    facts["private_pools"] = private
                if allocated is not None and unalloc is not None:
                    facts["reserved"] = allocated + unalloc + (private or 0)
        elif (m := _OOM_LEGACY_DEVICE_RE.search(block)) is not None:
            facts.update(format="legacy", device=int(m.group("device")))
            for name, pattern in _OOM_LEGACY_FIELDS:
                if (f := pattern.search(block)) is not None:
                    facts[name] = _size_of(f, "v")
            if isinstance(facts.get("reserved"), int) and isinstance(facts.get("allocated"), int):
                facts["reserved_unallocated"] = max(0, facts["reserved"] - facts["allocated"])
        elif (m := _OOM_MPS_RE.search(block)) is not None:
            facts.update(format="mps", allocated=parse_size(m.group("allocated")),
                         other_allocations=parse_size(m.group("other")),
                         max_allowed=parse_size(m.group("max")))
        return _Hit("memory", "oom", 0.95 if "requested" in facts else 0.85, begin, facts,
                    _oom_headline(facts), _oom_note(facts))
    return None


def _oom_headline(facts: Mapping[str, Any]) -> str:
    backend = facts.get("backend", "CUDA")
    unit = backend if backend in ("NPU", "MLU", "MUSA") else "GPU"
    where = f" on {unit} {facts['device']}" if "device" in facts else ""
    parts = []
    if isinstance(facts.get("requested"), int):
        parts.append(f"tried to allocate {format_size(facts['requested'])}")
    if isinstance(facts.get("free"), int):
        tail = f" of {format_size(facts['capacity'])}" if isinstance(facts.get("capacity"), int) else ""
        parts.append(f"with {format_size(facts['free'])} free{tail}")
    detail = " ".join(parts)
    return f"{backend} OOM{where}: {detail}" if detail else f"{backend} out of memory{where}"


def _oom_note(facts: Mapping[str, Any]) -> str:
    notes = []
    requested, capacity = facts.get("requested"), facts.get("capacity")
    unalloc, others = facts.get("reserved_unallocated"), facts.get("other_processes")
    if isinstance(requested, int) and isinstance(capacity, int) and requested > capacity:
        notes.append(f"the request alone ({format_size(requested)}) exceeds the GPU's capacity "
                     f"({format_size(capacity)}): the batch, sequence length or a tensor's shape is far "
                     "off plan")
    if isinstance(unalloc, int) and isinstance(requested, int) and unalloc >= requested:
        notes.append(f"{format_size(unalloc)} is reserved but unallocated, more than the request: "
                     "fragmentation (try PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)")
    if others:
        total = sum(o["bytes"] or 0 for o in others)
        notes.append(f"other processes hold {format_size(total)} on this GPU")
    return "; ".join(notes)


_OOM_PLAIN_NEEDLES = ("cuda error: out of memory", "hip error: out of memory", "cublas_status_alloc_failed",
                      "cuda failure 'out of memory'", "cudaerrormemoryallocation", " 'out of memory'",
                      "error=2 : out of memory", "cuda_error_out_of_memory", "cuda error:out of memory",
                      "cuda runtime error (2) : out of memory", "cuda driver error: out of memory",
                      "hip_error_outofmemory", "hiperroroutofmemory")
"""Raw CUDA allocation failures: also NCCL's ``Cuda failure 2 'out of memory'``, torch 0.x's
``THCudaCheck FAIL file=... error=2 : out of memory`` and its exception ``cuda runtime error (2) : out of
memory at ...THCTensorRandom.cu:25``, the runtime's wording typed without its space (``CUDA error:out of
memory``), and the driver API's (``CUDA driver error: out of memory``); on ROCm the same statuses,
``HIP_ERROR_OutOfMemory`` (TensorFlow-ROCm's ``failed to allocate ... from device: HIP_ERROR_OutOfMemory``,
the HIP form of its ``CUDA_ERROR_OUT_OF_MEMORY``; keras-team/keras#13889) and ``hipErrorOutOfMemory``."""


_OOM_XLA_NEEDLES = ("resource_exhausted: out of memory", "resource exhausted: out of memory",
                    "resource exhausted: oom when allocating", "== cudasuccess (2 vs. 0)",
                    "out of memory error on gpu", "cudamalloc failed: out of memory",
                    "cudamalloc retry failed: out of memory", "out of memory to allocate",
                    "out of memory allocating", "memory::allocation::badalloc",
                    "memory not enough: current free memory size", "allocate output memory failed",
                    "resource_exhausted: failed to allocate request for",
                    "resource exhausted: failed to allocate request for")
"""The same failure as other frameworks' allocators word it: XLA's (JAX's
``jaxlib.xla_extension.XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 6291456
bytes.``, jax-ml/jax#13428; older XLA ``Resource exhausted: Out of memory while trying to allocate ...``),
TensorFlow's op kernel (``Resource exhausted: OOM when allocating tensor with shape[256,832,7,7]``,
tensorflow/tensorflow#4735) and Caffe's CUDA_CHECK through glog on error 2, cudaErrorMemoryAllocation
(``Check failed: error == cudaSuccess (2 vs. 0)  out of memory``, taokong/RON#4); PaddlePaddle's
allocator (``ResourceExhaustedError: Out of memory error on GPU 0. Cannot allocate 25.000244MB memory on GPU
0``, PaddlePaddle/ERNIE#479), MXNet's storage manager (``src/storage/./pooled_storage_manager.h:80: cudaMalloc
failed: out of memory``, apache/mxnet#5340; ``cudaMalloc retry failed: out of memory``) and CuPy's memory pool
under Chainer (``Exception in main training loop: out of memory to allocate 163840000 bytes (total 1673061376
bytes)``, motokimura/spacenet_building_detection#3; newer CuPy: ``Out of memory allocating 25,600,000 bytes
(allocated so far: ...)``); Paddle's C++ allocator exception (``terminate called after throwing an instance of
'paddle::memory::allocation::BadAlloc'``, PaddlePaddle/Paddle#42341) and MindSpore's device memory pool
(``Memory not enough: current free memory size[0] is smaller than required size[29491200].``, then
``MallocForKernelOutput] Allocate output memory failed, node:...``; mindspore-lab/mindone#465); XLA's
StreamExecutor allocator adapter, its fixed ``Failed to allocate request for %s (%uB) on device ordinal %d``
under the status (``RESOURCE_EXHAUSTED: Failed to allocate request for 176.00MiB (184549376B) on device
ordinal 0``, google-deepmind/jax_privacy#10; older XLA ``Resource exhausted: ...``). TensorFlow's
BFC allocator's ``ran out of memory trying to allocate`` is not one of them: it is also the warning of an
allocation the caller retries ("The caller indicates that this is not a failure"). Nor is XLA's wording inside
a record its autotuner recovers from -- a glog ``W`` / ``I`` record (``W external/xla/xla/service/gpu/
conv_algorithm_picker.cc:852] Failed to determine best cudnn convolution algorithm ... Original error:
RESOURCE_EXHAUSTED: Out of memory ...``, gemm autotuning alike): :func:`_xla_oom` skips those."""
_GLOG_RECORD_RE = re.compile(r"(?:^|[\s:\]])(?P<level>[IWEF])"
                             r"(?:\d{4} \d\d:\d\d:\d{2,10}(?:\.\d{1,9})?\s+\d{1,10})?"
                             r"\s?[\w/.-]{1,200}\.(?:cc|cpp|h):\d{1,6}\] ", re.MULTILINE)
"""A glog record's head (``W external/xla/.../conv_algorithm_picker.cc:852] ``, ``E1010 10:00:00.000 123
local_client.cc:672] ``, absl's ``W0000 00:00:1712345678.123456   12345 gemm_fusion_autotuner.cc:1045] ``
with seconds since the epoch): its letter is the record's level."""
_PY_QUIET_HEAD_RE = re.compile(r"(?:WARNING|INFO|DEBUG):[\w.]{1,100}:")
"""Python logging's default head of a warning or info record (``WARNING:absl:...``)."""
_AUTOTUNE_CANDIDATE = "Profiling failure on "
"""XLA's conv autotuner's fixed report of one candidate algorithm failing (``  Profiling failure on cuDNN
engine 1#TC: RESOURCE_EXHAUSTED: Failed to allocate request ...``), listed under its ``All algorithms tried
... Falling back to default algorithm.  Per-algorithm errors:`` warning: a candidate, not the run, failed --
and the replay reader passes such an indented line on without its record's head."""


def _quiet_record(t: _Text, pos: int) -> bool:
    """Whether the wording at ``pos`` sits where nothing failed: in a glog W/I record (the last record head
    within 1000 characters before it; else the head of the record's first line, its indented continuation
    lines -- a conv autotuner's per-candidate errors under a warning whose HLO runs past 1000 characters --
    included), on a Python logging WARNING/INFO line, on one candidate's autotuning failure
    (:data:`_AUTOTUNE_CANDIDATE`), or on a line saying the program recovers (vocab's ``_RECOVERED``:
    ``retrying``, ``falling back``, ...)."""
    text = t.text
    start = text.rfind("\n", 0, pos) + 1
    end = text.find("\n", pos)
    line = text[start:end if end >= 0 else len(text)]
    if _PY_QUIET_HEAD_RE.match(line) or _RECOVERED.search(line) or _AUTOTUNE_CANDIDATE in line:
        return True
    heads = list(_GLOG_RECORD_RE.finditer(text, max(0, pos - 1000), pos))
    if not heads:
        steps = 0
        while start > 0 and text[start:start + 1] in (" ", "\t") and steps < 64:
            start = text.rfind("\n", 0, start - 1) + 1
            steps += 1
        heads = list(_GLOG_RECORD_RE.finditer(text, start, min(pos, start + 400)))[:1]
    return bool(heads) and heads[-1].group("level") in "WI"


def _xla_oom(t: _Text) -> int:
    """The first XLA / TensorFlow / Caffe out-of-memory wording (:data:`_OOM_XLA_NEEDLES`) that is not XLA's
    where nothing failed (:func:`_quiet_record`: an autotuner's W/I record, a recovered attempt), or -1."""
    for needle in _OOM_XLA_NEEDLES:
        for pos in t.find_all(needle):
            if needle.startswith("resource") and ("out of memory" in needle or "allocate request" in needle) \
                    and _quiet_record(t, pos):
                continue
            return pos
    return -1


_OOM_RECOVERY = "attempting to recover from oom in forward/backward pass"
"""fairseq's trainer catching a CUDA OOM (it skips the batch; the OOM message itself may be elsewhere)."""


def _rule_cuda_oom_plain(t: _Text) -> Optional[_Hit]:
    pos = t.first(*_OOM_PLAIN_NEEDLES)
    if pos < 0 and (pos := _xla_oom(t)) >= 0:
        return _Hit("memory", "oom", 0.85, pos, {"error": _shorten(t.line_at(pos), 120)},
                    "out of accelerator memory (the framework's allocator)",
                    "the framework's device allocator (XLA, TensorFlow, Caffe, Paddle, MXNet, CuPy) could "
                    "not allocate: the GPU/TPU was full -- a smaller batch or model shard; with JAX, memory "
                    "another process or XLA_PYTHON_CLIENT_PREALLOCATE already holds")
    if pos < 0:
        pos = t.first(_OOM_RECOVERY)
        if pos < 0:
            return None
        return _Hit("memory", "oom", 0.7, pos, {"error": _shorten(t.line_at(pos), 120)},
                    "CUDA out of memory (fairseq recovering from it)",
                    "fairseq caught a CUDA OOM in the forward/backward pass and skipped the batch; repeated, "
                    "the batch (max tokens) is too large for the GPU")
    what = _shorten(t.line_at(pos), 120)
    return _Hit("memory", "oom", 0.85, pos, {"error": what},
                "CUDA out of memory outside the caching allocator", "a raw CUDA allocation failed (CUDA "
                "context creation, cuBLAS/cuDNN workspace, NCCL buffers): the GPU was already full")


_ASSERT_RE = re.compile(r"Assertion `(?P<assertion>[^\n]{1,300}?)`"
                        r"(?:[ \t]{0,8}\n?[ \t]{0,8}failed|[ \t]{0,8}(?=\n|$))")
"""A kernel's assertion; a paste may wrap the line before its ``failed.`` (the line then ends after the
assertion's closing backtick, and a reader that passes lines one by one sees it without ``failed``). The
assertion's own text may hold backticks: torch.multinomial's kernel asserts ``probability tensor contains
either `inf`, `nan` or element < 0`` (the shortest text that a closing backtick and ``failed`` end)."""
_ASSERT_SITE_RE = re.compile(r"(?P<file>[^\s:]{1,300}\.cuh?):(?P<line>\d+): "
                             r"(?:(?P<kernel>(?:[^\n:]|:(?! )){1,400}): )?"
                             r"block: \[(?P<block>[\d,]{1,40})\], thread: \[(?P<thread>[\d,]{1,40})\]")
"""Where a device-side assert fired: ``Indexing.cu:1284: indexSelectLargeIndex: block: [..], thread:
[..]``, also with the kernel's whole C++ signature (legacy THC: ``void indexSelectSmallIndex(TensorInfo<T,
...>, ...) [with T = float, ...]``) or with no kernel name at all (``THCTensorIndex.cu:218: block: [..],
thread: [..]``), or a lambda's signature whose ``::`` the kernel part may hold (torch 1.2-1.7's IndexKernel:
``IndexKernel.cu:60: lambda [](int)->auto::operator()(int)->auto: block: [..], thread: [..]``): a colon in the
kernel part is one not followed by a space, the site's own separators are ``: ``."""
_KERNEL_NAME_RE = re.compile(r"(?:^|\s)(?P<name>[A-Za-z_][\w:]{0,120})(?:<[^(]{0,200}>)?\(")
_INDEX_ASSERT_RE = re.compile(r"index|Index|n_classes|< *numel|srcSelectDimSize|dstAddDimSize|num_classes")


def _kernel_name(said: Optional[str]) -> str:
    """The kernel's name from the assertion site: a bare name, or the function name in a C++ signature."""
    if not said:
        return "a kernel"
    said = said.strip()
    if "(" not in said:
        return said
    m = _KERNEL_NAME_RE.search(said)
    return m.group("name") if m else _shorten(said, 80)


_BARE_ASSERT_NEEDLE = "] assertion "
_BARE_ASSERT_RE = re.compile(r"\] Assertion (?P<assertion>[^`\n]{1,300}?) failed\b")
"""The same assertion with its backticks lost (markdown renders `` `...` `` as code and a copy drops the
marks: ``... thread: [124,0,0] Assertion srcIndex < srcSelectDimSize failed.``): read only right after the
kernel site's ``thread: [..]`` and up to ``failed``."""


def _assertions(t: _Text) -> Iterator[Tuple[int, re.Match[str]]]:
    """Each kernel assertion of the text: ``(position, match)`` of :data:`_ASSERT_RE`, then of
    :data:`_BARE_ASSERT_RE` (backticks lost)."""
    for pos in t.find_all("assertion `"):
        found = _search(_ASSERT_RE, t, pos, before=0, after=400)
        if found is not None:
            yield pos, found[1]
    for pos in t.find_all(_BARE_ASSERT_NEEDLE):
        found = _search(_BARE_ASSERT_RE, t, pos, before=0, after=400)
        if found is not None:
            yield pos, found[1]


def _rule_device_assert(t: _Text) -> Optional[_Hit]:
    for pos, m in _assertions(t):
        line = t.line_at(pos)
        facts: Facts = {"assertion": m.group("assertion")}
        site = _ASSERT_SITE_RE.search(line[:1200])
        if site is None or ".cu" not in line:
            continue  # a C++ assert or a Python message, not a CUDA kernel's device-side assert
        facts.update(kernel=_kernel_name(site.group("kernel")),
                     source=f"{site.group('file')}:{site.group('line')}")
        index = bool(_INDEX_ASSERT_RE.search(m.group("assertion")))
        facts["index_out_of_range"] = index
        note = ("an index out of range on the GPU (embedding ids >= vocabulary size, class targets >= number "
                "of classes, gather/scatter indices)" if index else "a device-side assertion in a kernel")
        return _Hit("memory", "cuda-error", 0.9, pos, facts,
                    f"CUDA device-side assert in {facts['kernel']}: {_shorten(facts['assertion'], 80)}", note)
    return None


_HIP_ASSERT_RE = re.compile(r"(?:(?P<file>[^\s:]{1,300}):(?P<line>\d+): (?P<kernel>[^\n]{1,800}?): )?"
                            r"Device-side assertion `(?P<assertion>[^\n]{0,300}?)' failed")
"""ROCm's (HIP clang's) device-side assertion: ``vectoradd_hip.cpp:50: void vectoradd_float(float *, ...):
Device-side assertion `0' failed.`` (the quote closed with ``'``; no block/thread) -- ROCm/hip#3368."""
_HSA_FAULT_RE = re.compile(r"Memory access fault by GPU node-(?P<node>\d{1,4}) "
                           r"\(Agent handle: [0-9a-fA-Fx]{1,20}\) on address (?P<address>[^\s.]{1,40})\. "
                           r"Reason: (?P<reason>[^\n.]{1,120})")
"""The ROCm (HSA) runtime's GPU page fault -- the AMD form of an illegal memory access, printed before the
process aborts: ``Memory access fault by GPU node-2 (Agent handle: 0x55fe...) on address 0x7fc1.... Reason:
Page not present or supervisor privilege.`` (ROCm/ROCm#1535, a training run; ROCm/hip#2482, a failed kernel
assert shows up as this)."""
_HSA_ABORT_RE = re.compile(r"aborting with error : (?P<status>HSA_STATUS_ERROR_[A-Z_]{2,60}): "
                           r"(?P<error>[^\n]{1,200}?)(?: code: (?P<code>0x[0-9a-fA-F]{1,8}))?(?=\\n|\n|$|\")")
"""The ROCm runtime tearing a GPU queue down after a kernel fault: ``:0:rocdevice.cpp :2778: ... Callback:
Queue 0x7fcf... aborting with error : HSA_STATUS_ERROR_EXCEPTION: An HSAIL operation resulted in a hardware
exception. code: 0x1016`` (ROCm/hip#3368 after a device assert; milabench#397, a training benchmark's
JSON-lines log)."""
_HSA_CLASSES = (("MEMORY", "illegal-memory-access"), ("ILLEGAL_INSTRUCTION", "illegal-instruction"),
                ("EXCEPTION", "hardware-exception"))
_ROCM_NOTE = ("a GPU kernel faulted on an AMD GPU (ROCm): an out-of-bounds access or a failed device assert "
              "in a kernel, or a build without this GPU's architecture; rerun with AMD_SERIALIZE_KERNEL=3 "
              "(and HIP_LAUNCH_BLOCKING=1) to find the op")


def _rule_rocm_fault(t: _Text) -> Optional[_Hit]:
    """A kernel fault as ROCm prints it (HIP's device-side assertion, the HSA runtime's memory access
    fault, a queue aborted with an ``HSA_STATUS_ERROR_*``): memory/cuda-error, the AMD wordings of a
    device-side assert / illegal memory access. The assertion, the cause, wins over the runtime's fault
    that follows it."""
    for pos in t.find_all("device-side assertion `"):
        found = _search(_HIP_ASSERT_RE, t, pos, before=900, after=320)
        if found is None:
            continue
        m = found[1]
        facts: Facts = {"assertion": m.group("assertion"), "error_class": "device-side-assert",
                        "kernel": _kernel_name(m.group("kernel"))}
        if m.group("file"):
            facts["source"] = f"{m.group('file')}:{m.group('line')}"
        facts["index_out_of_range"] = bool(_INDEX_ASSERT_RE.search(m.group("assertion")))
        return _Hit("memory", "cuda-error", 0.9, found[0] + m.start(), facts,
                    f"HIP device-side assert in {facts['kernel']}: {_shorten(facts['assertion'], 80)}",
                    _ROCM_NOTE)
    pos = t.first("memory access fault by gpu node-")
    if pos >= 0 and (found := _search(_HSA_FAULT_RE, t, pos, before=0, after=300)) is not None:
        m = found[1]
        facts = {"error_class": "illegal-memory-access", "gpu_node": int(m.group("node")),
                 "address": m.group("address"), "reason": m.group("reason").strip()}
        return _Hit("memory", "cuda-error", 0.85, pos, facts,
                    f"GPU memory access fault on GPU node {facts['gpu_node']} at {facts['address']} (ROCm): "
                    f"{facts['reason']}", _ROCM_NOTE)
    pos = t.first("hsa_status_error_")
    if pos >= 0 and (found := _search(_HSA_ABORT_RE, t, pos, before=40, after=320)) is not None:
        m = found[1]
        status = m.group("status")
        kind_ = next((k for needle, k in _HSA_CLASSES if needle in status), "other")
        facts = {"error_class": kind_, "error": status, "detail": _shorten(m.group("error").strip(), 160)}
        if m.group("code"):
            facts["code"] = m.group("code")
        return _Hit("memory", "cuda-error", 0.8, found[0] + m.start(), facts,
                    f"ROCm runtime aborted a GPU queue: {status}", _ROCM_NOTE)
    return None


_XID_RE = re.compile(r"NVRM: Xid \(PCI:(?P<pci>[0-9A-Fa-f:.]{1,24})\): (?P<xid>\d+)")
XID_MEANINGS = {
    13: "graphics engine exception (often an illegal memory access in a kernel)",
    31: "GPU memory page fault (illegal memory access)",
    43: "GPU stopped processing (a kernel fault)",
    45: "preemptive cleanup after an earlier fault",
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint/warning",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping recorded",
    64: "ECC page retirement or row remapping failure",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
}


def _rule_xid(t: _Text) -> Optional[_Hit]:
    for pos in t.find_all("nvrm: xid"):
        found = _search(_XID_RE, t, pos, before=0, after=120)
        if found is None:
            continue
        m = found[1]
        xid = int(m.group("xid"))
        meaning = XID_MEANINGS.get(xid, "driver-reported GPU error")
        facts: Facts = {"xid": xid, "pci": m.group("pci"), "meaning": meaning}
        return _Hit("memory", "cuda-error", 0.85, pos, facts,
                    f"GPU Xid {xid} at PCI {m.group('pci')}: {meaning}",
                    "a driver-level GPU fault: check the node's hardware (dmesg, nvidia-smi -q) before the "
                    "code")
    pos = t.first(*_GPU_LOST_NEEDLES)
    if pos >= 0:
        lost: Facts = {"error": _shorten(t.line_at(pos), 160), "error_class": "gpu-lost"}
        return _Hit("memory", "cuda-error", 0.75, pos, lost,
                    "the GPU is lost: the driver can no longer reach it",
                    "a GPU that fell off the bus or stopped answering the driver (Xid 79 in dmesg): a "
                    "hardware, power or PCIe fault -- reset or reboot the node and check it before rerunning")
    return None


_GPU_LOST_NEEDLES = ("unable to determine the device handle for gpu", "gpu has fallen off the bus",
                     "gpu is lost.", "ur_result_error_device_lost", "ze_result_error_device_lost")
"""The driver's and nvidia-smi's words for a GPU it can no longer reach, when no ``NVRM: Xid`` line is in the
text: nvidia-smi's ``Unable to determine the device handle for GPU0000:03:00.0: Unknown Error`` (a training
job hung on that node, dmesg full of PCIe AER errors; rwth-i6/returnn#1486) or ``...: GPU is lost.  Reboot
the system to recover this GPU``, and the kernel log's ``GPU has fallen off the bus`` without its Xid
prefix; on Intel GPUs (XPU) the Level Zero / Unified Runtime status for the same event,
``UR_RESULT_ERROR_DEVICE_LOST`` / ``ZE_RESULT_ERROR_DEVICE_LOST`` (``RuntimeError: level_zero backend failed
with error: 20 (UR_RESULT_ERROR_DEVICE_LOST)`` while the xe driver resets the engine; intel/torch-xpu-ops
#5164)."""


_CUDA_ERROR_RE = re.compile(r"(?:CUDA error|CUDA driver error|Cuda failure(?: \d{1,4})?(?= ')|HIP error"
                            r"|cudaError[A-Z]\w{2,40}|hipError[A-Z]\w{2,40}"
                            r"|Triton Error \[CUDA\]|CUDA_ERROR_[A-Z_]{2,40}"
                            r"|cuda runtime error \(\d{1,4}\) ?"
                            r"|THCudaCheck FAIL file=\S{1,300} line=\d{1,7} error=\d{1,4} ?"
                            r"|Check failed: error == cudaSuccess \(\d{1,4} vs\. 0\) ?)[:]? '?"
                            r"(?P<error>[^'\n]{1,200})")
"""Also a CUDA runtime enum before its text, as thrust prints it: ``cudaErrorIllegalAddress: an
illegal ...``; NCCL's ``Cuda failure 'reason'`` with, since NCCL 2.19, the error's number before the quote
(``include/alloc.h:125 NCCL WARN Cuda failure 700 'an illegal memory access was encountered'``,
pytorch/pytorch#131755); the driver API's (``CUDA driver error: ...``, ``CUDA_ERROR_ILLEGAL_ADDRESS: ...``),
Triton's ``Triton Error [CUDA]: ...``; the HIP runtime's enum before its text, as ROCm prints a failure
it aborts on (``"hipErrorNoBinaryForGpu: Unable to find code object for all current devices!"`` then
``Aborted (core dumped)``, ROCm/legacy-rocm-build#1560); and torch < 1.0's THC wordings ``cuda runtime error
(39) :
uncorrectable ECC error encountered at ...`` / ``THCudaCheck FAIL file=... line=84 error=74 : misaligned
address``; Caffe's CUDA_CHECK through glog, ``Check failed: error == cudaSuccess (74 vs. 0)  misaligned
address``."""
_CUDA_ENUM_RE = re.compile(r"cudaError(?P<enum>[A-Z][A-Za-z]{2,40})")
_CUDA_ENUM_CLASSES = {"IllegalAddress": "illegal-memory-access", "Assert": "device-side-assert",
                      "ECCUncorrectable": "ecc", "LaunchFailure": "launch-failure",
                      "IllegalInstruction": "illegal-instruction", "MisalignedAddress": "misaligned-address"}
"""A CUDA runtime enum that names a device fault by itself, when its text is not where
:data:`_CUDA_ERROR_RE` reads it: thrust's message retyped with spaces around the colons and broken after the
enum (``copy_if failed to synchronize : cudaErrorIllegalAddress`` / ``an illegal memory access was
encountered.``, xg-chu/CrowdDet#26), or with full-width colons (U+FF1A) in Chinese prose
(sithu31296/semantic-segmentation#45)."""
_CUDA_ERROR_TYPED_RE = re.compile(r"(?i:cuda (?:runtime )?error): ?'?(?P<error>[^'\n]{1,200})")
"""The same retyped by a user: any case, the space after the colon optional
(``RuntimeError:cuda error:unspecified launch failure``); also a CUDA extension's own check, ``CUDA Runtime
Error: an illegal memory access was encountered at scene.cpp:1523`` (diffvg; the exception's type printed
alone on the line before)."""
_CUDA_LIB_RE = re.compile(r"(?P<status>(?:CUBLAS|CUDNN|CUSOLVER|CUFFT)_STATUS_[A-Z_]{2,60})")
_CUDA_CLASSES = (
    ("illegal memory access", "illegal-memory-access"), ("device-side assert", "device-side-assert"),
    ("ecc error", "ecc"), ("unspecified launch failure", "launch-failure"),
    ("illegal instruction", "illegal-instruction"), ("misaligned address", "misaligned-address"),
    ("no kernel image", "no-kernel-image"), ("invalid device function", "no-kernel-image"),
    ("code object for all current devices", "no-kernel-image"),
    ("binary for current devices", "no-kernel-image"),
    ("launch timed out", "launch-timeout"),
    ("busy or unavailable", "device-unavailable"), ("invalid device ordinal", "invalid-device"),
    ("driver version is insufficient", "driver-too-old"), ("initialization error", "initialization"),
    ("compiled with an unsupported toolchain", "driver-too-old"),
)
_DEVICE_FAULTS = frozenset({"illegal-memory-access", "device-side-assert", "ecc", "launch-failure",
                            "illegal-instruction", "misaligned-address"})
"""The error classes that are a fault on the device itself (a kernel's or the GPU memory's): what NCCL's
``Cuda failure '<reason>'`` must name to be that fault rather than NCCL's own failure."""
_DS_GEMM_RE = re.compile(r"!!!! kernel execution error\. \((?:batch: \d+, )?m: \d+, n: \d+, k: \d+, "
                         r"error: (?P<status>\d{1,3})\)")
"""DeepSpeed's cuBLAS wrappers (csrc/includes/cublas_wrappers.h) when a GEMM fails: ``!!!! kernel execution
error. (m: 1280, n: 3075, k: 5120, error: 13)`` -- the cuBLAS status number (index-tts/index-tts#424)."""
_CUBLAS_STATUS = {1: "CUBLAS_STATUS_NOT_INITIALIZED", 3: "CUBLAS_STATUS_ALLOC_FAILED",
                  7: "CUBLAS_STATUS_INVALID_VALUE", 8: "CUBLAS_STATUS_ARCH_MISMATCH",
                  11: "CUBLAS_STATUS_MAPPING_ERROR", 13: "CUBLAS_STATUS_EXECUTION_FAILED",
                  14: "CUBLAS_STATUS_INTERNAL_ERROR", 15: "CUBLAS_STATUS_NOT_SUPPORTED"}
_DS_GEMM_NEEDLE = "!!!! kernel execution error. ("
_CUDA_NOTES = {
    "illegal-memory-access": "a kernel read or wrote out of bounds (custom kernels, indices, a corrupted "
                             "tensor); rerun with CUDA_LAUNCH_BLOCKING=1 to find the op",
    "device-side-assert": "a kernel's assertion failed, most often an index out of range (embedding ids, "
                          "class targets); rerun with CUDA_LAUNCH_BLOCKING=1",
    "ecc": "an uncorrectable memory error on the GPU: a hardware fault, drain the node",
    "no-kernel-image": "the installed framework has no kernels for this GPU architecture (on ROCm: its gfx "
                       "target is not in the build; HSA_OVERRIDE_GFX_VERSION, or a build for it)",
    "driver-too-old": "the NVIDIA driver is older than the CUDA the framework (or its PTX) was built with",
}
_PTX_TOOLCHAIN = "the provided ptx was compiled with an unsupported toolchain"
"""The CUDA runtime's own string for cudaErrorUnsupportedPtxVersion (222): PTX built by a newer CUDA than the
driver can JIT -- reported by whatever made the call, also without a ``CUDA error:`` prefix (jaxlib's
``operation cudaGetLastError() failed: the provided PTX was compiled with an unsupported toolchain.``,
naruya/VaxNeRF#1; Triton's and PyTorch's ``CUDA error: the provided PTX ...``)."""
_CUDA_NEEDLES = ("cuda error", "cuda failure ", "hip error", "_status_", "driver version is insufficient",
                 "nvidia driver on your system is too old", "cudaerror", "cuda runtime error",
                 "thcudacheck fail", "cuda driver error", "triton error [cuda]", "cuda_error_",
                 "check failed: error == cudasuccess", "hiperror", _PTX_TOOLCHAIN)


def _rule_cuda_error(t: _Text) -> Optional[_Hit]:
    pos = t.first(*_CUDA_NEEDLES)
    tries = 0
    while pos >= 0 and tries < MAX_HITS:
        tries += 1
        if t.lower.startswith("_status_", pos):
            while pos > 0 and t.text[pos - 1].isalpha():
                pos -= 1
        _offset, text = t.window(pos, 0, 400)
        m = _CUDA_ERROR_RE.match(text) or _CUDA_ERROR_TYPED_RE.match(text) or _CUDA_LIB_RE.match(text)
        if m is None and (enum := _CUDA_ENUM_RE.match(text)) is not None and \
                (named := _CUDA_ENUM_CLASSES.get(enum.group("enum"))) is not None:
            enum_facts: Facts = {"error": enum.group(0), "error_class": named}
            return _Hit("memory", "cuda-error", 0.85, pos, enum_facts, f"CUDA error: {enum.group(0)}",
                        _CUDA_NOTES.get(named, "a CUDA call failed; rerun with CUDA_LAUNCH_BLOCKING=1"))
        if m is None and text[:60].lower().startswith(_PTX_TOOLCHAIN) and \
                (t.text[pos - 1:pos] in ("'", '"', "\u2018", "\u201c", "`") or _quiet_record(t, pos)):
            pos = _next(t, pos)  # quoted (a FAQ about the message), or a warning the caller falls back from
            continue
        if m is None and ("driver version is insufficient" in text[:60].lower()
                          or "driver on your system is too old" in text[:60].lower()
                          or text[:60].lower().startswith(_PTX_TOOLCHAIN)):
            facts: Facts = {"error": _shorten(t.line_at(pos), 160), "error_class": "driver-too-old"}
            return _Hit("memory", "cuda-error", 0.8, pos, facts, "CUDA driver too old for this build",
                        _CUDA_NOTES["driver-too-old"])
        if m is not None:
            if "status" in m.groupdict():
                status = m.group("status")
                if status.endswith(("ALLOC_FAILED", "_SUCCESS")):
                    pos = _next(t, pos)
                    continue
                facts = {"error": status, "error_class": "library"}
                return _Hit("memory", "cuda-error", 0.75, pos, facts, f"CUDA library error {status}",
                            "a cuBLAS/cuDNN call failed on the device, often after an earlier illegal "
                            "memory access; rerun with CUDA_LAUNCH_BLOCKING=1")
            error = m.group("error").strip()
            for stop in (" CUDA kernel errors", ". ", " at /", "\n"):
                cut = error.find(stop)
                if cut > 0:
                    error = error[:cut]
            error = error.rstrip(".")
            if "out of memory" in error.lower():
                pos = _next(t, pos)
                continue
            kind_ = next((k for needle, k in _CUDA_CLASSES if needle in error.lower()), "other")
            hip = m.group(0).startswith("hipError")
            if hip:
                error = error.rstrip('"!')
                if kind_ == "other" and "NoBinaryForGpu" in m.group(0):
                    # the enum names it; its text may be cut at an apostrophe (``Coudn't``)
                    kind_, error = "no-kernel-image", m.group(0).split(":")[0]
            if kind_ not in _DEVICE_FAULTS and m.group(0).startswith("Cuda failure"):
                # NCCL's own report of a CUDA call it made: a device fault only when it names one (as
                # nccl.error reads its Last error); 'invalid argument', 'initialization error' & co. are
                # NCCL's failure, its rule's
                pos = _next(t, pos)
                continue
            facts = {"error": error, "error_class": kind_}
            return _Hit("memory", "cuda-error", 0.9, pos, facts, f"{'HIP' if hip else 'CUDA'} error: {error}",
                        _CUDA_NOTES.get(kind_, "a CUDA call failed; rerun with CUDA_LAUNCH_BLOCKING=1"))
        pos = _next(t, pos)
    return _ds_gemm_failed(t) or _cuda_op_error(t) or _cuda_check_at(t)


_OP_ERROR_NEEDLE = "error in "
_OP_ERROR_RE = re.compile(r"\berror in (?P<op>[A-Za-z_]\w{0,80}): (?P<error>[^\n]{1,120})")
"""A CUDA extension op's own check of its kernel launch, ``printf("error in %s: %s\\n", op,
cudaGetErrorString(err))``: Deformable DETR's / mmcv's ``error in ms_deformable_col2im_cuda: an illegal memory
access was encountered``, DCNv2's ``error in modulated_deformable_im2col_cuda: no kernel image is available
for execution on the device``. Read only when the text after the colon is the CUDA runtime's own string for
a device fault or a missing kernel image (:data:`_OP_ERROR_CLASSES`): any other ``error in x: ...`` is not
CUDA's."""
_OP_ERROR_CLASSES = frozenset({*_DEVICE_FAULTS, "no-kernel-image"})


def _cuda_op_error(t: _Text) -> Optional[_Hit]:
    """An extension op's ``error in <op>: <CUDA runtime error string>`` (:data:`_OP_ERROR_RE`)."""
    for pos in t.find_all(_OP_ERROR_NEEDLE):
        found = _search(_OP_ERROR_RE, t, pos, before=0, after=220)
        if found is None:
            continue
        m = found[1]
        error = m.group("error").strip().rstrip(".")
        kind_ = next((k for needle, k in _CUDA_CLASSES if needle in error.lower()), "other")
        if kind_ not in _OP_ERROR_CLASSES:
            continue
        facts: Facts = {"error": error, "error_class": kind_, "op": m.group("op")}
        return _Hit("memory", "cuda-error", 0.85, found[0] + m.start(), facts,
                    f"CUDA error in {m.group('op')}: {error}",
                    _CUDA_NOTES.get(kind_, "a CUDA call failed; rerun with CUDA_LAUNCH_BLOCKING=1"))
    return None


_CHECK_AT_NEEDLE = " at line "
_CHECK_AT_RE = re.compile(r"(?:^|\s)Error (?P<error>[a-z][a-z ,'-]{2,100}?) at line (?P<line>\d{1,7}) "
                          r"in file "
                          r"(?P<file>\S{1,300})")
"""A CUDA extension's check macro that prints the runtime's string and the source site, ``printf("Error %s at
line %d in file %s\\n", cudaGetErrorString(status), __LINE__, __FILE__)``: bitsandbytes' CUDA_CHECK_RETURN,
``Error invalid device ordinal at line 393 in file .../csrc/pythonInterface.c`` (artidoro/qlora#255),
``Error invalid device function at line 508 in file .../csrc/ops.cu`` -- the file name often wrapped by the
terminal. Read only when the text between ``Error`` and ``at line`` is one of the CUDA runtime's own strings
(:data:`_CUDA_CLASSES`)."""


def _cuda_check_at(t: _Text) -> Optional[_Hit]:
    """An extension's ``Error <CUDA runtime error string> at line N in file F`` (:data:`_CHECK_AT_RE`)."""
    for pos in t.find_all(_CHECK_AT_NEEDLE):
        found = _search(_CHECK_AT_RE, t, pos, before=120, after=40)
        if found is None:
            continue
        m = found[1]
        error = m.group("error").strip()
        kind_ = next((k for needle, k in _CUDA_CLASSES if needle in error.lower()), "other")
        if kind_ == "other":
            continue
        facts: Facts = {"error": error, "error_class": kind_, "site": f"{m.group('file')}:{m.group('line')}"}
        return _Hit("memory", "cuda-error", 0.8, found[0] + m.start("error"), facts, f"CUDA error: {error}",
                    _CUDA_NOTES.get(kind_, "a CUDA call failed in an extension's kernel launch; rerun with "
                                           "CUDA_LAUNCH_BLOCKING=1"))
    return None


def _ds_gemm_failed(t: _Text) -> Optional[_Hit]:
    """DeepSpeed's cuBLAS wrapper reporting a failed GEMM (:data:`_DS_GEMM_RE`); an allocation failure (status
    3) is left to the OOM rules."""
    pos = t.first(_DS_GEMM_NEEDLE)
    if pos < 0 or (found := _search(_DS_GEMM_RE, t, pos, before=0, after=120)) is None:
        return None
    code = int(found[1].group("status"))
    if code == 3:
        return None
    status = _CUBLAS_STATUS.get(code, f"cuBLAS status {code}")
    facts: Facts = {"error": status, "error_class": "library", "cublas_status": code}
    return _Hit("memory", "cuda-error", 0.75, found[0] + found[1].start(), facts,
                f"CUDA library error {status} (DeepSpeed's cuBLAS GEMM)",
                "a cuBLAS call failed on the device, often after an earlier kernel fault (illegal memory "
                "access, illegal instruction); rerun with CUDA_LAUNCH_BLOCKING=1")


_ASYNC_NOTE = "cuda kernel errors might be asynchronously reported at some other api call"
"""The sentence PyTorch prints after every CUDA error (``CUDA error: ...``): alone, the error line itself
was cut from the text."""


def _rule_cuda_error_cut(t: _Text) -> Optional[_Hit]:
    pos = t.first(_ASYNC_NOTE)
    if pos < 0:
        return _c10_cuda_frames(t)
    facts: Facts = {"error_class": "unknown"}
    return _Hit("memory", "cuda-error", 0.6, pos, facts, "CUDA error (its first line is not in the text)",
                "PyTorch prints this after a CUDA error; the error itself (illegal memory access, "
                "device-side assert, ...) is on the line before: rerun with CUDA_LAUNCH_BLOCKING=1")


_C10_CUDA = ("libc10_cuda.so", "c10_cuda_check_implementation")
_ERROR_FRAME = ("c10::error::error", "std::function<std::string ()>", "torchcheckfail", "c10::detail::")
_NEAR_RAISE_RE = re.compile(r"frame #[12]: ")


def _c10_cuda_frames(t: _Text) -> Optional[_Hit]:
    """A c10 C++ stack alone (its message cut) whose raising frame -- the first ``frame #N:`` past the
    c10::Error constructor -- is in libc10_cuda: ``c10_cuda_check_implementation`` (C10_CUDA_CHECK: a CUDA
    error) is memory/cuda-error; any other libc10_cuda frame (the caching allocator's OOM, or a CUDA check
    inlined, e.g. freeing a tensor after an asynchronous fault) is memory/oom-or-cuda-error. It names no rank
    (``from_frames``)."""
    pos = t.first(*_C10_CUDA)
    if pos < 0:
        return None
    start = t.lower.rfind("frame #0:", max(0, pos - 4000), pos)
    if start < 0:  # a stack read line by line: the raising frame is #1 or #2 (after c10::Error's own)
        line = t.line_at(pos).lower()
        if not _NEAR_RAISE_RE.match(line):
            return None
        start = t.lower.rfind("\n", 0, pos) + 1
    for line in t.lower[start: pos + 400].splitlines():
        if not line.lstrip().startswith("frame #"):
            continue
        if any(marker in line for marker in _ERROR_FRAME):
            continue  # the exception being built, not where it was raised
        if "c10_cuda_check_implementation" in line:
            return _Hit("memory", "cuda-error", 0.6, pos, {"from_frames": True},
                        "CUDA error raised by C10_CUDA_CHECK (only its C++ stack is in the text)",
                        _FRAMES_NOTE)
        if "libc10_cuda.so" in line:
            return _Hit("memory", "oom-or-cuda-error", 0.6, pos, {"from_frames": True},
                        "c10 error raised in libc10_cuda: a CUDA OOM or a CUDA error (only its C++ stack "
                        "is in the text)", _FRAMES_NOTE)
        return None
    return None


_FRAMES_NOTE = ("the error's message line is cut; the stack shows it came from PyTorch's CUDA runtime "
                "layer (libc10_cuda): look for the 'CUDA error:' or 'CUDA out of memory' line before it, or "
                "rerun with CUDA_LAUNCH_BLOCKING=1")


def _next(t: _Text, pos: int) -> int:
    best = -1
    for needle in _CUDA_NEEDLES:
        p = t.lower.find(needle, pos + len(needle))
        if p >= 0 and (best < 0 or p < best):
            best = p
    return best


GATES = {
    "cuda.oom": ("out of memory",),
    "cuda.oom-plain": (*_OOM_PLAIN_NEEDLES, *_OOM_XLA_NEEDLES, _OOM_RECOVERY),
    "cuda.device-assert": ("assertion `", _BARE_ASSERT_NEEDLE),
    "nvidia.xid": ("nvrm: xid", *_GPU_LOST_NEEDLES),
    "rocm.gpu-fault": ("device-side assertion `", "memory access fault by gpu node-", "hsa_status_error_"),
    "cuda.error": (*_CUDA_NEEDLES, _DS_GEMM_NEEDLE, _OP_ERROR_NEEDLE, _CHECK_AT_NEEDLE),
    "cuda.error-cut": (_ASYNC_NOTE, *_C10_CUDA),
}
"""Each rule's needles: the rule cannot match a text in which none of them occurs (the classifier skips it
after the shared pre-scan)."""


DOCS = {
    'cuda.error-cut': (
        "PyTorch's ``CUDA kernel errors might be asynchronously reported ...`` without the error line before "
        "it → memory/cuda-error; a c10 C++ stack alone whose raising frame is in libc10_cuda "
        "(``c10_cuda_check_implementation`` → memory/cuda-error, another libc10_cuda frame → "
        "memory/oom-or-cuda-error; no rank) (the last rule: any named error wins)"
    ),
    'cuda.oom': (
        '``CUDA out of memory. Tried to allocate ...`` (current and older formats; HIP/XPU/MPS too) → '
        'memory/oom'
    ),
    'cuda.oom-plain': (
        "``CUDA error: out of memory``, ``CUBLAS_STATUS_ALLOC_FAILED``, ``CUDA_ERROR_OUT_OF_MEMORY`` / "
        "``HIP_ERROR_OutOfMemory`` / ``hipErrorOutOfMemory``, fairseq's ``attempting to recover "
        "from OOM in forward/backward pass``; other allocators' wordings: XLA's ``RESOURCE_EXHAUSTED: Out of "
        "memory while trying to allocate ...`` / ``Failed to allocate request for ...`` (JAX), "
        "TensorFlow's ``Resource exhausted: OOM when allocating "
        "tensor ...``, Caffe's ``Check failed: error == cudaSuccess (2 vs. 0)  out of memory`` (not XLA's "
        "inside a glog W/I record its autotuner recovers from) → memory/oom"
    ),
    'cuda.device-assert': ("a kernel's ``file.cu:N: [kernel or its C++ signature: ]block: [..], thread: [..] "
                           "Assertion `...` failed`` line (the assertion may hold backticks, or have lost "
                           "them; ``failed`` may be wrapped to the next line) → "
                           "memory/cuda-error"),
    'nvidia.xid': ("``NVRM: Xid (PCI:...): N``; a GPU the driver lost without that line: nvidia-smi's "
                   "``Unable to determine the device handle for GPU...: Unknown Error`` / ``GPU is lost``, "
                   "``GPU has fallen off the bus``; Intel XPU's ``UR_RESULT_ERROR_DEVICE_LOST`` / "
                   "``ZE_RESULT_ERROR_DEVICE_LOST`` → memory/cuda-error"),
    'rocm.gpu-fault': ("a kernel fault as ROCm prints it: HIP's ``file:N: <kernel>: Device-side assertion "
                       "`...' failed.``, the HSA runtime's ``Memory access fault by GPU node-N (Agent "
                       "handle: ...) on address ... Reason: ...``, a queue ``aborting with error : "
                       "HSA_STATUS_ERROR_*: ...`` → memory/cuda-error"),
    'cuda.error': (
        "``CUDA error: <reason>``, NCCL's ``Cuda failure '<reason>'``, cuBLAS / cuDNN execution failures, "
        "torch < 1.0's ``cuda runtime error (N) : <reason>`` / ``THCudaCheck FAIL ... error=N : <reason>``, "
        "Caffe's ``Check failed: error == cudaSuccess (N vs. 0)  <reason>``, a CUDA runtime enum naming a "
        "device fault (``cudaErrorIllegalAddress``) however its text follows, "
        "``CUDA driver error: ...``, ``CUDA_ERROR_*: ...``, Triton's ``Triton Error [CUDA]: ...``, "
        "an extension's ``CUDA Runtime Error: <reason>``, an extension op's own ``error in <op>: <reason>`` "
        "when the reason is the CUDA runtime's string for a device fault or a missing kernel image, "
        "an extension's check macro ``Error <CUDA runtime string> at line N in file F`` (bitsandbytes' "
        "``Error invalid device ordinal at line 393 in file .../pythonInterface.c``), "
        "driver too old (also the runtime's bare ``the provided PTX was compiled with an unsupported "
        "toolchain``) → memory/cuda-error"
    ),
}
"""What each rule of this module recognises, and the kind it gives (docs/classifier.md is made of these)."""
