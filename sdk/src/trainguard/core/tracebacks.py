"""Parse traceback TEXT (logs, stderr captures) into exceptions with frames, and fingerprint it.

What it reads:

* Python tracebacks (``Traceback (most recent call last):``), chained ones included ("The above
  exception was the direct cause..." -> ``relation="cause"``, "During handling of the above
  exception..." -> ``"context"``), Python 3.11+ caret lines and "[Previous line repeated N more times]".
* Tracebacks embedded in another exception's message -- ``torch.utils.data`` workers ("Original
  Traceback (most recent call last):"), ``torch.multiprocessing.spawn`` ("-- Process N terminated with
  the following error:") and torchrun's ``ChildFailedError`` summary ("traceback : Traceback ...",
  indented). The host exception keeps the whole text as its message (exactly as ``str(exc)`` would be);
  each embedded exception is also returned, just before its host, the last of each embedded chain with
  ``relation="embedded"``. Limitation: a chain separator right after an embedded traceback is taken as
  part of the embedded text (the common case: a worker's own chained exception).
* Line prefixes that launchers add -- ``[rank1]:`` (torch >= 2.2) and ``[default0]:`` (older torchrun)
  -- are stripped; lines are demultiplexed by prefix first, so interleaved output of several ranks
  parses as one traceback per rank (``ParsedException.stream`` names the prefix).
* ``faulthandler`` dumps ("Fatal Python error: Aborted" + "Current thread 0x... (most recent call
  first):"); frames are printed innermost first and reversed here. Type ``"Fatal Python error"``.
* C++ terminations ("terminate called after throwing an instance of 'c10::DistBackendError'" + "what():"),
  with the "frame #N:" backtrace that c10 errors carry (native frames, ``in_app=False``).

Frames are derived exactly as :func:`trainguard.core.fingerprint.frames_from_traceback` derives them from
a live traceback, so ``fingerprint_text(text)`` equals ``fingerprint_exception(exc)`` for the text Python
printed for ``exc``. Pure: no I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from trainguard.core.fingerprint import (
    Fingerprint,
    FrameInfo,
    fingerprint,
    is_library_path,
    module_from_filename,
)

RELATION_CAUSE = "cause"
RELATION_CONTEXT = "context"
RELATION_EMBEDDED = "embedded"
FATAL_ERROR_TYPE = "Fatal Python error"
MAX_EMBEDDING_DEPTH = 8
"""Tracebacks embedded deeper than this are kept as plain message text (bounded recursion)."""


@dataclass(frozen=True)
class ParsedException:
    """One exception found in a text. ``relation`` is ``""`` for the last (outermost) exception of a
    printed chain, ``"cause"``/``"context"`` for one printed before a separator (it is the cause/context
    of the next), ``"embedded"`` for the last exception of a traceback printed inside another
    exception's message. ``stream`` is the launcher prefix of its lines (``"rank1"``), or ``""``."""

    exc_type: str
    message: str
    frames: Tuple[FrameInfo, ...]
    relation: str
    stream: str = ""

    def fingerprint(self) -> Fingerprint:
        """The ``fp:v1`` fingerprint of this exception."""
        return fingerprint(self.exc_type, self.message, self.frames)


