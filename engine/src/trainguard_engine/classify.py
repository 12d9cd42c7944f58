"""The error-text classifier: what a piece of error text means, as a catalogue kind with parsed facts.

::

    c = classify_text(log_tail)                       # Classification | None
    c = classify_exception("torch.OutOfMemoryError", message)   # always a Classification
    c.kind, c.rule, c.confidence, c.facts, c.headline, c.lines

**Contract.**

* *Input*: any text -- one log line, a log tail, an exception message, a whole stderr capture; launcher
  prefixes (``[rank1]:``, ``[default0]:``) are stripped in place (a multi-line C++ message carries the
  prefix on its first line only) and name the rank when the text itself does not; ``\\r\\n`` and ``\\r``
  are newlines. Texts longer than :data:`MAX_TEXT_CHARS` are read as their first
  :data:`HEAD_CHARS` and the rest of the budget from the end (errors come last).
* *Output*: ``None`` when nothing in the text is recognised (a plain log line, garbage); otherwise the
  :class:`Classification` of the **most causal** rule that matched (the order of :data:`RULES`: a launcher
  summary naming the root cause, then memory and CUDA errors, then collective mismatches, then timeouts and
  lost peers, then generic communication and rendezvous errors, then model-side errors, then a plain Python
  traceback). Facts of the enriching rules (:data:`ENRICHING_RULES`: desync report, PG status, flight
  recorder stack, monitored barrier) of the same category are merged in; the names of the other rules
  that matched are in ``also``. Exceptions are read as Python prints them, ``"Type: message"``.
* ``category``/``subtype`` are always a row of :data:`trainguard_engine.catalogue.KINDS`. Model-side errors
  (shape / device / index) stay ``process/exception``: they are ordinary Python exceptions whose triage is
  the traceback; the ``rule`` (``model.shape-mismatch`` ...) and ``facts`` say which, and the incident
  summary carries the specific advice. An index error *on CUDA* surfaces as a device-side assert and is
  ``memory/cuda-error`` (the DESIGN puts device-side asserts in the memory category).
* *Facts* are JSON-ready (str, int, float, bool, None, lists, dicts with str keys); sizes are bytes.
* *Bounded and linear*: every regex is precompiled and applied only to a bounded window around an
  occurrence of a literal needle (found with ``str.find``), at most :data:`MAX_HITS` occurrences per
  needle; no pattern starts with an unbounded wildcard. A 1 MB line costs a few ``find`` passes.
* Pure: no I/O, stdlib only.

**Rules** (category/subtype ← text):

=================================  =====================================================================
``torchrun.child-failed``          torchrun's ``ChildFailedError`` summary: the root cause's own kind
                                   (its traceback, else its exit code / signal by the decision path)
``cuda.oom``                       ``CUDA out of memory. Tried to allocate ...`` (current and older
                                   formats; HIP/XPU/MPS too) → memory/oom
``cuda.oom-plain``                 ``CUDA error: out of memory``, ``CUBLAS_STATUS_ALLOC_FAILED`` → memory/oom
``cuda.device-assert``             a kernel's ``Assertion `...` failed`` line → memory/cuda-error
``nvidia.xid``                     ``NVRM: Xid (PCI:...): N`` → memory/cuda-error
``cuda.error``                     ``CUDA error: <reason>``, NCCL's ``Cuda failure '<reason>'``, cuBLAS /
                                   cuDNN execution failures, driver too old → memory/cuda-error
``c10d.collective-mismatch``       ``Detected mismatch between collectives on ranks`` → comm/mismatch
``gloo.size-mismatch``             gloo ``Received data size doesn't match expected size`` → comm/mismatch
``nccl.watchdog-timeout``          ``Watchdog caught collective operation timeout: WorkNCCL(...)`` →
                                   comm/timeout
``c10d.desync-report``             the desync debug report ("lagging ranks", "joined but didn't finish")
                                   → comm/timeout
``gloo.monitored-barrier``         ``Rank N failed to pass monitoredBarrier`` → comm/timeout
``nccl.dump-signal``               ``Received a dump signal due to a collective timeout from rank N`` →
                                   comm/timeout
``nccl.watchdog-status``           (adds facts only) the PG status line (last enqueued / completed work)
                                   and the flight recorder's stack of the failed collective
``nccl.error``                     ``NCCL error ...`` / ``nccl*Error``: RemoteError → comm/rank-lost;
                                   InvalidUsage / InvalidArgument → comm/mismatch; UnhandledCudaError →
                                   memory/cuda-error; SystemError on a connect → comm/init-failure;
                                   SystemError / InternalError → comm/failure
``nccl.comm-aborted``              ``NCCL communicator was aborted on rank N`` → comm/failure
``gloo.timeout``                   ``Timed out waiting Nms for recv/send operation`` → comm/timeout
``gloo.peer-lost``                 gloo ``Connection reset/closed by peer``, monitoredBarrier errors from a
                                   peer, TCPStore ``Failed to recv, got 0 bytes`` → comm/rank-lost
``c10d.rendezvous``                ``Timed out ... waiting for clients. k/n clients joined``, client socket
                                   connect timeouts/failures, store ``wait timeout``, port in use,
                                   ``Rendezvous*Error``, NCCL bootstrap / socket connect, "connection
                                   refused"/"timed out" next to rendezvous words → comm/init-failure
``nccl.ib-error``                  ``NET/IB : Got completion from peer ... with error N`` → comm/failure
``autograd.anomaly-nan``           ``Function 'X' returned nan values in its Nth output`` →
                                   gradient/nan-source
``model.device-mismatch``          tensors on different devices (incl. ``meta``) → process/exception
``model.index-out-of-range``       ``index out of range in self``, ``index i is out of bounds ...``,
                                   ``Target t is out of bounds`` → process/exception
``model.shape-mismatch``           ``mat1 and mat2 shapes cannot be multiplied``, size mismatches →
                                   process/exception
``dataloader.worker``              ``Caught X in DataLoader worker process N`` / worker killed →
                                   process/exception
``torchrun.worker-failed``         ``failed (exitcode: N) local_rank: ...`` → by the exit decision path
``python.fatal-error``             ``Fatal Python error: Aborted|Segmentation fault|...`` → by the exit
                                   decision path for that signal
``type:<name>``                    (with ``exc_type``) :data:`~trainguard_engine.catalogue.EXCEPTION_RULES`
``python.exception``               any other printed Python traceback → process/exception
=================================  =====================================================================

Survivors' views follow the fixtures: gloo ``Connection reset by peer`` is what a rank sees when its peer
aborted (``gloo_size_mismatch_peer.txt``: the peer died of a gloo enforce failure) or was SIGKILLed, so it
is ``comm/rank-lost``; ``Timed out waiting ... for recv`` is what ranks see of a live straggler
(``gloo_timeout_rank*.txt``), so it is ``comm/timeout``.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from trainguard.core.tracebacks import parse_traceback_text

from .catalogue import EXCEPTION_RULES, SIGNAL_NAMES, classify_exit

MAX_TEXT_CHARS = 2_000_000
"""Characters of one text that are read: the first :data:`HEAD_CHARS` and the last ones."""
HEAD_CHARS = 400_000
MAX_HITS = 32
"""Occurrences of one needle that a rule examines."""
WINDOW_BEFORE = 400
WINDOW_AFTER = 6_000
"""A rule's regexes see this many characters before and after an occurrence of its needle."""
MAX_LINE_CHARS = 500
MAX_LINES = 6
TRACEBACK_TAIL_CHARS = 256_000
"""The Python-traceback fallback parses at most this much of the end of a text."""

Facts = Dict[str, Any]


@dataclass(frozen=True)
class Classification:
    """What an error text means.

    ``category``/``subtype``: a catalogue kind. ``rule``: the rule that decided (see the module table).
    ``confidence``: 0..1, how specific the evidence is (an exact PyTorch/NCCL message with parsed fields
    ~0.9; a generic phrase ~0.5). ``headline``: one line naming what was parsed, fit for an incident
    title. ``facts``: the parsed details (JSON-ready; sizes in bytes). ``lines``: the matching text
    line(s), prefixes stripped, each at most :data:`MAX_LINE_CHARS`. ``note``: what the match implies,
    for a summary. ``also``: other rules that matched the same text."""

    category: str
    subtype: str
    rule: str
    confidence: float
    headline: str
    facts: Mapping[str, Any] = field(default_factory=dict)
    lines: Tuple[str, ...] = ()
    note: str = ""
    also: Tuple[str, ...] = ()

    @property
    def kind(self) -> str:
        """``"category/subtype"``."""
        return f"{self.category}/{self.subtype}"


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
# The text as the rules see it


_PREFIX_RE = re.compile(r"\[(?P<stream>[A-Za-z_]{1,32}\d{1,7})\]:(?: )?")
_STREAM_RANK_RE = re.compile(r"(?:rank|default)(\d+)$")


