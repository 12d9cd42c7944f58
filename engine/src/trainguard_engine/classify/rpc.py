"""Classifier rules for torch.distributed.rpc text: the TensorPipe agent's errors on its connections.

TensorPipe's agent logs one warning per failed request or response, ``[W tensorpipe_agent.cpp:N] RPC agent
for <me> encountered error when <what> <peer>: <reason>``. What a failed connection means depends on when
it failed:

* the group never got connected -- the peer refused the connection (``ECONNREFUSED``), or the agent's
  *first* outgoing request failed (request ``#0``: every follower's first request is ``init_rpc``'s
  all-gather round to the leader, which the TensorPipe backend runs before ``init_rpc`` returns):
  comm/init-failure (pytorch/tensorpipe#201, pytorch/pytorch#85607);
* otherwise a peer that was there went away mid-run -- ``eof``, ``ECONNRESET``, a broken pipe on a later
  request or response, which per the TensorPipe maintainers is the other endpoint terminating abruptly:
  comm/rank-lost naming that peer (pytorch/tensorpipe#411, pytorch/PiPPy#806).
"""

from __future__ import annotations

import re
from typing import Optional

from .text import Facts, _Hit, _search, _shorten, _Text

_AGENT_RE = re.compile(
    r"RPC agent for (?P<me>[^\s]{1,120}) encountered error when "
    r"(?P<what>sending outgoing request #(?P<request>\d{1,12}) to|sending response to request #\d{1,12} to"
    r"|reading incoming (?:request|response) from) "
    r"(?P<peer>[^\s:]{1,120}): (?P<error>[^\n]{1,300})")
_REFUSED = ("econnrefused", "connection refused")
_INIT_NOTE = ("the RPC agents never got connected: check that every worker started and that the address "
              "TensorPipe picked for each is reachable from the others (TP_SOCKET_IFNAME names the "
              "interface; tensorpipe's shm/ibv transports can be turned off with _transports=['uv'])")
_LOST_NOTE = ("the RPC peer went away while requests were in flight (an EOF / reset is the other end "
              "terminating abruptly): its own log holds the cause")


def _rule_tensorpipe_agent(t: _Text) -> Optional[_Hit]:
    """A TensorPipe agent's failed request or response: comm/init-failure when the peer refused the
    connection or the agent's first request (#0, ``init_rpc``'s round) failed, else comm/rank-lost."""
    for pos in t.find_all("encountered error when"):
        found = _search(_AGENT_RE, t, pos, before=160, after=460)
        if found is None:
            continue
        m = found[1]
        error = m.group("error").strip()
        facts: Facts = {"backend": "tensorpipe", "agent": m.group("me"), "peer": m.group("peer"),
                        "error": _shorten(error, 160)}
        refused = any(needle in error.lower() for needle in _REFUSED)
        first = m.group("request") == "0"
        if refused or first:
            facts["at"] = "connect" if refused else "first request (init_rpc)"
            return _Hit("comm", "init-failure", 0.7, found[0] + m.start(), facts,
                        f"RPC agent {facts['agent']} could not reach {facts['peer']} "
                        f"({'refused' if refused else 'its first request failed'}): {_shorten(error, 80)}",
                        _INIT_NOTE)
        return _Hit("comm", "rank-lost", 0.7, found[0] + m.start(), facts,
                    f"RPC peer {facts['peer']} lost (agent {facts['agent']}: {_shorten(error, 80)})",
                    _LOST_NOTE)
    return None


GATES = {"rpc.tensorpipe-agent": ("encountered error when",)}
"""Each rule's needles (see :data:`trainguard_engine.classify.GATES`)."""

DOCS = {
    "rpc.tensorpipe-agent": (
        "TensorPipe's ``RPC agent for <me> encountered error when <sending/reading> ... <peer>: <reason>`` → "
        "comm/init-failure when the peer refused the connection or the agent's first request (``#0``, "
        "``init_rpc``'s all-gather round) failed, else comm/rank-lost (``eof``, ``ECONNRESET``: the peer "
        "went away)"),
}
"""What each rule of this module recognises, and the kind it gives (docs/classifier.md is made of these)."""
