"""Classifier rules for NCCL text: the watchdog's collective timeout, its status line and flight-recorder
stack, dump signals, ``NCCL error`` codes, aborted communicators, InfiniBand completion errors."""

from __future__ import annotations

import re
from typing import Optional, Tuple

from .c10d import _WENT_ON_RE
from .text import (
    Facts,
    _Hit,
    _ints,
    _on_rank,
    _rank_of,
    _search,
    _shorten,
    _Text,
)

_WATCHDOG_RE = re.compile(r"(?:\[Rank (?P<rank>\d+)\] )?(?:Watchdog c|C)aught collective operation timeout: "
                          r"(?P<work>.{0,600}?) ran for (?P<ran>\d+) milliseconds before timing out")
_WORK_FIELDS = (
    ("seq_num", re.compile(r"SeqNum=(\d+)")), ("op_type", re.compile(r"OpType=(\w+)")),
    ("numel_in", re.compile(r"NumelIn=(\d+)")), ("numel_out", re.compile(r"NumelOut=(\d+)")),
    ("timeout_ms", re.compile(r"Timeout\(ms\)=(\d+)")),
)
_TIMEOUT_NOTE = ("the collective did not complete within the process group's timeout on this rank: a peer "
                 "never joined it (stuck, slower, or dead) or the interconnect stalled")


def _work_facts(work: str, facts: Facts) -> None:
    """Put the fields a work descriptor (``WorkNCCL(SeqNum=.., OpType=.., ...)``) holds into ``facts``."""
    for name, pattern in _WORK_FIELDS:
        if (f := pattern.search(work)) is not None:
            facts[name] = int(f.group(1)) if name != "op_type" else f.group(1)


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
    for pos in t.find_all("caught collective operation timeout"):
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
        _work_facts(work, facts)
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
                    _TIMEOUT_NOTE)
    pos = t.first("caught collective operation timeout")
    if pos >= 0:  # a line a terminal or a paste wrapped: what is left of it still says what happened
        cut: Facts = {}
        rank = _rank_of(t, pos, cut)
        _offset, rest = t.window(pos, 0, 200)
        if (seq_match := _WORK_FIELDS[0][1].search(rest)) is not None:
            cut["seq_num"] = int(seq_match.group(1))
        return _Hit("comm", "timeout", 0.8, pos, cut,
                    f"NCCL watchdog timeout{_on_rank(rank)} (its line is cut)",
                    _TIMEOUT_NOTE)
    pos = t.first(") ran for ")
    if pos >= 0 and (bare := _search(_WORK_RAN_RE, t, pos, before=600, after=40)) is not None:
        # the watchdog's message quoted without its start ("WorkNCCL(SeqNum=5125, ...) ran for 1807734
        # millisecond", an issue title): the work descriptor and how long it ran still say it timed out
        offset, m = bare
        quoted: Facts = {"backend": m.group("backend"), "ran_for_ms": int(m.group("ran"))}
        _work_facts(m.group("work"), quoted)
        rank = _rank_of(t, pos, quoted)
        op = quoted.get("op_type", "collective")
        return _Hit("comm", "timeout", 0.85, offset + m.start(), quoted,
                    f"{quoted['backend']} collective timeout{_on_rank(rank)}: {op} ran "
                    f"{quoted['ran_for_ms']} ms (the watchdog's line without its start)",
                    _TIMEOUT_NOTE)
    pos = t.first(*_TIMEOUT_SAID)
    if pos >= 0:  # ProcessGroupNCCL's other timeout lines, when the watchdog's own line is not in the text
        said: Facts = {}
        rank = _rank_of(t, pos, said)
        return _Hit("comm", "timeout", 0.8, pos, said,
                    f"NCCL collective timeout{_on_rank(rank)} (the watchdog's own line is not in the text)",
                    _TIMEOUT_NOTE)
    return None


_WORK_RAN_RE = re.compile(r"Work(?P<backend>[A-Z]{2,10})\("
                          r"(?P<work>(?:[^()\n]|\(ms\)){0,500}?Timeout\(ms\)=\d+(?:[^()\n]|\(ms\)){0,200}?)"
                          r"\) ran for (?P<ran>\d+) millisecond")
"""A work descriptor with its timeout and how long it ran: the watchdog's message without its start."""
_TIMEOUT_SAID = ("timeout at nccl work:", "timed out in blocking wait")
"""ProcessGroupNCCL's lines that say a collective timed out besides the watchdog's own (torch >= 2.4's
``[PG 1 Rank 0] Timeout at NCCL work: 7753, last enqueued NCCL work: 7755, ...``; with
TORCH_NCCL_BLOCKING_WAIT, ``Work WorkNCCL(SeqNum=2521, OpType=ALLREDUCE, ...) timed out in blocking
wait.``)."""


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


_TEARDOWN_NEEDLES = ("some nccl operations have failed or timed out", "we are taking the entire process down",
                     "failure detected by watchdog at work sequence id",
                     "(either an error or timeout) detected by watchdog")


def _rule_watchdog_teardown(t: _Text) -> Optional[_Hit]:
    """ProcessGroupNCCL's watchdog tearing the process down (``Some NCCL operations have failed or timed
    out ...``, ``To avoid data inconsistency, we are taking the entire process down.``, ``failure detected
    by watchdog at work sequence id: N``) in a text whose timeout or error line itself is missing: most
    often a collective timeout, said with less certainty than the timeout line."""
    pos = t.first(*_TEARDOWN_NEEDLES)
    if pos < 0:
        return _timeout_frame(t)
    facts: Facts = {}
    found = _search(_WATCHDOG_STATUS_RE, t, pos, before=0, after=400)
    if found is not None:
        facts.update(last_enqueued=int(found[1].group("enq")), last_completed=int(found[1].group("done")))
    return _Hit("comm", "timeout", 0.6, pos, facts,
                "NCCL watchdog tore the process down (a collective failed or timed out)",
                "the watchdog aborts every rank after a collective timeout or an NCCL error; the first rank "
                "to report, and its timeout or error line, say which")


