"""Classifier rules for gloo text: size mismatches, monitored-barrier failures, recv/send timeouts and
lost peers."""

from __future__ import annotations

import re
from typing import Optional

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

_GLOO_SIZE_RE = re.compile(r"op\.preamble\.length <= op\.nbytes\. (?P<received>\d+) vs (?P<expected>\d+)")


_FULL_MESH_RE = re.compile(r"Gloo connectFullMesh failed(?: with (?P<error>[^\n]{0,200}))?")
"""gloo's ``Gloo connectFullMesh failed with [...pair.cc:N] ...``, also cut or quoted before its reason
(``"RuntimeError: Gloo connectFullMesh failed ..."`` in a sentence): gloo raises it only when the group's
pairs cannot connect."""
_PAIR_CONNECT_RE = re.compile(r"pair\.cc:\d+\] (?:connect \[(?P<peer>[^\]\n]{1,100})\]:(?P<port>\d+): "
                              r"(?P<error>Connection refused|Connection timed out|No route to host"
                              r"|Network is unreachable)"
                              r"|(?P<old>Connect timeout) \[(?P<peer2>[^\]\n]{1,100})\]:(?P<port2>\d+))")
"""gloo's pair failing to connect to its peer: ``[...pair.cc:799] connect [10.0.0.2]:13195: Connection
refused``, and older gloo's ``[.../gloo/transport/tcp/pair.cc:611] Connect timeout [172.17.27.13]:27023``
(caffe2#360): a pair connects only while the group forms."""
_CONNECT_NOTE = ("gloo's ranks open a TCP pair to every other rank when a process group is created: the "
                 "peers' addresses must be reachable (GLOO_SOCKET_IFNAME names the interface), no firewall "
                 "between them")


def _rule_gloo_connect(t: _Text) -> Optional[_Hit]:
    """gloo cannot connect its ranks' pairs while a process group is created: ``Gloo connectFullMesh failed
    with [...pair.cc:144] ...``, ``[...gloo/transport/tcp/pair.cc:799] connect [10.0.0.2]:13195: Connection
    refused``."""
    pos = t.first("gloo connectfullmesh failed")
    if pos >= 0 and (found := _search(_FULL_MESH_RE, t, pos, before=0, after=260)) is not None:
        error = found[1].group("error")
        facts: Facts = {"backend": "gloo", **({"error": _shorten(error, 160)} if error else {})}
        return _Hit("comm", "init-failure", 0.85, pos, facts,
                    "gloo could not connect its ranks (connectFullMesh)", _CONNECT_NOTE)
    pos = t.first("] connect [", "] connect timeout [")
    if pos >= 0 and (found := _search(_PAIR_CONNECT_RE, t, pos, before=40, after=200)) is not None:
        m = found[1]
        error = m.group("error") or m.group("old")
        peer = f"{m.group('peer') or m.group('peer2')}:{m.group('port') or m.group('port2')}"
        facts = {"backend": "gloo", "peer": peer, "error": error}
        return _Hit("comm", "init-failure", 0.8, found[0] + m.start(), facts,
                    f"gloo cannot connect to peer {peer} ({error})", _CONNECT_NOTE)
    return None


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
                    _TIMEOUT_NOTE)
    pos = t.first(_PAIR_CLOSURE)
    if pos >= 0:
        facts = {"backend": "gloo"}
        rank = _rank_of(t, pos, facts)
        return _Hit("comm", "timeout", 0.75, pos, facts,
                    f"gloo: application timeout caused pair closure{_on_rank(rank)}", _TIMEOUT_NOTE)
    return None


_TIMEOUT_NOTE = ("a peer did not take part in the collective in time (a straggler or a stuck rank); a dead "
                 "peer shows as a reset connection instead")
_PAIR_CLOSURE = "application timeout caused pair closure"
"""gloo's TCP pair closing a connection whose operation ran past the collective's timeout (``RuntimeError:
Application timeout caused pair closure``): the same timeout as ``Timed out waiting Nms for send/recv``,
said by the pair."""


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


GATES = {
    "gloo.connect": ("gloo connectfullmesh failed", "] connect [", "] connect timeout ["),
    "gloo.size-mismatch": ("received data size doesn't match expected size",
                           "op.preamble.length <= op.nbytes"),
    "gloo.monitored-barrier": ("failed to pass monitoredbarrier",),
    "gloo.timeout": ("timed out waiting", _PAIR_CLOSURE),
    "gloo.peer-lost": ("monitoredbarrier, but received errors", "by peer", "broken pipe",
                       "connection closed by peer", "failed to recv, got 0 bytes"),
}
"""Each rule's needles: the rule cannot match a text in which none of them occurs (the classifier skips it
after the shared pre-scan)."""


DOCS = {
    'gloo.connect': (
        "``Gloo connectFullMesh failed with ...`` (also cut or quoted before its reason), gloo's "
        "``pair.cc:N] connect [addr]:port: Connection refused`` (older gloo: ``pair.cc:N] Connect timeout "
        "[addr]:port``) → comm/init-failure"
    ),
    'gloo.size-mismatch': "gloo ``Received data size doesn't match expected size`` → comm/mismatch",
    'gloo.monitored-barrier': '``Rank N failed to pass monitoredBarrier`` → comm/timeout',
    'gloo.timeout': ('``Timed out waiting Nms for recv/send operation``, the TCP pair\'s ``Application '
                     'timeout caused pair closure`` → comm/timeout'),
    'gloo.peer-lost': (
        'gloo ``Connection reset/closed by peer``, monitoredBarrier errors from a peer, TCPStore ``Failed '
        'to recv, got 0 bytes`` → comm/rank-lost'
    ),
}
"""What each rule of this module recognises, and the kind it gives (docs/classifier.md is made of these)."""