class _Text:
    """A text with launcher prefixes stripped in place (a multi-line C++ message carries the prefix on
    its first line only, so lines keep their order); ``lower`` for needles; ``stream_at(pos)`` names the
    prefix of the line at ``pos`` ("" for an unprefixed line)."""

    def __init__(self, raw: str) -> None:
        if len(raw) > MAX_TEXT_CHARS:
            raw = raw[:HEAD_CHARS] + "\n" + raw[-(MAX_TEXT_CHARS - HEAD_CHARS):]
        lines: List[str] = []
        self.starts: List[int] = []    # offset of each prefixed line ...
        self.streams: List[str] = []   # ... and its prefix; unprefixed lines are not listed
        self.ends: List[int] = []
        offset = 0
        for line in raw.replace("\r\n", "\n").replace("\r", "\n").split("\n"):
            match = _PREFIX_RE.match(line)
            if match:
                line = line[match.end():]
                self.starts.append(offset)
                self.streams.append(match.group("stream"))
                self.ends.append(offset + len(line))
            lines.append(line)
            offset += len(line) + 1
        self.text = "\n".join(lines) + "\n"
        self.lower = self.text.lower()

    def find_all(self, needle: str, start: int = 0) -> Iterator[int]:
        """Positions of ``needle`` (lower case) in the text, at most :data:`MAX_HITS`."""
        found = 0
        pos = self.lower.find(needle, start)
        while pos >= 0 and found < MAX_HITS:
            yield pos
            found += 1
            pos = self.lower.find(needle, pos + max(1, len(needle)))

    def first(self, *needles: str) -> int:
        """The earliest position of any of ``needles``, or -1."""
        best = -1
        for needle in needles:
            pos = self.lower.find(needle)
            if pos >= 0 and (best < 0 or pos < best):
                best = pos
        return best

    def window(self, pos: int, before: int = WINDOW_BEFORE, after: int = WINDOW_AFTER) -> Tuple[int, str]:
        """``(offset, text)`` of the bounded window around ``pos``."""
        start = max(0, pos - before)
        return start, self.text[start: pos + after]

    def line_at(self, pos: int) -> str:
        """The line containing ``pos``, cut to :data:`MAX_LINE_CHARS` around ``pos``."""
        start = self.text.rfind("\n", max(0, pos - MAX_LINE_CHARS), pos) + 1
        if start == 0 and pos > MAX_LINE_CHARS:
            start = pos - MAX_LINE_CHARS // 4
        end = self.text.find("\n", pos, pos + MAX_LINE_CHARS)
        if end < 0:
            end = min(len(self.text), start + MAX_LINE_CHARS)
        line = self.text[start:end].strip()
        return line if len(line) <= MAX_LINE_CHARS else line[: MAX_LINE_CHARS - 3] + "..."

    def stream_at(self, pos: int) -> str:
        index = bisect.bisect_right(self.starts, pos) - 1
        if index >= 0 and pos <= self.ends[index]:
            return self.streams[index]
        return ""


@dataclass
class _Hit:
    """One rule's match."""

    category: str
    subtype: str
    confidence: float
    pos: int
    facts: Facts
    headline: str
    note: str = ""
    extra_lines: Tuple[int, ...] = ()   # further positions whose lines are evidence
    supporting: bool = False            # never the classification; only adds facts (ENRICHING_RULES)
    rule: str = ""


_Rule = Callable[[_Text], Optional[_Hit]]


def _search(pattern: re.Pattern[str], t: _Text, pos: int, before: int = WINDOW_BEFORE,
            after: int = WINDOW_AFTER) -> Optional[Tuple[int, re.Match[str]]]:
    offset, text = t.window(pos, before, after)
    match = pattern.search(text)
    return (offset, match) if match else None


_BRACKET_RANK_RE = re.compile(r"\[(?:PG [^\]\n]{0,80} )?Rank (?P<rank>\d+)\]")


def _rank_of(t: _Text, pos: int, facts: Facts) -> Optional[int]:
    """The rank the text names for ``pos``: ``facts["rank"]``, else a ``[Rank N]`` / ``[PG ... Rank N]``
    tag on its line, else the line's ``[rankN]:`` prefix."""
    rank = facts.get("rank")
    if isinstance(rank, int):
        return rank
    line_start = t.text.rfind("\n", max(0, pos - MAX_LINE_CHARS), pos) + 1
    tag = _BRACKET_RANK_RE.search(t.text, line_start, pos + 200)
    if tag is not None:
        facts["rank"] = int(tag.group("rank"))
        return facts["rank"]
    match = _STREAM_RANK_RE.search(t.stream_at(pos))
    if match:
        facts["rank"] = int(match.group(1))
        return facts["rank"]
    return None


def _on_rank(rank: Optional[int]) -> str:
    return f" on rank {rank}" if rank is not None else ""


_INT_RE = re.compile(r"-?\d+")


def _ints(text: str) -> List[int]:
    return [int(x) for x in _INT_RE.findall(text[:40_000])[:4096]]


def _shorten(text: str, most: int = 160) -> str:
    text = " ".join(text.split())
    return text if len(text) <= most else text[: most - 3] + "..."


# ----------------------------------------------------------------------------------------------------
# Memory and CUDA


_OOM_START_RE = re.compile(r"(?P<backend>CUDA|HIP|XPU|MPS)(?: backend)? out of memory")
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
_OOM_LEGACY_DEVICE_RE = re.compile(r"\(GPU (?P<device>\d+); ")
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
    where = f" on GPU {facts['device']}" if "device" in facts else ""
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
                      "cuda failure 'out of memory'", "cudaerrormemoryallocation")


def _rule_cuda_oom_plain(t: _Text) -> Optional[_Hit]:
    pos = t.first(*_OOM_PLAIN_NEEDLES)
    if pos < 0:
        return None
    what = _shorten(t.line_at(pos), 120)
    return _Hit("memory", "oom", 0.85, pos, {"error": what},
                "CUDA out of memory outside the caching allocator", "a raw CUDA allocation failed (CUDA "
                "context creation, cuBLAS/cuDNN workspace, NCCL buffers): the GPU was already full")


_ASSERT_RE = re.compile(r"Assertion `(?P<assertion>[^`\n]{1,300})` failed")
_ASSERT_SITE_RE = re.compile(r"(?P<file>[^\s:]{1,300}\.cuh?):(?P<line>\d+): (?P<kernel>[^\n:]{1,200}): "
                             r"block: \[(?P<block>[\d,]{1,40})\], thread: \[(?P<thread>[\d,]{1,40})\]")
_INDEX_ASSERT_RE = re.compile(r"index|Index|n_classes|< *numel|srcSelectDimSize|dstAddDimSize|num_classes")


def _rule_device_assert(t: _Text) -> Optional[_Hit]:
    for pos in t.find_all("assertion `"):
        found = _search(_ASSERT_RE, t, pos, before=0, after=400)
        if found is None:
            continue
        _offset, m = found
        line = t.line_at(pos)
        facts: Facts = {"assertion": m.group("assertion")}
        site = _ASSERT_SITE_RE.search(line[:1000])
        if site is None or ".cu" not in line:
            continue  # a C++ assert or a Python message, not a CUDA kernel's device-side assert
        facts.update(kernel=site.group("kernel").strip(), source=f"{site.group('file')}:{site.group('line')}")
        index = bool(_INDEX_ASSERT_RE.search(m.group("assertion")))
        facts["index_out_of_range"] = index
        note = ("an index out of range on the GPU (embedding ids >= vocabulary size, class targets >= number "
                "of classes, gather/scatter indices)" if index else "a device-side assertion in a kernel")
        return _Hit("memory", "cuda-error", 0.9, pos, facts,
                    f"CUDA device-side assert in {facts['kernel']}: {_shorten(facts['assertion'], 80)}", note)
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
    return None


_CUDA_ERROR_RE = re.compile(r"(?:CUDA error|Cuda failure|HIP error)[:]? '?(?P<error>[^'\n]{1,200})")
_CUDA_LIB_RE = re.compile(r"(?P<status>(?:CUBLAS|CUDNN|CUSOLVER|CUFFT)_STATUS_[A-Z_]{2,60})")
_CUDA_CLASSES = (
    ("illegal memory access", "illegal-memory-access"), ("device-side assert", "device-side-assert"),
    ("ecc error", "ecc"), ("unspecified launch failure", "launch-failure"),
    ("illegal instruction", "illegal-instruction"), ("misaligned address", "misaligned-address"),
    ("no kernel image", "no-kernel-image"), ("launch timed out", "launch-timeout"),
    ("busy or unavailable", "device-unavailable"), ("invalid device ordinal", "invalid-device"),
    ("driver version is insufficient", "driver-too-old"), ("initialization error", "initialization"),
)
_CUDA_NOTES = {
    "illegal-memory-access": "a kernel read or wrote out of bounds (custom kernels, indices, a corrupted "
                             "tensor); rerun with CUDA_LAUNCH_BLOCKING=1 to find the op",
    "device-side-assert": "a kernel's assertion failed, most often an index out of range (embedding ids, "
                          "class targets); rerun with CUDA_LAUNCH_BLOCKING=1",
    "ecc": "an uncorrectable memory error on the GPU: a hardware fault, drain the node",
    "no-kernel-image": "the installed PyTorch has no kernels for this GPU architecture",
    "driver-too-old": "the NVIDIA driver is older than the CUDA runtime PyTorch was built with",
}
_CUDA_NEEDLES = ("cuda error", "cuda failure '", "hip error", "_status_", "driver version is insufficient",
                 "nvidia driver on your system is too old")


