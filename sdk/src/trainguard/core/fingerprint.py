"""Stack fingerprint ``fp:v1``: one stable hash per failure, identical across ranks, hosts and runs.

A fingerprint is the SHA-256 (first 32 hex characters) of a canonical text that starts with the version
tag and holds three parts (DESIGN §4 "Stack fingerprint"; grouping modelled on Sentry's):

1. **Exception type**, qualified as Python prints it (``torch.OutOfMemoryError``; builtins and
   ``__main__`` bare: ``ValueError``).
2. **Contributing frames**, each as ``module:function`` -- never a line number, an address or a path, so
   a script copied elsewhere, edited above the failure, or run on another host hashes the same. The
   module is derived from the filename alone (:func:`module_from_filename`), so a live traceback and the
   printed text of the same traceback give the same frames. Which frames contribute:

   * If any frame is in-app, in-app frames contribute, plus the **innermost frame when it is a library
     frame** (the library call that raised: ``torch.nn.functional:embedding``,
     ``torch.distributed.distributed_c10d:all_reduce``). Other library and stdlib frames do not. The
     exception lets "``all_reduce`` timed out" and "``broadcast`` timed out" in one user function differ,
     which function-level user frames alone (no line numbers) cannot.
   * If no frame is in-app, library frames contribute, except stdlib frames; if all frames are stdlib,
     they contribute.
   * **Recursion** collapses: a frame (or a block of up to :data:`RECURSION_MAX_PERIOD` frames) that
     repeats the one just before it is dropped, so recursion depth (and Python's "[Previous line
     repeated N more times]" elision in printed text) does not change the hash.
   * Only the innermost :data:`MAX_FRAMES` remaining frames contribute.

3. **Message template**: :func:`normalize_message` -- numbers, sizes, shapes, durations, addresses,
   paths, hosts, timestamps and ids replaced by placeholders; words kept.

Every input frame gets a :class:`FrameHint` saying whether it contributed and why. A rule change ships
as a new version (``fp:v2``), never as an edit of ``fp:v1``.

Pure: no I/O (``linecache`` only when a caller asks :func:`frames_from_traceback` for source lines),
stdlib only, importable on Python 3.9+.
"""

from __future__ import annotations

import hashlib
import re
import types
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

FINGERPRINT_VERSION = "fp:v1"
MAX_FRAMES = 10
"""At most this many frames (the innermost, after filtering and recursion collapse) contribute."""
RECURSION_MAX_PERIOD = 3
"""Repeated blocks of up to this many consecutive frames collapse into one (direct and mutual recursion)."""
MAX_TEMPLATE_CHARS = 2048
"""Message templates are truncated to this many characters before hashing."""
_MAX_MESSAGE_CHARS = 65536  # longer messages are cut before normalisation (bounded CPU per event)

REASON_IN_APP = "in-app frame"
REASON_INNERMOST_LIBRARY = "innermost library frame: raised the exception"
REASON_LIBRARY_IN_APP_PRESENT = "library frame: in-app frames present"
REASON_LIBRARY_NO_IN_APP = "library frame: no in-app frames"
REASON_STDLIB = "stdlib frame"
REASON_STDLIB_ONLY = "stdlib frame: no other frames"
REASON_RECURSION = "duplicate recursion frame"
REASON_FRAME_LIMIT = "beyond frame limit"


@dataclass(frozen=True)
class FrameInfo:
    """One stack frame, innermost last (the order Python prints). Mirrors the ``Frame`` proto message."""

    filename: str
    module: str
    function: str
    lineno: int = 0
    in_app: bool = True
    context_line: str = ""


@dataclass(frozen=True)
class FrameHint:
    """Why the frame at ``frame_index`` (an index into the frames given) did or did not contribute."""

    frame_index: int
    contributes: bool
    reason: str


