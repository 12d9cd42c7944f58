"""Classifier rules for RPC-based coordination text: torch.distributed.rpc's TensorPipe agent's errors on its
connections, and the coordination service JAX (XLA's PJRT) runs over gRPC between the processes of a job.

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


_COORD_INIT_RE = re.compile(
    r"DEADLINE_EXCEEDED: (?:Barrier timed out\. (?:Barrier_id|Id): (?P<barrier>[\w\[\]:]{1,80})"
    r"|Deadline Exceeded)")
_COORD_INIT_BARRIERS = ("PjRT_Client_Connect", "Wait_for_all_tasks_to_register")
_COORD_LOST_RE = re.compile(
    r"(?P<task>/job:[\w-]{1,40}/replica:\d{1,6}/task:(?P<id>\d{1,6})) heartbeat timeout|another task died"
    r"|the leader task was preempted/died/restarted unexpectedly")
_COORD_NEEDLES = ("deadline_exceeded:", "heartbeat timeout", "another task died", "leader task was preempted")


def _rule_coordination(t: _Text) -> Optional[_Hit]:
    """JAX's distributed coordination service (``jax.distributed.initialize``; XLA's PJRT client over
    gRPC): its start-up barrier or task registration running out of time -- ``XlaRuntimeError:
    DEADLINE_EXCEEDED: Barrier timed out. Barrier_id: PjRT_Client_Connect. Timed out task names: ...``
    (ayaka14732/llama-2-jax#20: the other processes never started), ``Barrier timed out. Id:
    [Init]Wait_for_all_tasks_to_register::0``, ``... /tensorflow.CoordinationService/RegisterTask: ...
    Deadline Exceeded`` -- is comm/init-failure; a task the service stopped hearing from
    (``/job:jax_worker/replica:0/task:3 heartbeat timeout. This indicates that the remote task has failed, got
    preempted, or crashed unexpectedly``, ``... detected fatal errors. This most likely indicates that another
    task died``) is comm/rank-lost. A barrier of the program's own (a custom id after start-up) is not
    read."""
    pos = t.first(*_COORD_NEEDLES)
    if pos < 0:
        return None
    for at in t.find_all("deadline_exceeded:"):
        found = _search(_COORD_INIT_RE, t, at, before=0, after=140)
        if found is None:
            continue
        m = found[1]
        barrier = m.group("barrier")
        window = t.lower[max(0, at - 400): at + 600]
        if (barrier is not None and not any(name in barrier for name in _COORD_INIT_BARRIERS)) or (
                barrier is None and "registertask" not in window):
            continue
        facts: Facts = {"service": "coordination", "error": _shorten(t.line_at(at), 160)}
        if barrier:
            facts["barrier"] = barrier
        return _Hit("comm", "init-failure", 0.8, found[0] + m.start(), facts,
                    "JAX's distributed start-up timed out: not every process registered with the "
                    "coordination service", "every process of the job must call "
                    "jax.distributed.initialize with the same coordinator and num_processes, each its own "
                    "process_id; a process that did not start (or started late: initialization_timeout) "
                    "leaves the others at this barrier")
    for needle in ("heartbeat timeout", "another task died", "leader task was preempted"):
        at = t.first(needle)
        if at < 0 or (found := _search(_COORD_LOST_RE, t, at, before=80, after=80)) is None:
            continue
        m = found[1]
        lost: Facts = {"service": "coordination", "error": _shorten(t.line_at(at), 160)}
        if m.group("id") is not None:
            lost["lost_task"] = int(m.group("id"))
        return _Hit("comm", "rank-lost", 0.7, found[0] + m.start(), lost,
                    "JAX's coordination service lost a process of the job"
                    + (f" (task {lost['lost_task']})" if "lost_task" in lost else ""),
                    "a process stopped answering the coordination service (it crashed, was preempted or its "
                    "node failed): its own log holds the cause")
    return None


GATES = {"rpc.tensorpipe-agent": ("encountered error when",), "xla.coordination": _COORD_NEEDLES}
"""Each rule's needles (see :data:`trainguard_engine.classify.GATES`)."""

DOCS = {
    "rpc.tensorpipe-agent": (
        "TensorPipe's ``RPC agent for <me> encountered error when <sending/reading> ... <peer>: <reason>`` → "
        "comm/init-failure when the peer refused the connection or the agent's first request (``#0``, "
        "``init_rpc``'s all-gather round) failed, else comm/rank-lost (``eof``, ``ECONNRESET``: the peer "
        "went away)"),
    "xla.coordination": (
        "JAX's distributed coordination service: ``DEADLINE_EXCEEDED: Barrier timed out. Barrier_id: "
        "PjRT_Client_Connect`` / ``Id: [Init]Wait_for_all_tasks_to_register`` or a ``RegisterTask`` call's "
        "``Deadline Exceeded`` → comm/init-failure (a program's own barrier not read); a task's "
        "``heartbeat timeout``, ``... another task died``, ``the leader task was preempted/died/restarted "
        "unexpectedly`` → comm/rank-lost"),
}
"""What each rule of this module recognises, and the kind it gives (docs/classifier.md is made of these)."""