def _rule_cuda_error(t: _Text) -> Optional[_Hit]:
    pos = t.first(*_CUDA_NEEDLES)
    tries = 0
    while pos >= 0 and tries < MAX_HITS:
        tries += 1
        if t.lower.startswith("_status_", pos):
            while pos > 0 and t.text[pos - 1].isalpha():
                pos -= 1
        _offset, text = t.window(pos, 0, 400)
        m = _CUDA_ERROR_RE.match(text) or _CUDA_LIB_RE.match(text)
        if m is None and ("driver version is insufficient" in text[:60].lower()
                          or "driver on your system is too old" in text[:60].lower()):
            facts: Facts = {"error": _shorten(t.line_at(pos), 160), "error_class": "driver-too-old"}
            return _Hit("memory", "cuda-error", 0.8, pos, facts, "CUDA driver too old for this PyTorch",
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
            for stop in (" CUDA kernel errors", ". ", "\n"):
                cut = error.find(stop)
                if cut > 0:
                    error = error[:cut]
            error = error.rstrip(".")
            if "out of memory" in error.lower():
                pos = _next(t, pos)
                continue
            kind_ = next((k for needle, k in _CUDA_CLASSES if needle in error.lower()), "other")
            facts = {"error": error, "error_class": kind_}
            return _Hit("memory", "cuda-error", 0.9, pos, facts, f"CUDA error: {error}",
                        _CUDA_NOTES.get(kind_, "a CUDA call failed; rerun with CUDA_LAUNCH_BLOCKING=1"))
        pos = _next(t, pos)
    return None


def _next(t: _Text, pos: int) -> int:
    best = -1
    for needle in _CUDA_NEEDLES:
        p = t.lower.find(needle, pos + len(needle))
        if p >= 0 and (best < 0 or p < best):
            best = p
    return best


# ----------------------------------------------------------------------------------------------------
# Communication: mismatches, timeouts, lost peers, NCCL errors, rendezvous


_MISMATCH_RE = re.compile(
    r"Detected mismatch between collectives on ranks\. Rank (?P<rank_a>\d+) is running (?:inconsistent )?"
    r"collective: CollectiveFingerPrint\((?P<fp_a>.{0,2000}?)\), but Rank (?P<rank_b>\d+) is running "
    r"(?:inconsistent )?collective: CollectiveFingerPrint\((?P<fp_b>.{0,2000}?)\)\.(?:Collectives differ in "
    r"the following aspects: (?P<diff>[^\n]{0,1000}))?")
_MISMATCH_SHORT_RE = re.compile(r"Detected mismatch between collectives on ranks\. Rank (?P<rank_a>\d+)")
_FP_FIELDS = (
    ("seq_num", re.compile(r"SequenceNumber=(\d+)"), int),
    ("op_type", re.compile(r"OpType=(\w+)"), str),
    ("tensor_shape", re.compile(r"TensorShape=\[([^\]]{0,300})\]"), str),
    ("dtypes", re.compile(r"TensorDtypes=([\w, ]{1,100}?)(?:,\s*TensorDeviceTypes|\)|$)"), str),
    ("device", re.compile(r"device=(\w+)"), str),
)
_ASPECT_RE = re.compile(r"(?P<aspect>Op type|Sequence number|Tensor Tensor shapes|Tensor Tensor dtypes|"
                        r"Tensor Tensor device types|Tensor shapes|Tensor dtypes|Tensor device types): "
                        r"(?P<a>[^\n]{0,200}?)vs (?P<b>[^\n]{0,200}?)(?=\s{2,}|$)")


def _fingerprint(rank: str, text: str) -> Facts:
    out: Facts = {"rank": int(rank)}
    for name, pattern, conv in _FP_FIELDS:
        m = pattern.search(text)
        if m is not None:
            value = m.group(1).strip()
            if name == "tensor_shape":
                out[name] = _ints(value)
            else:
                out[name] = conv(value)
    return out


def _rule_collective_mismatch(t: _Text) -> Optional[_Hit]:
    for pos in t.find_all("detected mismatch between collectives on ranks"):
        found = _search(_MISMATCH_RE, t, pos, before=0, after=5000)
        if found is None:
            short = _search(_MISMATCH_SHORT_RE, t, pos, before=0, after=200)
            facts: Facts = {"rank": int(short[1].group("rank_a"))} if short else {}
            return _Hit("comm", "mismatch", 0.8, pos, facts, "Collective mismatch between ranks")
        m = found[1]
        a = _fingerprint(m.group("rank_a"), m.group("fp_a"))
        b = _fingerprint(m.group("rank_b"), m.group("fp_b"))
        diffs: List[Facts] = [{"aspect": d.group("aspect").replace("Tensor Tensor", "Tensor"),
                               "values": [d.group("a").strip(), d.group("b").strip()]}
                              for d in _ASPECT_RE.finditer(m.group("diff") or "")]
        facts = {"rank": a["rank"], "ranks": sorted({a["rank"], b["rank"]}), "collectives": [a, b],
                 "differences": diffs}
        if diffs:
            what = "; ".join(f"{str(d['aspect']).lower()} {d['values'][0]} vs {d['values'][1]}"
                             for d in diffs)
        else:
            what = f"{a.get('op_type', '?')} {a.get('tensor_shape', '?')} vs {b.get('op_type', '?')} " \
                   f"{b.get('tensor_shape', '?')}"
        seq = a.get("seq_num")
        at = f" at collective #{seq}" if seq is not None else ""
        return _Hit("comm", "mismatch", 0.95, pos, facts,
                    f"Collective mismatch{at}: rank {a['rank']} vs rank {b['rank']}: {what}",
                    "the ranks called different collectives (or with different shapes/dtypes) at the same "
                    "point: rank-dependent control flow or data-dependent tensor sizes")
    return None


_GLOO_SIZE_RE = re.compile(r"op\.preamble\.length <= op\.nbytes\. (?P<received>\d+) vs (?P<expected>\d+)")


def _rule_gloo_size_mismatch(t: _Text) -> Optional[_Hit]:
    pos = t.first("received data size doesn't match expected size", "op.preamble.length <= op.nbytes")
    if pos < 0:
        return None
    facts: Facts = {}
    found = _search(_GLOO_SIZE_RE, t, pos, before=200, after=300)
    if found is not None:
        facts.update(received_bytes=int(found[1].group("received")),
                     expected_bytes=int(found[1].group("expected")))
        headline = (f"gloo collective size mismatch: received {facts['received_bytes']} bytes where "
                    f"{facts['expected_bytes']} were expected")
    else:
        headline = "gloo collective size mismatch between ranks"
    _rank_of(t, pos, facts)
    return _Hit("comm", "mismatch", 0.9, pos, facts, headline,
                "ranks passed tensors of different sizes to the same collective")


_WATCHDOG_RE = re.compile(r"(?:\[Rank (?P<rank>\d+)\] )?Watchdog caught collective operation timeout: "
                          r"(?P<work>.{0,600}?) ran for (?P<ran>\d+) milliseconds before timing out")
_WORK_FIELDS = (
    ("seq_num", re.compile(r"SeqNum=(\d+)")), ("op_type", re.compile(r"OpType=(\w+)")),
    ("numel_in", re.compile(r"NumelIn=(\d+)")), ("numel_out", re.compile(r"NumelOut=(\d+)")),
    ("timeout_ms", re.compile(r"Timeout\(ms\)=(\d+)")),
)
_WORK_BACKEND_RE = re.compile(r"Work(?P<backend>[A-Z]{2,10})\(")
_WORK_SHAPE_RE = re.compile(r"TensorShape=\[(?P<shape>[^\]]{0,200})\]")
_PG_RE = re.compile(r"\[PG ID (?P<pg_id>\d+) PG GUID (?P<guid>[^\s\]()]{1,100})"
                    r"(?:\((?P<desc>[^)\]]{0,100})\))? Rank (?P<rank>\d+)\]")
_WATCHDOG_STATUS_RE = re.compile(r"(?:work sequence id: (?P<seq>\d+) PG status: )?[Ll]ast enqueued (?:NCCL )?"
                                 r"work: (?P<enq>\d+), last completed (?:NCCL )?work: (?P<done>-?\d+)")
_FR_STACK_RE = re.compile(r"Stack trace of the failed collective: ?\n"
                          r"(?P<frames>(?:#\d+ [^\n]{1,300}\n){1,32})")
_FR_FRAME_RE = re.compile(r"#\d+ (?P<func>\S{1,200}) from (?P<where>[^\n]{1,300})")


def _rule_nccl_watchdog(t: _Text) -> Optional[_Hit]:
    for pos in t.find_all("watchdog caught collective operation timeout"):
        found = _search(_WATCHDOG_RE, t, pos, before=30, after=900)
        if found is None:
            continue
        offset, m = found
        facts: Facts = {}
        if m.group("rank"):
            facts["rank"] = int(m.group("rank"))
        work = m.group("work")
        backend = _WORK_BACKEND_RE.search(work)
        facts["backend"] = backend.group("backend") if backend else "NCCL"
        for name, pattern in _WORK_FIELDS:
            if (f := pattern.search(work)) is not None:
                facts[name] = int(f.group(1)) if name != "op_type" else f.group(1)
        if (shape := _WORK_SHAPE_RE.search(work)) is not None:
            facts["tensor_shape"] = _ints(shape.group("shape"))
        facts["ran_for_ms"] = int(m.group("ran"))
        line_start = t.text.rfind("\n", 0, offset + m.start()) + 1
        pg = _PG_RE.search(t.text, line_start, offset + m.start() + 1) or \
            _PG_RE.search(t.text, pos, pos + 400)
        if pg is not None:
            facts.update(pg_id=int(pg.group("pg_id")), pg_name=pg.group("guid"))
            if pg.group("desc"):
                facts["pg_desc"] = pg.group("desc")
        rank = _rank_of(t, pos, facts)
        op = facts.get("op_type", "collective")
        seq = f" SeqNum {facts['seq_num']}" if "seq_num" in facts else ""
        headline = (f"{facts['backend']} watchdog timeout{_on_rank(rank)}: {op}{seq} ran "
                    f"{facts['ran_for_ms']} ms")
        return _Hit("comm", "timeout", 0.95, offset + m.start(), facts, headline,
                    "the collective did not complete within the process group's timeout on this rank: a "
                    "peer never joined it (stuck, slower, or dead) or the interconnect stalled")
    return None


def _rule_watchdog_status(t: _Text) -> Optional[_Hit]:
    """Supporting facts of a watchdog timeout: the PG's last enqueued/completed work, the collective's
    call stack from the flight recorder."""
    facts: Facts = {}
    first = -1
    pos = t.first("last enqueued work:", "last enqueued nccl work:")
    if pos >= 0:
        found = _search(_WATCHDOG_STATUS_RE, t, pos, before=80, after=120)
        if found is not None:
            m = found[1]
            facts.update(last_enqueued=int(m.group("enq")), last_completed=int(m.group("done")))
            first = pos
    pos = t.first("stack trace of the failed collective:")
    if pos >= 0:
        found = _search(_FR_STACK_RE, t, pos, before=0, after=4000)
        if found is not None:
            frames = [f"{f.group('func')} from {f.group('where').strip()}"
                      for f in _FR_FRAME_RE.finditer(found[1].group("frames"))][:12]
            if frames:
                facts["collective_stack"] = frames
                user = [f for f in frames if "/torch/" not in f and "\\torch\\" not in f]
                if user:
                    facts["collective_call_site"] = user[0]
                first = pos if first < 0 else first
    if not facts:
        return None
    return _Hit("comm", "timeout", 0.5, first, facts, "", supporting=True)


_DESYNC_MISSING_RE = re.compile(r"ranks \[(?P<ranks>[\d, ]{1,4000})\] are the lagging ranks that caused this "
                                r"timeout")
_DESYNC_JOINED_RE = re.compile(r"\[(?P<ranks>[\d, ]{1,4000})\] joined but didn't finish collective "
                               r"#(?P<seq>\d+)")
_DESYNC_FINISHED_RE = re.compile(r"\[(?P<ranks>[\d, ]{1,4000})\] finished collective #(?P<seq>\d+), but "
                                 r"didn't join collective #(?P<next>\d+)")
_DESYNC_AT_RE = re.compile(r"\[(?P<rank>\d+)\] Timeout at collective: (?P<op>[\w.]{1,60}), #(?P<seq>\d+)")


def _rule_desync_report(t: _Text) -> Optional[_Hit]:
    pos = t.first("to our best knowledge", "timeout at collective:")
    if pos < 0:
        return None
    facts: Facts = {}
    offset, text = t.window(pos, 300, 12_000)
    lines: List[int] = []
    if (m := _DESYNC_AT_RE.search(text)) is not None:
        facts.update(rank=int(m.group("rank")), op_type=m.group("op"), seq_num=int(m.group("seq")))
    if (m := _DESYNC_MISSING_RE.search(text)) is not None:
        facts.update(lagging_ranks=_ints(m.group("ranks")), never_joined=True)
        lines.append(offset + m.start())
    else:
        # both groups sit at the lowest collective any rank reached: the report names them all as the
        # "lagging/dead/mismatched ranks that caused the desync"
        if (m := _DESYNC_JOINED_RE.search(text)) is not None:
            facts.update(joined_not_finished=_ints(m.group("ranks")), lagging_collective=int(m.group("seq")))
            lines.append(offset + m.start())
        if (m := _DESYNC_FINISHED_RE.search(text)) is not None:
            facts["finished_not_joined_next"] = _ints(m.group("ranks"))
            facts.setdefault("lagging_collective", int(m.group("seq")))
            lines.append(offset + m.start())
        both = facts.get("joined_not_finished", []) + facts.get("finished_not_joined_next", [])
        if both:
            facts["lagging_ranks"] = sorted(set(both))
    if "lagging_ranks" not in facts:
        return None
    lagging = facts["lagging_ranks"]
    rank = _rank_of(t, pos, facts)
    how = "never joined any collective" if facts.get("never_joined") else "lagging"
    return _Hit("comm", "timeout", 0.9, pos, facts,
                f"Collective timeout{_on_rank(rank)}: rank(s) {_ranks_text(lagging)} {how} (desync report)",
                "the desync report names the ranks the others waited for: start with them",
                extra_lines=tuple(lines))


def _ranks_text(ranks: Sequence[int]) -> str:
    shown = ", ".join(str(r) for r in list(ranks)[:16])
    return shown + (f" (+{len(ranks) - 16} more)" if len(ranks) > 16 else "")


_BARRIER_RE = re.compile(r"(?:\[Rank (?P<rank>\d+)\]: )?Ranks? (?P<ranks>\d+(?:, \d+){0,4000}) failed to "
                         r"pass monitoredBarrier in (?P<ms>\d+) ms")


def _rule_monitored_barrier(t: _Text) -> Optional[_Hit]:
    for pos in t.find_all("failed to pass monitoredbarrier"):
        found = _search(_BARRIER_RE, t, pos, before=300, after=100)
        if found is None:
            continue
        m = found[1]
        facts: Facts = {"lagging_ranks": _ints(m.group("ranks")), "timeout_ms": int(m.group("ms"))}
        if m.group("rank"):
            facts["rank"] = int(m.group("rank"))
        rank = _rank_of(t, pos, facts)
        seen = f" (seen by rank {rank})" if rank is not None else ""
        return _Hit("comm", "timeout", 0.9, found[0] + m.start(), facts,
                    f"Rank(s) {_ranks_text(facts['lagging_ranks'])} did not reach the monitored barrier "
                    f"within {facts['timeout_ms']} ms{seen}",
                    "the named ranks are stuck or slower than the others: start with them")
    return None


_DUMP_SIGNAL_RE = re.compile(r"Received a dump signal due to a collective timeout from\s+"
                             r"(?:rank (?P<from>\d+)|this local rank)")


def _rule_dump_signal(t: _Text) -> Optional[_Hit]:
    for pos in t.find_all("received a dump signal due to a collective timeout from"):
        found = _search(_DUMP_SIGNAL_RE, t, pos, before=0, after=200)
        if found is None:
            continue
        m = found[1]
        facts: Facts = {}
        status = _search(_WATCHDOG_STATUS_RE, t, pos, before=0, after=600)
        if status is not None:
            facts.update(last_enqueued=int(status[1].group("enq")),
                         last_completed=int(status[1].group("done")))
        if m.group("from") is None:
            return _Hit("comm", "timeout", 0.5, pos, facts, "", supporting=True)
        facts["timed_out_rank"] = int(m.group("from"))
        rank = _rank_of(t, pos, facts)
        return _Hit("comm", "timeout", 0.7, pos, facts,
                    f"Collective timeout on rank {facts['timed_out_rank']} (reported{_on_rank(rank)})",
                    "another rank's watchdog timed out; this rank dumps its flight-recorder state")
    return None


_NCCL_CODE_RE = re.compile(r"\b(?P<code>nccl(?:System|Remote|Internal|InvalidUsage|InvalidArgument|"
                           r"UnhandledCuda)Error)\b")
_NCCL_SITE_RE = re.compile(r"NCCL error in: (?P<site>[^,\n]{1,300}), (?P<reason>[^\n]{1,300}?), NCCL version "
                           r"(?P<version>[\w.+-]{1,40})")
_NCCL_PLAIN_RE = re.compile(r"NCCL error: (?P<reason>[^\n]{1,300}?), NCCL version (?P<version>[\w.+-]{1,40})")
_NCCL_LAST_RE = re.compile(r"Last error:\s{0,4}\n?(?P<last>[^\n]{1,300})")
_NCCL_REASONS = (
    ("remote process exited or there was a network error", "ncclRemoteError"),
    ("unhandled system error", "ncclSystemError"), ("unhandled cuda error", "ncclUnhandledCudaError"),
    ("internal error", "ncclInternalError"), ("invalid usage", "ncclInvalidUsage"),
    ("invalid argument", "ncclInvalidArgument"),
)
_CONNECT_RE = re.compile(r"socketStartConnect|[Cc]onnect to \S+ failed|[Cc]all to connect returned|"
                         r"Connection refused|bootstrap", re.IGNORECASE)
_NCCL_KINDS = {
    "ncclRemoteError": ("comm", "rank-lost", 0.75, "a peer process exited or the network between the ranks "
                        "failed: look for the peer's own incident first, then the interconnect"),
    "ncclSystemError": ("comm", "failure", 0.8, "a system call or the network failed inside NCCL (socket, "
                        "InfiniBand, shared memory); NCCL_DEBUG=INFO names it"),
    "ncclInternalError": ("comm", "failure", 0.75, "NCCL hit an internal check: version/driver mismatch "
                          "between nodes or an NCCL bug; NCCL_DEBUG=INFO"),
    "ncclInvalidUsage": ("comm", "mismatch", 0.7, "NCCL saw an invalid call: typically ranks disagreeing on "
                         "collectives (sizes, order, communicator) or a framework bug"),
    "ncclInvalidArgument": ("comm", "mismatch", 0.65, "an invalid argument reached NCCL (buffer, count, "
                            "dtype or device differs from what the communicator expects)"),
    "ncclUnhandledCudaError": ("memory", "cuda-error", 0.8, "a CUDA call inside NCCL failed: look for the "
                               "CUDA error on this rank (illegal memory access, ECC, Xid)"),
}
_NCCL_NEEDLES = ("nccl error", "ncclsystemerror", "ncclremoteerror", "ncclinternalerror", "ncclinvalidusage",
                 "ncclinvalidargument", "ncclunhandledcudaerror")


def _rule_nccl_error(t: _Text) -> Optional[_Hit]:
    pos = t.first(*_NCCL_NEEDLES)
    if pos < 0:
        return None
    _offset, text = t.window(pos, 0, 3000)
    facts: Facts = {}
    code = None
    if (m := _NCCL_CODE_RE.search(text)) is not None:
        code = m.group("code")
    site = _NCCL_SITE_RE.search(text) or _NCCL_PLAIN_RE.search(text)
    if site is not None:
        facts.update(reason=site.group("reason").strip(), nccl_version=site.group("version"))
        if "site" in site.groupdict() and site.group("site"):
            facts["site"] = site.group("site").strip()
        if code is None:
            reason = facts["reason"].lower()
            code = next((c for needle, c in _NCCL_REASONS if needle in reason), None)
    if code is None:
        return None
    facts["code"] = code
    extra: Tuple[int, ...] = ()
    if (last := _NCCL_LAST_RE.search(text)) is not None:
        facts["last_error"] = last.group("last").strip()
        extra = (pos + last.start("last"),)
    category, subtype, confidence, note = _NCCL_KINDS[code]
    if code == "ncclSystemError" and _CONNECT_RE.search(facts.get("last_error", "") + " " +
                                                        facts.get("reason", "")):
        category, subtype, confidence = "comm", "init-failure", 0.7
        note = ("NCCL could not connect to a peer (bootstrap or transport): addresses, NCCL_SOCKET_IFNAME, "
                "firewall")
    if "Duplicate GPU detected" in facts.get("last_error", ""):
        category, subtype, confidence = "comm", "init-failure", 0.85
        facts["duplicate_gpu"] = True
        note = ("two ranks were given the same GPU: call torch.cuda.set_device(local_rank) before "
                "init_process_group (or give each rank its own CUDA_VISIBLE_DEVICES)")
    rank = _rank_of(t, pos, facts)
    detail = facts.get("last_error") or facts.get("reason") or ""
    headline = f"{code}{_on_rank(rank)}" + (f": {_shorten(detail, 120)}" if detail else "")
    return _Hit(category, subtype, confidence, pos, facts, headline, note, extra_lines=extra)


_ABORTED_RE = re.compile(r"NCCL communicator was aborted on rank (?P<rank>\d+)\.(?: Original reason for "
                         r"failure was: (?P<reason>[^\n]{0,600}))?")


def _rule_nccl_comm_aborted(t: _Text) -> Optional[_Hit]:
    pos = t.first("nccl communicator was aborted on rank")
    if pos < 0:
        return None
    found = _search(_ABORTED_RE, t, pos, before=0, after=800)
    if found is None:
        return None
    m = found[1]
    facts: Facts = {"rank": int(m.group("rank"))}
    if m.group("reason"):
        facts["reason"] = _shorten(m.group("reason"), 300)
    return _Hit("comm", "failure", 0.6, pos, facts, f"NCCL communicator aborted on rank {facts['rank']}",
                "the process group was aborted after an earlier failure: the original reason is the cause")


_GLOO_TIMEOUT_RE = re.compile(r"Timed out waiting (?P<ms>\d+)ms for (?P<op>send|recv) operation to complete")


def _rule_gloo_timeout(t: _Text) -> Optional[_Hit]:
    for pos in t.find_all("timed out waiting"):
        found = _search(_GLOO_TIMEOUT_RE, t, pos, before=0, after=120)
        if found is None:
            continue
        m = found[1]
        facts: Facts = {"backend": "gloo", "op": m.group("op"), "timeout_ms": int(m.group("ms"))}
        rank = _rank_of(t, pos, facts)
        return _Hit("comm", "timeout", 0.85, pos, facts,
                    f"gloo {facts['op']} timed out after {facts['timeout_ms']} ms{_on_rank(rank)}",
                    "a peer did not take part in the collective in time (a straggler or a stuck rank); a "
                    "dead peer shows as a reset connection instead")
    return None


_PEER_RESET_RE = re.compile(r"(?P<op>Read|Write) error \[(?P<peer>[^\]\s]{1,100})\]:(?P<port>\d+): "
                            r"(?P<err>Connection reset by peer|Broken pipe)")
_PEER_CLOSED_RE = re.compile(r"Connection closed by peer \[(?P<peer>[^\]\s]{1,100})\]:(?P<port>\d+)")
_BARRIER_PEER_RE = re.compile(r"Rank (?P<rank>\d+) successfully reached monitoredBarrier, but received "
                              r"errors while waiting for send/recv from rank (?P<peer>\d+)")
_LOST_NOTE = ("the peer process most likely died (crash, abort, SIGKILL, OOM-killer) or its node went away: "
              "the survivors' errors are consequences -- find the peer's own failure first")


def _rule_gloo_peer_lost(t: _Text) -> Optional[_Hit]:
    pos = t.first("monitoredbarrier, but received errors")
    if pos >= 0 and (found := _search(_BARRIER_PEER_RE, t, pos, before=100, after=200)) is not None:
        m = found[1]
        facts: Facts = {"rank": int(m.group("rank")), "peer_rank": int(m.group("peer"))}
        return _Hit("comm", "rank-lost", 0.75, pos, facts,
                    f"Rank {facts['rank']} lost its connection to rank {facts['peer_rank']} at a monitored "
                    "barrier",
                    _LOST_NOTE)
    for needle, pattern in (("by peer", _PEER_RESET_RE), ("broken pipe", _PEER_RESET_RE),
                            ("connection closed by peer", _PEER_CLOSED_RE)):
        for pos in t.find_all(needle):
            found = _search(pattern, t, pos, before=150, after=150)
            if found is None:
                continue
            m = found[1]
            err = m.groupdict().get("err") or "Connection closed by peer"
            facts = {"backend": "gloo", "peer": f"{m.group('peer')}:{m.group('port')}", "error": err}
            rank = _rank_of(t, pos, facts)
            return _Hit("comm", "rank-lost", 0.8, found[0] + m.start(), facts,
                        f"Peer connection lost{_on_rank(rank)}: gloo {err.lower()} ({facts['peer']})",
                        _LOST_NOTE)
    pos = t.first("failed to recv, got 0 bytes")
    if pos >= 0:
        facts = {"error": "Failed to recv, got 0 bytes", "store": True}
        rank = _rank_of(t, pos, facts)
        return _Hit("comm", "rank-lost", 0.6, pos, facts,
                    f"The TCPStore server went away{_on_rank(rank)}",
                    "the store is hosted by rank 0 (or the launcher's agent): that process or its node died")
    return None


_CLIENTS_RE = re.compile(
    r"Timed out after (?P<s>\d+) seconds waiting for clients\. (?P<joined>\d+)/(?P<world>\d+) clients joined")
_SOCKET_TIMEOUT_RE = re.compile(
    r"The client socket has timed out after (?P<ms>\d+)ms while trying to connect to "
    r"\((?P<host>[^,()\s]{1,255}), (?P<port>\d+)\)")
_SOCKET_FAILED_RE = re.compile(r"The client socket has failed to connect to (?P<target>[^\n]{1,300})")
_HOST_PORT_RE = re.compile(r"\(?\[?(?P<host>[\w.\-:%]{1,255}?)\]?(?:, |:)(?P<port>\d{1,5})\)?")
_ERRNO_RE = re.compile(r"errno: (?P<errno>\d+) - (?P<err>[^)\n]{1,100})")
_TCP_CLIENT_RE = re.compile(
    r"TCP client failed to connect/validate to host (?P<host>[^\s:]{1,255}):(?P<port>\d+)")
_STORE_WAIT_RE = re.compile(r"wait timeout after (?P<ms>\d+)ms, keys: (?P<keys>[^\n]{1,300})")
_LISTEN_RE = re.compile(r"The server socket has failed to (?:listen|bind)[^\n]{0,400}")
_PORT_RE = re.compile(r"port: (?P<port>\d+)|:(?P<port2>\d{2,5})\b")
_RDZV_ERR_RE = re.compile(
    r"(?P<error>Rendezvous(?:Timeout|Connection|Closed|State|GracefulExit)Error)(?::\s?(?P<msg>[^\n]{0,200}))?")
_INIT_NOTE = ("the ranks could not meet at start-up: MASTER_ADDR/MASTER_PORT identical and reachable on "
              "every rank, the port free, no firewall between the nodes, every rank actually started")


def _rule_rendezvous(t: _Text) -> Optional[_Hit]:
    pos = t.first("waiting for clients.")
    if pos >= 0 and (found := _search(_CLIENTS_RE, t, pos, before=80, after=120)) is not None:
        m = found[1]
        joined, world = int(m.group("joined")), int(m.group("world"))
        facts: Facts = {"timeout_s": int(m.group("s")), "joined": joined, "world_size": world,
                        "missing": world - joined}
        return _Hit("comm", "init-failure", 0.9, pos, facts,
                    f"Rendezvous timed out after {facts['timeout_s']} s: {joined}/{world} ranks joined",
                    _INIT_NOTE)
    pos = t.first("the client socket has timed out after")
    if pos >= 0 and (found := _search(_SOCKET_TIMEOUT_RE, t, pos, before=0, after=400)) is not None:
        m = found[1]
        facts = {"host": m.group("host"), "port": int(m.group("port")), "timeout_ms": int(m.group("ms"))}
        return _Hit("comm", "init-failure", 0.9, pos, facts,
                    f"Rendezvous store {facts['host']}:{facts['port']} unreachable (timed out after "
                    f"{facts['timeout_ms']} ms)", _INIT_NOTE)
    pos = t.first("the client socket has failed to connect to")
    if pos >= 0 and (found := _search(_SOCKET_FAILED_RE, t, pos, before=0, after=400)) is not None:
        target = found[1].group("target")
        facts = {"target": _shorten(target, 200)}
        if (hp := _HOST_PORT_RE.search(target.replace("any network address of ", ""))) is not None:
            facts.update(host=hp.group("host"), port=int(hp.group("port")))
        if (en := _ERRNO_RE.search(target)) is not None:
            facts.update(errno=int(en.group("errno")), error=en.group("err").strip())
        where = f"{facts['host']}:{facts['port']}" if "host" in facts else "the rendezvous store"
        return _Hit("comm", "init-failure", 0.85, pos, facts,
                    f"Cannot connect to {where}" + (f" ({facts['error']})" if "error" in facts else ""),
                    _INIT_NOTE)
    pos = t.first("tcp client failed to connect/validate to host")
    if pos >= 0 and (found := _search(_TCP_CLIENT_RE, t, pos, before=0, after=300)) is not None:
        m = found[1]
        facts = {"host": m.group("host"), "port": int(m.group("port"))}
        return _Hit("comm", "init-failure", 0.85, pos, facts,
                    f"Cannot connect to the rendezvous store {facts['host']}:{facts['port']}", _INIT_NOTE)
    pos = t.first("wait timeout after")
    if pos >= 0 and (found := _search(_STORE_WAIT_RE, t, pos, before=0, after=400)) is not None:
        m = found[1]
        facts = {"timeout_ms": int(m.group("ms")), "keys": _shorten(m.group("keys"), 200)}
        return _Hit("comm", "init-failure", 0.7, pos, facts,
                    f"Store wait timed out after {facts['timeout_ms']} ms (keys {facts['keys']})",
                    "a rank never wrote the key the others wait for: it did not start, crashed early, or "
                    "cannot reach the store")
    pos = t.first("the server socket has failed to")
    if pos >= 0 and (found := _search(_LISTEN_RE, t, pos, before=0, after=500)) is not None:
        text = found[1].group(0)
        facts = {"error": _shorten(text, 200)}
        if (p := _PORT_RE.search(text)) is not None:
            facts["port"] = int(p.group("port") or p.group("port2"))
        in_use = "in use" in text.lower() or "eaddrinuse" in text.lower()
        return _Hit("comm", "init-failure", 0.85, pos, facts,
                    ("Rendezvous port already in use" if in_use else "Rendezvous server cannot listen")
                    + (f" (port {facts['port']})" if "port" in facts else ""),
                    "another job (or a previous run's process) holds MASTER_PORT on this node")
    pos = t.first("rendezvous")
    if pos >= 0:
        for at in t.find_all("rendezvous"):
            found = _search(_RDZV_ERR_RE, t, at, before=0, after=300)
            if found is not None:
                m = found[1]
                facts = {"error": m.group("error")}
                if m.group("msg"):
                    facts["message"] = _shorten(m.group("msg"), 200)
                return _Hit("comm", "init-failure", 0.8, at, facts,
                            f"{m.group('error')}" + (f": {facts['message']}" if "message" in facts else ""),
                            _INIT_NOTE)
    pos = t.first("no socket interface found", "socketstartconnect", "call to connect returned")
    if pos >= 0:
        facts = {"error": _shorten(t.line_at(pos), 200)}
        return _Hit("comm", "init-failure", 0.65, pos, facts,
                    "NCCL cannot connect: " + _shorten(t.line_at(pos), 120),
                    "NCCL's bootstrap or transport could not reach a peer: NCCL_SOCKET_IFNAME, addresses, "
                    "firewall")
    for needle in ("connection refused", "timed out"):
        for error in t.find_all(needle):
            near = t.lower[max(0, error - 300): error + 300]
            if any(word in near for word in _RDZV_WORDS):
                facts = {"error": _shorten(t.line_at(error), 200)}
                return _Hit("comm", "init-failure", 0.55, error, facts,
                            "Rendezvous failed: " + _shorten(t.line_at(error), 120), _INIT_NOTE)
    return None


_RDZV_WORDS = ("rendezvous", "tcpstore", "init_process_group", "master_addr", "master_port", "c10d store")
"""Words that make a nearby "connection refused" / "timed out" (within 300 characters) a rendezvous
failure."""


_IB_RE = re.compile(r"Got completion from peer (?P<peer>[^\s,]{1,100}) with (?:error |status=)(?P<code>\d+)")
_IB_STATUS = {5: "work request flushed (the queue pair went to error: usually the peer or link went away)",
              12: "transport retry counter exceeded (packets lost on the network)",
              13: "RNR retry counter exceeded (the peer stopped posting receives)"}


def _rule_ib_error(t: _Text) -> Optional[_Hit]:
    pos = t.first("got completion from peer")
    if pos < 0 or (found := _search(_IB_RE, t, pos, before=0, after=200)) is None:
        return None
    m = found[1]
    code = int(m.group("code"))
    facts: Facts = {"peer": m.group("peer"), "ib_status": code, "meaning": _IB_STATUS.get(code, "IB work "
                                                                                          "completion error")}
    rank = _rank_of(t, pos, facts)
    return _Hit("comm", "failure", 0.7, pos, facts,
                f"InfiniBand completion error {code} from {facts['peer']}{_on_rank(rank)}",
                "check the fabric between the two nodes (ibstat, port counters) and the peer's own state")


# ----------------------------------------------------------------------------------------------------
# Model-side errors and plain Python


_ANOMALY_RE = re.compile(
    r"Function '(?P<fn>\w{1,100})' returned nan values in its (?P<idx>\d+)(?:st|nd|rd|th) output")


def _rule_anomaly_nan(t: _Text) -> Optional[_Hit]:
    pos = t.first("returned nan values in its")
    if pos < 0 or (found := _search(_ANOMALY_RE, t, pos, before=200, after=60)) is None:
        return None
    m = found[1]
    facts: Facts = {"function": m.group("fn"), "output_index": int(m.group("idx"))}
    return _Hit("gradient", "nan-source", 0.9, found[0] + m.start(), facts,
                f"Autograd anomaly: {facts['function']} produced NaN in its output {facts['output_index']}",
                "anomaly mode names the backward op that produced the first NaN; its forward is printed "
                "above as 'Traceback of forward call'")


_DEVICE_PATTERNS: Tuple[Tuple[str, re.Pattern[str]], ...] = (
    ("expected all tensors to be on the same device", re.compile(
        r"Expected all tensors to be on the same device, but (?:found at least two devices, "
        r"(?P<a>[\w:]{1,20}) and (?P<b>[\w:]{1,20})|got (?P<arg>\w{1,60}) is on (?P<c>[\w:]{1,20}), "
        r"different from other tensors on (?P<d>[\w:]{1,20}))")),
    ("is not on the expected device", re.compile(
        r"Tensor on device (?P<a>[\w:]{1,20}) is not on the expected device (?P<b>[\w:]{1,20})")),
    ("and weight type", re.compile(
        r"Input type \((?P<a>[\w.]{1,60})\) and weight type \((?P<b>[\w.]{1,60})\) should be the same")),
    ("indices should be either on cpu or on the same device", re.compile(
        r"indices should be either on cpu or on the same device as the indexed tensor "
        r"\((?P<b>[\w:]{1,20})\)")),
)


def _rule_device_mismatch(t: _Text) -> Optional[_Hit]:
    for needle, pattern in _DEVICE_PATTERNS:
        pos = t.first(needle)
        if pos < 0 or (found := _search(pattern, t, pos, before=200, after=300)) is None:
            continue
        m = found[1]
        devices = [v for k, v in m.groupdict().items() if v and k != "arg"]
        facts: Facts = {"devices": devices}
        if m.groupdict().get("arg"):
            facts["argument"] = m.group("arg")
        meta = any(d == "meta" for d in devices)
        facts["meta"] = meta
        note = ("parameters on the meta device were never materialised (to_empty() / "
                "load_state_dict(assign=True) missing after building the model on 'meta')" if meta else
                "inputs and parameters live on different devices: move the batch (or the module) with "
                ".to(device)")
        return _Hit("process", "exception", 0.85, found[0] + m.start(), facts,
                    f"Device mismatch: {' vs '.join(devices)}", note)
    return None


_INDEX_PATTERNS: Tuple[Tuple[str, re.Pattern[str], str], ...] = (
    ("index out of range in self", re.compile(r"index out of range in self"),
     "an index >= the table size (embedding ids >= num_embeddings: tokenizer and model vocabulary disagree)"),
    ("is out of bounds for", re.compile(r"index (?P<index>-?\d+) is out of bounds for (?:dimension|axis) "
                                        r"(?P<dim>\d+) with size (?P<size>\d+)"),
     "an index outside the tensor's size in that dimension"),
    ("is out of bounds", re.compile(r"Target (?P<target>-?\d+) is out of bounds"),
     "a class target >= the number of classes (or negative, other than ignore_index)"),
)


def _rule_index(t: _Text) -> Optional[_Hit]:
    for needle, pattern, note in _INDEX_PATTERNS:
        for pos in t.find_all(needle):
            found = _search(pattern, t, pos, before=80, after=120)
            if found is None:
                continue
            m = found[1]
            facts: Facts = {k: int(v) for k, v in m.groupdict().items() if v is not None}
            return _Hit("process", "exception", 0.85, found[0] + m.start(), facts,
                        f"Index out of range: {_shorten(m.group(0), 120)}", note)
    return None


_SHAPE_PATTERNS: Tuple[Tuple[str, re.Pattern[str]], ...] = (
    ("shapes cannot be multiplied", re.compile(
        r"mat1 and mat2 shapes cannot be multiplied \((?P<a>\d+x\d+) and (?P<b>\d+x\d+)\)")),
    ("must match the size of tensor b", re.compile(
        r"The size of tensor a \((?P<a>\d+)\) must match the size of tensor b \((?P<b>\d+)\) at "
        r"non-singleton dimension (?P<dim>\d+)")),
    ("size mismatch for", re.compile(
        r"size mismatch for (?P<param>[\w.]{1,200}): copying a param with shape "
        r"(?P<a>torch\.Size\(\[[\d, ]{0,100}\]\)) from checkpoint, the shape in current model is "
        r"(?P<b>torch\.Size\(\[[\d, ]{0,100}\]\))")),
    ("is invalid for input of size", re.compile(
        r"shape '\[(?P<a>[-\d, ]{0,100})\]' is invalid for input of size (?P<b>\d+)")),
    ("to match target batch_size", re.compile(
        r"Expected input batch_size \((?P<a>\d+)\) to match target batch_size \((?P<b>\d+)\)")),
    ("channels instead", re.compile(
        r"expected input\[(?P<input>[\d, ]{0,100})\] to have (?P<a>\d+) channels, but got (?P<b>\d+) "
        r"channels instead")),
    ("inconsistent tensor size", re.compile(
        r"inconsistent tensor size, expected tensor \[(?P<a>[\d, ]{0,100})\] and src "
        r"\[(?P<b>[\d, ]{0,100})\]")),
    ("sizes of tensors must match", re.compile(
        r"Sizes of tensors must match except in dimension (?P<dim>\d+)\. Expected size (?P<a>\d+) but got "
        r"size (?P<b>\d+)")),
    ("size mismatch, m1:", re.compile(
        r"size mismatch, m1: \[(?P<a>[\d x]{1,40})\], m2: \[(?P<b>[\d x]{1,40})\]")),
)


def _rule_shape(t: _Text) -> Optional[_Hit]:
    best: Optional[_Hit] = None
    for needle, pattern in _SHAPE_PATTERNS:
        pos = t.first(needle)
        if pos < 0 or (best is not None and pos >= best.pos):
            continue
        found = _search(pattern, t, pos, before=200, after=400)
        if found is None:
            continue
        m = found[1]
        facts: Facts = {"pattern": needle, "shapes": [m.group("a"), m.group("b")]}
        for extra in ("dim", "param", "input"):
            if m.groupdict().get(extra):
                facts[extra] = int(m.group(extra)) if extra == "dim" else m.group(extra)
        best = _Hit("process", "exception", 0.85, found[0] + m.start(), facts,
                    f"Shape mismatch: {_shorten(m.group(0), 140)}",
                    "tensor shapes disagree with a layer or each other: compare the layer sizes in the model "
                    "config with the input features (and the checkpoint, when loading one)")
    return best


_WORKER_ERROR_RE = re.compile(r"Caught (?P<type>[\w.]{1,100}) in DataLoader worker process (?P<worker>\d+)")
_WORKER_DIED_RE = re.compile(r"DataLoader worker \(pids?\(?s?\)? (?P<pids>[\d, ]{1,200})\) "
                             r"(?:exited unexpectedly|is killed by signal: (?P<sig>[\w ]{1,40}))")


def _rule_dataloader(t: _Text) -> Optional[_Hit]:
    pos = t.first("in dataloader worker process")
    if pos >= 0 and (found := _search(_WORKER_ERROR_RE, t, pos, before=200, after=40)) is not None:
        m = found[1]
        facts: Facts = {"worker": int(m.group("worker")), "worker_exception": m.group("type")}
        head = f"\n{_bare(m.group('type'))}: "
        cut = t.text.find(head, pos, pos + 200_000)
        while cut >= 0 and (nxt := t.text.find(head, cut + 1, pos + 200_000)) >= 0:
            cut = nxt  # the innermost (last printed) exception line of the worker's traceback
        if cut >= 0:
            facts["worker_message"] = _shorten(t.line_at(cut + len(head)).split(": ", 1)[-1], 200)
        return _Hit("process", "exception", 0.8, found[0] + m.start(), facts,
                    f"{m.group('type')} in DataLoader worker {facts['worker']}"
                    + (f": {facts['worker_message']}" if "worker_message" in facts else ""),
                    "the dataset or collate_fn raised in a worker: the original traceback is in the message")
    pos = t.first("dataloader worker (pid")
    if pos >= 0 and (found := _search(_WORKER_DIED_RE, t, pos, before=0, after=300)) is not None:
        m = found[1]
        facts = {"pids": _ints(m.group("pids"))}
        if m.group("sig"):
            facts["signal"] = m.group("sig").strip()
        note = ("a DataLoader worker died: 'Killed' is the host OOM-killer (too many workers x dataset "
                "copies), 'Bus error' a too small /dev/shm")
        return _Hit("process", "exception", 0.75, pos, facts,
                    "DataLoader worker died" + (f" ({facts['signal']})" if "signal" in facts else ""), note)
    return None


_WORKER_FAILED_RE = re.compile(
    r"failed \(exitcode: (?P<code>-?\d+)\) local_rank: (?P<lr>\d+) \(pid: (?P<pid>\d+)\)")


def _exit_kind(code: int) -> Tuple[str, str, str]:
    verdict = classify_exit(code)
    if verdict is None:
        return "process", "exit", "exit code 0"
    return verdict.category, verdict.subtype, verdict.describe()


def _rule_worker_failed(t: _Text) -> Optional[_Hit]:
    pos = t.first("failed (exitcode:")
    if pos < 0 or (found := _search(_WORKER_FAILED_RE, t, pos, before=0, after=200)) is None:
        return None
    m = found[1]
    code = int(m.group("code"))
    category, subtype, said = _exit_kind(code)
    facts: Facts = {"exitcode": code, "local_rank": int(m.group("lr")), "pid": int(m.group("pid"))}
    return _Hit(category, subtype, 0.6, pos, facts,
                f"torchrun: local rank {facts['local_rank']} failed ({said})", "")


_FATAL_RE = re.compile(r"Fatal Python error: (?P<msg>[^\n]{1,200})")
_FATAL_SIGNALS = {"aborted": 6, "segmentation fault": 11, "bus error": 7, "floating point exception": 8,
                  "illegal instruction": 4}


def _rule_fatal(t: _Text) -> Optional[_Hit]:
    pos = t.first("fatal python error:")
    if pos < 0 or (found := _search(_FATAL_RE, t, pos, before=0, after=250)) is None:
        return None
    msg = found[1].group("msg").strip()
    sig = _FATAL_SIGNALS.get(msg.lower())
    facts: Facts = {"error": msg}
    if sig is None:
        return _Hit("process", "exception", 0.5, pos, facts, f"Fatal Python error: {msg}")
    facts.update(signal=sig, signal_name=SIGNAL_NAMES.get(sig, str(sig)))
    category, subtype, _said = _exit_kind(128 + sig)
    return _Hit(category, subtype, 0.5, pos, facts, f"Fatal Python error: {msg} ({facts['signal_name']})",
                "a native crash; faulthandler printed the Python stack at the moment of the signal")


# ----------------------------------------------------------------------------------------------------
# torchrun's ChildFailedError summary


_FAILURE_HEADER_RE = re.compile(r"^\[(?P<idx>\d+)\]:\s*$")
_FAILURE_FIELD_RE = re.compile(
    r"^\s{1,8}(?P<key>time|host|rank|exitcode|error_file|traceback)\s{0,8}: ?(?P<value>.*)$")
_RANK_FIELD_RE = re.compile(r"(?P<rank>-?\d+)(?: \(local_rank: (?P<local>-?\d+)\))?")
_EXIT_FIELD_RE = re.compile(r"(?P<code>-?\d+)(?: \(pid: (?P<pid>\d+)\))?\s*(?:\((?P<sig>SIG\w+)\))?")
_SIGNAL_MSG_RE = re.compile(r"Signal (?P<sig>\d+) \((?P<name>SIG\w+)\) received by PID (?P<pid>\d+)")
_SEPARATOR_RE = re.compile(r"^\s*(?:={8,}|-{8,})\s*$")
_MAX_FAILURES = 64
_MAX_TRACEBACK_LINES = 400


def _parse_failures(lines: Sequence[str]) -> List[Tuple[bool, Dict[str, Any], List[str]]]:
    """``(is_root, fields, traceback lines)`` of each failure block after ``Failures:``."""
    out: List[Tuple[bool, Dict[str, Any], List[str]]] = []
    root = False
    current: Optional[Tuple[bool, Dict[str, Any], List[str]]] = None
    in_traceback = False
    for line in lines:
        if line.startswith("Root Cause (first observed failure):"):
            root, current, in_traceback = True, None, False
            continue
        if _FAILURE_HEADER_RE.match(line):
            if len(out) >= _MAX_FAILURES:
                break
            current = (root, {}, [])
            out.append(current)
            in_traceback = False
            continue
        if _SEPARATOR_RE.match(line):
            if root and current is not None:
                break  # the closing border
            current, in_traceback = None, False
            continue
        if current is None:
            continue
        field_match = _FAILURE_FIELD_RE.match(line)
        if field_match and not (in_traceback and _indent(line) > 2):
            key, value = field_match.group("key"), field_match.group("value").strip()
            current[1][key] = value
            in_traceback = key == "traceback"
            if in_traceback and value:
                current[2].append(value)
            continue
        if in_traceback and len(current[2]) < _MAX_TRACEBACK_LINES:
            current[2].append(line[2:] if line.startswith("  ") else line)
    return out


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _failure_facts(fields: Mapping[str, Any], traceback_lines: Sequence[str]) -> Tuple[Facts, str, str]:
    """Facts of one failure, its traceback text, and a short description of its error."""
    facts: Facts = {}
    if (m := _RANK_FIELD_RE.match(fields.get("rank", ""))) is not None:
        facts["rank"] = int(m.group("rank"))
        if m.group("local") is not None:
            facts["local_rank"] = int(m.group("local"))
    if (m := _EXIT_FIELD_RE.match(fields.get("exitcode", ""))) is not None:
        facts["exitcode"] = int(m.group("code"))
        if m.group("pid"):
            facts["pid"] = int(m.group("pid"))
        if m.group("sig"):
            facts["signal_name"] = m.group("sig")
    for key in ("time", "host"):
        if fields.get(key):
            facts[key] = fields[key]
    error_file = fields.get("error_file", "")
    facts["error_file"] = None if error_file in ("", "<N/A>") else error_file
    text = "\n".join(traceback_lines).strip()
    error = ""
    if (sig := _SIGNAL_MSG_RE.search(text[:400])) is not None:
        facts.update(signal=int(sig.group("sig")), signal_name=sig.group("name"))
        error = sig.group(0)
    elif text.startswith("Traceback"):
        parsed = [e for e in parse_traceback_text(text) if e.relation == ""]
        if parsed:
            last = parsed[-1]
            error = f"{last.exc_type}: {_first_line(last.message)}" if last.message else last.exc_type
    elif text and not text.startswith("To enable traceback"):
        error = _first_line(text)
    if error:
        facts["error"] = _shorten(error, 300)
    if "signal" not in facts and isinstance(facts.get("exitcode"), int) and facts["exitcode"] < 0:
        facts["signal"] = -facts["exitcode"]
        facts.setdefault("signal_name", SIGNAL_NAMES.get(facts["signal"], f"signal {facts['signal']}"))
    return facts, text, error


def _first_line(text: str) -> str:
    for line in text.splitlines():
        if line.strip():
            return line.strip()
    return ""


def _rule_torchrun(t: _Text, depth: int) -> Optional[_Hit]:
    pos = t.first("root cause (first observed failure):")
    if pos < 0:
        return None
    start = t.lower.rfind("failures:", max(0, pos - 400_000), pos)
    start = t.text.rfind("\n", 0, start) + 1 if start >= 0 else t.text.rfind("\n", 0, pos) + 1
    title_start = t.text.rfind("\n", 0, max(0, start - 1))
    title_block = t.text[max(0, title_start - 400): start].splitlines()
    job = next((ln.strip()[: -len(" FAILED")] for ln in reversed(title_block)
                if ln.strip().endswith(" FAILED")), "")
    end = t.text.find("\n=====", pos)
    end = len(t.text) if end < 0 else end + 200
    blocks = _parse_failures(t.text[start:end].split("\n"))
    failures: List[Facts] = []
    root_facts: Optional[Facts] = None
    root_text = ""
    for is_root, fields, tb_lines in blocks:
        one, text, _error = _failure_facts(fields, tb_lines)
        failures.append(one)
        if is_root and root_facts is None:
            root_facts, root_text = one, text
    if root_facts is None:
        return None
    facts: Facts = {"root_cause_rank": root_facts.get("rank"), "failures": failures,
                    "failed_ranks": sorted({f["rank"] for f in failures if isinstance(f.get("rank"), int)})}
    if job:
        facts["job"] = job
    for key in ("exitcode", "signal", "signal_name", "time", "host", "error", "error_file", "local_rank"):
        if root_facts.get(key) is not None:
            facts[f"root_cause_{key}" if key != "time" else "first_failure_time"] = root_facts[key]
    # the root cause's own kind: its exception if it printed one, else its exit code / signal
    root_kind: Optional[Classification] = None
    if root_text.startswith("Traceback") and depth < 2:
        parsed = [e for e in parse_traceback_text(root_text) if e.relation == ""]
        if parsed:
            root_kind = _classify_exception(parsed[-1].exc_type, parsed[-1].message, depth + 1)
    if root_kind is not None:
        category, subtype, confidence = root_kind.category, root_kind.subtype, min(0.9, root_kind.confidence)
        facts["root_cause_rule"] = root_kind.rule
        if root_kind.facts:
            facts["root_cause_facts"] = dict(root_kind.facts)
    elif isinstance(root_facts.get("exitcode"), int):
        category, subtype, _said = _exit_kind(root_facts["exitcode"])
        confidence = 0.8
    else:
        category, subtype, confidence = "process", "exit", 0.5
    how = root_facts.get("error") or (f"exit code {root_facts['exitcode']}" if "exitcode" in root_facts
                                      else "")
    if "signal_name" in root_facts and "exitcode" in root_facts and "received" not in how:
        how = f"exit code {root_facts['exitcode']}, {root_facts['signal_name']}"
    count = len(facts["failed_ranks"]) or len(failures)
    headline = (f"torchrun: rank {facts['root_cause_rank']} failed first ({_shorten(how, 120)}); "
                f"{count} rank{'s' if count != 1 else ''} failed")
    note = ("torchrun's root cause is the first observed failure; the other ranks' failures usually follow "
            "from it")
    evidence = [t.lower.find(key, pos, end) for key in ("rank      :", "exitcode  :", "traceback :")]
    error = root_facts.get("error")
    if isinstance(error, str) and error:
        evidence.append(t.text.find(error[:80], pos, end))
    return _Hit(category, subtype, confidence, pos, facts, headline, note,
                extra_lines=tuple(p for p in evidence if p >= 0))


# ----------------------------------------------------------------------------------------------------
# The engine


RULES: Tuple[Tuple[str, _Rule], ...] = (
    ("cuda.oom", _rule_cuda_oom),
    ("cuda.oom-plain", _rule_cuda_oom_plain),
    ("cuda.device-assert", _rule_device_assert),
    ("nvidia.xid", _rule_xid),
    ("cuda.error", _rule_cuda_error),
    ("c10d.collective-mismatch", _rule_collective_mismatch),
    ("gloo.size-mismatch", _rule_gloo_size_mismatch),
    ("nccl.watchdog-timeout", _rule_nccl_watchdog),
    ("c10d.desync-report", _rule_desync_report),
    ("gloo.monitored-barrier", _rule_monitored_barrier),
    ("nccl.dump-signal", _rule_dump_signal),
    ("nccl.watchdog-status", _rule_watchdog_status),
    ("nccl.error", _rule_nccl_error),
    ("nccl.comm-aborted", _rule_nccl_comm_aborted),
    ("gloo.timeout", _rule_gloo_timeout),
    ("gloo.peer-lost", _rule_gloo_peer_lost),
    ("c10d.rendezvous", _rule_rendezvous),
    ("nccl.ib-error", _rule_ib_error),
    ("autograd.anomaly-nan", _rule_anomaly_nan),
    ("model.device-mismatch", _rule_device_mismatch),
    ("model.index-out-of-range", _rule_index),
    ("model.shape-mismatch", _rule_shape),
    ("dataloader.worker", _rule_dataloader),
    ("torchrun.worker-failed", _rule_worker_failed),
    ("python.fatal-error", _rule_fatal),
)
"""The text rules, most causal first (after ``torchrun.child-failed``, which is tried before all of them)."""


ENRICHING_RULES = frozenset({"nccl.watchdog-status", "nccl.dump-signal", "c10d.desync-report",
                             "gloo.monitored-barrier"})
"""Rules whose facts (lagging ranks, PG status, the collective's call stack) are added to a primary
classification of the same category; facts of other rules that matched are never mixed in."""


def _merge(primary: _Hit, hits: Sequence[_Hit], t: _Text) -> Tuple[Facts, Tuple[str, ...], Tuple[str, ...]]:
    facts = dict(primary.facts)
    positions = [primary.pos, *primary.extra_lines]
    also = []
    for hit in hits:
        if hit is primary:
            continue
        if hit.rule in ENRICHING_RULES and hit.category == primary.category:
            for key, value in hit.facts.items():
                facts.setdefault(key, value)
            positions.extend([hit.pos, *hit.extra_lines])
        if not hit.supporting:
            also.append(hit.rule)
    lines: List[str] = []
    for pos in positions:
        if pos < 0:
            continue
        line = t.line_at(pos)
        if line and line not in lines:
            lines.append(line)
        if len(lines) >= MAX_LINES:
            break
    return facts, tuple(lines), tuple(also)


def _classify(text: str, exc_type: str, depth: int) -> Optional[Classification]:
    if not text and not exc_type:
        return None
    t = _Text(text)
    hits: List[_Hit] = []
    torchrun = _rule_torchrun(t, depth)
    if torchrun is not None:
        torchrun.rule = "torchrun.child-failed"
        hits.append(torchrun)
    for name, rule in RULES:
        hit = rule(t)
        if hit is not None:
            hit.rule = name
            hits.append(hit)
    primary = next((h for h in hits if not h.supporting), None)
    if primary is not None:
        facts, lines, also = _merge(primary, hits, t)
        if "rank" not in facts and primary.rule != "torchrun.child-failed":
            _rank_of(t, primary.pos, facts)
        headline = primary.headline
        if primary.category == "comm" and primary.subtype == "timeout" and "lagging_ranks" in facts \
                and "lagging" not in headline and "did not reach" not in headline:
            headline += f"; lagging rank(s) {_ranks_text(facts['lagging_ranks'])}"
        return Classification(primary.category, primary.subtype, primary.rule, primary.confidence, headline,
                              facts, lines, primary.note, also)
    if exc_type:
        prefix = f"{exc_type}: "
        by_type = _by_type(exc_type, text[len(prefix):] if text.startswith(prefix) else text)
        if by_type is not None:
            return by_type
    return _python_traceback(text, depth)


def _bare(exc_type: str) -> str:
    return exc_type.rsplit(".", 1)[-1]


_TYPE_RULES = tuple((rule, re.compile(rule.pattern, re.IGNORECASE) if rule.pattern else None)
                    for rule in EXCEPTION_RULES)


def _by_type(exc_type: str, message: str) -> Optional[Classification]:
    """The first :data:`~trainguard_engine.catalogue.EXCEPTION_RULES` row naming ``exc_type`` (qualified or
    bare) or whose pattern matches the message's first 4096 characters."""
    bare = _bare(exc_type)
    for rule, pattern in _TYPE_RULES:
        named = exc_type in rule.types or bare in rule.types
        if named or (pattern is not None and pattern.search(message[:4096])):
            line = _first_line(message)
            headline = f"{exc_type}: {_shorten(line, 140)}" if line else exc_type
            if (rule.category, rule.subtype) == ("memory", "oom"):
                headline = f"CUDA out of memory ({exc_type})" if not line else headline
            return Classification(rule.category, rule.subtype, f"type:{bare}", rule.confidence, headline,
                                  {"exc_type": exc_type}, (f"{exc_type}: {line}" if line else exc_type,))
    return None


def _python_traceback(text: str, depth: int) -> Optional[Classification]:
    tail = text[-TRACEBACK_TAIL_CHARS:]
    if "Traceback (most recent call last)" not in tail and "terminate called after throwing" not in tail:
        return None
    start = tail.find("\n") + 1 if len(text) > TRACEBACK_TAIL_CHARS else 0
    parsed = [e for e in parse_traceback_text(tail[start:]) if e.relation == ""]
    if not parsed or depth >= 2:
        return None
    last = parsed[-1]
    if not last.exc_type or (not last.message.strip() and "Traceback (most recent call last)" not in tail):
        return None  # a bare "terminate called after throwing an instance of 'X'" says nothing more
    return _classify_exception(last.exc_type, last.message, depth + 1)


def _classify_exception(exc_type: str, message: str, depth: int) -> Classification:
    # read as Python prints it ("Type: message"), so rules may see the type ("Fatal Python error: ...")
    text = f"{exc_type}: {message}" if exc_type and not exc_type.startswith("<") else message
    found = _classify(text, exc_type, depth) if depth < 3 else None
    if found is not None:
        return found
    line = _first_line(message)
    headline = f"{exc_type}: {_shorten(line, 140)}" if line else exc_type
    return Classification("process", "exception", "python.exception", 0.8, headline, {"exc_type": exc_type},
                          (f"{exc_type}: {_shorten(line, MAX_LINE_CHARS)}" if line else exc_type,),
                          "a Python exception: read the traceback from its innermost in-app frame")


def classify_text(text: str, *, exc_type: str = "") -> Optional[Classification]:
    """The classification of ``text`` (see the module docstring), or None when nothing is recognised.

    ``exc_type`` (the exception's type, qualified or bare) lets the exception-type rules decide when no
    text rule matches. A printed Python traceback with no specific rule gives ``process/exception``
    (or its type's rule). Never raises on any string."""
    return _classify(text or "", exc_type or "", 0)


def classify_exception(exc_type: str, message: str) -> Classification:
    """The classification of an exception: :func:`classify_text` of its message with its type, else
    ``process/exception`` (rule ``python.exception``). Always returns one."""
    return _classify_exception(exc_type or "<unknown exception>", message or "", 0)


def classify_chain(exc_type: str, message: str, chain: Sequence[Mapping[str, Any]] = ()) -> Classification:
    """:func:`classify_exception` of the exception, unless it is a generic ``process/exception`` and one
    of its chained causes/contexts (``[{"type", "message"}]``) classifies as comm/* or memory/*: then that
    one (with ``facts["via_chain"]`` naming its type), so a wrapper exception does not hide an OOM."""
    top = classify_exception(exc_type, message)
    if top.rule != "python.exception":
        return top
    for link in list(chain)[:16]:
        if not isinstance(link, Mapping):
            continue
        link_type, link_message = str(link.get("type") or ""), str(link.get("message") or "")
        found = classify_text(link_message, exc_type=link_type)
        if found is not None and found.category in ("comm", "memory"):
            facts = dict(found.facts)
            facts["via_chain"] = link_type
            return Classification(found.category, found.subtype, found.rule, found.confidence, found.headline,
                                  facts, found.lines, found.note, found.also)
    return top
