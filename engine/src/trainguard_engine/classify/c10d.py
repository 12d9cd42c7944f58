"""Classifier rules for torch.distributed's c10d layer: collective mismatches (TORCH_DISTRIBUTED_DEBUG),
the desync report, rendezvous and TCPStore failures."""

from __future__ import annotations

import re
from typing import List, Optional

from .text import (
    Facts,
    _Hit,
    _ints,
    _on_rank,
    _rank_of,
    _ranks_text,
    _search,
    _shorten,
    _Text,
)

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
        seq_a, seq_b = a.get("seq_num"), b.get("seq_num")
        if isinstance(seq_a, int) and isinstance(seq_b, int) and seq_a != seq_b:
            # the rank behind (fewer collectives issued: it skipped some, or runs a fresh group) is the one
            # that diverged, whichever rank reported the mismatch
            behind = a if seq_a < seq_b else b
            facts.update(rank=behind["rank"], lagging_ranks=[behind["rank"]], reporting_rank=a["rank"])
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


_CLIENTS_RE = re.compile(
    r"Timed out after (?P<s>\d+) seconds waiting for clients\. (?P<joined>\d+)/(?P<world>\d+) clients joined")
_SOCKET_TIMEOUT_RE = re.compile(
    r"The client socket has timed out after (?P<ms>\d+)(?P<unit>ms|s) while trying to connect to "
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


_BARRIER_RE = re.compile(
    r"(?P<what>Timed out initializing process group in|Waiting in) store based barrier (?:on|to initialize "
    r"process group for) rank:? (?P<rank>\d+), (?:for )?key: (?P<key>[^\s,]{1,200}),? "
    r"\(world_size=(?P<world>\d+), worker_count=(?P<count>\d+), timeout=(?P<timeout>[^)\n]{1,40})\)")
"""c10d's store-based barrier at process-group creation (torch 1.8-2.0): the error after its timeout, and
the INFO line it prints while it waits."""
_UNIQUE_ID_RE = re.compile(
    r"(?:\[(?P<rank>\d+)\] )?is setting up NCCL communicator and retr\w{1,12} ncclUniqueId "
    r"from \[(?P<root>\d+)\] "
    r"via c10d key-value store by key '(?P<key>[^'\n]{0,100})', but store->get\('[^'\n]{0,100}'\) got "
    r"(?:error|exception): (?P<error>[^\n]{1,200})")
"""A rank fetching the NCCL communicator's id that the root rank puts in the store (torch >= 1.11). The
message starts with the waiting rank in brackets (``[1] is setting up ...``); a paste or a reader that took
that tag for a line-number column leaves the message without it, which still names the root rank."""


def _rule_store_barrier(t: _Text) -> Optional[_Hit]:
    """The store-based barrier timed out, or waits with more workers than the world (a stale store)."""
    for pos in t.find_all("store based barrier"):
        found = _search(_BARRIER_RE, t, pos, before=60, after=300)
        if found is None:
            continue
        m = found[1]
        world, count = int(m.group("world"), 10), int(m.group("count"), 10)
        facts: Facts = {"world_size": world, "worker_count": count, "key": m.group("key"),
                        "timeout": m.group("timeout"), "waiting_rank": int(m.group("rank"))}
        if m.group("what").startswith("Timed out"):
            return _Hit("comm", "init-failure", 0.9, found[0] + m.start(), facts,
                        f"Process group creation timed out in the store barrier: {count}/{world} workers "
                        f"arrived", _INIT_NOTE)
        if count > world:
            return _Hit("comm", "init-failure", 0.7, found[0] + m.start(), facts,
                        f"Store barrier counts {count} workers for a world of {world}",
                        "more processes joined the store than the world size: a second launch (or a "
                        "previous run) on the same MASTER_ADDR/MASTER_PORT")
    return None


_RETRY_WARNING_RE = re.compile(
    r"\[w(?:\d{3,4} [\d:.]+(?: +\d+)?)? ?[\w./-]*\.cpp:\d+\]|\bwarn(?:ing)?\b|^\W{0,4}w\d{3,4} ",
    re.MULTILINE)
"""A warning's mark before c10d's ``The client socket has failed to connect to ...`` (``[W socket.cpp:663]``,
``[W427 01:04:16.149509694 socket.cpp:752]``, a glog ``W1108`` record, ``WARNING``): torch prints it for each
attempt while it keeps retrying until its timeout -- the failure is the raised error or the timeout."""
_WENT_ON_RE = re.compile(
    r"^[^\n]{0,200}?(?:\b(?:epoch|step|iter(?:ation)?|batch)\b['\"]?\s*[:=#\[(]?\s*\d"
    r"|\bloss\b['\"]?\s*[:=]?\s*-?\d"
    r"|\d\s*it/s\b|\d{1,3}%\||\bnccl info\b[^\n]{0,200}\binit complete\b)", re.MULTILINE)
"""A training-progress line (a step / epoch / iteration / batch counter, a loss value -- also as a quoted
dict key, the HF Trainer's ``{'loss': 2.3012, 'grad_norm': 1.53, ..., 'epoch': 0.01}`` (hR's review, stop 45,
F3) --, a progress bar), or
NCCL's ``NCCL INFO comm 0x... rank R nranks N ... - Init COMPLETE`` (the communicator was built: its
connections succeeded): after connect warnings it says the retries succeeded and the run went on."""
_NCCL_RETRY_RE = re.compile(r"\bnccl info\b[^\n]{0,200}?\bcall to connect returned\b[^\n]{0,120}\bretrying\b")
"""NCCL_DEBUG=INFO's line for one connect attempt to a peer that is not listening yet (``NCCL INFO Call to
connect returned Connection refused, retrying``): NCCL retries (NCCL_SOCKET_RETRY_CNT) and healthy runs print
it while a peer comes up; the failure is the WARN / error that follows when the retries run out."""


def connect_retry(line: str) -> bool:
    """Whether ``line`` is c10d's warning for one failed connect attempt (:data:`_RETRY_WARNING_RE`), or
    NCCL's INFO line for one (:data:`_NCCL_RETRY_RE`): the connection failed only if the log does not go on
    training after it (:func:`went_on`)."""
    lower = line.lower()
    pos = lower.find("the client socket has failed to connect to")
    if pos >= 0:
        return _RETRY_WARNING_RE.search(lower, 0, pos) is not None
    return "retrying" in lower and _NCCL_RETRY_RE.search(lower) is not None


def went_on(line: str) -> bool:
    """Whether ``line`` is a training-progress line (:data:`_WENT_ON_RE`)."""
    return _WENT_ON_RE.search(line.lower()) is not None


def _connect_failure(t: _Text) -> int:
    """Where c10d's ``The client socket has failed to connect to ...`` says the connection failed, or -1. An
    error-level line or a raised error's always does; a warning-level one (:data:`_RETRY_WARNING_RE`, torch's
    message for one attempt while it retries -- healthy runs print it while the master comes up: NeMo#7351,
    PiPPy#158 CI) does only when no training-progress line (:data:`_WENT_ON_RE`) follows it: a log that ends
    in the attempts (or in the error they end in) is the failure; one that goes on training is not."""
    went_on = -1  # where the progress line found after an earlier attempt starts (it follows later ones too)
    for pos in t.find_all("the client socket has failed to connect to"):
        line_start = t.lower.rfind("\n", 0, pos) + 1
        if _RETRY_WARNING_RE.search(t.lower, line_start, pos) is None:
            return pos
        line_end = t.lower.find("\n", pos)
        if line_end < 0:
            return pos
        if went_on <= line_end:
            progress = _WENT_ON_RE.search(t.lower, line_end + 1)
            if progress is None:
                return pos
            went_on = progress.start()
    return -1


def _nccl_retries_went_on(t: _Text) -> bool:
    """Whether every NCCL ``Call to connect returned ..., retrying`` INFO line of the text is followed by a
    training-progress line or NCCL's ``Init COMPLETE`` (:data:`_WENT_ON_RE`): the retries succeeded. An
    error- or warning-level NCCL line saying a connect failed is read by its own needle, not here."""
    last = -1
    for pos in t.find_all("call to connect returned"):
        line_end = t.lower.find("\n", pos)
        if line_end < 0 or not _NCCL_RETRY_RE.search(t.line_at(pos).lower()):
            return False
        last = line_end
    return last >= 0 and _WENT_ON_RE.search(t.lower, last + 1) is not None


def _rule_rendezvous(t: _Text) -> Optional[_Hit]:
    barrier = _rule_store_barrier(t)
    if barrier is not None:
        return barrier
    pos = t.first("nccluniqueid from [")
    if pos >= 0 and (found := _search(_UNIQUE_ID_RE, t, pos, before=200, after=600)) is not None:
        m = found[1]
        waiting = m.group("rank")
        facts: Facts = {"root_rank": int(m.group("root")), "error": _shorten(m.group("error"), 160)}
        if waiting is not None:
            facts = {"waiting_rank": int(waiting), **facts}
        who = f"Rank {waiting}" if waiting is not None else "A rank"
        return _Hit("comm", "init-failure", 0.85, found[0] + m.start(), facts,
                    f"{who} could not get the NCCL id from rank {facts['root_rank']} "
                    f"through the store ({facts['error']})",
                    "the root rank never published the communicator id (it did not reach the collective, "
                    "crashed, or hangs) or the store is unreachable")
    pos = t.first("waiting for clients.")
    if pos >= 0 and (found := _search(_CLIENTS_RE, t, pos, before=80, after=120)) is not None:
        m = found[1]
        joined, world = int(m.group("joined")), int(m.group("world"))
        facts = {"timeout_s": int(m.group("s")), "joined": joined, "world_size": world,
                        "missing": world - joined}
        return _Hit("comm", "init-failure", 0.9, pos, facts,
                    f"Rendezvous timed out after {facts['timeout_s']} s: {joined}/{world} ranks joined",
                    _INIT_NOTE)
    pos = t.first("the client socket has timed out after")
    if pos >= 0 and (found := _search(_SOCKET_TIMEOUT_RE, t, pos, before=0, after=400)) is not None:
        m = found[1]
        ms = int(m.group("ms")) * (1000 if m.group("unit") == "s" else 1)  # torch >= 2.2 prints seconds
        facts = {"host": m.group("host"), "port": int(m.group("port")), "timeout_ms": ms}
        return _Hit("comm", "init-failure", 0.9, pos, facts,
                    f"Rendezvous store {facts['host']}:{facts['port']} unreachable (timed out after "
                    f"{facts['timeout_ms']} ms)", _INIT_NOTE)
    pos = _connect_failure(t)
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
            if "failed to shutdown the rendezvous" in t.line_at(at).lower():
                continue  # elastic's end-of-job clean-up warning: the job itself already ended
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
    if pos >= 0 and _nccl_retries_went_on(t):
        pos = t.first("no socket interface found", "socketstartconnect")
    if pos >= 0:
        facts = {"error": _shorten(t.line_at(pos), 200)}
        return _Hit("comm", "init-failure", 0.65, pos, facts,
                    "NCCL cannot connect: " + _shorten(t.line_at(pos), 120),
                    "NCCL's bootstrap or transport could not reach a peer: NCCL_SOCKET_IFNAME, addresses, "
                    "firewall")
    for needle in ("connection refused", "timed out"):
        for error in t.find_all(needle):
            if t.lower.endswith(("not ", "never "), max(0, error - 6), error):
                continue  # negated: submitit's 'Job has not timed out.' near the job's MASTER_ADDR line
            near = t.lower[max(0, error - 300): error + 300]
            if any(word in near for word in _RDZV_WORDS):
                facts = {"error": _shorten(t.line_at(error), 200)}
                return _Hit("comm", "init-failure", 0.55, error, facts,
                            "Rendezvous failed: " + _shorten(t.line_at(error), 120), _INIT_NOTE)
    return None


_RDZV_WORDS = ("rendezvous", "tcpstore", "init_process_group", "master_addr", "master_port", "c10d store")
"""Words that make a nearby "connection refused" / "timed out" (within 300 characters) a rendezvous
failure."""


GATES = {
    "c10d.collective-mismatch": ("detected mismatch between collectives on ranks",),
    "c10d.desync-report": ("to our best knowledge", "timeout at collective:"),
    "c10d.rendezvous": ("store based barrier", "nccluniqueid from [", "waiting for clients.",
                        "the client socket has timed out after", "the client socket has failed to connect to",
                        "tcp client failed to connect/validate to host", "wait timeout after",
                        "the server socket has failed to", "rendezvous", "no socket interface found",
                        "socketstartconnect", "call to connect returned", "connection refused", "timed out"),
}
"""Each rule's needles: the rule cannot match a text in which none of them occurs (the classifier skips it
after the shared pre-scan)."""


DOCS = {
    'c10d.collective-mismatch': '``Detected mismatch between collectives on ranks`` → comm/mismatch',
    'c10d.desync-report': (
        'the desync debug report ("lagging ranks", "joined but didn\'t finish") → comm/timeout'
    ),
    'c10d.rendezvous': (
        '``Timed out ... waiting for clients. k/n clients joined``, the store-based barrier\'s timeout (or '
        'its wait with more workers than the world), ``... retrieving ncclUniqueId from [0] via c10d '
        'key-value store ... got error``, client socket connect '
        'timeouts/failures (c10d\'s ``[W ...]`` warning for one connect attempt only when no '
        'training-progress line follows it: healthy runs print it while the master comes up), store '
        '``wait timeout``, port in '
        'use, ``Rendezvous*Error`` (not elastic\'s end-of-job "failed to shutdown the rendezvous"), NCCL '
        'bootstrap / '
        'socket connect (NCCL\'s ``NCCL INFO Call to connect returned ..., retrying`` only when neither a '
        'training-progress line nor NCCL\'s ``Init COMPLETE`` follows it), "connection refused"/"timed out" '
        'next to rendezvous words → comm/init-failure'
    ),
}
"""What each rule of this module recognises, and the kind it gives (docs/classifier.md is made of these)."""