_PREFIX_RE = re.compile(r"^\[(?P<stream>[A-Za-z_]+\d+)\]:(?: )?")
_HEADER_RE = re.compile(r"^(?P<indent>\s*)(?P<lead>.*?)Traceback \(most recent call last\):\s*$")
_CAUSE_RE = re.compile(r"^\s*The above exception was the direct cause of the following exception:\s*$")
_CONTEXT_RE = re.compile(r"^\s*During handling of the above exception, another exception occurred:\s*$")
_FILE_RE = re.compile(r'^(?P<indent>\s*)File "(?P<file>.*)", line (?P<line>\d+), in (?P<func>.*?)\s*$')
_CARET_RE = re.compile(r"^\s*[\^~]+\s*$")
_EXC_LINE_RE = re.compile(r"^(?P<type>[A-Za-z_][\w.<>]*)(?::\s?(?P<msg>.*))?$")
_FATAL_RE = re.compile(r"^Fatal Python error: (?P<msg>.*?)\s*$")
_THREAD_RE = re.compile(r"^(?:(?P<current>Current thread)|Thread|Stack)\b.*\(most recent call first\):\s*$")
_FAULT_FILE_RE = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+|\?\?\?) in (?P<func>.*?)\s*$')
_TERMINATE_RE = re.compile(r"^terminate called after throwing an instance of '(?P<type>[^']+)'\s*$")
_WHAT_RE = re.compile(r"^\s*what\(\):\s+(?P<msg>.*)$")
_CPP_RAISED_RE = re.compile(r"^Exception raised from .* \(most recent call first\):\s*$")
_CPP_FRAME_RE = re.compile(
    r"^frame #\d+: (?P<sym>.*?)(?: \+ 0x[0-9a-fA-F]+)? \((?:0x[0-9a-fA-F]+ )?in (?P<lib>[^)]*)\)\s*$"
)
_NATIVE_MODULE_RE = re.compile(r"\.so(?:\.[\d.]+)?$|\.dylib$|\.dll$|\.pyd$")
# Lines that end an exception's message: new log records and process-level banners.
_BREAK_RE = re.compile(
    r"^(?:[IWEF]\d{4} \d\d:\d\d:\d\d"                     # glog / c10 logging
    r"|\[?\d{4}-\d\d-\d\d[ T]\d\d:\d\d"                    # timestamped log records
    r"|\[[IWEF]\d{0,4}[ \]]"                               # c10d "[E ProcessGroupNCCL.cpp:...]"
    r"|(?:DEBUG|INFO|WARNING|ERROR|CRITICAL):[\w.]*:"      # logging.basicConfig default format
    r"|Exception in thread |Exception ignored in|Process [\w-]+:$"
    r"|(?:srun|slurmstepd|wandb|mpirun|torchrun): "         # launchers and trackers sharing the log
    r"|Fatal Python error: |terminate called after throwing)"
)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _dedent(line: str, width: int) -> str:
    head = line[:width]
    return line[width:] if not head.strip() else line.lstrip()


def _python_frame(match: re.Match[str], prefixes: Sequence[str], context: str = "") -> FrameInfo:
    filename = match.group("file")
    line = match.group("line")
    return FrameInfo(
        filename=filename,
        module=module_from_filename(filename, prefixes),
        function=match.group("func"),
        lineno=int(line) if line.isdigit() else 0,
        in_app=not is_library_path(filename, prefixes),
        context_line=context,
    )


_Found = List[Tuple[int, ParsedException]]
_Block = Tuple[str, str, Tuple[FrameInfo, ...], _Found, int]


