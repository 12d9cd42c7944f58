"""What a native crash leaves behind, as an event: faulthandler's dump from a dead process's spool directory.

Contract of :func:`fault_event`: the text faulthandler wrote (``Fatal Python error: Aborted`` + the stack
of the crashing thread, or of every thread with the current one first) becomes one ``exception`` envelope
of the dead process (its identity from ``.owner``): type ``Fatal Python error``, the message after it
(``Aborted``, ``Segmentation fault``, ...), the current thread's Python frames innermost last,
fingerprinted like any exception (:mod:`trainguard.core.tracebacks`), ``mechanism="faulthandler"``,
``handled`` false, the whole dump as its traceback. Text that holds no such dump (cut short) is sent as a
CRITICAL ``log`` event, so it is not lost either. The event id is derived from the directory and the text:
whoever converts the same file (the next SDK process, ``trainguard agent``) sends the same id, which the
platform keeps once.
"""

from __future__ import annotations

import hashlib
from typing import Any, Dict, Mapping

from .core import events as ev
from .core.tracebacks import FATAL_ERROR_TYPE, parse_traceback_text

MECHANISM = "faulthandler"
MAX_FRAMES = 128
MAX_MESSAGE_CHARS = 8_192
MAX_TRACEBACK_CHARS = 64_000
IDENTITY_FIELDS = ("project", "run_id", "trace_id", "host", "pid", "rank", "local_rank", "world_size",
                   "group_rank", "run_name", "sdk")


def frame_dict(frame: Any) -> Dict[str, Any]:
    """A Frame message (JSON mapping) for a :class:`~trainguard.core.fingerprint.FrameInfo`."""
    out: Dict[str, Any] = {"filename": frame.filename, "module": frame.module,
                           "function": frame.function, "lineno": frame.lineno, "in_app": frame.in_app}
    if getattr(frame, "context_line", ""):
        out["context_line"] = frame.context_line
    return out


def fault_event(text: str, owner: Mapping[str, Any], *, key: str, time_ns: int, step: int = -1) -> ev.Event:
    """The envelope for faulthandler's ``text`` of the process described by ``owner`` (see the module doc);
    ``key`` names where the text was found (its spool directory), for the deterministic event id."""
    base = {name: owner[name] for name in IDENTITY_FIELDS if name in owner}
    event_id = hashlib.sha256(f"{key}\0{text}".encode("utf-8", "replace")).hexdigest()[:32]
    fatal = [p for p in parse_traceback_text(text) if p.exc_type == FATAL_ERROR_TYPE]
    if not fatal:
        payload = {"logger": "faulthandler", "level": "CRITICAL", "source": MECHANISM,
                   "message": ev.safe_str(text, MAX_TRACEBACK_CHARS)}
        return ev.envelope(base, "log", payload, step=step, time_unix_nano=time_ns, severity="CRITICAL",
                           event_id=event_id)
    parsed = fatal[0]
    frames = list(parsed.frames)
    offset = max(0, len(frames) - MAX_FRAMES)
    printed = parsed.fingerprint().to_dict()
    printed["hints"] = [dict(h, frame_index=h["frame_index"] - offset) for h in printed["hints"]
                        if h["frame_index"] >= offset]
    printed["message_template"] = ev.safe_str(printed["message_template"], MAX_MESSAGE_CHARS)
    exception: Dict[str, Any] = {
        "type": FATAL_ERROR_TYPE, "message": ev.safe_str(parsed.message, MAX_MESSAGE_CHARS),
        "handled": False, "mechanism": MECHANISM, "traceback": ev.safe_str(text, MAX_TRACEBACK_CHARS),
        "frames": [frame_dict(f) for f in frames[offset:]],
    }
    exception.update(printed)
    return ev.envelope(base, "exception", exception, step=step, time_unix_nano=time_ns, severity="CRITICAL",
                       event_id=event_id)
