"""Classifier rules for Horovod: its view of a peer that left (and its coordinator's mismatch report,
:func:`_rule_mismatch`): once one rank raised or finished, Horovod stops its
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


_MISMATCH_NEEDLE = ", but another rank "
_MISMATCH_RE = re.compile(r"Mismatched (?P<what>data types|(?:MPI )?operations|prescale and/or postscale "
                          r"factors|(?:[A-Z_]{3,20} )?(?:tensor shapes|root ranks|CPU/GPU device "
                          r"selection)): One rank (?P<one>[^\n]{1,200}?), but another rank "
                          r"(?P<other>[^\n]{1,200}?)\.?[ \t]*$", re.MULTILINE)
"""Horovod's coordinator refusing a collective the ranks submitted differently (horovod/common/controller.cc,
its fixed ``Mismatched <what>: One rank ..., but another rank ...`` forms): ``Mismatched data types: One rank
had type float32, but another rank had type float16.``, ``Mismatched MPI operations: One rank did an
ALLREDUCE, but another rank did an ALLGATHER.``, ``Mismatched ALLREDUCE tensor shapes: One rank sent a
tensor of shape [10], but another rank sent a tensor of shape [12].``, ``Mismatched BROADCAST root ranks:
...``, ``Mismatched ALLREDUCE CPU/GPU device selection: One rank specified device GPU, but another rank
specified device CPU.`` (horovod/horovod#748, through TensorFlow's ``FailedPreconditionError``). ``<what>`` is
controller.cc's own set (the request type upper case: ALLREDUCE, ALLGATHER, BROADCAST, ADASUM, ALLTOALL,
REDUCE), not free text: ``Note: Mismatched learning rates: One rank ..., but another rank ...`` is prose
(hR3 LOW-6)."""


def _rule_mismatch(t: _Text) -> Optional[_Hit]:
    """Horovod's ``Mismatched <what>: One rank ..., but another rank ...`` → comm/mismatch: the ranks
    submitted the same-named collective with different types, shapes, devices or operations."""
    pos = t.first(_MISMATCH_NEEDLE)
    if pos < 0 or (found := _search(_MISMATCH_RE, t, pos, before=300, after=240)) is None:
        return None
    m = found[1]
    facts: Facts = {"backend": "horovod", "mismatch": m.group("what").strip(),
                    "error": f"Mismatched {m.group('what')}: One rank {m.group('one')}, but another rank "
                             f"{m.group('other')}"}
    rank = _rank_of(t, found[0] + m.start(), facts)
    return _Hit("comm", "mismatch", 0.85, found[0] + m.start(), facts,
                f"Horovod: ranks disagree on a collective ({m.group('what').strip()}){_on_rank(rank)}",
                "the ranks submitted the same collective differently (dtype, shape, device or operation): a "
                "rank-dependent code path or model, or a node whose framework does not see its GPU "
                "(CPU on one rank, GPU on the others)")


GATES = {"horovod.shut-down": (_NEEDLE,), "horovod.mismatch": (_MISMATCH_NEEDLE,)}
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
    "horovod.mismatch": (
        "Horovod's coordinator ``Mismatched <what>: One rank ..., but another rank ...`` (data types, MPI "
        "operations, tensor shapes, root ranks, CPU/GPU device selection) → comm/mismatch"
    ),
}
"""What the rules recognise (docs/classifier.md is made of these)."""
