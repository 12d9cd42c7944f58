"""Which log text is worth the classifier's look even below the log level a reader keeps.

A job's most telling lines often carry no level: ``RuntimeError: NCCL communicator was aborted``,
``torch.OutOfMemoryError: CUDA out of memory``, a watchdog line from a logger that prints INFO. Readers
that filter by level (``trainguard replay --log-level``, the agent's output capture) keep such a line when
:func:`recognised` says so: a cheap substring scan first, then the classifier itself.
"""

from __future__ import annotations

import re

from trainguard_engine.classify import classify_text

NEEDLES = ("out of memory", "CUDA", "NCCL", "nccl", "Watchdog", "ChildFailedError", "exitcode", "Xid",
           "Fatal Python error", "mismatch", "Timed out", "timed out", "rendezvous", "Rendezvous",
           "Connection reset", "Connection closed", "device-side assert", "Assertion", "Traceback")
"""Substrings that make a below-level line worth the classifier's look."""
_NEEDLE_RE = re.compile("|".join(re.escape(n) for n in NEEDLES))  # one scan of the line for all of them


def recognised(message: str) -> bool:
    """Whether ``message`` is text the classifier gives a kind (a plain Python exception line aside:
    those come with their traceback, which is always kept)."""
    return _NEEDLE_RE.search(message) is not None and classified(message)


def classified(message: str) -> bool:
    """:func:`recognised` without the substring pre-scan: every line goes to the classifier (~20 µs a
    line). ``trainguard replay`` uses it -- a pasted or saved log is read once, and a line that names a
    failure in words the scan does not list (``loss is nan``, ``OVERFLOW! ... reducing to``) must still
    reach it; the agent keeps the scan (it reads a live job's output at up to thousands of lines/s)."""
    found = classify_text(message)
    return found is not None and found.rule != "python.exception"