class _Parser:
    """Recursive-descent parser over the lines of one stream (prefixes already stripped)."""

    def __init__(self, lines: List[str], stream: str, prefixes: Sequence[str]) -> None:
        self.lines = lines
        self.stream = stream
        self.prefixes = prefixes
        self.depth = 0  # nesting of embedded tracebacks being parsed

    # -- top level ------------------------------------------------------------------------------------
    def parse(self) -> List[Tuple[int, ParsedException]]:
        """(index of the line where its top-level print starts, exception), in printed order."""
        found: List[Tuple[int, ParsedException]] = []
        i = 0
        n = len(self.lines)
        while i < n:
            start = i
            line = self.lines[i]
            if _HEADER_RE.match(line):
                chain, i = self._print(i, "")
                found.extend((start, exc) for _, exc in chain)
            elif _FATAL_RE.match(line):
                (_, exc), i = self._fatal(i)
                found.append((start, exc))
            elif _TERMINATE_RE.match(line):
                (_, exc), i = self._terminate(i)
                found.append((start, exc))
            else:
                i += 1
        return found

    def _print(self, i: int, last_relation: str) -> Tuple[List[Tuple[int, ParsedException]], int]:
        """A printed chain: block (separator block)*; the last block gets ``last_relation``."""
        out: List[Tuple[int, ParsedException]] = []
        n = len(self.lines)
        while True:
            start = i
            base = _indent(self.lines[i])
            exc_type, message, frames, embedded, i = self._block(i)
            out.extend(embedded)
            j = i
            while j < n and not self.lines[j].strip():
                j += 1
            relation = ""
            if j < n and _indent(self.lines[j]) <= base + 2:
                if _CAUSE_RE.match(self.lines[j]):
                    relation = RELATION_CAUSE
                elif _CONTEXT_RE.match(self.lines[j]):
                    relation = RELATION_CONTEXT
            nxt = j + 1
            while relation and nxt < n and not self.lines[nxt].strip():
                nxt += 1
            if relation and nxt < n and _HEADER_RE.match(self.lines[nxt]):
                out.append((start, ParsedException(exc_type, message, frames, relation, self.stream)))
                i = nxt
                continue
            out.append((start, ParsedException(exc_type, message, frames, last_relation, self.stream)))
            return out, i

    def _block(self, i: int) -> _Block:
        """Header at ``i``, frames, exception line and message; returns the index after the message."""
        lines = self.lines
        n = len(lines)
        base = _indent(lines[i])
        i += 1
        frames: List[FrameInfo] = []
        while i < n:
            line = lines[i]
            if not line.strip():
                i += 1
                continue
            if _indent(line) <= base:
                break
            match = _FILE_RE.match(line)
            if match:
                context = ""
                if i + 1 < n and _indent(lines[i + 1]) > _indent(line) and not _FILE_RE.match(lines[i + 1]) \
                        and not _CARET_RE.match(lines[i + 1]):
                    context = lines[i + 1].strip()
                frames.append(_python_frame(match, self.prefixes, context))
            i += 1
        if i >= n:
            return "", "", tuple(frames), [], i
        first = _dedent(lines[i], base).rstrip()
        match = _EXC_LINE_RE.match(first)
        if match:
            exc_type, msg_lines = match.group("type"), [match.group("msg") or ""]
        else:
            exc_type, msg_lines = "", [first]
        i += 1
        embedded: List[Tuple[int, ParsedException]] = []
        while i < n:
            line = lines[i]
            stripped = line.strip()
            indent = _indent(line)
            if stripped and base and indent < base:
                break  # an embedded traceback's message ends where its indentation does
            if stripped and indent <= base and (_CAUSE_RE.match(line) or _CONTEXT_RE.match(line)
                                                or _BREAK_RE.match(line.lstrip())):
                break
            header = _HEADER_RE.match(line)
            if header and self.depth < MAX_EMBEDDING_DEPTH:
                previous = next((m for m in reversed(msg_lines) if m.strip()), "")
                if header.group("lead") or indent > base or previous.rstrip().endswith(":"):
                    self.depth += 1
                    try:
                        sub, end = self._print(i, RELATION_EMBEDDED)
                    finally:
                        self.depth -= 1
                    embedded.extend(sub)
                    msg_lines.extend(_dedent(x, base) for x in lines[i:end])
                    i = end
                    continue
                break
            msg_lines.append(_dedent(line, base))
            i += 1
        while len(msg_lines) > 1 and not msg_lines[-1].strip():
            msg_lines.pop()
            i -= 1
        return exc_type, "\n".join(msg_lines).rstrip(), tuple(frames), embedded, i

    # -- faulthandler ---------------------------------------------------------------------------------
    def _fatal(self, i: int) -> Tuple[Tuple[int, ParsedException], int]:
        lines = self.lines
        n = len(lines)
        start = i
        match = _FATAL_RE.match(lines[i])
        message = match.group("msg") if match else ""
        i += 1
        threads: List[Tuple[bool, List[FrameInfo]]] = []
        current: Optional[List[FrameInfo]] = None
        while i < n:
            line = lines[i]
            thread = _THREAD_RE.match(line)
            if thread:
                current = []
                threads.append((bool(thread.group("current")), current))
            elif current is not None and (fmatch := _FAULT_FILE_RE.match(line)) is not None:
                current.append(_python_frame(fmatch, self.prefixes))
            elif _HEADER_RE.match(line) or _FATAL_RE.match(line) or _TERMINATE_RE.match(line):
                break
            elif line.strip() and not line[:1].isspace():
                if threads:
                    i += 1
                    break  # "Extension modules: ..." or any other trailer ends the dump
            i += 1
        chosen = next((frames for is_current, frames in threads if is_current), None)
        if chosen is None:
            chosen = threads[0][1] if threads else []
        exc = ParsedException(FATAL_ERROR_TYPE, message, tuple(reversed(chosen)), "", self.stream)
        return (start, exc), i

    # -- C++ std::terminate ---------------------------------------------------------------------------
    def _terminate(self, i: int) -> Tuple[Tuple[int, ParsedException], int]:
        lines = self.lines
        n = len(lines)
        start = i
        match = _TERMINATE_RE.match(lines[i])
        exc_type = match.group("type") if match else ""
        i += 1
        msg_lines: List[str] = []
        if i < n and (what := _WHAT_RE.match(lines[i])) is not None:
            msg_lines.append(what.group("msg"))
            i += 1
            while i < n:
                line = lines[i]
                if not line.strip() or _CPP_RAISED_RE.match(line) or _CPP_FRAME_RE.match(line) \
                        or _HEADER_RE.match(line) or _BREAK_RE.match(line.lstrip()):
                    break
                msg_lines.append(line)
                i += 1
        native: List[FrameInfo] = []
        if i < n and _CPP_RAISED_RE.match(lines[i]):
            i += 1
        while i < n and (frame := _CPP_FRAME_RE.match(lines[i])) is not None:
            lib = frame.group("lib").strip()
            base = lib.replace("\\", "/").rsplit("/", 1)[-1]
            native.append(FrameInfo(filename=lib, module=_NATIVE_MODULE_RE.sub("", base),
                                    function=frame.group("sym").strip(), lineno=0, in_app=False))
            i += 1
        message = "\n".join(msg_lines).rstrip()
        exc = ParsedException(exc_type, message, tuple(reversed(native)), "", self.stream)
        return (start, exc), i