_CHECK_TIMEOUT = ("worknccl::checktimeout(", "exception raised from checktimeout at")
"""The watchdog's timeout check in a c10 C++ stack (``frame #1:
c10d::ProcessGroupNCCL::WorkNCCL::checkTimeout(std::optional<...>) + 0x282 (... libtorch_cuda.so)``, its
head ``Exception raised from checkTimeout at .../ProcessGroupNCCL.cpp:N``): it throws only when a collective
ran past its timeout, so that stack is the timeout's when the message line was cut."""


def _timeout_frame(t: _Text) -> Optional[_Hit]:
    """A c10 stack that shows the NCCL watchdog's timeout check raising (:data:`_CHECK_TIMEOUT`: a ``frame
    #N:`` line, or the stack's head naming ProcessGroupNCCL) -- the stack of ``Watchdog caught collective
    operation timeout`` without its message."""
    pos = t.first(*_CHECK_TIMEOUT)
    if pos < 0:
        return None
    line = t.line_at(pos).lower()
    if "frame #" not in line and "processgroupnccl" not in line:
        return None
    return _Hit("comm", "timeout", 0.6, pos, {"from_frames": True},
                "NCCL watchdog: a collective timed out (WorkNCCL::checkTimeout raised; its message is cut)",
                "only the watchdog's C++ stack is shown: the collective ran past its timeout on this rank; "
                "the full watchdog line names the collective (OpType, SeqNum) and the other ranks' lines "
                "which one lagged")


_STUCK_RE = re.compile(r"watchdog got stuck for (?P<seconds>\d{1,9}) seconds")
_HANG_NEEDLE = "due to processgroupnccl watchdog hang"
"""The monitor's own verdict as it kills the process (torch 2.4+, a fatal ``[F...]`` line): ``Terminating the
process after attempting to dump debug info, due to ProcessGroupNCCL watchdog hang.`` -- the same hang, its
stuck time not said."""


def _rule_heartbeat_stuck(t: _Text) -> Optional[_Hit]:
    """ProcessGroupNCCL's heartbeat monitor (torch 2.3+): ``ProcessGroupNCCL's watchdog got stuck for N
    seconds without making progress in monitoring enqueued collectives`` -- the watchdog itself hung (an
    NCCL/CUDA call blocking it, most often inside a collective that never completes), and the monitor is
    about to kill the process; or the monitor's kill itself (:data:`_HANG_NEEDLE`). A hang seen from inside
    the process group: comm/timeout, less certain than a timed-out collective's own line."""
    pos = t.first("watchdog got stuck for")
    if pos >= 0 and (found := _search(_STUCK_RE, t, pos, before=0, after=80)) is not None:
        facts: Facts = {"stuck_s": int(found[1].group("seconds"))}
        said = f"NCCL watchdog stuck for {facts['stuck_s']} s"
    elif (pos := t.first(_HANG_NEEDLE)) >= 0:
        facts, said = {"watchdog_hang": True}, "NCCL watchdog hang"
    else:
        return None
    rank = _rank_of(t, pos, facts)
    return _Hit("comm", "timeout", 0.6, pos, facts, f"{said}{_on_rank(rank)} (heartbeat monitor)",
                "the watchdog made no progress on the enqueued collectives: a collective (or a CUDA call "
                "under it) hung; find the rank that stopped calling collectives (py-spy dump of each rank, "
                "TORCH_NCCL_TRACE_BUFFER_SIZE for the flight recorder)")


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


_NCCL_CODE_RE = re.compile(r"\b(?P<code>nccl(?:(?:System|Remote|Internal|UnhandledCuda)Error"
                           r"|InvalidUsage|InvalidArgument))\b")
"""ncclResult_t's names as NCCL prints them (``ncclInvalidUsage`` and ``ncclInvalidArgument`` end without
``Error``)."""
_NCCL_SITE_RE = re.compile(r"NCCL error in: (?P<site>[^,\n]{1,300}), (?P<reason>[^\n]{1,300}?), NCCL version "
                           r"(?P<version>[\w.+-]{1,40})")
_NCCL_PLAIN_RE = re.compile(r"NCCL error: (?P<reason>[^\n]{1,300}?), NCCL version (?P<version>[\w.+-]{1,40})")
_NCCL_BARE_RE = re.compile(r"NCCL error: (?P<reason>(?:remote process exited or there was a network error|"
                           r"unhandled system error|unhandled cuda error|internal error|invalid usage)"
                           r"[^\n]{0,200})")
"""``NCCL error: <ncclGetErrorString>`` with neither a site nor a version: vLLM's and SGLang's own NCCL
wrapper (pynccl) raises ``RuntimeError(f"NCCL error: {error_str}")`` -- ``NCCL error: internal error -
please report this issue to the NCCL developers``, ``NCCL error: unhandled system error (run with
NCCL_DEBUG=INFO for details)``. Only NCCL's own result strings follow the colon."""
_NCCL_OLD_SITE_RE = re.compile(r"NCCL error in: (?P<site>[^,\n]{1,300}), (?P<reason>[^,\n]{1,200}?)"
                               r"[ \t]*(?:\n|$)")
