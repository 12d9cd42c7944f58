"""Classifier rule for HCCL (Huawei Ascend's collective library, under ``torch_npu``) timing out: its error
codes print a fixed sentence whatever the stack above them (vLLM-Ascend, MindSpeed, LLaMA-Factory, lmdeploy)::

    EI0002: [PID: N] <time> The wait execution of the Notify register times out. Reason: The Notify register
        has not received the Notify record from remote rank: [r]. ...
    EI0006: [PID: N] <time> Getting socket times out. Reason: Remote Rank did not send the data in time.
        Please check the reason for the rank being stuck

EI0002 is a collective whose peers did not arrive within ``HCCL_EXEC_TIMEOUT`` (NCCL's watchdog timeout),
EI0006 a socket wait past ``HCCL_CONNECT_TIMEOUT``; both are this rank waiting on a stuck or dead peer: a
collective timeout (comm/timeout; raised while the group is being set up, the frames rule makes it an
init failure). The ``torch_npu`` exception above them (``OPS function error: HcclAllreduce, error code is
6``) names no cause of its own.
"""

from __future__ import annotations

import re
from typing import Optional

from .text import Facts, _Hit, _on_rank, _rank_of, _search, _Text

_NEEDLES = ("notify register times out", "getting socket times out")
_TIMEOUT_RE = re.compile(r"(?:(?P<code>EI000[26]):?[^\n]{0,80}?)?"
                         r"(?:The wait execution of the Notify register times out|Getting socket times out)")
_NOTE = ("HCCL waited on a peer past its timeout (HCCL_EXEC_TIMEOUT for a collective, HCCL_CONNECT_TIMEOUT "
         "for a socket): a rank is stuck or died first -- look for the earliest error on the other ranks, "
         "then raise the timeout only if they were merely slow")


def _rule_hccl_timeout(t: _Text) -> Optional[_Hit]:
    """HCCL's EI0002 ``The wait execution of the Notify register times out`` / EI0006 ``Getting socket times
    out`` (also without the code) → comm/timeout."""
    for needle in _NEEDLES:
        pos = t.first(needle)
        if pos < 0 or (found := _search(_TIMEOUT_RE, t, pos, before=100, after=60)) is None:
            continue
        m = found[1]
        facts: Facts = {"backend": "hccl"}
        if m.group("code"):
            facts["code"] = m.group("code")
        rank = _rank_of(t, pos, facts)
        what = "a collective" if needle.startswith("notify") else "a socket"
        return _Hit("comm", "timeout", 0.85, found[0] + m.start(), facts,
                    f"HCCL timed out waiting on a peer ({what}){_on_rank(rank)}", _NOTE)
    return None


GATES = {"hccl.timeout": _NEEDLES}
"""The rule's needles (see ``classify.GATES``)."""

DOCS = {
    "hccl.timeout": (
        "HCCL (Ascend NPUs, ``torch_npu``) ``EI0002: ... The wait execution of the Notify register times "
        "out`` and ``EI0006: ... Getting socket times out. Reason: Remote Rank did not send the data in "
        "time`` (also without the code) → comm/timeout: this rank waited on a stuck or dead peer past "
        "HCCL_EXEC_TIMEOUT / HCCL_CONNECT_TIMEOUT"
    ),
}
"""What the rule recognises (docs/classifier.md is made of these)."""