@dataclass(frozen=True)
class Fingerprint:
    """A versioned fingerprint, the message template it hashed and one hint per input frame."""

    version: str
    hash: str
    exc_type: str
    message_template: str
    hints: Tuple[FrameHint, ...]

    def to_dict(self) -> Dict[str, Any]:
        """The fingerprint fields of an ``ExceptionEvent`` (proto3 JSON mapping, snake_case names)."""
        return {
            "fingerprint": self.hash,
            "fingerprint_version": self.version,
            "message_template": self.message_template,
            "hints": [
                {"frame_index": h.frame_index, "contributes": h.contributes, "reason": h.reason}
                for h in self.hints
            ],
        }


# ----------------------------------------------------------------------------------------------------
# Filenames: library or in-app, and the module a frame belongs to

_KNOWN_LIBRARY_PACKAGES = frozenset(
    {"torch", "torchvision", "torchaudio", "torchtext", "functorch", "triton", "trainguard"}
)
_SITE_RE = re.compile(r"(?:^|/)(?:site|dist)-packages/")
_STDLIB_RE = re.compile(r"(?:^|/)lib/python\d+(?:\.\d+)?[a-z]?/|(?:^|/)python\d+\.zip/", re.IGNORECASE)
_WIN_STDLIB_RE = re.compile(r"^[a-z]:/(?:.*/)?lib/", re.IGNORECASE)
_NATIVE_SYSTEM_RE = re.compile(
    r"(?:^|/)(?:libc|libm|libdl|libpthread|libgcc_s|libstdc\+\+|ld-linux[\w.-]*)\.so"
)
_IPYTHON_RE = re.compile(r"^<ipython-input-\d+-[0-9a-f]+>$")
_IPYKERNEL_RE = re.compile(r"(?:^|/)ipykernel_\d+/")
_SOURCE_SUFFIX_RE = re.compile(r"\.(?:py[cdwi]?|pyx|so|pyd)$")


def _slashes(filename: str) -> str:
    return filename.replace("\\", "/")


def _matches_prefix(path: str, library_prefixes: Sequence[str]) -> Optional[str]:
    """The part of ``path`` after the first matching prefix, or None."""
    for prefix in library_prefixes:
        norm = _slashes(prefix)
        if norm and path.startswith(norm):
            return path[len(norm):].lstrip("/")
    return None


def is_stdlib_path(filename: str) -> bool:
    """True for the standard library (``.../lib/python3.11/json/decoder.py``, ``<frozen runpy>``) and
    for native system libraries (``libc.so.6``, ``libstdc++.so.6``) in C++ backtraces."""
    path = _slashes(filename)
    if path.startswith("<frozen "):
        return True
    if _SITE_RE.search(path):
        return False
    return bool(_STDLIB_RE.search(path) or _WIN_STDLIB_RE.match(path) or _NATIVE_SYSTEM_RE.search(path))


def is_library_path(filename: str, library_prefixes: Sequence[str] = ()) -> bool:
    """True when ``filename`` is not the user's code: a path under one of ``library_prefixes``,
    ``site-packages``/``dist-packages``, the standard library, ``<frozen ...>``, or a known library
    package directory outside site-packages (a source checkout of ``torch``, ``triton``, ...).

    An extension-less file directly in a ``bin``/``Scripts`` directory is a console-script entry point
    (``.../bin/torchrun``) and a library frame too. Everything else (including ``<string>`` and
    ``<stdin>``) is in-app.
    """
    path = _slashes(filename)
    if not path:
        return False
    if _matches_prefix(path, library_prefixes) is not None:
        return True
    if is_stdlib_path(path) or _SITE_RE.search(path):
        return True
    parts = path.split("/")
    if len(parts) > 1 and parts[-2] in ("bin", "Scripts") and "." not in parts[-1]:
        return True  # a console-script entry point (``.../bin/torchrun``), not the user's code
    return any(part in _KNOWN_LIBRARY_PACKAGES for part in parts[:-1])