"""torch < 1.1's wording, without the NCCL version (``what():  NCCL error in: .../c10d/NCCLUtils.hpp:29,
unhandled cuda error``, pytorch/pytorch#12744): read only when the reason is one of ncclGetErrorString's."""
_NCCL_LAST_RE = re.compile(r"Last error:\s{0,4}\n?(?P<last>[^\n]{1,300})")
_NCCL_NUMBERED_RE = re.compile(r"NCCL Error (?P<num>[1-6]): (?P<reason>[^\n]{1,300})")
"""The wording of wrappers that print ncclResult_t's number and ncclGetErrorString (torch's
``torch.cuda.nccl`` / pynccl-style bindings): ``RuntimeError: NCCL Error 3: internal error - please report
this issue to the NCCL developers``."""
_NCCL_RESULT_CODES = {1: "ncclUnhandledCudaError", 2: "ncclSystemError", 3: "ncclInternalError",
                      4: "ncclInvalidArgument", 5: "ncclInvalidUsage", 6: "ncclRemoteError"}
"""ncclResult_t's numbers (nccl.h): 0 success, 1-6 these errors, 7 in progress."""
_NCCL_REASONS = (
    ("remote process exited or there was a network error", "ncclRemoteError"),
    ("unhandled system error", "ncclSystemError"), ("unhandled cuda error", "ncclUnhandledCudaError"),
    ("internal error", "ncclInternalError"), ("invalid usage", "ncclInvalidUsage"),
    ("invalid argument", "ncclInvalidArgument"),
)
_CONNECT_RE = re.compile(r"socketStartConnect|[Cc]onnect to \S+ failed|[Cc]all to connect returned|"
                         r"Connection refused|bootstrap|ncclSocketInit|no socket interface", re.IGNORECASE)
"""An NCCL error whose reason or ``Last error:`` is the bootstrap / socket set-up: a connect that failed,
NCCL finding no usable interface (``Bootstrap : no socket interface found``, ``ncclSocketInit: connecting to
address with family N ...`` -- NCCL_SOCKET_IFNAME naming an interface that is not there)."""
_CONNECT_TRACE_RE = re.compile(r"NCCL (?:INFO|WARN) (?:Call to connect returned [^\n]{0,80}retrying|"
                               r"socketStartConnect: Connect to \S+ failed|Call to connect failed)")
"""NCCL_DEBUG's own lines of a connect to a peer that does not succeed (``NCCL INFO Call to connect returned
Connection refused, retrying``, ``misc/socket.cc:N NCCL WARN socketStartConnect: Connect to <addr> failed``,
``Call to connect failed``) printed by the process whose system / internal error they precede or follow
(NVIDIA/nccl#948: the error line pasted above its NCCL_DEBUG=INFO output): the error is the connect's.
Read only within :data:`INIT_CONTEXT_WINDOW` of the error line. A retry line alone is no error (healthy runs
print it while a peer comes up): it only says what an NCCL system / internal error was, and only when no
training-progress line or NCCL ``Init COMPLETE`` (:func:`c10d.went_on`'s lines) lies between it and the error:
a retry the run went on from is a connect that succeeded, and a later error mid-run is not its failure (hR's
review, stop 45, F2)."""


def _connect_trace(t: _Text, pos: int) -> bool:
    """Whether NCCL's own trace of a failing connect lies around the NCCL error at ``pos``: a WARN /
    ``Call to connect failed`` line anywhere in the window, a ``..., retrying`` line only with no
    training-progress line (:data:`c10d._WENT_ON_RE`) between it and the error line."""
    offset, text = t.window(pos, INIT_CONTEXT_WINDOW, INIT_CONTEXT_WINDOW)
    error_start = t.lower.rfind("\n", 0, pos) + 1
    error_end = t.lower.find("\n", pos)
    error_end = len(t.lower) if error_end < 0 else error_end
    for m in _CONNECT_TRACE_RE.finditer(text):
        if not m.group(0).endswith("retrying"):
            return True
        start, end = offset + m.start(), offset + m.end()
        between = (end, error_start) if end <= error_start else (error_end, start)
        if between[0] >= between[1] or _WENT_ON_RE.search(t.lower, between[0], between[1]) is None:
            return True
    return False


_SETUP_CODES = ("ncclSystemError", "ncclInternalError")
"""The codes such a set-up failure comes as: ``unhandled system error`` (a failed connect) and ``internal
error`` / ``Internal check failed`` (NCCL >= 2.19 for a missing socket interface). Newer NCCL (2.27) returns
``invalid usage`` for the same bootstrap failure, its ``Last error:`` saying so (``Bootstrap : no socket
interface found``, NVIDIA-NeMo/Speech#15019): read as set-up only by that last error -- an ``invalid usage``
without one stays NCCL's mismatch reading (ranks disagreeing on a call)."""
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
    "ncclUnhandledCudaError": ("comm", "failure", 0.8, "a CUDA call inside NCCL failed (its 'Last error' "
                               "says which): a CUDA driver/runtime or NCCL version mismatch, or an earlier "
                               "CUDA error on this rank (illegal memory access, ECC, Xid)"),
}
_INIT_CONTEXT_RE = re.compile(r"ncclCommInitRank|\binit_process_group\b(?!\(\) with a device_id)|"
                              r"processing method init_device\b|"
                              r"\binit_worker_distributed_environment\b|\binit_model_parallel_group\b|"
                              r"\binitialize_model_parallel\b|\bPyNcclCommunicator\(|"
                              r"\b_new_process_group_helper\b|\bfrom_engine_args\b|\b_init_executor\b|"
                              r"\bline \d+,? in (?:init_distributed(?:_mode)?|init_dist|init_parallel_env)"
                              r"[ \t\r]*$", re.MULTILINE)