def _streams(text: str) -> List[Tuple[str, List[int], List[str]]]:
    """Split ``text`` into per-prefix streams: (prefix, original line numbers, lines without prefix)."""
    order: List[str] = []
    numbers: Dict[str, List[int]] = {}
    contents: Dict[str, List[str]] = {}
    for number, raw in enumerate(text.replace("\r\n", "\n").replace("\r", "\n").split("\n")):
        match = _PREFIX_RE.match(raw)
        stream = match.group("stream") if match else ""
        line = raw[match.end():] if match else raw
        if stream not in contents:
            order.append(stream)
            numbers[stream] = []
            contents[stream] = []
        numbers[stream].append(number)
        contents[stream].append(line.rstrip())
    return [(s, numbers[s], contents[s]) for s in order]


def parse_traceback_text(text: str, library_prefixes: Sequence[str] = ()) -> List[ParsedException]:
    """Every exception printed in ``text``, in printed order: ordered by the line where each printed
    traceback starts, the exceptions of one printed chain kept together in their order, an embedded
    exception just before the exception whose message holds it.

    A message runs until a chain separator, a new traceback, a recognisable log record (glog, c10d
    ``[E ...]``, timestamped, ``logging`` default format, srun/wandb lines) or the end of its stream;
    other plain lines printed right after an exception cannot be told from a multi-line message and
    are taken as part of it.
    """
    found: List[Tuple[int, int, ParsedException]] = []
    for stream, numbers, lines in _streams(text):
        for seq, (index, exc) in enumerate(_Parser(lines, stream, library_prefixes).parse()):
            found.append((numbers[index], seq, exc))
    found.sort(key=lambda item: (item[0], item[1]))  # stable: a print's exceptions share one key
    return [exc for _, _, exc in found]


def fingerprint_text(text: str, library_prefixes: Sequence[str] = ()) -> Optional[Fingerprint]:
    """The fingerprint of the final (outermost) exception printed in ``text``, or None if there is none.

    "Final" is the last exception with ``relation == ""`` in :func:`parse_traceback_text` order.
    """
    parsed = parse_traceback_text(text, library_prefixes)
    for exc in reversed(parsed):
        if exc.relation == "":
            return exc.fingerprint()
    return None
