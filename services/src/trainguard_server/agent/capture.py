"""The job's output, line by line, into log and exception events (the agent's log tailer core).

Contract of :class:`OutputCapture` (one per source: the child's stdout or stderr, or one log file):

* ``line(number, raw, now_ns)`` takes one physical line (bytes decoded by the caller, newline optional).
  It is cleaned (:func:`~trainguard_server.replay.logs.clean_line`) and returned (the agent keeps the last
  lines of all sources, in arrival order, for its hang report), and segmented
  (:class:`~trainguard_server.replay.logs.LogSegmenter`: ``[rankN]:`` prefixes route lines to rank N;
  Python / faulthandler / C++ tracebacks become one exception each, fingerprinted as the SDK would).
* What is sent: every traceback; every line at or above ``min_level`` (WARNING by default, as the SDK's
  logging integration forwards); and any lower or level-less line that the shared error-text classifier
  (:func:`trainguard_engine.classify.classify_text`) recognises (a CUDA OOM printed with ``print``, a
  torchrun failure summary, NCCL text) -- checked only for lines holding one of the needles of
  :mod:`trainguard_server.replay.recognised`, so a plain line costs a few substring searches.
* torchrun's ``ChildFailedError`` summary (:data:`LAUNCHER_SUMMARY`) is sent as one ERROR log line, not
  as an exception of the launcher.
* Times: a line's time is when the agent read it (``now_ns``); a traceback's, its first line's.
* ``idle(now_ns)`` closes an open traceback when the source has been quiet for ``block_quiet_s`` (a
  process that printed its traceback and hangs on in atexit handlers); ``close()`` closes everything.
"""

from __future__ import annotations

import threading
from typing import Callable, List

from ..replay.logs import LogItem, LogSegmenter, clean_line
from ..replay.recognised import recognised
from .events import Event, EventBuilder

LAUNCHER_SUMMARY = "ChildFailedError"
"""torchrun's own traceback summarising a rank's failure: the rank's failure seen again, so it is sent as the
launcher's log text (classified as text: a comm/memory root cause in it still counts) and not as a second,
launcher-side exception."""
MAX_SUMMARY_CHARS = 8192


class OutputCapture:
    def __init__(self, source: str, rank: int, builder: EventBuilder, emit: Callable[[List[Event]], None], *,
                 step_of: Callable[[int], int] = lambda rank: -1, min_level: str = "WARNING",
                 block_quiet_s: float = 1.0, id_source: str = "") -> None:
        self.source = source
        self.id_source = id_source or source
        self.rank = rank
        self.builder = builder
        self.emit = emit
        self.step_of = step_of
        self.block_quiet_ns = int(block_quiet_s * 1e9)
        # live: nothing waits for a progress line that a hang never prints (LogSegmenter.hold_unsettled)
        self.segmenter = LogSegmenter(rank, min_level=min_level, keep_below=recognised, hold_unsettled=False)
        self.last_line_ns = 0
        self.lines = 0
        self.sent = 0
        self._lock = threading.Lock()   # a pump thread feeds lines, the agent's loop calls idle()

    def line(self, number: int, raw: str, now_ns: int) -> str:
        """Take one line; returns it cleaned."""
        with self._lock:
            return self._line(number, raw, now_ns)

    def _line(self, number: int, raw: str, now_ns: int) -> str:
        text = clean_line(raw)
        self.lines += 1
        self.last_line_ns = now_ns
        segmenter = self.segmenter
        segmenter.feed(number, text, now_ns)
        items = segmenter.take()
        if items:
            self._send(items)
        return text

    def idle(self, now_ns: int) -> None:
        with self._lock:
            if self.segmenter.open_blocks and now_ns - self.last_line_ns >= self.block_quiet_ns:
                self._send(self.segmenter.flush())

    def close(self) -> None:
        with self._lock:
            self._send(self.segmenter.flush())

    def _send(self, items: List[LogItem]) -> None:
        events: List[Event] = []
        for item in items:
            if item.kind == "exception" and str(item.payload.get("type", "")).endswith(LAUNCHER_SUMMARY):
                item = LogItem("log", item.rank, item.line, item.last_line, item.time_ns, "ERROR",
                               str(item.payload.get("traceback", ""))[:MAX_SUMMARY_CHARS])
            time_ns = item.time_ns or self.last_line_ns
            events.append(self.builder.log_item(item, self.source, self.step_of(item.rank), time_ns,
                                                 id_source=self.id_source))
        if events:
            self.sent += len(events)
            self.emit(events)