"""Where an NCCL system/internal error is raised while a communicator is being created: NCCL's own
``ncclCommInitRank`` (also ``...Config``), torch's ``init_process_group`` / ``_new_process_group_helper``,
vLLM's worker setting up its device (``Exception in worker VllmWorkerProcess while processing method
init_device: NCCL error: unhandled system error``, vllm-project/vllm#7800) and its model-parallel groups
(``init_worker_distributed_environment``, ``initialize_model_parallel``, ``init_model_parallel_group``,
pynccl's ``PyNcclCommunicator(``) while its engine is built (``from_engine_args``, ``_init_executor``: no
request has run yet). Also a program's distributed start-up function by the names the common code bases
give it (``init_distributed_mode`` of the DeiT / MAE family -- its ``barrier()`` is the first collective,
NVIDIA/nccl#1546 --, DeepSpeed's ``init_distributed``, mmcv's ``init_dist``, Paddle's
``init_parallel_env``), but only as a traceback frame's function (``File "...", line N, in init_dist``): as a
bare word they are no set-up context -- DeepSpeed logs ``[comm.py:637:init_distributed] cdb=None`` at every
start and configs print ``init_distributed=True``, so a mid-run error would read as set-up (hR's review,
stop 45, F1). Not DistributedDataParallel's construction (``_verify_model_across_ranks``): the
corpus labels an NCCL system error there comm/failure (OpenPCDet#1215, ColossalAI#1320). Read in the
traceback around the error line (:data:`INIT_CONTEXT_WINDOW`
characters either side): the same error later in a run, inside a collective, stays NCCL's failure. torch's
warning at the first barrier of a healthy run (``... or call init_process_group() with a device_id.``) is no
set-up context (hR's review, stop 42)."""
INIT_CONTEXT_WINDOW = 2500
"""How far (characters, either side of the NCCL error line) a set-up frame counts as the error's context."""
_PEER_GONE_RE = re.compile(r"[Cc]onnection (?:closed|reset) by (?:remote )?peer|"
                           r"Connection closed by localRank|[Bb]roken pipe")
"""A last error saying the other end went away: the peer died (its own incident is the cause)."""
_LAST_CUDA = (("out of memory", ("memory", "oom")), ("illegal memory access", ("memory", "cuda-error")),
              ("ecc error", ("memory", "cuda-error")), ("device-side assert", ("memory", "cuda-error")))
"""A CUDA failure inside NCCL that names a device-side cause is that cause."""
_NCCL_NEEDLES = ("nccl error", "ncclsystemerror", "ncclremoteerror", "ncclinternalerror", "ncclinvalidusage",
                 "ncclinvalidargument", "ncclunhandledcudaerror")


_DUPLICATE_GPU_RE = re.compile(r"Duplicate GPU detected : rank (?P<rank>\d+) and rank (?P<other>\d+) both on "
                               r"CUDA device (?P<device>\w+)")
_DUPLICATE_NOTE = ("two ranks were given the same GPU: call torch.cuda.set_device(local_rank) before "
                   "init_process_group (or give each rank its own CUDA_VISIBLE_DEVICES)")


def _duplicate_gpu(t: _Text) -> Optional[_Hit]:
    """NCCL's last error ``Duplicate GPU detected : ...`` on a line of its own (a paste in reverse order, or
    one cut above its ``NCCL error`` line)."""
    dup = t.first("duplicate gpu detected")
    if dup < 0 or (found := _search(_DUPLICATE_GPU_RE, t, dup, before=0, after=200)) is None:
        return None
    m = found[1]
    facts: Facts = {"duplicate_gpu": True, "ranks": [int(m.group("rank")), int(m.group("other"))],
                    "device": m.group("device"), "code": "ncclInvalidUsage"}
    return _Hit("comm", "init-failure", 0.85, dup, facts,
                f"NCCL: ranks {m.group('rank')} and {m.group('other')} on the same CUDA device "
                f"{m.group('device')}", _DUPLICATE_NOTE)


def _rule_nccl_error(t: _Text) -> Optional[_Hit]:
    pos = t.first(*_NCCL_NEEDLES)
    if pos < 0:
        return _duplicate_gpu(t)
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
    elif (numbered := _NCCL_NUMBERED_RE.search(text)) is not None:
        facts["reason"] = numbered.group("reason").strip()
        code = code or _NCCL_RESULT_CODES[int(numbered.group("num"))]
    elif (bare := _NCCL_BARE_RE.search(text)) is not None:
        reason = bare.group("reason").strip()
        facts["reason"] = reason
        code = code or next(c for needle, c in _NCCL_REASONS if reason.lower().startswith(needle))
    elif (legacy := _NCCL_OLD_SITE_RE.search(text)) is not None:
        reason = legacy.group("reason").strip()
        said = next((c for needle, c in _NCCL_REASONS if reason.lower().startswith(needle)), None)
        if said is not None:
            facts.update(reason=reason, site=legacy.group("site").strip())
            code = code or said
    if code is None:
        return None
    facts["code"] = code
    extra: Tuple[int, ...] = ()
    if (last := _NCCL_LAST_RE.search(text)) is not None:
        facts["last_error"] = last.group("last").strip()
        extra = (pos + last.start("last"),)
    category, subtype, confidence, note = _NCCL_KINDS[code]
    set_up = f"{facts.get('last_error', '')} {facts.get('reason', '')}"
    if (code in _SETUP_CODES and (_CONNECT_RE.search(set_up) or _connect_trace(t, pos))) or \
            (code == "ncclInvalidUsage" and _CONNECT_RE.search(facts.get("last_error", ""))):
        category, subtype, confidence = "comm", "init-failure", 0.7
        note = ("NCCL could not connect to a peer (bootstrap or transport): addresses, NCCL_SOCKET_IFNAME, "
                "firewall")
    if (category, subtype) == ("comm", "failure") and code in _SETUP_CODES and \
            _INIT_CONTEXT_RE.search(t.window(pos, INIT_CONTEXT_WINDOW, INIT_CONTEXT_WINDOW)[1]):
        category, subtype, confidence = "comm", "init-failure", 0.65
        facts["during"] = "communicator set-up"
        note = ("NCCL failed while the communicator was being created (its set-up: sockets, shared memory, "
                "IB devices, the peers' addresses): NCCL_DEBUG=INFO names the failing call; check "
                "NCCL_SOCKET_IFNAME, /dev/shm, every rank started with the same world")
    said = f"{facts.get('last_error', '')} {facts.get('reason', '')}"
    if code in ("ncclInternalError", "ncclSystemError", "ncclRemoteError") and _PEER_GONE_RE.search(said):
        category, subtype, confidence = "comm", "rank-lost", 0.75
        note = _NCCL_KINDS["ncclRemoteError"][3]
    if code == "ncclUnhandledCudaError":
        cause = next((kind for needle, kind in _LAST_CUDA if needle in said.lower()), None)
        if cause is not None:
            category, subtype = cause
    if "Duplicate GPU detected" in facts.get("last_error", ""):
        category, subtype, confidence = "comm", "init-failure", 0.85
        facts["duplicate_gpu"] = True
        note = _DUPLICATE_NOTE
    rank = _rank_of(t, pos, facts)
    detail = facts.get("last_error") or facts.get("reason") or ""
    headline = f"{code}{_on_rank(rank)}" + (f": {_shorten(detail, 120)}" if detail else "")
    return _Hit(category, subtype, confidence, pos, facts, headline, note, extra_lines=extra)


