"""Classifier rule for Horovod's view of a peer that left: once one rank raised or finished, Horovod stops its
background loop, and every collective the other ranks still submit (``hvd.allreduce``, the
``DistributedOptimizer``'s gradient reduction, TensorFlow's ``HorovodAllreduce`` ops) fails with

    Horovod has been shut down. This was caused by an exception on one of the ranks or an attempt to
    allreduce, allgather or broadcast a tensor after one of the ranks finished execution. If the shutdown was
    caused by an exception, you should see the exception in the log before the first shutdown message.

(older Horovod: ``This has been caused by ...``). Those errors are the survivors' consequence of a peer gone
(comm/rank-lost); as the message itself says, an exception printed BEFORE the first of them is the cause, so
the rule steps aside for a text that has one.
"""

from __future__ import annotations

import re
from typing import Optional

from .text import Facts, _Hit, _on_rank, _rank_of, _search, _Text

_NEEDLE = "horovod has been shut down"
_SHUT_DOWN_RE = re.compile(r"Horovod has been shut down\. This (?:was|has been) caused by an exception "
                           r"on one of the ranks")
_ERROR_LINE_RE = re.compile(r"(?m)^[ \t]*(?:\[[^\]\n]{1,24}\][^:\n]{0,24}:)?[ \t]*[A-Za-z_][\w.]{0,160}"
                            r"(?:Error|Exception)(?::|[ \t]*$)")
"""A Python exception's own line (``ValueError: ...``, also behind an mpirun ``[1,0]<stderr>:`` prefix).
Anchored at a line's start, every quantifier bounded: a scan of all the text before the message is linear."""
_HEADER_RE = re.compile(r"[ \t]{0,8}\d{1,6} root error\(s\) found|"
                        r"[^\n]{0,300}?\bOP_REQUIRES failed")
"""What follows the exception type on a header that names no culprit, only the shutdown below it:
TensorFlow's ``UnknownError: 2 root error(s) found.`` (its ``(0) Unknown: Horovod has been shut down ...``
follows) or an ``OP_REQUIRES failed at mpi_ops.cc:316 : Unknown: ...`` line."""
_NOTE = ("Horovod stopped because another rank raised an exception or finished early (training ended on one "
         "rank, e.g. by early stopping, while the others still reduce): that rank's own log holds the cause")


def _rule_shut_down(t: _Text) -> Optional[_Hit]:
    """Horovod's ``Horovod has been shut down. This was caused by an exception on one of the ranks ...`` with
    no exception printed anywhere before it (from the text's start; TensorFlow's header of the shutdown
    itself, :data:`_HEADER_RE`, is none) → comm/rank-lost. One printed before it, even on the line right
    above (mpirun interleaves the ranks: the culprit's ``[1,0]<stderr>:ValueError: ...`` and a survivor's
    shutdown line), is the cause: the rule steps aside."""
    pos = t.first(_NEEDLE)
    if pos < 0 or (found := _search(_SHUT_DOWN_RE, t, pos, before=0, after=120)) is None:
        return None
    line_start = t.text.rfind("\n", 0, pos) + 1
    for m in _ERROR_LINE_RE.finditer(t.text, 0, line_start):
        if _HEADER_RE.match(t.text, m.end()) is None:  # no header of the shutdown's own: the cause
            return None
    facts: Facts = {"backend": "horovod"}
    rank = _rank_of(t, pos, facts)
    return _Hit("comm", "rank-lost", 0.6, found[0] + found[1].start(), facts,
                f"Horovod has been shut down{_on_rank(rank)}: another rank raised or finished first", _NOTE)


GATES = {"horovod.shut-down": (_NEEDLE,)}
"""The rule's needle (see ``classify.GATES``)."""

DOCS = {
    "horovod.shut-down": (
        "Horovod's ``Horovod has been shut down. This was caused by an exception on one of the ranks or an "
        "attempt to allreduce, allgather or broadcast a tensor after one of the ranks finished execution`` "
        "(also ``This has been caused by``; behind mpirun's ``[1,3]<stderr>:`` or inside TensorFlow's "
        "``OP_REQUIRES failed ... Unknown:``) → comm/rank-lost: a peer raised or finished first (steps aside "
        "when an exception line is printed anywhere before it, other than TensorFlow's ``N root error(s) "
        "found`` header of the shutdown itself: that exception is the cause)"
    ),
}
"""What the rule recognises (docs/classifier.md is made of these)."""