def _dotted(rest: str) -> str:
    parts = [p for p in rest.split("/") if p and p != "."]
    while len(parts) > 1 and parts[0].endswith((".egg", ".zip", ".whl")):
        parts = parts[1:]
    if not parts:
        return ""
    parts[-1] = _SOURCE_SUFFIX_RE.sub("", parts[-1])
    if len(parts) > 1 and parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def module_from_filename(filename: str, library_prefixes: Sequence[str] = ()) -> str:
    """Best-effort dotted module name from a filename alone (no ``sys.path``, no file system).

    ``.../site-packages/torch/distributed/distributed_c10d.py`` -> ``torch.distributed.distributed_c10d``;
    ``/usr/lib/python3.11/multiprocessing/process.py`` -> ``multiprocessing.process``;
    ``<frozen runpy>`` -> ``runpy``; ``/src/pytorch/torch/nn/functional.py`` -> ``torch.nn.functional``;
    a path under a library prefix -> the dotted rest; anything else (user code) -> the file's stem
    (``/home/me/run-7/train.py`` -> ``train``), so copies of a script in different directories agree.
    """
    path = _slashes(filename)
    if not path:
        return ""
    if path.startswith("<"):
        if path.startswith("<frozen ") and path.endswith(">"):
            return path[len("<frozen "):-1]
        if _IPYTHON_RE.match(path):
            return "<ipython-input>"
        return path
    rest = _matches_prefix(path, library_prefixes)
    if rest is not None:
        return _dotted(rest)
    site = list(_SITE_RE.finditer(path))
    if site:
        return _dotted(path[site[-1].end():])
    std = _STDLIB_RE.search(path) or _WIN_STDLIB_RE.match(path)
    if std:
        return _dotted(path[std.end():])
    parts = path.split("/")
    for i in range(len(parts) - 2, -1, -1):
        if parts[i] in _KNOWN_LIBRARY_PACKAGES:
            return _dotted("/".join(parts[i:]))
    if _IPYKERNEL_RE.search(path):
        return "<ipykernel>"
    if parts[-1] in ("__init__.py", "__main__.py"):
        return _dotted("/".join(parts[-2:]))
    return _dotted(parts[-1])


# ----------------------------------------------------------------------------------------------------
# Message templates

_TB_FILE_LINE_RE = re.compile(r'^(?P<indent>\s*)File "(?P<file>[^"]*)", line \d+(?:, in (?P<func>.*?))?\s*$')
_TB_REPEAT_RE = re.compile(r"^\s*\[Previous line repeated \d+ more times?\]\s*$")