_ABORTED_RE = re.compile(r"NCCL communicator was aborted(?: on rank (?P<rank>\d+))?\.(?: Original reason for "
                         r"failure was: (?P<reason>[^\n]{0,600}))?")
"""Also torch < 1.8's bare ``RuntimeError: NCCL communicator was aborted.`` (no rank, no reason:
karfly/learnable-triangulation-pytorch#81)."""


def _rule_nccl_comm_aborted(t: _Text) -> Optional[_Hit]:
    pos = t.first("nccl communicator was aborted")
    if pos < 0:
        return None
    found = _search(_ABORTED_RE, t, pos, before=0, after=800)
    if found is None:
        return None
    m = found[1]
    facts: Facts = {}
    if m.group("rank"):
        facts["rank"] = int(m.group("rank"))
    if m.group("reason"):
        facts["reason"] = _shorten(m.group("reason"), 300)
    on = f" on rank {facts['rank']}" if "rank" in facts else ""
    return _Hit("comm", "failure", 0.6, pos, facts, f"NCCL communicator aborted{on}",
                "the process group was aborted after an earlier failure: the original reason is the cause")


_IB_RE = re.compile(r"Got completion from peer (?P<peer>[^\s,]{1,100}) with (?:error |status=)(?P<code>\d+)")
_IB_STATUS = {5: "work request flushed (the queue pair went to error: usually the peer or link went away)",
              12: "transport retry counter exceeded (packets lost on the network)",
              13: "RNR retry counter exceeded (the peer stopped posting receives)"}


_NCCL_MISMATCH_RE = re.compile(r"Mismatched collective detected, please check your collective calls at and "
                               r"around rank (?P<rank>\d+)")
_NCCL_WARN_PATTERNS: Tuple[Tuple[str, str, str, float, str], ...] = (
    ("cuda failure 'out of memory'", "memory", "oom", 0.8,
     "NCCL could not allocate its buffers on the GPU (``Cuda failure 'out of memory'``, then ``Failed to "
     "CUDA calloc N bytes``): the device is full; the peers' closed connections that follow are its "
     "consequence"),
    ("collective mismatch error", "comm", "mismatch", 0.75,
     "NCCL's network plugin received a message of another size than posted: the ranks' collectives differ"),
    ("failed to execute operation init from rank", "comm", "init-failure", 0.75,
     "a proxy could not run a peer's ``Init`` while the communicator was being built (``Failed to execute "
     "operation Init from rank N``): the communicator never came up; the peer's own first error says why"),
    ("call to bind failed", "comm", "init-failure", 0.75,
     "NCCL's bootstrap could not bind its listening socket (``Call to bind failed : Address already in "
     "use``) while building a communicator: the port is taken (another job, or a communicator rebuilt "
     "before the last one let go of it)"),
    ("call to connect failed", "comm", "init-failure", 0.7,
     "NCCL could not open a socket to a peer while setting up (``WARN Call to connect failed : Connection "
     "refused / timed out``, bootstrap or transport): the address NCCL picked is not reachable -- "
     "NCCL_SOCKET_IFNAME, firewalls, every rank started; the peers' closed connections that follow are its "
     "consequence"),
    ("invalid rank requested", "comm", "init-failure", 0.7,
     "NCCL's communicator init was asked for a rank outside the communicator (``init.cc:N NCCL WARN Invalid "
     "rank requested : R/N``): the rank or world size the launcher gave the job is wrong (RANK / WORLD_SIZE, "
     "the number of nodes or processes per node), so the communicator is never built"),
    ("connection reset by peer", "comm", "rank-lost", 0.7,
     "a peer's socket went away: the peer process died or its node/network failed"),
    ("connection closed by remote peer", "comm", "rank-lost", 0.7,
     "a peer's socket went away: the peer process died or its node/network failed"),
    ("connection closed by localrank", "comm", "rank-lost", 0.7,
     "a local peer's proxy connection closed: that process exited"),
    ("does not loop back to start", "comm", "init-failure", 0.75,
     "NCCL's ring search did not close while building the communicator (``ring N does not loop back to "
     "start``): the ranks see different topologies (NCCL_HOSTID, topology files, mixed nodes)"),
    ("error while creating shared memory segment", "comm", "failure", 0.75,
     "NCCL could not create its shared-memory segment: /dev/shm too small (docker --shm-size) or full"),
    ("ibv_create_cq", "comm", "failure", 0.7,
     "creating InfiniBand resources failed (locked-memory limit: ulimit -l, or the HCA's resources)"),
)
"""NCCL_DEBUG lines (``host:pid:tid [dev] file:line NCCL WARN ...``) that say what failed, most causal
first (a mismatch before the peers' resets it causes). Without a WARN line, an error traced through
``bootstrap.cc`` (:data:`_INIT_TRACE_RE`) is the set-up's."""
_LOCAL_RANK_RE = re.compile(r"Connection closed by localRank (?P<rank>\d+)")
_OLD_WARN_RE = re.compile(r"\[\d{1,3}\] [\w./-]{1,200}\.(?:h|hpp|cc|cu|cpp):\d{1,6} WARN ")
"""NCCL < 2.3's debug line, without the word NCCL: ``host:pid:tid [0] include/socket.h:360 WARN Call to
connect failed : Connection timed out`` (also with the host hidden: ``*server name* [0]
include/socket.h:185 WARN ...``). Read only around :data:`_OLD_WARN_NEEDLE`, the one such line a pattern
below reads."""
_OLD_WARN_NEEDLE = "warn call to connect failed"


def _old_warn(t: _Text) -> bool:
    """Whether the text holds NCCL < 2.3's ``[dev] file:line WARN Call to connect failed`` line."""
    pos = t.first(_OLD_WARN_NEEDLE)
    return pos >= 0 and _search(_OLD_WARN_RE, t, pos, before=260, after=8) is not None


def _rule_nccl_debug(t: _Text) -> Optional[_Hit]:
    """What NCCL's own debug output (``NCCL WARN`` / ``NCCL INFO`` lines) says failed."""
    pos = t.first("mismatched collective detected")
    if pos >= 0 and (found := _search(_NCCL_MISMATCH_RE, t, pos, before=0, after=200)) is not None:
        facts: Facts = {"around_rank": int(found[1].group("rank"))}
        facts["rank"] = facts["around_rank"]
        return _Hit("comm", "mismatch", 0.85, pos, facts,
                    f"NCCL: mismatched collective at and around rank {facts['around_rank']}",
                    "the ranks called different collectives (or sizes) in the same position: start at the "
                    "named rank; NCCL_DEBUG_SUBSYS=COLL lists each rank's calls")
    if t.first("nccl warn", "nccl info") < 0 and not _old_warn(t):
        return None
    for needle, category, subtype, confidence, note in _NCCL_WARN_PATTERNS:
        pos = t.first(needle)
        if pos < 0:
            continue
        facts = {"nccl_line": _shorten(t.line_at(pos), 200)}
        if (m := _search(_LOCAL_RANK_RE, t, pos, before=40, after=40)) is not None:
            facts["rank"] = int(m[1].group("rank"))
        rank = _rank_of(t, pos, facts)
        return _Hit(category, subtype, confidence, pos, facts,
                    f"NCCL: {_shorten(t.line_at(pos).split('NCCL ', 1)[-1], 120)}{_on_rank(rank)}", note)
    pos = t.first("nccl warn cuda failure")
    if pos >= 0 and (found := _search(_WARN_CUDA_RE, t, pos, before=0, after=200)) is not None:
        reason = found[1].group("reason")
        if not any(needle in reason.lower() for needle in _DEVICE_SIDE):
            facts = {"nccl_line": _shorten(t.line_at(pos), 200), "cuda_error": reason}
            rank = _rank_of(t, pos, facts)
            return _Hit("comm", "failure", 0.6, pos, facts,
                        f"NCCL: a CUDA call failed ('{_shorten(reason, 80)}'){_on_rank(rank)}",
                        _WARN_CUDA_NOTE)
    for pos in t.find_all(_INIT_TRACE_NEEDLE):
        if (found := _search(_INIT_TRACE_RE, t, pos, before=20, after=40)) is not None:
            code = int(found[1].group("code"))
            trace: Facts = {"nccl_line": _shorten(t.line_at(pos), 200), "nccl_result": code,
                            "meaning": _NCCL_RESULTS.get(code, "an NCCL error")}
            rank = _rank_of(t, pos, trace)
            return _Hit("comm", "init-failure", 0.6, found[0] + found[1].start(), trace,
                        f"NCCL: the ranks' bootstrap failed ({trace['meaning']}, returned through "
                        f"bootstrap.cc){_on_rank(rank)}",
                        "NCCL_DEBUG=INFO traced an error up through its bootstrap (the ranks exchanging "
                        "their addresses to build the communicator) with no WARN line: addresses, "
                        "NCCL_SOCKET_IFNAME, a firewall between the nodes")
    return None


_INIT_TRACE_NEEDLE = "nccl info bootstrap.cc:"
_INIT_TRACE_RE = re.compile(r"NCCL INFO bootstrap\.cc:\d{1,6} -> (?P<code>[1-7])\b")
"""NCCL_DEBUG=INFO's trace of an error as it returns through each function (``file.cc:line -> code``): one
through ``bootstrap.cc`` -- the ranks exchanging addresses to build a communicator -- with a non-zero
ncclResult_t and no WARN line (``misc/socket.cc:564 -> 2``, ``bootstrap.cc:270 -> 2``, ``init.cc:1303 ->
2``: the bootstrap's connect failed, NVIDIA/nccl#1099) is a communicator that never came up. A trace through
``init.cc`` alone is not read: the transport's set-up inside a first collective fails through it too
(``transport/p2p.cc``, ``init.cc -> 3`` before the collective's own ``ncclInternalError``)."""
_NCCL_RESULTS = {1: "an unhandled CUDA error", 2: "a system error", 3: "an internal error",
                 4: "an invalid argument", 5: "an invalid usage", 6: "a remote error", 7: "in progress"}