_UUID_RE = re.compile(r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b")
_DATETIME_RE = re.compile(
    r"\b\d{4}-\d{2}-\d{2}(?:[T _]\d{1,2}:\d{2}(?::\d{2}(?:[.,]\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?)?\b"
)
_TIME_RE = re.compile(r"(?<![\w.:])\d{1,2}:\d{2}:\d{2}(?:\.\d+)?(?![\w:])")
_WIN_PATH_RE = re.compile(r"(?<![\w])[A-Za-z]:\\[^\s'\"<>|:*?,;()\[\]]+")
_POSIX_PATH_RE = re.compile(r"(?<![\w:/.~<>-])(?:~)?/[\w.+@~-]+(?:/[\w.+@~-]*)+")
_ADDR_RE = re.compile(r"\b0[xX][0-9a-fA-F]+\b")
_IPV6_RE = re.compile(r"\[[0-9a-fA-F]*:[0-9a-fA-F:.]*\](?::\d{1,5})?")
_IPV4_RE = re.compile(r"(?<![\w.])\[?\d{1,3}(?:\.\d{1,3}){3}\]?(?::\d{1,5})?(?![\w.])")
_HOST_PORT_RE = re.compile(r"(?<![\w.<>-])(?P<name>[A-Za-z][\w-]*(?:\.[\w-]+)*):(?P<port>\d{2,5})(?![\w.])")
_HOST_TUPLE_RE = re.compile(r"\((?P<name>[A-Za-z0-9][\w.-]*[A-Za-z][\w.-]*),\s*(?P<port>\d{2,5})\)")
_HOST_FIELD_RE = re.compile(r"\b(?P<key>host(?:name)?|MASTER_ADDR)(?P<sep>\s*[:=]\s*)(?P<val>[^\s,;)\]'\"]+)",
                            re.IGNORECASE)
_SIZE_RE = re.compile(r"(?<![\w.])\d+(?:\.\d+)?\s?(?:[KMGTPE]i?B|bytes?|B)\b")
_DURATION_RE = re.compile(
    r"(?<![\w.])\d+(?:\.\d+)?\s?(?:ms|milliseconds?|s|secs?|seconds?|mins?|minutes?|hrs?|hours?"
    r"|us|µs|microseconds?|ns|nanoseconds?)\b"
)
_SHAPE_BRACKET_RE = re.compile(r"\[\s*-?\d+(?:\s*,\s*-?\d+)*\s*,?\s*\]")
_SHAPE_TUPLE_RE = re.compile(r"\(\s*-?\d+\s*,(?:\s*-?\d+\s*,)*\s*(?:-?\d+\s*)?\)")
_SHAPE_X_RE = re.compile(r"(?<![\w.])\d+(?:x\d+)+(?![\w.])")
_HEX_ID_RE = re.compile(r"(?<![\w])(?=[0-9a-fA-F]*\d)(?=[0-9a-fA-F]*[a-fA-F])[0-9a-fA-F]{8,}(?![\w])")
_RANKED_WORD_RE = re.compile(r"\b(?P<word>[A-Za-z]*(?:rank|Rank|RANK|worker|Worker))(?P<num>\d+)\b")
_NUMBER_RE = re.compile(r"(?<![A-Za-z_\d])[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
_QUOTED_DATA_RE = re.compile(r"(?P<lead>:\s+)(?P<q>['\"])(?P<val>[^'\"]*)(?P=q)(?P<trail>\s*)$")
_WS_RE = re.compile(r"[ \t\r\f\v]+")
_IDENTIFIER_RE = re.compile(r"^[A-Za-z_][\w.]*$")
_PLACEHOLDER_RE = re.compile(r"^<[a-z]+>$")

_NOT_HOST_SUFFIXES = frozenset({"py", "pyx", "cpp", "cc", "cxx", "c", "h", "hpp", "hh", "cu", "cuh", "so",
                                "txt", "json", "yaml", "yml", "log", "ipynb", "md", "rs", "go", "java"})
_NOT_HOST_NAMES = frozenset({"cuda", "cpu", "meta", "mps", "xpu", "hpu", "npu", "xla", "hip", "ipu", "lazy",
                             "vulkan", "mtia", "privateuseone", "line", "rank", "step", "epoch", "seq",
                             "https", "http", "file"})


def _host_port(match: re.Match[str]) -> str:
    name = match.group("name")
    labels = name.lower().split(".")
    if labels[-1] in _NOT_HOST_SUFFIXES or labels[0] in _NOT_HOST_NAMES:
        return match.group(0)
    if name != "localhost" and not any(c in name for c in ".-0123456789"):
        return match.group(0)  # "key:123" is a field, not a host; hosts have dots, dashes or digits
    return "<host>"


def _quoted_data(match: re.Match[str]) -> str:
    value = match.group("val")
    if _IDENTIFIER_RE.match(value) or _PLACEHOLDER_RE.match(value):
        return match.group(0)  # a name (key, parameter, op) is part of what failed, not data
    return f"{match.group('lead')}{match.group('q')}<str>{match.group('q')}{match.group('trail')}"


def _compact_embedded_tracebacks(message: str) -> str:
    """Rewrite tracebacks printed inside a message (DataLoader workers, ``mp.spawn``, torchrun summaries).

    ``File "/abs/path/x.py", line 12, in f`` becomes ``File "x", in f`` (module, no line); the source and
    caret lines under it and ``[Previous line repeated ...]`` go; and if any embedded frame is in-app,
    the library frames go too -- the same rule as the frames of the exception itself.
    """
    lines = message.split("\n")
    if not any(_TB_FILE_LINE_RE.match(line) for line in lines):
        return message
    parsed: List[Tuple[str, Optional[re.Match[str]]]] = []
    skip_indent = -1
    for line in lines:
        stripped = line.lstrip()
        indent = len(line) - len(stripped)
        if skip_indent >= 0:
            if stripped and indent > skip_indent:
                continue
            skip_indent = -1
        if _TB_REPEAT_RE.match(line):
            continue
        match = _TB_FILE_LINE_RE.match(line)
        if match and match.group("func") is not None:
            parsed.append((line, match))
            skip_indent = indent
        else:
            parsed.append((line, None))
    any_in_app = any(m is not None and not is_library_path(m.group("file")) for _, m in parsed)
    out: List[str] = []
    for line, match in parsed:
        if match is None:
            out.append(line)
            continue
        if any_in_app and is_library_path(match.group("file")):
            continue
        module = module_from_filename(match.group("file"))
        out.append(f'{match.group("indent")}File "{module}", in {match.group("func")}')
    return "\n".join(out)


def normalize_message(message: str) -> str:
    """The message template: ``message`` with the parts that vary between occurrences of one failure
    replaced by placeholders, the words kept.

    Placeholders: ``<id>`` UUIDs and hex ids, ``<time>`` dates/timestamps/clock times, ``<path>``
    absolute paths, ``<addr>`` hex addresses, ``<host>`` IPs, ``host:port`` and ``host: name`` fields,
    ``<size>`` byte sizes (``2.00 GiB``), ``<duration>`` (``600000 milliseconds``, ``2000ms``),
    ``<shape>`` (``[32, 128]``, ``(4, 8)``, ``4x8``), ``<str>`` for a quoted value ending a line after
    ``": "`` (Python's "description: 'value'" convention) unless it is a name (``'fc.weight'``),
    ``<num>`` any other number (ranks, PIDs, sequence numbers; also the digits of ``rank3``). Tracebacks
    embedded in the message are compacted (see :func:`_compact_embedded_tracebacks`). Whitespace runs
    collapse to one space, blank lines go, and the result is cut at :data:`MAX_TEMPLATE_CHARS`.
    Deterministic and idempotent.
    """
    text = message[:_MAX_MESSAGE_CHARS].replace("\r\n", "\n")
    text = _compact_embedded_tracebacks(text)
    text = _UUID_RE.sub("<id>", text)
    text = _DATETIME_RE.sub("<time>", text)
    text = _TIME_RE.sub("<time>", text)
    text = _WIN_PATH_RE.sub("<path>", text)
    text = _POSIX_PATH_RE.sub("<path>", text)
    text = _ADDR_RE.sub("<addr>", text)
    text = _IPV6_RE.sub("<host>", text)
    text = _IPV4_RE.sub("<host>", text)
    text = _HOST_TUPLE_RE.sub(lambda m: f"(<host>, {m.group('port')})", text)  # c10d: "(host, port)"
    text = _HOST_FIELD_RE.sub(lambda m: f"{m.group('key')}{m.group('sep')}<host>", text)
    text = _HOST_PORT_RE.sub(_host_port, text)
    text = _SIZE_RE.sub("<size>", text)
    text = _DURATION_RE.sub("<duration>", text)
    text = _SHAPE_BRACKET_RE.sub("<shape>", text)
    text = _SHAPE_TUPLE_RE.sub("<shape>", text)
    text = _SHAPE_X_RE.sub("<shape>", text)
    text = _HEX_ID_RE.sub("<id>", text)
    text = _RANKED_WORD_RE.sub(lambda m: f"{m.group('word')}<num>", text)
    text = _NUMBER_RE.sub("<num>", text)
    lines = []
    for line in text.split("\n"):
        line = _WS_RE.sub(" ", line).strip()
        if line:
            lines.append(_QUOTED_DATA_RE.sub(_quoted_data, line))
    return "\n".join(lines)[:MAX_TEMPLATE_CHARS]


# ----------------------------------------------------------------------------------------------------
# Frame selection and the hash

def _frame_key(frame: FrameInfo) -> Tuple[str, str]:
    return (frame.module, frame.function)


def _select_frames(frames: Sequence[FrameInfo]) -> Tuple[List[int], List[FrameHint]]:
    """Indices of the contributing frames (outermost first) and one hint per frame."""
    count = len(frames)
    reasons: List[str] = [""] * count
    candidates: List[int] = []
    stdlib = [is_stdlib_path(f.filename) for f in frames]
    if any(f.in_app for f in frames):
        for i, frame in enumerate(frames):
            if frame.in_app:
                candidates.append(i)
                reasons[i] = REASON_IN_APP
            elif i == count - 1:
                candidates.append(i)
                reasons[i] = REASON_INNERMOST_LIBRARY
            else:
                reasons[i] = REASON_STDLIB if stdlib[i] else REASON_LIBRARY_IN_APP_PRESENT
    elif all(stdlib):
        candidates = list(range(count))
        reasons = [REASON_STDLIB_ONLY] * count
    else:
        for i in range(count):
            if stdlib[i]:
                reasons[i] = REASON_STDLIB
            else:
                candidates.append(i)
                reasons[i] = REASON_LIBRARY_NO_IN_APP

    kept: List[int] = []
    for i in candidates:
        kept.append(i)
        for period in range(1, RECURSION_MAX_PERIOD + 1):
            if len(kept) < 2 * period:
                break
            tail = [_frame_key(frames[j]) for j in kept[-period:]]
            before = [_frame_key(frames[j]) for j in kept[-2 * period:-period]]
            if tail == before:
                for j in kept[-period:]:
                    reasons[j] = REASON_RECURSION
                del kept[-period:]
                break
    if len(kept) > MAX_FRAMES:
        for j in kept[:-MAX_FRAMES]:
            reasons[j] = REASON_FRAME_LIMIT
        kept = kept[-MAX_FRAMES:]
    contributing = set(kept)
    hints = [FrameHint(i, i in contributing, reasons[i]) for i in range(count)]
    return kept, hints


def canonical_input(exc_type: str, message_template: str, frames: Sequence[FrameInfo]) -> str:
    """The exact text that is hashed, given the *contributing* frames (outermost first).

    Line one is :data:`FINGERPRINT_VERSION`; then ``type:``, one ``frame:module:function`` per frame,
    and ``message:`` followed by the template.
    """
    lines = [FINGERPRINT_VERSION, "type:" + exc_type.strip()]
    lines.extend(f"frame:{f.module}:{f.function}" for f in frames)
    lines.append("message:" + message_template)
    return "\n".join(lines)


def _fingerprint_v1(exc_type: str, message: str, frames: Sequence[FrameInfo]) -> Fingerprint:
    template = normalize_message(message)
    kept, hints = _select_frames(frames)
    text = canonical_input(exc_type, template, [frames[i] for i in kept])
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:32]
    return Fingerprint("fp:v1", digest, exc_type.strip(), template, tuple(hints))


Fingerprinter = Callable[[str, str, Sequence[FrameInfo]], Fingerprint]

FINGERPRINTERS: Dict[str, Fingerprinter] = {"fp:v1": _fingerprint_v1}
"""Every fingerprint version this code can compute, by name (Sentry-style grouping versions): a stored
fingerprint keeps the version it was made with, and any registered version can be recomputed -- so a
rule change ships as a new entry (``fp:v2``) and old groups stay comparable. :data:`FINGERPRINT_VERSION`
is the one the SDK and the backend compute by default."""

_VERSION_RE = re.compile(r"fp:v[1-9][0-9]*")


def register_fingerprinter(version: str, compute: Fingerprinter) -> None:
    """Add a fingerprint version (``fp:vN``). A registered version is never replaced: ValueError."""
    if not _VERSION_RE.fullmatch(version):
        raise ValueError(f"a fingerprint version is 'fp:v<N>', not {version!r}")
    if version in FINGERPRINTERS:
        raise ValueError(f"fingerprint version {version} is registered already: ship a new version instead")
    FINGERPRINTERS[version] = compute


def fingerprint(exc_type: str, message: str, frames: Sequence[FrameInfo],
                version: str = FINGERPRINT_VERSION) -> Fingerprint:
    """The fingerprint (``version``, default :data:`FINGERPRINT_VERSION`) of an exception given as its
    type, message and frames (innermost last). ValueError names the known versions for another one.

    ``fp:v1`` uses ``frame.in_app``, ``frame.module``, ``frame.function`` and ``frame.filename`` (for the
    stdlib test) -- never line numbers or context lines.
    """
    compute = FINGERPRINTERS.get(version)
    if compute is None:
        known = ", ".join(sorted(FINGERPRINTERS))
        raise ValueError(f"unknown fingerprint version {version!r}; known: {known}")
    return compute(exc_type, message, frames)


# ----------------------------------------------------------------------------------------------------
# Live exceptions

def frames_from_traceback(tb: Optional[types.TracebackType], library_prefixes: Sequence[str] = (),
                          with_context: bool = False) -> List[FrameInfo]:
    """The frames of a live traceback, innermost last, as Python would print them.

    Reads only the traceback and code objects. ``with_context=True`` also reads each frame's source line
    through :mod:`linecache` (which may touch the file system); the fingerprint never uses it.
    """
    frames: List[FrameInfo] = []
    while tb is not None:
        frame = tb.tb_frame
        code = frame.f_code
        filename = code.co_filename
        lineno = tb.tb_lineno or 0
        context = ""
        if with_context:
            import linecache  # deferred: the only file access in this module, and only on request

            context = linecache.getline(filename, lineno, frame.f_globals).strip()
        frames.append(FrameInfo(
            filename=filename,
            module=module_from_filename(filename, library_prefixes),
            function=code.co_name,
            lineno=lineno,
            in_app=not is_library_path(filename, library_prefixes),
            context_line=context,
        ))
        tb = tb.tb_next
    return frames


def exception_type_name(exc_type: type) -> str:
    """The type as Python's traceback prints it: ``module.Qualname``, bare for builtins and __main__."""
    qualname = getattr(exc_type, "__qualname__", exc_type.__name__)
    module = getattr(exc_type, "__module__", None)
    if module in ("__main__", "builtins"):
        return str(qualname)
    if not isinstance(module, str):
        module = "<unknown>"
    return f"{module}.{qualname}"


def exception_message(exc: BaseException) -> str:
    """The message as Python's traceback prints it -- ``str(exc)`` (for a ``SyntaxError`` its ``msg``;
    the location goes on separate lines) plus its ``__notes__``, one per line; never raises."""
    try:
        message = exc.msg if isinstance(exc, SyntaxError) and isinstance(exc.msg, str) else str(exc)
    except Exception:  # a broken __str__ must not break capture; Python prints the same placeholder
        message = "<exception str() failed>"
    notes = getattr(exc, "__notes__", None)
    if isinstance(notes, (list, tuple)):
        for note in notes:
            message += "\n" + (note if isinstance(note, str) else "<note str() failed>")
    return message


def fingerprint_exception(exc: BaseException, library_prefixes: Sequence[str] = ()) -> Fingerprint:
    """The fingerprint of a live exception; equal to ``fingerprint_text`` of its printed traceback."""
    return fingerprint(exception_type_name(type(exc)), exception_message(exc),
                       frames_from_traceback(exc.__traceback__, library_prefixes))