_WARN_CUDA_RE = re.compile(r"NCCL WARN Cuda failure (?:\d{1,4} )?'(?P<reason>[^'\n]{1,160})'")
_DEVICE_SIDE = ("out of memory", "illegal memory access", "ecc error", "device-side assert",
                "unspecified launch failure", "illegal instruction", "misaligned address")
_WARN_CUDA_NOTE = ("NCCL's own CUDA call failed (ncclUnhandledCudaError) with no fault of the device named: "
                   "the CUDA setup NCCL runs in (driver, CUDA_VISIBLE_DEVICES, NVLS / P2P support, "
                   "containers)")
"""NCCL_DEBUG's ``NCCL WARN Cuda failure 3 'initialization error'`` (pytorch/pytorch#130113, NVLS set-up): a
CUDA call inside NCCL that names no device fault (those are cuda.error's) is NCCL's unhandled CUDA error."""


_IB_FATAL_EVENTS = ("local catastrophic error", "port error", "local work queue catastrophic error",
                    "invalid request local work queue error", "local access violation work queue error",
                    "cq error", "srq catastrophic error", "path migration request error")
"""libibverbs' names (``ibv_event_type_str``) of the asynchronous events that are fatal to the adapter, a
port, a queue pair or a completion queue; the others (``GID table change``, ``port active``, ``LID change``,
``client reregistration``) are routine and NCCL < 2.19 prints them at the same WARN level."""
_IB_ASYNC_RE = re.compile(r"NET/IB\s?:\s?(?:(?P<dev>[\w.-]{1,40}):\d{1,3}\s)?(?:Got async event\s?:\s?|"
                          r"async (?P<fatal>fatal )?event on \w{1,12}\s?(?:\([^)\n]{0,40}\))?\s?:\s?)"
                          r"(?P<event>[A-Za-z][A-Za-z ]{2,60})")
"""NCCL's IB transport reporting an asynchronous event of the adapter: ``NET/IB : Got async event : local
catastrophic error`` (NCCL < 2.19, every event at WARN), ``NET/IB : mlx5_ib0:1 async fatal event on QP
(0x7f69f01519a8): local access violation work queue error`` (NCCL 2.19+ says which are fatal)."""
_IB_ASYNC_NEEDLES = ("got async event", "async fatal event")


def _ib_fatal_event(t: _Text) -> Optional[_Hit]:
    """A fatal asynchronous event of the local InfiniBand adapter (``_IB_ASYNC_RE``): the local NIC, port or
    queue pair failed -- a fault of the fabric under this rank, not a peer that went away."""
    for needle in _IB_ASYNC_NEEDLES:
        for pos in t.find_all(needle):
            found = _search(_IB_ASYNC_RE, t, pos, before=80, after=140)
            if found is None:
                continue
            m = found[1]
            event = m.group("event").strip().lower()
            if not m.group("fatal") and event not in _IB_FATAL_EVENTS:
                continue
            facts: Facts = {"ib_event": event}
            if m.group("dev"):
                facts["device"] = m.group("dev")
            rank = _rank_of(t, pos, facts)
            return _Hit("comm", "failure", 0.7, found[0] + m.start(), facts,
                        f"InfiniBand adapter fault: {event}{_on_rank(rank)}",
                        "the local InfiniBand adapter, port or queue pair reported a fatal event: the node's "
                        "fabric failed under the job (ibstat, port counters, the kernel log); the peers' "
                        "errors follow from it")
    return None


def _rule_ib_error(t: _Text) -> Optional[_Hit]:
    fatal = _ib_fatal_event(t)
    if fatal is not None:
        return fatal
    pos = t.first("got completion from peer")
    if pos < 0 or (found := _search(_IB_RE, t, pos, before=0, after=200)) is None:
        return None
    m = found[1]
    code = int(m.group("code"))
    facts: Facts = {"peer": m.group("peer"), "ib_status": code, "meaning": _IB_STATUS.get(code, "IB work "
                                                                                          "completion error")}
    rank = _rank_of(t, pos, facts)
    # NCCL returns a failed IB work completion as ncclRemoteError ("remote process exited or there was a
    # network error"): the peer or the link to it went away, as nccl.error reads that code
    return _Hit("comm", "rank-lost", 0.7, pos, facts,
                f"InfiniBand completion error {code} from {facts['peer']}{_on_rank(rank)}",
                "the peer or the link to it went away: check the peer's own state first, then the fabric "
                "between the two nodes (ibstat, port counters)")


GATES = {
    "nccl.watchdog-timeout": ("caught collective operation timeout", ") ran for ", *_TIMEOUT_SAID),
    "nccl.dump-signal": ("received a dump signal due to a collective timeout from",),
    "nccl.watchdog-status": ("last enqueued work:", "last enqueued nccl work:",
                             "stack trace of the failed collective:"),
    "nccl.error": (*_NCCL_NEEDLES, "duplicate gpu detected"),
    "nccl.comm-aborted": ("nccl communicator was aborted",),
    "nccl.debug": ("mismatched collective detected", "nccl warn", "nccl info", _OLD_WARN_NEEDLE),
    "nccl.ib-error": ("got completion from peer", *_IB_ASYNC_NEEDLES),
    "nccl.watchdog-teardown": (*_TEARDOWN_NEEDLES, *_CHECK_TIMEOUT),
    "nccl.heartbeat-stuck": ("watchdog got stuck for", _HANG_NEEDLE),
}
"""Each rule's needles: the rule cannot match a text in which none of them occurs (the classifier skips it
after the shared pre-scan)."""


DOCS = {
    'nccl.debug': (
        "NCCL_DEBUG lines: ``Mismatched collective detected ... around rank N`` / ``collective mismatch "
        "error`` → comm/mismatch; ``Connection reset/closed by (remote) peer|localRank N`` → comm/rank-lost; "
        "``ring N does not loop back to start`` or a proxy's ``Failed to execute operation Init from rank "
        "N`` (it wins over a connection-closed line in the same text) or the bootstrap's ``Call to bind "
        "failed : Address already in use`` or ``Call to connect failed : ...`` (also NCCL < 2.3's line "
        "without the word NCCL, ``[0] include/socket.h:360 WARN Call to connect failed``) or the init's "
        "``Invalid rank requested : R/N`` (a rank outside the communicator: wrong RANK / WORLD_SIZE) → "
        "comm/init-failure; ``Cuda failure 'out of memory'`` (NCCL allocating its buffers) → memory/oom; "
        "shared-memory segment or ``ibv_create_cq`` failures → comm/failure; with no WARN line, an error "
        "NCCL_DEBUG=INFO traces back through its bootstrap (``NCCL INFO bootstrap.cc:N -> 2``) "
        "→ comm/init-failure"
    ),
    'nccl.watchdog-timeout': (
        '``Watchdog caught collective operation timeout: WorkNCCL(...)`` (also quoted without its '
        'start: ``WorkNCCL(SeqNum=.., OpType=.., Timeout(ms)=N) ran for M millisecond(s)``; and the '
        'blocking-wait wording '
        '``Caught collective operation timeout: ...``); without it, ``Timeout at NCCL work: N`` or ``Work '
        'WorkNCCL(...) timed out in blocking wait`` → comm/timeout'
    ),
    'nccl.dump-signal': '``Received a dump signal due to a collective timeout from rank N`` → comm/timeout',
    'nccl.watchdog-status': (
        "(adds facts only) the PG status line (last enqueued / completed work) and the flight recorder's "
        'stack of the failed collective'
    ),
    'nccl.error': (
        '``NCCL error ...`` / ``nccl*Error`` / a wrapper\'s ``NCCL Error N: <reason>`` (N: ncclResult_t\'s '
        'number): RemoteError → comm/rank-lost; InvalidUsage / '
        'InvalidArgument → comm/mismatch; UnhandledCudaError → comm/failure (memory/oom or cuda-error when '
        'its last error names one); SystemError on a connect, or SystemError / InternalError whose last '
        'error is the socket set-up (``Bootstrap : no socket interface found``, ``ncclSocketInit``) or '
        'whose process\'s NCCL_DEBUG lines around it show a connect failing (``socketStartConnect: Connect '
        'to ... failed``; ``Call to connect returned Connection refused, retrying`` only with no '
        'training-progress line or ``Init COMPLETE`` between it and the error) → '
        'comm/init-failure; SystemError / InternalError raised while a communicator is created (its '
        'traceback shows ``ncclCommInitRank``, ``init_process_group``, vLLM\'s ``processing method '
        'init_device`` '
        '/ ``init_worker_distributed_environment`` / ``initialize_model_parallel``, pynccl\'s '
        '``PyNcclCommunicator(``, an engine being built: ``from_engine_args``; a start-up function as a '
        'frame\'s function, ``File "...", line N, in init_distributed_mode`` / ``init_distributed`` / '
        '``init_dist`` / ``init_parallel_env``, not the bare word) → '
        'comm/init-failure; also a '
        'wrapper\'s bare ``NCCL error: internal error`` '
        '(vLLM / SGLang pynccl); '
        'a last error saying the '
        'peer closed or reset the connection → comm/rank-lost; SystemError / InternalError → comm/failure; '
        '``Duplicate GPU detected : rank N and rank M both on CUDA device D`` (in its last error, or on a '
        'line of its own) → comm/init-failure'
    ),
    'nccl.comm-aborted': ('``NCCL communicator was aborted on rank N`` (torch < 1.8: ``NCCL communicator was '
                          'aborted.``, no rank) → comm/failure'),
    'nccl.ib-error': (
        '``NET/IB : Got completion from peer ... with error N`` → comm/rank-lost (NCCL returns it as '
        'ncclRemoteError: the peer or the link to it went away); before it, a fatal asynchronous event of '
        'the local adapter -- ``NET/IB : Got async event : local catastrophic error`` (or a port error, a '
        "queue pair's or completion queue's error; routine events such as ``GID table change`` are not "
        "read), NCCL 2.19+'s ``async fatal event on QP (...): ...`` → comm/failure"
    ),
    'nccl.heartbeat-stuck': (
        "the heartbeat monitor's ``ProcessGroupNCCL's watchdog got stuck for N seconds without making "
        "progress in monitoring enqueued collectives`` (torch 2.3+), or its kill ``Terminating the process "
        "after attempting to dump debug info, due to ProcessGroupNCCL watchdog hang`` (torch 2.4+) → "
        "comm/timeout, at a lower confidence"
    ),
    'nccl.watchdog-teardown': (
        "the watchdog's teardown without its timeout/error line (``Some NCCL operations have failed or timed "
        "out``, ``we are taking the entire process down``, ``failure detected by watchdog at work sequence "
        "id``, ``Exception (either an error or timeout) detected by watchdog``), or a c10 C++ stack of "
        "``WorkNCCL::checkTimeout`` raising (its ``frame #N:`` line, or "
        "``Exception raised from checkTimeout at .../ProcessGroupNCCL.cpp``: the timeout's stack with its "
        "message cut) → "
        "comm/timeout, at a lower confidence"
    ),
}
"""What each rule of this module recognises, and the kind it gives (docs/classifier.md is made of these)."""
