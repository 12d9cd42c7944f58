"""Log files → log lines and exceptions (tracebacks assembled from their lines), per rank.

Contract of :class:`LogReader` (iterate it; :attr:`LogReader.stats` counts):

* **Lines.** The file is read as UTF-8 (undecodable bytes replaced). ANSI colour codes are removed (and Ray's
  coloured prefix pasted without its escape bytes, ``[36m(pid=12)[0m``, loses the residue); a line
  rewritten with carriage returns (progress bars) keeps only its final text. Blank lines produce nothing.
  What a paste or a relay puts before every line is dropped: an indent all lines share (a tab or 4+
  spaces, :func:`paste_indent`), a markdown quote marker ``> ``, a relayed stream's ``stderr: ``, a
  collector's ISO timestamp column (``2024-05-01T10:00:00Z ``; it is the line's time).
* **Ranks.** A launcher prefix ``[rankN]:`` (torch >= 2.2) or ``[defaultN]:`` (older torchrun), or
  ParlAI's ``rank:  N | `` column, routes the line to rank N and is stripped (stacked prefixes too,
  ``[rankN]:`` winning, and a launcher's column before them: a host ``worker-5: ``, a nemo-run task
  ``i.pretrain/0 ``); so do the unprefixed lines that continue a prefixed c10 message (its CUDA hints
  and C++ frames) or a traceback whose header line carried the prefix (a logger that prefixes a
  record's first line only), and the ``exitcode`` / ``error_file`` / ``traceback`` fields of a torchrun
  failure-summary entry read outside a traceback go to its ``rank :`` (a ``traceback : Traceback (most
  recent call last):`` field and its lines, two spaces further in, are read as that rank's traceback, the
  two spaces dropped, ending at the first line not so indented). Other ``[nameN]:`` prefixes are
  stripped and the line stays with the file's rank, as do unprefixed lines (in a torchrun log: the
  agent's own output). Each rank's lines are segmented on their own, so interleaved output of several
  ranks gives one traceback per rank.
* **Tracebacks.** A block starts at a top-level ``Traceback (most recent call last):`` line, a
  ``Fatal Python error:`` (faulthandler) or ``terminate called after throwing an instance of`` (C++)
  line. A Python block takes its frames, chained tracebacks (after "The above exception was the direct
  cause ..." / "During handling ..."), its exception line and message lines, including tracebacks
  embedded in the message (DataLoader "Original Traceback", ``mp.spawn`` "-- Process N terminated with
  the following error:", torchrun's failure summary). The message ends at a new top-level traceback that
  does not follow a line ending in ``:``, at a log record (glog / c10d ``[E ...]``, a timestamped line,
  ``logging``'s default format, srun/wandb/torchrun lines, "Exception in thread") or after
  :data:`MAX_MESSAGE_LINES` plain lines. A faulthandler block ends after its trailer ("Extension modules:
  ..."), a C++ block at a blank line. The block's text goes to
  :func:`trainguard.core.tracebacks.parse_traceback_text`; its final exception becomes one exception item
  whose fingerprint (fp:v1, over the whole un-truncated text) is the one the SDK computes for the same
  exception live, with the chained causes/contexts as ``chain``. A block that parses to nothing is
  emitted as plain lines, and so is a Python traceback cut before its exception line -- unless it was cut
  inside a process-group set-up function (one of its three innermost frames is ``init_process_group``,
  DeepSpeed's ``init_distributed``, a rendezvous store's creation ...: ``classify.INIT_FUNCTIONS``): then it
  is one exception item of no known type, whose frames say the group never came up -- or unless pasted
  text ends inside it (its last line a frame's) and nothing before says what failed (no exception item,
  no line ``keep_below`` recognises): then the process raised there and the paste cut the exception line
  off, one exception item of no known type as well; not a launcher's own traceback (torchrun,
  ``torch.distributed.launch``, DeepSpeed's / Accelerate's launchers) nor one whose innermost frame is
  start-up or supervision code (runpy, torchelastic, a ``bin/`` stub): :func:`_raised_in_program`. In a paste
  (``headless``), an exception line with no traceback is an exception item too: a bare ``RuntimeError: ...``
  line, one wrapped in markdown (:func:`unwrap_markup`), a logging library's record of one
  (:func:`logged_exception`), and a tool's report of one of PyTorch's exception messages without its
  type (``Error running job: element 0 of tensors does not require grad ...``: :func:`reported_exception`,
  read as the ``RuntimeError: ...`` PyTorch raised), and a sentence quoting one after saying it is an error
  (``it report a error:"RuntimeError: ..."``: :func:`quoted_exception`), or pasting one with its qualified
  type at a sentence's end (``... this isssue.      tensorflow.python.framework.errors_impl.X: ...``).
* **NCCL error messages** outside a traceback (a line ending in ``NCCL version X.Y.Z``, then
  NCCL's unprefixed ``ncclXError: ...``, ``Last error:`` and the last error's line) are one log item
  (its ``[rankN]:`` prefix, if the first line has one, applies to all), so the reason is read with the
  last error.
* **Everything else** is one log item per line, with the level found in it (glog letter or a level
  word) as ``level``.
* **Time.** An item's ``time_ns`` is the timestamp its first line starts with (see
  :func:`.times.leading_stamp`; a glog line takes the year of the last dated line before it -- of the
  file's first dated line before any, see :func:`paste_year` --, else of the file's modification time --,
  or the year either side of it when that puts it nearer the stamp before it (the first dated line's
  before any): a paste crossing a new year, or glog lines whose year the ISO lines would misstate),
  else the last timestamp seen earlier in the file, else None; ``precision_ns`` is that timestamp's
  precision (1 ms for ``logging``'s ``,123``): the item was written at some time in
  ``[time_ns, time_ns + precision_ns)`` (an item without a stamp of its own: no earlier than ``time_ns``).
* **Order.** Items come out ordered by their first line; ``line`` and ``last_line`` are 1-based.
"""

from __future__ import annotations

import heapq
import re
from collections import deque
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Deque, Dict, Iterator, List, Mapping, NamedTuple, Optional, Sequence, Tuple

from trainguard.core.events import safe_str
from trainguard.core.tracebacks import (
    RELATION_CAUSE,
    RELATION_CONTEXT,
    ParsedException,
    parse_traceback_text,
)
from trainguard_engine.classify import INIT_FUNCTIONS
from trainguard_engine.classify.c10d import connect_retry, went_on

from .times import leading_stamp_year

MAX_MESSAGE_LINES = 100
"""Plain lines after an exception line that may still belong to its message."""
MAX_BLOCK_LINES = 5000
MAX_FRAMES = 128          # the SDK's defaults (trainguard.options): frames shipped, message and text sizes
MAX_MESSAGE_CHARS = 8192
MAX_TRACEBACK_CHARS = 64_000
MAX_LINE_CHARS = 8192

_PREFIX_RE = re.compile(r"^\[(?P<name>[A-Za-z_]+)(?P<num>\d+)(?:\|\d{1,7})?\]:(?: )?")
_SPACED_TAGS = ("rank", "default")
"""Tags after which one space is the tag's, not the line's: torch's ``[rank3]: `` (its own prefix ends with a
space) and torchrun's ``[default0]:`` (read so since the corpus's pastes hold both). A role's tag
(``[trainer3]:``, ``[trainer0|0]:``) is glued to what the process printed, so the spaces after it, when more
than one, are the line's indentation -- a torchrun failure entry's ``  traceback : ...`` field and its
worker's traceback lines keep their columns (one space before text is read as the tag's, as before)."""
UNSETTLED_MAX_PENDING = 10_000
"""How many items may wait behind an unsettled one (an inline exception, c10d's connect-retry warning: kept
only if no training-progress line follows, see :class:`LogSegmenter`) before it is emitted as it is: a bound
on the memory a long log with no progress line after it holds, not a detection setting (a log that goes on
training shows a progress line long before)."""
MAX_STACKED_PREFIXES = 8
"""How many ``[rankN]:``-style tags are stripped from one line at most (real logs stack two or three: a
launcher's and torch's own); more stay in the text, so a line of thousands of them costs linear time."""
"""A launcher's tag before every line a process prints: torch's ``[rank3]:``, torchrun's ``[default0]:``, a
role-named tag (TorchX / torchelastic roles: ``[trainer3]:``, with a replica index ``[trainer0|0]:``); only
``rank`` and ``default`` name a rank (:func:`split_prefix`), any other name is dropped as a tag."""
_RANK_COLUMN_RE = re.compile(r"^(?P<name>rank):\s{0,4}(?P<num>\d{1,7}) \| ")
_MPI_TAG_RE = re.compile(r"^\[\d{1,6},(?P<num>\d{1,7})\]<(?:stdout|stderr|stddiag)>:")
"""Open MPI's ``mpirun --tag-output`` column ``[1,3]<stderr>:`` (job, then the process's rank), as Horovod
and DeepSpeed's MPI launcher runs print every line."""
"""ParlAI's distributed logger column ``rank:  3 | 2022-04-03 18:44:26,615 CRITICAL | ...``."""
_COLUMN_RE = re.compile(r"^(?:\[\d{1,9}\] |\s{0,6}\d{1,7} [|\u2502] "
                        r"|\((?:[\w.-]{1,60},? )?(?:rank=\d{1,7} )?pid=\d+(?:, ip=[\d.]+)?\)(?: |$)"
                        r"|[a-z][\w.-]{0,60}[-_]\d{1,4} +\| ?)")
"""What a paste puts before a line: a viewer's line-number column (``[80746] ``, ``  12 | ``), Ray's
``(RayWorkerWrapper pid=4009) `` / ``(pid=4009, ip=10.0.0.1) `` worker prefix (also SkyPilot's
``(task-name, pid=18593) ``, vLLM's ``(VllmWorker rank=1 pid=12231) `` / ``(EngineCore_DP0 pid=33630) ``) or
docker compose's ``trainer-worker-1    | `` service column."""
_PASTE_MARK_RE = re.compile(r"^(?:(?:>(?: |$))+|(?:stderr|stdout|STDERR|STDOUT):(?: |$))")
"""What a paste or a wrapper puts before every line it passes on: markdown's quote marker (``> ``, nested
``> > ``) and a subprocess runner's stream name (``stderr: ``, as accelerate or a job wrapper relays a
child's output)."""
_VLLM_HEADER_RE = re.compile(r"^(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d(?:\.\d{1,6})? "
                             r"\[?[\w./-]{1,120}:\d{1,6}\](?: |$)")
"""vLLM's logger header (``ERROR 03-25 21:13:53 [multiproc_executor.py:374] ``, before v0.8 without the
opening bracket; with the file's path under the package in later builds and plugins,
``[v1/executor/multiproc_executor.py:932]``, vllm-project/vllm#45092): its formatter repeats it on every line
of a multi-line message, so a traceback vLLM logs carries it on each of its lines. :func:`split_prefix` drops
it where the rest of the line is a multi-line error's (:data:`_CARRIED_TRACEBACK_RE`): the traceback or the
message reads as one; a record's own line keeps its header (its level)."""
_CARRIED_TRACEBACK_RE = re.compile(r"$|Traceback \(most recent call last\):|\s|(?:[A-Za-z_]\w*\.)*[A-Z]\w*"
                                   r"(?:Error|Exception|Interrupt|Failure)(?::|$)|File \"|frame #\d{1,4}: "
                                   r"|Exception raised from |terminate called after throwing |what\(\): "
                                   r"|Last error:")
"""The rest of a line under vLLM's header that is part of a multi-line error message, not a record of its own:
a traceback's header, frame (also one a paste set flush left, ``File "x.py", line 3``), code or exception
line, the C++ stack of a c10 error (``frame #3: c10d::ProcessGroupNCCL::...``, ``Exception raised from ...``),
``terminate called after throwing ...`` / ``what():`` and NCCL's ``Last error:``."""
_KUBECTL_PREFIX_RE = re.compile(r"^\[pod/[^\s/\]]{1,253}/[^\s\]]{1,63}\](?: |$)")
"""``kubectl logs --prefix``'s source column before every line (``[pod/train-worker-0/pytorch] ``; with
``--timestamps`` an ISO stamp follows it): dropped like a relayed stream's name."""
_ISO_COLUMN_RE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:[.,]\d{1,9})?(?:Z|[+-]\d\d:?\d\d) ")
"""A collector's timestamp column before every line (``kubectl logs --timestamps``, CloudWatch, Loki:
``2024-05-01T10:00:00.123456789Z <line>``): the line's time, then the line as the job printed it (the stamp is
read as the line's time before it is dropped)."""
_SYSLOG_COLUMN_RE = re.compile(r"^(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec) [ 0-3]?\d "
                               r"\d\d:\d\d:\d\d ")
"""A CI runner's or syslog's stamp column before every line (CircleCI's ``Oct 16 02:07:00 <line>``,
pytorch/pytorch#12744): dropped like a collector's ISO column, so the line reads as the job printed it."""
_TASK_COLUMN_RE = re.compile(r"^(?:[\w.-]{1,60}/\d{1,4}|[A-Za-z][\w.-]{0,60}:) (?=\[(?:rank|default)\d+\]:)")
"""A launcher's column before a rank prefix: pdsh / DeepSpeed's multi-node runner's host ``worker-5: ``,
nemo-run's task ``i.pretrain/0 ``."""
_FAILURE_ENTRY_RE = re.compile(r"^\[\d+\]:\s*$")
_FAILURE_RANK_RE = re.compile(r"^\s{1,8}rank\s{0,8}: ?(?P<rank>\d{1,7})\b")
_FAILURE_FIELD_RE = re.compile(r"^\s{1,8}(?:time|host|exitcode|error_file|traceback)\s{0,8}:")
"""torchrun's failure summary: an entry ``[0]:`` then its fields; ``rank      : 3 (local_rank: 3)``."""
_SUMMARY_ROOT = "Root Cause (first observed failure):"
CHILD_FAILED_ERROR = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError"
_SUMMARY_LINE_RE = re.compile(r"^\s{0,8}(?:Failures:|Root Cause \(first observed failure\):|\[\d{1,7}\]:"
                              r"|<NO_OTHER_FAILURES>|-{20,}|={20,})\s*$")
"""The lines of torchrun's failure summary besides an entry's fields: its section heads, an entry's ``[N]:``,
``<NO_OTHER_FAILURES>`` and its rules of dashes / equals signs (see :meth:`LogSegmenter._summary_line`)."""
_FAILURE_TRACEBACK_RE = re.compile(r"^\s{1,8}traceback\s{0,8}: ?(?=Traceback \(most recent call last\):\s*$)")
ENTRY_TRACEBACK_INDENT = "  "
"""An entry's ``traceback : Traceback (most recent call last):`` field: torchrun prints the worker's traceback
(from its error file) after the field's key, each further line indented by two more spaces than the worker
printed it (``    File ...`` for a frame, ``  RuntimeError: ...`` for the exception line)."""
_FRAME_LINE_RE = re.compile(r'^\s+File "[^"]*", line \d+')
_LOOSE_FRAME_RE = re.compile(r'^ ?File "[^"]*", line \d+')
"""A frame line a paste lost its indentation on (``File "x.py", line 3, in f`` at column 0 or 1)."""
_LOOSE_FRAME_FIX_RE = re.compile(r'^ ?File "(?=[^"\n]*", line \d+)', re.MULTILINE)
_EXCEPTION_LINE_RE = re.compile(
    r"^(?:(?:[A-Za-z_]\w*\.)*(?:[A-Z]\w*(?:Error|Exception|Interrupt|Failure)|Exception)(?::\s.*|:?)"
    r"|(?:[A-Za-z_]\w*\.)*(?:exc|exceptions|errors)\.[A-Z]\w*(?<!Warning): \S.*)$")
"""A Python exception line (``RuntimeError: ...``, ``torch.OutOfMemoryError: ...``, ``AssertionError``), also
one whose class is named for no error but is qualified by a module of exceptions (``exc``, ``exceptions``,
``errors``) and followed by a message: ``torch._dynamo.exc.FailOnRecompileLimitHit: recompile_limit reached
with fullgraph=True ...`` (microsoft/dion#23), ``torch._dynamo.exc.BackendCompilerFailed: ...``,
``ray.exceptions.RayTaskError: ...``. A warning class there (``urllib3.exceptions.InsecureRequestWarning:``)
is no exception line."""
_LOGGER_HEAD_RE = re.compile(
    r"^(?:\[?\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[.,]\d{1,9})?\]?[ \t]*(?:[-|][ \t]*)?)?"
    r"(?:[\w.-]{1,60}[ \t]+-[ \t]+)?"
    r"\[?(?:DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL|FATAL)\]?(?:[ \t]*[-|:][ \t]*|[ \t]+)"
    r"(?:[\w.<>]{1,60}:[\w.<>]{1,60}:\d{1,6}[ \t]+-[ \t]+)?")
"""A logging library's header before a record's message: an optional timestamp, an optional logger name,
then the level and its separator -- ``2024-05-01 12:00:00,123 - ERROR - ``, ``... - trainer - ERROR - ``,
loguru's ``2024-05-01 12:00:00.123 | ERROR    | train:main:42 - ``, ``[2024-05-01 12:00:00] [ERROR] ``,
basicConfig's ``ERROR:`` (its logger name, ``root:``, is dropped by :func:`logged_exception`)."""
_LOGGER_NAME_RE = re.compile(r"^[\w.]{1,60}:")


def logged_exception(line: str) -> Optional[str]:
    """The exception line a logging library's record carries as its message (``2024-05-01 12:00:00,123 -
    ERROR - RuntimeError: CUDA error: ...``, ``ERROR:root:ValueError: ...``): that message, when it is one
    (:data:`_EXCEPTION_LINE_RE`); else None."""
    head = _LOGGER_HEAD_RE.match(line)
    if head is None or not head.end():
        return None
    rest = line[head.end():]
    if _EXCEPTION_LINE_RE.match(rest):
        return rest
    name = _LOGGER_NAME_RE.match(rest)
    if name is not None and _EXCEPTION_LINE_RE.match(rest[name.end():]):
        return rest[name.end():]
    return None


_MARKUP_WRAP_RE = re.compile(r"^(?:`{1,3}|[*_]{1,3})(?P<body>[A-Za-z_][^`]*?)(?:`{1,3}|[*_]{1,3})?\s*$")
"""An exception line a paste wrapped in markdown: inline code (`` `RuntimeError: ...` ``), bold or italics
(``**...**``, ``_**...**_``); its body is read as the exception line when it is one."""
_C10_CONTINUATION_RE = re.compile(
    r"^(?:CUDA kernel errors might be asynchronously reported|For debugging consider passing "
    r"CUDA_LAUNCH_BLOCKING|Compile with `TORCH_USE_CUDA_DSA`|Exception raised from \w+ at |frame #\d+: "
    r"|<omitting python frames>)")
"""Lines that continue a c10 error message (its CUDA hints, C++ stack): torch prints the ``[rankN]:``
prefix on the message's first line only, so they belong to that line's rank."""
_NCCL_HEAD_RE = re.compile(r"NCCL version \d+(?:\.\d+){1,3}\s*$")
"""The first line of an NCCL error message as torch prints it (``NCCL error in: ..., <reason>, NCCL version
2.14.3``, also cut at the left by a paste); NCCL's own lines follow it unprefixed."""
_NCCL_MORE_RE = re.compile(r"^\s*(?:nccl[A-Z]\w*Error: |ncclInvalid(?:Usage|Argument): |Last error:\s*$)")
"""The lines an NCCL error message goes on with: its ``ncclXError: <what it means>`` (``ncclInvalidUsage:``
and ``ncclInvalidArgument:`` have no ``Error`` in their names) and ``Last error:`` (the
line after which is the last error itself). The message is one log item, so the last error is read with
the reason (``internal error`` + ``Connection closed by remote peer``). A paste that double-spaces its lines
(a blank line after each, NVIDIA-NeMo/Speech#15019) keeps the message open over its blank lines: the next
non-blank line still goes on with it when it is one of these (or the last error after ``Last error:``)."""
_NCCL_REASON_RE = re.compile(r"^\s*nccl[A-Z]\w*Error: ")
"""An NCCL message whose ``NCCL error in: ..., NCCL version ...`` head is not in the paste (cut, or printed
by a wrapper that drops it): its ``ncclXError: <what it means>`` line opens the message, so its ``Last
error:`` line and the last error after it are read with it (one log item), as with the head."""
_ANSI_RE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_RAY_SGR_RESIDUE_RE = re.compile(r"^\[\d{1,3}(?:;\d{1,3}){0,3}m(\([^()\n]{1,200}\))\[0m")
"""Ray's coloured worker prefix (``ESC[36m(WorkerDict pid=3175143, ip=10.49.193.113)ESC[0m``) pasted without
its escape bytes, as a copy from a terminal or a web log viewer often leaves it: ``[36m(WorkerDict
pid=...)[0m``. Only that shape, at the start of a line, loses its colour residue; any other ``[36m`` is kept
as text."""
_TOP_HEADER_RE = re.compile(r"^Traceback \(most recent call last\):\s*$")
_ANY_HEADER_RE = re.compile(r"Traceback \(most recent call last\):\s*$")
_SEPARATOR_RE = re.compile(r"^\s*(?:The above exception was the direct cause of the following exception:"
                           r"|During handling of the above exception, another exception occurred:)\s*$")
_FATAL_RE = re.compile(r"^Fatal Python error: ")
_TERMINATE_RE = re.compile(r"^terminate called after throwing an instance of ")
_THREAD_RE = re.compile(r"^(?:Current thread|Thread|Stack)\b.*\(most recent call first\):\s*$")
_RECORD_RE = re.compile(
    r"^(?:[IWEF]\d{3,4} \d\d:\d\d:\d\d"
    r"|\[?\d{4}-\d\d-\d\d[ T]\d\d:\d\d"
    r"|\[[IWEF]\d{0,4}[ \]]"
    r"|(?:DEBUG|INFO|WARNING|ERROR|CRITICAL):[\w.]*:"
    r"|Exception in thread |Exception ignored in|Process [\w-]+:$"
    r"|(?:srun|slurmstepd|wandb|mpirun|torchrun): )"
)
_GLOG_LEVEL_RE = re.compile(r"^\[?(?:NeMo )?([IWEF])(?:\d{3,4} \d\d:\d\d:\d\d| [\w.]+:\d+\]"
                            r"|(?<=NeMo [IWEF]) \d{4}-\d\d-\d\d \d\d:\d\d:\d\d [\w.]{1,80}:\d{1,6}\])")
"""glog / c10 records: ``E1129 08:12:43``, c10's unpadded month ``[E626 06:24:44``, undated
``[E file.cpp:12]``; NeMo's logger, the same letters: ``[NeMo W 2024-03-20 18:55:16 nemo_logging:349] ``,
``[NeMo E ...]``, ``[NeMo I ...]``."""
_LEVEL_RE = re.compile(r"\b(CRITICAL|FATAL|ERROR|WARNING|WARN|INFO|DEBUG)\b|(Warning):")  # "...Warning:"
_ERROR_TEXT_RE = re.compile(r"Segmentation fault|core dumped|Bus error|^Killed\b|\bAborted\b|out of memory",
                            re.IGNORECASE)
# cheap tests that rule a line out before the regexes above run (most lines of a training log state no level)
_MAYBE_LEVEL_RE = re.compile(r"[A-Z]{4}|Warning:")
_ERROR_WORDS = ("segmentation fault", "core dumped", "bus error", "killed", "aborted", "out of memory")
_GLOG_LEVELS = {"I": "INFO", "W": "WARNING", "E": "ERROR", "F": "CRITICAL"}
_LEVELS = {"CRITICAL": "CRITICAL", "FATAL": "CRITICAL", "ERROR": "ERROR", "WARNING": "WARNING",
           "WARN": "WARNING", "INFO": "INFO", "DEBUG": "DEBUG", "Warning": "WARNING"}
LEVEL_ORDER = {"": 0, "DEBUG": 10, "INFO": 20, "WARNING": 30, "ERROR": 40, "CRITICAL": 50}
"""Numeric levels (``logging``'s); a line without a level counts as 0."""

_PYTHON, _FATAL, _TERMINATE, _NCCL = "python", "fatal", "terminate", "nccl"
_HEADER = "Traceback (most recent call last):\n"
UNKNOWN_EXCEPTION = "<unknown exception>"


def clean_line(raw: str) -> str:
    """A line as a terminal would have shown it: colour codes removed (also the colour codes of Ray's prefix
    that a paste kept without their escape bytes, :data:`_RAY_SGR_RESIDUE_RE`), carriage-return rewrites
    resolved."""
    line = raw.rstrip("\r\n")
    if "\x1b" in line:
        line = _ANSI_RE.sub("", line)
    elif line.startswith("[") and "m(" in line[:16]:
        line = _RAY_SGR_RESIDUE_RE.sub(r"\1", line, count=1)
    if "\r" in line:
        parts = [p for p in line.split("\r") if p.strip()]
        line = parts[-1] if parts else ""
    return line.rstrip()


_TORCH_MESSAGES: Tuple[Tuple[str, str], ...] = (
    ("RuntimeError", r"element 0 of tensors does not require grad and does not have a grad_fn"),
    ("RuntimeError", r"Trying to backward through the graph a second time"),
    ("RuntimeError", r"one of the variables needed for gradient computation has been modified by an inplace "
                     r"operation"),
    ("RuntimeError", r"Expected all tensors to be on the same device, but"),
    ("RuntimeError", r"mat1 and mat2 shapes cannot be multiplied \("),
    ("RuntimeError", r"The size of tensor a \(\d+\) must match the size of tensor b \(\d+\)"),
    ("RuntimeError", r"Input type \([\w.]{1,60}\) and weight type \([\w.]{1,60}\) should be the same"),
    ("RuntimeError", r"Sizes of tensors must match except in dimension \d+"),
    ("RuntimeError", r"shape '\[[-\d, ]{0,100}\]' is invalid for input of size \d+"),
    ("RuntimeError", r"Given groups=\d+, weight of size"),
    ("RuntimeError", r"expected scalar type \w+ but found \w+"),
    ("RuntimeError", r"Error\(s\) in loading state_dict for \w+"),
    ("IndexError", r"index out of range in self"),
    ("RuntimeError", r"An attempt has been made to start a new process before the"),
)
_TORCH_MESSAGE_NEEDLES = ("element 0 of", "through the graph", "gradient computation", "on the same device",
                          "mat1 and mat2", "size of tensor", "weight type", "Sizes of tensors",
                          "invalid for input", "weight of size", "expected scalar type", "loading state_dict",
                          "index out of range", "start a new process before")
"""Words of each :data:`_TORCH_MESSAGES` (a line holding none is none of them: the regex is not run)."""
"""PyTorch's exception messages that a tool's own report prints without their type (``print(f"Error running
job: {e}")``, ``logger.error(f"Training failed: {e}")``), with the type PyTorch raises them as: autograd
misuse, device / dtype / shape mismatches, a state dict that does not fit, an embedding index. Only errors of
the model's own code (process/exception): CUDA errors and OOM are read from their text already. Also
CPython's ``multiprocessing`` refusing to start a child while a spawned child imports the main module
(``RuntimeError: An attempt has been made to start a new process before the`` / ``current process has
finished its bootstrapping phase.`` -- a script without the ``__main__`` guard under spawn: Windows / macOS
DataLoader workers, ``mp.spawn``), whose message is a triple-quoted text pasted with its indentation and
often without the ``RuntimeError:`` line: the message's lines may be indented."""
_TORCH_MESSAGE_RE = re.compile(
    r"(?:^[ \t]{0,12}|(?P<lead>(?i:error|fail|exception)[^:]{0,60}):\s+)(?:"
    + "|".join(f"(?P<m{i}>{pattern})" for i, (_type, pattern) in enumerate(_TORCH_MESSAGES)) + ")")


def reported_exception(line: str) -> Optional[str]:
    """A PyTorch exception message (:data:`_TORCH_MESSAGES`) a line reports without its type -- the whole
    line, or after a lead that says it is an error (``Error running job: element 0 of tensors does not require
    grad ...``; ``error``, ``fail`` or ``exception`` within the 60 characters before the colon, as a tool's
    report glued to a progress bar prints it) -- as the exception line PyTorch printed
    (``RuntimeError: element 0 of tensors ...``); else None. A line that states a level below ERROR
    (``[WARN] GradCAM failed: ..., using fallback``, ``Warning: OCR loss failed: ...``) reports an error
    the code handled: None."""
    if not any(needle in line for needle in _TORCH_MESSAGE_NEEDLES):
        return None
    m = _TORCH_MESSAGE_RE.search(line)
    if m is None or (m.start() > 0 and m.group("lead") is None):
        return None
    if line_level(line) in ("DEBUG", "INFO", "WARNING"):
        return None
    index = next(int(k[1:]) for k, v in m.groupdict().items() if k != "lead" and v is not None)
    body_at = m.start(f"m{index}")
    return f"{_TORCH_MESSAGES[index][0]}: {line[body_at:].rstrip()}"


_QUOTED_EXCEPTION_RE = re.compile(
    r"(?i:error|fail|exception)[^:\n]{0,60}:\s{0,4}[\"'\u201c\u2018](?P<body>(?:[A-Za-z_]\w*\.)*[A-Z]\w*"
    r"(?:Error|Exception): [^\"\u201d\n]{1,2000}?)[\"'\u201d\u2019]?\s*$")
"""An exception line a sentence quotes after saying it is an error (``it report a error:"RuntimeError:
[enforce fail at inline_container.cc:144] . PytorchStreamReader failed reading zip archive: failed finding
central directory"``, open-mmlab/mmdetection#4835): the quoted line, to the end of the line."""


_INLINE_EXCEPTION_RE = re.compile(
    r"(?:[.!?:;)]\s{1,8}|\s{2,})"
    r"(?P<body>(?:[a-z_][a-z0-9_]*\.){1,8}[A-Z]\w*(?:Error|Exception): [^\n]{1,2000})$")
"""A qualified exception line pasted at the end of a sentence, with no quote around it (``I am also getting
this isssue.      tensorflow.python.framework.errors_impl.ResourceExhaustedError: ...; No space left on
device``, keras-team/keras-tuner#390): the type's module path (Python prints one for every exception not a
builtin) after a sentence's end or a run of spaces marks the rest of the line as the exception line."""


_HANDLED_LEAD_RE = re.compile(
    r"\bretr(?:y|ying|ies)\b|\bfall(?:ing|s)? ?back\b|\bfallback\b|\bignor(?:e|ed|ing)\b|\bskipp(?:ed|ing)\b"
    r"|\bcontinu(?:e|es|ing)\b|\binstead\b|\btry(?:ing)? again\b", re.IGNORECASE)
"""Wording before an inline exception (:data:`_INLINE_EXCEPTION_RE`) that says the program handled it: it
retries, falls back, ignores or skips it, goes on (``Retrying in 1s [Retry 1/5].  requests.exceptions.
ConnectionError: ...``, ``Could not import flash attention, falling back to eager.  transformers...Error:
...`` -- a healthy run's own report of an exception it recovered from, not the log's exception)."""


def quoted_exception(line: str) -> Optional[str]:
    """The exception line a prose line quotes after an error lead (:data:`_QUOTED_EXCEPTION_RE`), or pastes
    after a sentence with its qualified type (:data:`_INLINE_EXCEPTION_RE`) that does not say the program
    handled it (:data:`_HANDLED_LEAD_RE`), or None. A line that states a level below ERROR reports an error
    the code handled: None."""
    if "rror: " not in line and "xception: " not in line:
        return None
    if (m := _QUOTED_EXCEPTION_RE.search(line)) is None:
        m = _INLINE_EXCEPTION_RE.search(line)
        if m is None or _HANDLED_LEAD_RE.search(line, 0, m.start("body")):
            return None
    if line_level(line) in ("DEBUG", "INFO", "WARNING"):
        return None
    return m.group("body").rstrip()


def unwrap_markup(line: str) -> Optional[str]:
    """The exception line inside ``line``'s markdown wrapping (inline code, bold, italics), or None when
    ``line`` is not a wrapped exception line."""
    if line[:1] not in "`*_" or (m := _MARKUP_WRAP_RE.match(line)) is None:
        return None
    body = m.group("body").rstrip("`*_ ")
    return body if _EXCEPTION_LINE_RE.match(body) else None


def _outer_columns(line: str) -> str:
    """``line`` without a paste's quote marker / relayed stream name, ``kubectl logs --prefix``'s source
    column and a column before a timestamp."""
    mark = _PASTE_MARK_RE.match(line)
    if mark is not None:
        line = line[mark.end():]
    if line.startswith("[pod/") and (pod := _KUBECTL_PREFIX_RE.match(line)) is not None:
        line = line[pod.end():]
    column = _COLUMN_RE.match(line)
    if column is not None and _ISO_COLUMN_RE.match(line, column.end()):
        line = line[column.end():]
    return line


def split_prefix(line: str) -> Tuple[Optional[int], str]:
    """(rank named by a ``[rankN]:`` / ``[defaultN]:`` prefix or None, the line without any prefix); a
    pasted line-number column or a Ray worker prefix before it is dropped too, and so is a launcher's
    column before a rank prefix (a host ``worker-5: [rank22]: ...``, a nemo-run task
    ``i.pretrain/0 [default2]:[rank2]: ...``); Open MPI's ``[1,3]<stderr>:`` tag names rank 3 (a
    ``[rankN]:`` after it wins). Of two stacked prefixes, ``[rankN]:`` (torch's global rank)
    wins over ``[defaultN]:`` (torchrun's local rank). A markdown quote marker or a relayed stream's name
    (``> ``, ``stderr: ``) before all of it is dropped first, then a collector's ISO timestamp column
    (:func:`line_stamp` reads it) or a CI runner's / syslog's ``Oct 16 02:07:00 `` column. vLLM's logger
    header before a traceback's line (:data:`_VLLM_HEADER_RE`) is dropped after a worker column."""
    line = _outer_columns(line)
    iso = _ISO_COLUMN_RE.match(line) or _SYSLOG_COLUMN_RE.match(line)
    if iso is not None:
        line = line[iso.end():]
    column = _COLUMN_RE.match(line)
    if column is not None:
        line = line[column.end():]
    if line[:1] in "DIWEC" and (header := _VLLM_HEADER_RE.match(line)) is not None \
            and _CARRIED_TRACEBACK_RE.match(line, header.end()):
        line = line[header.end():]
    task = _TASK_COLUMN_RE.match(line)
    if task is not None:
        line = line[task.end():]
    mpi = _MPI_TAG_RE.match(line)
    mpi_rank = None
    if mpi is not None:
        line, mpi_rank = line[mpi.end():], int(mpi.group("num"))
    match = _PREFIX_RE.match(line) or _RANK_COLUMN_RE.match(line)
    if match is None:
        return mpi_rank, line
    names: Dict[str, int] = {}
    for _ in range(MAX_STACKED_PREFIXES):  # a bound: each strip copies the line (a 1 MB line of "[rank0]:"s)
        if match is None or len(names) >= 3:
            break
        names.setdefault(match.group("name"), int(match.group("num")))
        end = match.end()
        if match.group("name") not in _SPACED_TAGS and match.group(0).endswith(" ") \
                and line.startswith(" ", end):
            end -= 1  # a role's tag glued to an indented line: the spaces after it are the line's own
        line = line[end:]
        match = _PREFIX_RE.match(line)
    rank = names.get("rank", names.get("default", mpi_rank))
    return rank, line


def line_stamp(line: str, year: int) -> Optional[Tuple[int, int]]:
    """(time in ns, precision in ns) of the timestamp ``line`` starts with once its prefixes are dropped, or
    of a collector's timestamp column before them (``2024-05-01T10:00:00Z [rank1]: ...``); else None."""
    found = line_stamp_year(line, year)
    return None if found is None else found[:2]


def line_stamp_year(line: str, year: int,
                    near: Optional[int] = None) -> Optional[Tuple[int, int, Optional[int]]]:
    """:func:`line_stamp` and the year its ISO date states (None for a yearless glog stamp, read with
    ``year``): the year the glog lines after a dated line are read with. ``near``: the stamp before the
    line (see :func:`.times.leading_stamp_year`: a yearless stamp takes the year nearest it)."""
    found = leading_stamp_year(split_prefix(line)[1], year, near)
    if found is None:
        outer = _outer_columns(line)
        if _ISO_COLUMN_RE.match(outer):
            found = leading_stamp_year(outer, year, near)
    return found


def line_year(line: str) -> Optional[int]:
    """The year of the ISO date ``line`` starts with once its prefixes are dropped (or of a collector's
    timestamp column before them), else None."""
    found = line_stamp_year(line, 2000)
    return None if found is None else found[2]


def line_level(line: str) -> str:
    """The level a line states: a glog letter (``E1129 ...``), a level word near its start (``ERROR``,
    ``WARN``, ``...Warning:``), or ERROR for crash text without one ("Segmentation fault", "Killed",
    "out of memory", ...); "" when none."""
    match = _GLOG_LEVEL_RE.match(line)
    if match is not None:
        return _GLOG_LEVELS[match.group(1)]
    head = line[:120]
    if _MAYBE_LEVEL_RE.search(head) is not None:
        match = _LEVEL_RE.search(head)
        if match is not None:
            return _LEVELS[match.group(1) or match.group(2)]
    lowered = line.lower()
    if not any(word in lowered for word in _ERROR_WORDS):
        return ""
    return "ERROR" if _ERROR_TEXT_RE.search(line) else ""


def reindent_loose_frames(text: str) -> str:
    """A Python block's frame lines that a paste set flush left (``File "x.py", line 3, in f`` at column 0 or
    1) indented as Python prints them, and so is a frame's code line when it lost its indentation too (the
    unindented line right after such a frame that is no exception line), so the traceback parses."""
    if _LOOSE_FRAME_FIX_RE.search(text) is None:
        return text
    out: List[str] = []
    after_frame = False
    for line in text.split("\n"):
        if _LOOSE_FRAME_RE.match(line):
            out.append('  File "' + line.split('File "', 1)[1])
            after_frame = True
            continue
        if after_frame and line.strip() and not _indented(line) and _EXCEPTION_LINE_RE.match(line) is None:
            line = "    " + line
        after_frame = False
        out.append(line)
    return "\n".join(out)


def _starts_block(line: str) -> Optional[str]:
    if _TOP_HEADER_RE.match(line):
        return _PYTHON
    if _FATAL_RE.match(line):
        return _FATAL
    if _TERMINATE_RE.match(line):
        return _TERMINATE
    return None


def _indented(line: str) -> bool:
    return line[:1] in (" ", "\t")


# ----------------------------------------------------------------------------------------------- items

@dataclass
class LogItem:
    """One log line (``kind == "log"``) or one exception (``"exception"``, ``payload`` is the
    ExceptionEvent in the JSON mapping) of ``rank``."""

    kind: str
    rank: int
    line: int
    last_line: int
    time_ns: Optional[int]
    level: str = ""
    message: str = ""
    payload: Dict[str, Any] = field(default_factory=dict)
    precision_ns: int = 1       # of ``time_ns`` (see the module doc)


@dataclass
class LogStats:
    lines: int = 0            # non-blank lines
    log_lines: int = 0        # emitted as log items
    below_level: int = 0      # lines left out by ``min_level``
    exceptions: int = 0
    recognised: int = 0       # lines the classifier gives a kind (``keep_below`` said so), kept at any level
    timestamped: int = 0      # lines that start with a timestamp
    ranks: Dict[int, int] = field(default_factory=dict)  # items per rank


def exception_payload(parsed: Sequence[ParsedException], text: str) -> Optional[Dict[str, Any]]:
    """The ExceptionEvent (JSON mapping) for the final exception of one printed block, as the SDK builds
    it for a live exception (frames capped to the innermost :data:`MAX_FRAMES`, hints re-indexed); None
    when ``parsed`` is empty."""
    if not parsed:
        return None
    index = max((i for i, p in enumerate(parsed) if not p.relation), default=len(parsed) - 1)
    final = parsed[index]
    chain: List[Dict[str, Any]] = []
    for earlier in reversed(parsed[:index]):  # the final exception's own causes/contexts, outermost first
        if earlier.relation not in (RELATION_CAUSE, RELATION_CONTEXT):
            break
        chain.insert(0, {"type": earlier.exc_type, "message": safe_str(earlier.message, 2048),
                         "relation": earlier.relation,
                         "frames": [_frame(f) for f in earlier.frames[-MAX_FRAMES:]]})
    printed = final.fingerprint().to_dict()
    frames = list(final.frames)
    offset = max(0, len(frames) - MAX_FRAMES)
    printed["hints"] = [dict(h, frame_index=h["frame_index"] - offset) for h in printed["hints"]
                        if h["frame_index"] >= offset]
    printed["message_template"] = safe_str(printed["message_template"], MAX_MESSAGE_CHARS)
    payload: Dict[str, Any] = {
        "type": final.exc_type or UNKNOWN_EXCEPTION,
        "message": safe_str(final.message, MAX_MESSAGE_CHARS),
        "handled": False, "mechanism": "log",
        "traceback": safe_str(text, MAX_TRACEBACK_CHARS),
        "frames": [_frame(f) for f in frames[offset:]],
    }
    payload.update(printed)
    if chain:
        payload["chain"] = chain
    return payload


def _cut_chain(parsed: List[ParsedException]) -> List[ParsedException]:
    """A chain whose last traceback was cut before its exception line ends with the exception before it:
    the cause that was printed is what is known (a typeless tail is dropped)."""
    if len(parsed) > 1 and not parsed[-1].exc_type and parsed[-1].relation == "" and parsed[-2].exc_type \
            and parsed[-2].relation in (RELATION_CAUSE, RELATION_CONTEXT):
        return [*parsed[:-2], replace(parsed[-2], relation="")]
    return parsed


def _cut_in_setup(payload: Mapping[str, Any]) -> bool:
    """Whether one of ``payload``'s three innermost frames is a process-group set-up function
    (``init_process_group``, DeepSpeed's ``init_distributed``, rendezvous store creation ...)."""
    frames = payload.get("frames") or []
    return any(isinstance(f, Mapping) and f.get("function") in INIT_FUNCTIONS for f in frames[-3:])


_LAUNCHER_PATH_RE = re.compile(r"torch/distributed/(?:run|launch)\.py|torch/distributed/launcher/"
                               r"|deepspeed/launcher/|accelerate/commands/")
"""A launcher's own code: torchrun / ``torch.distributed.launch``, DeepSpeed's and Accelerate's launchers."""
_BOOTSTRAP_PATH_RE = re.compile(r"torch/distributed/elastic/|/runpy\.py$|/bin/[\w.-]+$")
"""Code that only starts or supervises the program: torchelastic's agent and ``@record`` wrapper, runpy, a
console script's ``bin/`` stub."""


def _ends_in_frames(block: Sequence[Tuple[int, str]]) -> bool:
    """Whether a block's last non-blank line is part of a frame: its ``File "...", line N`` line (indented
    or not) or an indented line under it (the source line, its carets) -- the text stops inside the stack,
    not in lines that merely followed one."""
    last = next((line for _, line in reversed(block) if line.strip()), "")
    return _LOOSE_FRAME_RE.match(last) is not None or last[:1].isspace()


def _raised_in_program(frames: Sequence[Mapping[str, Any]]) -> bool:
    """Whether a traceback cut before its exception line was raised in the program: it has frames, none of
    them a launcher's own (:data:`_LAUNCHER_PATH_RE`: the launcher's traceback after a worker failed, the
    workers' own errors and its summary being what tell the failure), and its innermost frame is not only
    start-up or supervision code (:data:`_BOOTSTRAP_PATH_RE`)."""
    paths = [str(f.get("filename") or "").replace("\\", "/") for f in frames if isinstance(f, Mapping)]
    if not paths or any(_LAUNCHER_PATH_RE.search(p) for p in paths):
        return False
    return _BOOTSTRAP_PATH_RE.search(paths[-1]) is None


def _frame(frame: Any) -> Dict[str, Any]:
    out: Dict[str, Any] = {"filename": frame.filename, "module": frame.module, "function": frame.function,
                           "lineno": frame.lineno, "in_app": frame.in_app}
    if frame.context_line:
        out["context_line"] = frame.context_line
    return out


# ------------------------------------------------------------------------------------------- segmenter

class _Stream:
    """The lines of one rank: outside a block, or inside one (Python, faulthandler, C++)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.mode: Optional[str] = None
        self.block: List[Tuple[int, str]] = []   # (line number, text)
        self.time_ns: Optional[int] = None       # time of the block's first line
        self.precision_ns = 1                    # ... and its precision
        self.in_message = False
        self.message_lines = 0
        self.seen_thread = False
        self.prev = ""                           # previous non-blank line of the block
        self.headless = False                    # a Python block cut at the top (no header line)
        self.unsettled = False                   # an inline exception: kept only if the run did not go on
        self.went_on = False                     # ... and a progress line came while it was read

    @property
    def first_line(self) -> int:
        return self.block[0][0] if self.block else 0

    def start(self, mode: str, number: int, text: str, time_ns: Optional[int], precision_ns: int, *,
              headless: bool = False, in_message: bool = False) -> None:
        self.mode, self.block, self.time_ns, self.precision_ns = mode, [(number, text)], time_ns, precision_ns
        self.in_message, self.message_lines, self.seen_thread, self.prev = in_message, 0, False, text
        self.headless = headless
        self.unsettled = self.went_on = False

    def continues(self, text: str) -> Tuple[bool, bool]:
        """(the line belongs to the open block, the block ends with it)."""
        if len(self.block) >= MAX_BLOCK_LINES:
            return False, False
        blank = not text.strip()
        if self.mode == _NCCL:
            if blank:
                return True, False  # a double-spaced paste: the message may go on after its blank lines
            if self.prev.strip() == "Last error:":
                return True, True  # the last error: the message ends with it
            return _NCCL_MORE_RE.match(text) is not None, False
        if self.mode == _TERMINATE:
            if blank or _starts_block(text) or _RECORD_RE.match(text):
                return False, False
            return True, False
        if blank:
            return True, False
        if _RECORD_RE.match(text) or _FATAL_RE.match(text) or _TERMINATE_RE.match(text):
            return False, False
        if self.mode == _FATAL:
            if _TOP_HEADER_RE.match(text):
                return False, False
            if _THREAD_RE.match(text):
                self.seen_thread = True
                return True, False
            if not _indented(text) and self.seen_thread:
                return True, True  # "Extension modules: ..." or another trailer
            return True, False
        # Python traceback
        if _TOP_HEADER_RE.match(text):
            previous = self.prev.rstrip()
            if _SEPARATOR_RE.match(previous) or (self.in_message and previous.endswith(":")):
                self.in_message, self.message_lines = False, 0
                return True, False
            return False, False
        if _SEPARATOR_RE.match(text) or _indented(text):
            if _ANY_HEADER_RE.search(text):
                self.message_lines = 0
            return True, False
        if not self.in_message:
            if _LOOSE_FRAME_RE.match(text):
                return True, False  # a frame whose indentation the paste lost
            if _LOOSE_FRAME_RE.match(self.prev) and _EXCEPTION_LINE_RE.match(text) is None:
                return True, False  # ... and its code line, flush left too (every indentation lost)
            self.in_message = True  # the exception line
            return True, False
        if _ANY_HEADER_RE.search(text):
            self.message_lines = 0
            return True, False
        self.message_lines += 1
        return self.message_lines <= MAX_MESSAGE_LINES, False

    def take(self) -> List[Tuple[int, str]]:
        block = self.block
        while block and not block[-1][1].strip():
            block.pop()
        self.mode, self.block = None, []
        return block


class LogSegmenter:
    """The incremental core of :class:`LogReader`: lines in, :class:`LogItem` out (see the module doc).

    ``feed(number, line, time_ns, precision_ns)`` takes one cleaned line (:func:`clean_line`) with the time
    it was written (or None); ``take()`` returns the items that are complete and ordered (an open traceback
    holds back everything after its first line); ``flush()`` closes the open blocks (end of input, or a
    source that went quiet) and returns everything left. ``rank`` and ``min_level`` as for LogReader;
    ``keep_below(text)``: a line below ``min_level`` is kept when this says so (the agent keeps error text
    the classifier recognises), decided here so a dropped line costs no item. ``headless``: pasted text
    -- a traceback cut at the top (frame lines with no ``Traceback ...`` header) and an exception line
    printed with no traceback at all (``RuntimeError: ...``) are exceptions too (``trainguard replay``;
    a live job's output always has its header). ``tail``: when nothing at all passed the level by the end,
    the last ``tail`` lines left out are emitted after all (a file of a job that died without an error
    line still shows what it printed last); 0 keeps nothing. ``hold_unsettled`` (default True: a file or a
    paste): an item that says something failed only if the run did not go on (an inline exception after a
    sentence, c10d's warning for one connect attempt) waits for a progress line (dropped) or the end
    (emitted), holding later items back; False (a live tail) emits it at once."""

    def __init__(self, rank: int = 0, *, min_level: str = "",
                 keep_below: Optional[Callable[[str], bool]] = None, headless: bool = False,
                 tail: int = 0, hold_unsettled: bool = True) -> None:
        self.rank = rank
        self.headless = headless
        # False (a live tail: the agent): an unsettled item is emitted at once, in line order like any other
        # -- a live log cannot wait for a progress line that may never come (a hang), and a held item holds
        # every later one; the engine judges such a live record itself (detectors/process.py CONNECT_RULE)
        self.hold_unsettled = hold_unsettled
        self._tail: Deque[Tuple[int, int, str, Optional[int], int]] = deque(maxlen=max(0, tail))
        self.min_level = LEVEL_ORDER[min_level]
        self.keep_below = keep_below
        self.stats = LogStats()
        self._streams: Dict[int, _Stream] = {}
        self._pending: List[Tuple[int, int, LogItem]] = []  # (first line, seq, item): released in order
        self._seq = 0
        self._message_rank: Optional[int] = None  # the rank of the c10 message being continued, if any
        self._traceback_rank: Optional[int] = None  # the rank whose prefixed traceback header is continued
        self._entry_rank: Optional[int] = None    # the rank of the torchrun failure entry being read
        self._entry_traceback: Optional[int] = None  # the rank whose entry's ``traceback :`` field is read
        # a torchrun failure summary read without its ``ChildFailedError:`` line: its lines held as fed
        # (number, line, time, precision) until it ends (see _summary_line)
        self._summary: Optional[List[Tuple[int, str, Optional[int], int]]] = None
        self._summary_off = False  # its lines fed again one by one (it named no root cause)
        self._summary_rooted = False  # a held line is its "Root Cause (first observed failure):" head
        self._summary_traced = -1  # the index of the last held entry "traceback :" field (-1: none)
        # items that say something failed only if the run did not go on after them (an inline exception
        # a sentence reports, c10d's warning for one connect attempt): held until a training-progress line
        # drops them or the end of the log (or UNSETTLED_MAX_PENDING items waiting behind them) emits them
        self._unsettled: List[LogItem] = []
        self._watch = False  # an unsettled item or block may be open: lines are checked for progress

    @property
    def open_blocks(self) -> int:
        """Tracebacks still being read."""
        return sum(1 for s in self._streams.values() if s.mode is not None)

    def feed(self, number: int, line: str, time_ns: Optional[int], precision_ns: int = 1) -> None:
        """One line (already cleaned), line number ``number``."""
        prefixed, text = split_prefix(line)
        if self._watch:  # something unsettled was read: does the run go on?
            if not self._unsettled and not any(s.unsettled for s in self._streams.values()):
                self._watch = False
            elif went_on(text):
                self._go_on()
        if not self._summary_off and prefixed is None and self._summary_line(number, line, text, time_ns,
                                                                              precision_ns):
            return
        if prefixed is not None:
            self._message_rank = prefixed
            # a logger that prefixes a record's first line only (ParlAI's ``rank:  3 | ... | Traceback (most
            # recent call last):``): the traceback's unprefixed lines are that rank's
            header = _ANY_HEADER_RE.search(text) is not None and _TOP_HEADER_RE.match(text) is None
            self._traceback_rank = prefixed if header else None
            self._entry_rank = None
            self._end_entry_traceback()
        elif text.strip():
            if self._message_rank is not None:
                if _C10_CONTINUATION_RE.match(text) or self._nccl_goes_on(self._message_rank, text):
                    prefixed = self._message_rank
                else:
                    self._message_rank = None
            if prefixed is None and self._traceback_rank is not None:
                if _indented(text) or _EXCEPTION_LINE_RE.match(text) or _SEPARATOR_RE.match(text) \
                        or _TOP_HEADER_RE.match(text):
                    prefixed = self._traceback_rank
                else:
                    self._traceback_rank = None
            if prefixed is None and self._entry_traceback is not None:
                if text.startswith(ENTRY_TRACEBACK_INDENT) and _FAILURE_FIELD_RE.match(text) is None \
                        and _FAILURE_RANK_RE.match(text) is None:
                    prefixed, text = self._entry_traceback, text[len(ENTRY_TRACEBACK_INDENT):]
                else:
                    self._end_entry_traceback()
            if prefixed is None:
                prefixed = self._failure_entry_rank(text)
                if prefixed is not None and (m := _FAILURE_TRACEBACK_RE.match(text)) is not None:
                    text = text[m.end():]  # the worker's traceback: read as the entry's rank printed it
                    self._entry_traceback = prefixed
        rank = self.rank if prefixed is None else prefixed
        stream = self._streams.get(rank)
        if stream is None:
            stream = self._streams[rank] = _Stream(rank)
        if text.strip():
            self.stats.lines += 1
        if stream.mode is not None and self.headless and self._cut_traceback_starts(stream, text):
            self._close(stream)
        if stream.mode is not None:
            belongs, ends = stream.continues(text)
            if belongs:
                stream.block.append((number, text))
                if text.strip():
                    stream.prev = text
                if ends:
                    self._close(stream)
                return
            self._close(stream)
        if not text.strip():
            return
        mode = _starts_block(text)
        if mode is None and (_NCCL_HEAD_RE.search(text) or _NCCL_REASON_RE.match(text)):
            mode = _NCCL
        if mode is not None:
            stream.start(mode, number, text, time_ns, precision_ns)
            return
        if self.headless:
            if _FRAME_LINE_RE.match(text) or _LOOSE_FRAME_RE.match(text):
                # a paste cut inside a traceback; its first frame may have lost its indentation (copied
                # from the middle of the frame line's row, or into backticks: NVIDIA/nccl#1546)
                stream.start(_PYTHON, number, text, time_ns, precision_ns, headless=True)
                return
            if _EXCEPTION_LINE_RE.match(text):
                stream.start(_PYTHON, number, text, time_ns, precision_ns, headless=True, in_message=True)
                return
            bare = unwrap_markup(text)
            if bare is None:
                bare = logged_exception(text)
            if bare is None:
                bare = reported_exception(text)
            inline = False
            if bare is None:
                bare = quoted_exception(text)
                inline = bare is not None and _QUOTED_EXCEPTION_RE.search(text) is None
            if bare is not None:
                stream.start(_PYTHON, number, bare, time_ns, precision_ns, headless=True, in_message=True)
                stream.unsettled = inline
                self._watch = self._watch or inline
                return
        self._line(rank, number, text, time_ns, precision_ns)

    def _summary_line(self, number: int, line: str, text: str, time_ns: Optional[int],
                      precision_ns: int) -> bool:
        """Whether the unprefixed ``line`` was taken as part of a torchrun failure summary read without its
        ``ChildFailedError:`` line (a paste cut above it, or a launcher's stderr apart from the worker's):
        from its ``Failures:`` head, an entry's ``[N]:`` or field, or its ``Root Cause (first observed
        failure):`` head -- outside a traceback -- to its closing rule of equals signs (or the first line not
        of a summary). A summary that names its root cause's rank is read as the ``ChildFailedError`` it is
        the message of (torchrun prints it only so), ONE exception as when its ``ChildFailedError:`` line is
        in the text, so the classifier reads it whole: torchrun's root cause leads, not the entry listed
        first. One that names none (cut above its root cause's ``rank`` field), or in which another entry
        carries its worker's traceback (read line by line, that traceback is its rank's exception, the
        error the exit came from; read whole, only the root cause's own traceback is), is fed again line by
        line, each entry's lines its rank's, as before."""
        summary = self._summary
        shaped = _SUMMARY_LINE_RE.match(text) is not None or _FAILURE_FIELD_RE.match(text) is not None \
            or _FAILURE_RANK_RE.match(text) is not None
        if summary is None:
            own = self._streams.get(self.rank)
            if not shaped or text.lstrip().startswith(("-", "=")) or (
                    own is not None and own.mode is not None):
                return False
            self._summary = [(number, line, time_ns, precision_ns)]
            self._summary_rooted = _SUMMARY_ROOT in text
            self._summary_traced = 0 if _FAILURE_TRACEBACK_RE.match(text) else -1
            return True
        rooted = self._summary_rooted  # flags kept as lines arrive: no rescan of the held lines per line
        entry_traceback = text.startswith(ENTRY_TRACEBACK_INDENT) and bool(text.strip()) \
            and self._summary_traced >= 0 and self._summary_traced >= len(summary) - 200
        if shaped or entry_traceback:
            summary.append((number, line, time_ns, precision_ns))
            self._summary_rooted = rooted or _SUMMARY_ROOT in text
            if _FAILURE_TRACEBACK_RE.match(text):
                self._summary_traced = len(summary) - 1
            if rooted and text.lstrip().startswith("="):
                self._end_summary()
            return True
        self._end_summary()
        return False

    def _end_summary(self) -> None:
        summary, self._summary = self._summary, None
        if not summary:
            return
        # the lines as the job printed them: a tag that names no rank (``[trainer0|0]:``, a relayed stream's
        # name) is not part of the summary the classifier reads; the held lines keep it for a feed again
        texts = [split_prefix(held[1])[1] for held in summary]
        text = "\n".join(texts)
        root = next((i for i, said in enumerate(texts) if _SUMMARY_ROOT in said), None)
        named = root is not None and any(_FAILURE_RANK_RE.match(said) for said in texts[root:])
        others_traced = root is not None and any(_FAILURE_TRACEBACK_RE.match(said) for said in texts[:root])
        if named and not others_traced and len(text) <= MAX_LINE_CHARS:
            # torchrun prints this summary only as its ChildFailedError's message: read as that exception
            parsed = parse_traceback_text(f"{_HEADER}{CHILD_FAILED_ERROR}: \n{text}")
            payload = exception_payload(parsed, text)
            if payload is not None and payload["type"] != UNKNOWN_EXCEPTION:
                first, last = summary[0], summary[-1]
                self._emit(LogItem("exception", self.rank, first[0], last[0], first[2], "CRITICAL",
                                   payload=payload, precision_ns=first[3]))
                return
        self._summary_off = True
        try:
            for held in summary:
                self.feed(*held)
        finally:
            self._summary_off = False

    def _end_entry_traceback(self) -> None:
        """The entry's ``traceback :`` field ended (a line not indented as its lines are): its block, if still
        open, ends with it -- what follows is the summary's, not the worker's exception message."""
        rank, self._entry_traceback = self._entry_traceback, None
        stream = self._streams.get(rank) if rank is not None else None
        if stream is not None and stream.mode is not None:
            self._close(stream)

    def _nccl_goes_on(self, rank: int, text: str) -> bool:
        """Whether unprefixed ``text`` goes on with the NCCL error message open on ``rank``'s stream."""
        stream = self._streams.get(rank)
        return stream is not None and stream.mode == _NCCL and stream.continues(text)[0]

    def _failure_entry_rank(self, text: str) -> Optional[int]:
        """The rank of a field line of torchrun's failure summary read outside a traceback (its
        ``ChildFailedError:`` line cut off): ``exitcode`` / ``error_file`` / ``traceback`` after an entry's
        ``rank : R`` field are about rank R (``traceback : Signal 6 (SIGABRT) received by PID ...``)."""
        own = self._streams.get(self.rank)
        if own is not None and own.mode is not None:
            self._entry_rank = None
            return None
        if (m := _FAILURE_RANK_RE.match(text)) is not None:
            self._entry_rank = int(m.group("rank"))
            return None
        if self._entry_rank is not None and _FAILURE_FIELD_RE.match(text):
            return self._entry_rank
        self._entry_rank = None
        return None

    @staticmethod
    def _cut_traceback_starts(stream: _Stream, text: str) -> bool:
        """A frame line after an exception's message (not after a header or another frame): the next
        traceback, cut at the top."""
        return stream.mode == _PYTHON and stream.in_message and _FRAME_LINE_RE.match(text) is not None \
            and not _indented(stream.prev) and _ANY_HEADER_RE.search(stream.prev) is None

    def take(self) -> List[LogItem]:
        """Items whose first line precedes every open block's and every unsettled item's, in line order."""
        if self._unsettled and len(self._pending) > UNSETTLED_MAX_PENDING:
            self._settle()
        return list(self._release())

    def _go_on(self) -> None:
        """A training-progress line: the unsettled items before it reported what the run recovered from."""
        for item in self._unsettled:
            self._uncount(item)
        self._unsettled.clear()
        for stream in self._streams.values():
            if stream.unsettled:
                stream.went_on = True

    def _uncount(self, item: LogItem) -> None:
        stats = self.stats
        if item.kind == "log":
            stats.log_lines -= 1
        else:
            stats.exceptions -= 1
        stats.ranks[item.rank] -= 1
        if not stats.ranks[item.rank]:
            del stats.ranks[item.rank]

    def _settle(self) -> None:
        """The unsettled items, emitted: the run did not go on after them (as far as the log shows)."""
        for item in self._unsettled:
            self._seq += 1
            heapq.heappush(self._pending, (item.line, self._seq, item))
        self._unsettled.clear()

    def flush(self) -> List[LogItem]:
        """Close every open block; all items left, in line order."""
        self._end_summary()
        for stream in self._streams.values():
            if stream.mode is not None:
                self._close(stream, at_end=self.headless)
        self._settle()
        if self.stats.log_lines + self.stats.exceptions == 0:
            for rank, number, text, time_ns, precision_ns in self._tail:
                self.stats.below_level -= 1
                self._emit(LogItem("log", rank, number, number, time_ns, line_level(text),
                                   safe_str(text, MAX_LINE_CHARS), precision_ns=precision_ns))
        self._tail.clear()
        return list(self._release(final=True))

    def _close(self, stream: _Stream, at_end: bool = False) -> None:
        """Emit the block ``stream`` holds. ``at_end``: pasted text ends inside it (see :meth:`flush`)."""
        time_ns, precision_ns = stream.time_ns, stream.precision_ns
        headless, mode = stream.headless, stream.mode
        unsettled, dropped = stream.unsettled, stream.went_on
        stream.unsettled = stream.went_on = False
        block = stream.take()
        if not block:
            return
        if unsettled and dropped:
            return  # an inline exception the run went on after: what it recovered from
        text = "\n".join(t for _, t in block)
        if mode == _NCCL:  # one message, one log item (a lone head line is a plain line)
            self._line(stream.rank, block[0][0], text, time_ns, precision_ns, last=block[-1][0])
            return
        readable = reindent_loose_frames(text) if mode == _PYTHON else text
        parsed = _cut_chain(parse_traceback_text(_HEADER + readable if headless else readable))
        payload = exception_payload(parsed, text)
        if payload is not None and payload["type"] == UNKNOWN_EXCEPTION and mode == _PYTHON \
                and not payload.get("chain") and _cut_in_setup(payload):
            # cut inside a process-group set-up function: where it stopped says what failed (the group never
            # came up), so the block stays one exception item, of no known type
            self._emit(LogItem("exception", stream.rank, block[0][0], block[-1][0], time_ns, "CRITICAL",
                               payload=payload, precision_ns=precision_ns))
            return
        if payload is None or (mode == _PYTHON and payload["type"] == UNKNOWN_EXCEPTION):
            # a Python traceback cut before its exception line says nothing of what failed: its lines
            # go on as lines (one may still say it, e.g. an NCCL error printed inside it; in pasted text
            # a bare ``RuntimeError: ...`` line among them is an exception of its own)
            for number, line in block:
                if not line.strip():
                    continue
                if self.headless and _EXCEPTION_LINE_RE.match(line) and self._bare_exception(
                        stream.rank, number, line, time_ns, precision_ns):
                    continue
                self._line(stream.rank, number, line, time_ns, precision_ns)
            if at_end and mode == _PYTHON and payload is not None and not payload.get("chain") \
                    and not self.stats.exceptions and not self.stats.recognised \
                    and _ends_in_frames(block) and _raised_in_program(payload["frames"]):
                # the paste ends inside this traceback and nothing else in it says what failed (no exception,
                # no line the classifier recognises): the process raised here and the paste (or the excerpt
                # it came from) cut the exception line off -- an exception of no known type
                self._emit(LogItem("exception", stream.rank, block[0][0], block[-1][0], time_ns, "CRITICAL",
                                   payload=payload, precision_ns=precision_ns))
            return
        self._emit(LogItem("exception", stream.rank, block[0][0], block[-1][0], time_ns, "CRITICAL",
                           payload=payload, precision_ns=precision_ns), unsettled=unsettled)

    def _bare_exception(self, rank: int, number: int, line: str, time_ns: Optional[int],
                        precision_ns: int) -> bool:
        """``line`` (an exception line with no traceback that parses) as an exception item; False if not."""
        payload = exception_payload(parse_traceback_text(_HEADER + line), line)
        if payload is None or payload["type"] == UNKNOWN_EXCEPTION:
            return False
        self._emit(LogItem("exception", rank, number, number, time_ns, "CRITICAL", payload=payload,
                           precision_ns=precision_ns))
        return True

    def _line(self, rank: int, number: int, text: str, time_ns: Optional[int], precision_ns: int,
              last: Optional[int] = None) -> None:
        level = line_level(text)
        known = self.keep_below is not None and self.keep_below(text)
        if LEVEL_ORDER[level] < self.min_level and not known:
            self.stats.below_level += 1
            if self._tail.maxlen:
                self._tail.append((rank, number, text, time_ns, precision_ns))
            return
        self.stats.recognised += known
        self._emit(LogItem("log", rank, number, number if last is None else last, time_ns, level,
                           safe_str(text, MAX_LINE_CHARS), precision_ns=precision_ns),
                   unsettled=("socket has failed to connect" in text or "retrying" in text)
                   and connect_retry(text))

    def _emit(self, item: LogItem, unsettled: bool = False) -> None:
        stats = self.stats
        if item.kind == "log":
            stats.log_lines += 1
        else:
            stats.exceptions += 1
        stats.ranks[item.rank] = stats.ranks.get(item.rank, 0) + 1
        if unsettled and self.hold_unsettled:
            self._unsettled.append(item)
            self._watch = True
            return
        self._seq += 1
        heapq.heappush(self._pending, (item.line, self._seq, item))

    def _release(self, final: bool = False) -> Iterator[LogItem]:
        pending = self._pending
        if not pending:
            return
        limit = None if final else min([s.first_line for s in self._streams.values() if s.mode is not None]
                                       + ([self._summary[0][0]] if self._summary else [])
                                       + [item.line for item in self._unsettled], default=None)
        while pending and (limit is None or pending[0][0] < limit):
            yield heapq.heappop(pending)[2]


class LogReader:
    """Iterates the :class:`LogItem` of one log file (see the module doc). ``rank``: the rank of lines
    without a rank prefix; ``min_level``: log lines whose level (:func:`line_level`) is below it are left
    out and counted (``""``: every line; exceptions are always kept) unless ``keep_below(text)`` says the
    line matters anyway; ``on_bytes(n)`` is called with the size of every line read (progress); ``headless``
    and ``tail`` as for :class:`LogSegmenter` (headless on by default: a file is pasted or saved text)."""

    def __init__(self, path: Path, rank: int = 0, *, min_level: str = "",
                 on_bytes: Optional[Callable[[int], None]] = None,
                 keep_below: Optional[Callable[[str], bool]] = None, headless: bool = True,
                 tail: int = 0) -> None:
        self.path = path
        self.rank = rank
        self.on_bytes = on_bytes
        self._segmenter = LogSegmenter(rank, min_level=min_level, keep_below=keep_below, headless=headless,
                                       tail=tail)
        self.stats = self._segmenter.stats
        self._head = _head_lines(path)  # read once: the year here, the paste's shape when iterated
        self.year, self._first_dated = paste_dated(path, self._head)
        self._last_ts: Optional[int] = None
        self._last_precision = 1

    def __iter__(self) -> Iterator[LogItem]:
        segmenter = self._segmenter
        indent, numbered, labelled, width, padded, relay = paste_shape(self.path, self._head)
        self._head = None
        with open(self.path, "rb") as fh:
            for number, raw in unwrapped(fh, width, self.on_bytes, padded):
                line = clean_line(raw)
                if numbered:
                    line = drop_line_number(line)
                elif labelled:
                    line = task_label_as_prefix(line)
                if indent and line.startswith(indent):
                    line = line[len(indent):]
                if line.strip():
                    near = self._first_dated if self._last_ts is None else self._last_ts
                    found = line_stamp_year(line, self.year, near)
                    if found is not None:
                        self.stats.timestamped += 1
                        self._last_ts, self._last_precision, stated = found
                        self.year = stated or self.year
                    if relay:
                        line = line[relay:]
                segmenter.feed(number, line, self._last_ts, self._last_precision)
                yield from segmenter.take()
        yield from segmenter.flush()


INDENT_SCAN_LINES = 2000
"""Lines :func:`paste_indent` (and :func:`paste_wrap_width`) look at."""
WRAP_MIN_WIDTH = 60
"""The narrowest terminal whose hard wrap :func:`paste_wrap_width` recognises."""
_PROGRESS_BAR_RE = re.compile(r"\d{1,3}%\|.*\]\s*$")
"""A progress bar's row, whole (tqdm's ``  1%|▎     | 8/1122 [00:03<08:00,  2.32it/s]``, ending with its
stats): sized to the console's width. A bar with the error glued to it (``...it/s]RuntimeError: ...``)
that the console then wrapped ends elsewhere."""
TERMINAL_WIDTHS = frozenset({80, 100, 120, 132, 160})
"""Terminal widths a console opens with (80 the classic default, 120 Windows' console, 132 VT100's wide mode,
100 / 160 common presets): a paste whose longest lines all have one of these lengths needs one wrapped piece
to show the wrap (:func:`paste_wrap`) -- a one- or two-line error message cut once by the terminal."""
_DIGIT_RE = re.compile(r"\d")


def _head_lines(path: Path) -> Optional[List[str]]:
    """The file's first :data:`INDENT_SCAN_LINES` lines, decoded (undecodable bytes replaced) and without
    their line ends -- what the paste-shape probes below read; None when the file cannot be read."""
    texts: List[str] = []
    try:
        with open(path, "rb") as fh:
            for number, raw in enumerate(fh):
                if number >= INDENT_SCAN_LINES:
                    break
                texts.append(raw.decode("utf-8", "replace").rstrip("\r\n"))
    except OSError:
        return None
    return texts


def _head_or(path: Path, head: Optional[List[str]]) -> Optional[List[str]]:
    """``head`` when the caller read the file's head already (:func:`paste_shape`), else a fresh read."""
    return head if head is not None else _head_lines(path)


class PasteShape(NamedTuple):
    """How a paste was saved, from one read of its head (:func:`paste_shape`): what :class:`LogReader` and
    :func:`scan_log` undo on every line."""

    indent: str
    numbered: bool
    labelled: bool
    width: int
    padded: bool
    relay: int


def paste_shape(path: Path, head: Optional[List[str]] = None) -> PasteShape:
    """:func:`paste_indent`, :func:`paste_numbered`, :func:`paste_task_labels`, :func:`paste_wrap` and
    :func:`paste_relay_prefix` of ``path``, each only where the ones before leave it to decide (a numbered
    paste is no task-labelled one, and neither is wrapped or relayed), all from one read of the file's head
    (``head``: that read, when the caller made it)."""
    head = _head_or(path, head)
    indent = paste_indent(path, head)
    numbered = paste_numbered(path, head)
    labelled = not numbered and paste_task_labels(path, head)
    width, padded = (0, False) if numbered or labelled else paste_wrap(path, head)
    relay = 0 if numbered or labelled or width else paste_relay_prefix(path, head)
    return PasteShape(indent, numbered, labelled, width, padded, relay)


def paste_year(path: Path, head: Optional[List[str]] = None) -> int:
    """The year yearless glog stamps (``E0416 00:03:25.080 ...``) are read with until a dated line says
    otherwise: that of the first line among the file's first :data:`INDENT_SCAN_LINES` that starts with an
    ISO date (a paste mixing Python ``logging``'s ``2024-04-16 00:03:25,080`` with c10's glog lines is one
    job's output, whenever the file was saved), else the year of the file's modification time, else this
    year."""
    return paste_dated(path, head)[0]


SAVED_SLACK_NS = 86_400 * 10**9
"""How far after a file's modification time its first yearless glog stamp may lie and still be read in that
year (:func:`paste_dated`): the log's host and the machine that saved the paste may keep different clocks and
time zones (at most a day apart). Further after it, the stamp is of the year before: a log is written
before it is saved."""


def paste_dated(path: Path, head: Optional[List[str]] = None) -> Tuple[int, Optional[int]]:
    """:func:`paste_year` and the stamp (ns) of that first dated line (None when there is none): the stamp the
    glog lines before it are read nearest (a paste that starts in December and dates its first ISO line
    in January). A paste without a dated line reads its first yearless stamp in the year, of the file's
    modification time's and the one before, that puts it nearest that time and not after it (beyond
    :data:`SAVED_SLACK_NS`): ``E1231 23:59:50`` in a file saved on 2030-01-02 is of 2029, ``E0229`` in a file
    saved on 2029-01-02 of 2028 (the last year that has the day)."""
    first_yearless: Optional[str] = None
    for text in _head_or(path, head) or ():
        line = clean_line(text)
        found = line_stamp_year(line, 2000)
        if found is not None and found[2] is not None:
            return found[2], found[0]
        if found is not None and first_yearless is None:
            first_yearless = line
    try:
        saved_ns = path.stat().st_mtime_ns
    except OSError:
        return datetime.now().year, None
    year = datetime.fromtimestamp(saved_ns / 10**9).year
    if first_yearless is not None:
        for candidate in range(year, year - 5, -1):  # a 29 February stamp: back to the last leap year
            found = line_stamp_year(first_yearless, candidate)
            if found is not None and found[0] <= saved_ns + SAVED_SLACK_NS:
                return candidate, None
    return year, None


def _shared_start(a: str, b: str) -> str:
    """The longest start ``a`` and ``b`` have in common."""
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return a[:k]


def _head(text: str) -> str:
    """How a line starts, digits blurred: ``[rank1]:[E513`` and ``[rank2]:[E514`` start alike."""
    return _DIGIT_RE.sub("0", text[:8])


_LINE_START_RE = re.compile(
    r"\s\s|\t|\[|-{3,}|={3,}|\*{3,}|\d{4}-\d\d-\d\d|\d{1,3}%\||[IWEF]\d{4} "
    r"|[\w.]{0,60}(?:Error|Exception|Warning)\b|Traceback \(|terminate called|During handling"
    r"|The above exception|(?:INFO|WARNING|ERROR|DEBUG)\b")
"""How a line of its own starts (an indent of 2+ spaces or a tab, a bracketed prefix or tag, a date, a
progress bar, a glog severity, an exception or warning name, a traceback's head, a rule of dashes): a piece
of a wrapped line starting so is taken for a new line (a wrap falling just there is missed, never a line
joined wrongly)."""
_OPEN_END_RE = re.compile(r"(?:\S:|\b(?:NCCL|WARN|WARNING|INFO|ERROR|DEBUG|FATAL|CRITICAL)) $")
"""How a wrapped piece ends when its line cannot have ended there: a colon with one space after it (a
label whose value follows: ``thread: `` before a CUDA assert's ``[47,0,0] Assertion ...``, ``what(): ``)
or a log tag with one space after it (``NCCL WARN `` before its ``Error : ring 0 ...``). Such a piece
joins the next one even when that starts like a line of its own (:data:`_LINE_START_RE`: a bracket, an
``...Error`` word) -- unless the next one is indented (a new line's own indent). Two trailing spaces are a
padded screen's end of line, never this."""


def _continued(first: str, chunk: str, nxt: str, width: int, padded: bool = True) -> bool:
    """Whether ``nxt`` is the rest of a line a terminal wrapped after ``chunk`` (the last piece so far of
    the line that started with ``first``): ``chunk`` fills the terminal's width to its last column (a line
    that ended there is padded with spaces when copied from a screen, or shorter), ``nxt`` does not start
    the way that line did (the same line printed again by another rank starts alike) nor the way a line
    of its own does (:data:`_LINE_START_RE`). ``padded``: the paste keeps the screen's padding (every line
    is ``width`` long, a line's last piece padded with spaces), so a piece ending in two spaces ended its
    line (its padding); one space at the last column is a wrap that fell after a space as often as not (a
    line one column short of the width, padded by one, is rarer than a wrap after any of a line's spaces:
    a DeepSpeed exit line wrapped after ``exits with return code = ``, its ``-9`` on the next row), and
    without padding any piece ending in a space is such a wrap. A piece that ends open (:data:`_OPEN_END_RE`:
    ``thread: ``, ``NCCL WARN ``) is continued by an unindented next piece even when that starts like a
    line."""
    return len(chunk) == width and not (padded and chunk[-2:].isspace() and len(chunk) >= 2) \
        and bool(nxt.strip()) and _head(nxt) != _head(first) \
        and (_LINE_START_RE.match(nxt) is None
             or (not nxt[:1].isspace() and _OPEN_END_RE.search(chunk) is not None))


def paste_wrap_width(path: Path, head: Optional[List[str]] = None) -> int:
    """:func:`paste_wrap`'s width."""
    return paste_wrap(path, head)[0]


def paste_wrap(path: Path, head: Optional[List[str]] = None) -> Tuple[int, bool]:
    """``(width, padded)``: the width a terminal hard-wrapped the pasted lines at, or 0. A paste
    copied from a terminal (or a console that wraps) cuts every long line into pieces of exactly the
    terminal's width, pads the last piece with spaces when copied from the screen, and no line is longer:
    the longest lines of the file's first :data:`INDENT_SCAN_LINES` all have one length, at least
    :data:`WRAP_MIN_WIDTH`, and at least two of them are followed by a piece that does not start like a line
    (:func:`_continued`); one is enough when the paste kept the screen's padding (``padded``: nearly every
    line is that long, short ones padded), or when that length is a console's width (:data:`TERMINAL_WIDTHS`:
    a short error message wrapped once, its only long line exactly 80 or 120 columns). A log that was not
    wrapped has lines of many lengths, its longest usually once (or the same line from several ranks, which
    starts alike)."""
    texts = _head_or(path, head)
    if texts is None:
        return 0, False
    width = max((len(x) for x in texts), default=0)
    if width < WRAP_MIN_WIDTH:
        return 0, False
    filled = [x for x in texts if x.strip()]
    padded = sum(len(x) == width for x in filled) * 5 >= len(filled) * 4
    pieces = sum(1 for a, b in zip(texts, texts[1:]) if _continued(a, a, b, width, padded))
    if pieces >= 2 or (padded and pieces and len(filled) >= 3):
        return width, padded
    # at a console's width one wrapped piece is enough -- unless it is a progress bar, sized to the console
    if width in TERMINAL_WIDTHS and any(_continued(a, a, b, width, padded) and not _PROGRESS_BAR_RE.search(a)
                                        for a, b in zip(texts, texts[1:])):
        return width, padded
    return 0, False


_GUTTER_RE = re.compile(r"^\s{0,8}(?P<n>\d{1,7})(?=$|[ \t:|\u2502])(?::|\s?[|\u2502])?[ \t]?")
"""An editor's or a viewer's line-number gutter: ``  12 text``, ``12\ttext``, ``12: text``, ``12 | text``."""
_TABLE_ROW_RE = re.compile(r"[\s\d.,:;/|%+eE\[\]()-]*(?:(?:nan|inf)[\s\d.,:;/|%+eE\[\]()-]*)*$",
                           re.IGNORECASE)
"""What follows a number that is a table row's first column (steps or epochs, then numbers), not a gutter."""
NUMBERED_MIN_LINES = 3
"""The fewest lines :func:`paste_numbered` needs to tell a gutter from a table of numbers."""


def paste_numbered(path: Path, head: Optional[List[str]] = None) -> bool:
    """Whether the paste carries a line-number gutter: every line of the file's first
    :data:`INDENT_SCAN_LINES` (blank ones included: a gutter numbers them too) starts with a number, and
    the numbers count up by one from line to line, over at least :data:`NUMBERED_MIN_LINES` lines (a
    progress table's first column -- steps, epochs -- does not count by one on every line, nor number
    its blank lines): at least one numbered line must say more than numbers."""
    last: Optional[int] = None
    seen = 0
    worded = False
    for text in _head_or(path, head) or ():
        m = _GUTTER_RE.match(text)
        if m is None:
            return False
        n = int(m.group("n"))
        if last is not None and n != last + 1:
            return False
        last, seen = n, seen + 1
        worded = worded or _TABLE_ROW_RE.match(text, m.end()) is None
    return seen >= NUMBERED_MIN_LINES and worded


def drop_line_number(line: str) -> str:
    """``line`` without its gutter's number (and the one space or tab after it)."""
    m = _GUTTER_RE.match(line)
    return line[m.end():] if m is not None else line


_TASK_LABEL_RE = re.compile(r"^\s{0,4}(?P<n>\d{1,5}):(?: |$)")
"""Slurm's ``srun --label`` column: the task number before every line (``3: Traceback ...``)."""


def paste_task_labels(path: Path, head: Optional[List[str]] = None) -> bool:
    """Whether every line carries Slurm's ``srun --label`` task number: all non-blank lines of the file's
    first :data:`INDENT_SCAN_LINES` (at least :data:`NUMBERED_MIN_LINES`) start with ``N: ``, and the
    numbers do not count up by one from line to line (that is a line-number gutter, :func:`paste_numbered`);
    a shorter paste when all its lines carry one task's label and one of them is a Python exception line.
    The task number is the process's rank under srun (``SLURM_PROCID``)."""
    numbers: List[int] = []
    said_exception = False
    for text in _head_or(path, head) or ():
        if not text.strip():
            continue
        m = _TASK_LABEL_RE.match(text)
        if m is None:
            return False
        numbers.append(int(m.group("n")))
        said_exception = said_exception or _EXCEPTION_LINE_RE.match(text[m.end():]) is not None
    if len(numbers) < NUMBERED_MIN_LINES:
        # too short to tell from a table; one task's label on each line of a Python error (``3: RuntimeError:
        # Expected to have finished reduction ...``, a one-line srun --label paste) is the label
        return bool(numbers) and said_exception and len(set(numbers)) == 1
    return not all(b == a + 1 for a, b in zip(numbers, numbers[1:]))


def task_label_as_prefix(line: str) -> str:
    """``line`` with its ``srun --label`` column as the launcher rank prefix ``[defaultN]:`` (a
    ``[rankN]:`` of torch's own after it still wins, :func:`split_prefix`)."""
    m = _TASK_LABEL_RE.match(line)
    return f"[default{m.group('n')}]: {line[m.end():]}" if m is not None else line


_RELAY_STAMP_RE = re.compile(r"[\[(]?0000-00-00[ T]00:00:00")
_RELAY_LEVEL_RE = re.compile(r"\b(?:CRITICAL|ERROR|WARNING|INFO|DEBUG)\b")
RELAY_MIN_LINES = 3
"""The fewest lines :func:`paste_relay_prefix` needs to call a shared prefix a relay's."""


def paste_relay_prefix(path: Path, head: Optional[List[str]] = None) -> int:
    """How many characters a relay's logger put before every line (0: none). A job wrapper or a log shipper
    that logs each line of the job's output with Python's ``logging`` (``%(asctime)s - %(name)s -
    %(levelname)s - %(message)s``) or loguru (``time | LEVEL | module:function:line - message``) gives every
    line one prefix that differs only in its digits: when all non-blank lines of the file's first
    :data:`INDENT_SCAN_LINES` (at least :data:`RELAY_MIN_LINES`) start with the same text, digits aside, that
    text starts with a date and time and holds a ``" - "`` after its level name (or after the time when it
    names none), the prefix ends at that ``" - "`` (else at the end of a carrier's column,
    :data:`_CARRIER_COLUMN_RE`); or the text is a host's column alone (:data:`_HOST_COLUMN_RE`: pdsh's
    ``gpu-q-13: `` as DeepSpeed's multi-node runner puts it before every line). A log whose own records carry
    such a prefix loses nothing
    the classifier reads (the line's time is read before it is dropped); a log with any line without it (a
    traceback a logger printed under its record) keeps its lines as they are."""
    common: Optional[str] = None
    lines = 0
    for text in _head_or(path, head) or ():
        if not text.strip():
            continue
        blurred = _DIGIT_RE.sub("0", text[:160]) + " "  # a line of the prefix alone lost its trailing space
        lines += 1
        common = blurred if common is None else _shared_start(common, blurred)
        if _RELAY_STAMP_RE.match(common) is None and _HOST_COLUMN_RE.match(common) is None:
            return 0
    if common is None or lines < RELAY_MIN_LINES:
        return 0
    if _RELAY_STAMP_RE.match(common) is None:
        host = _HOST_COLUMN_RE.match(common)
        return host.end() if host is not None else 0
    level = _RELAY_LEVEL_RE.search(common)
    stamp = _RELAY_STAMP_RE.match(common)
    after = level.end() if level is not None else (stamp.end() if stamp is not None else len(common))
    cut = common.find(" - ", after)
    if cut >= 0:
        return cut + 3
    carrier = _CARRIER_COLUMN_RE.match(common)
    return carrier.end() if carrier is not None else 0


_HOST_COLUMN_RE = re.compile(r"(?=[a-z0-9_.-]{0,62}[0-9-])[a-z][a-z0-9_.-]{0,62}: ")
"""pdsh's host column (DeepSpeed's multi-node runner, ``pdsh -w``): ``gpu-q-13: `` before every line a node's
processes print, no rank tag after it (deepspeedai/DeepSpeed#2899); read as a column only when the same on
every line (digits aside) and the name holds a digit or a hyphen as host names do (``worker-5``,
``node001``, ``ip-10-0-0-1``) -- a tool's own ``wandb: `` or ``stderr: `` is not a host."""
_CARRIER_COLUMN_RE = re.compile(
    r"\[0000-00-00[ T]00:00:00(?:[.,]0{1,9})?(?: [A-Z]{2,4}0{1,4}){0,4}\] "
    r"|0000-00-00[ T]00:00:00(?:[.,]0{1,9})? "
    r"(?:\[(?!(?:CRITICAL|ERROR|WARNING|WARN|INFO|DEBUG)\])[^\]\n]{1,200}\] ){1,3}")
"""A collector's or runner's column, the same on every line (digits aside), that :func:`paste_relay_prefix`
drops when it has no logger's `` - `` to end at: a bracketed stamp (``[2024-03-01 10:00:00] ``, also with
SGLang's parallel ranks ``[2025-03-19 11:39:39 DP4 TP4] ``) or a stamp
and the source in brackets (Azure ML's ``2021-02-05 05:32:39 [job-...-worker-1, unknown_ip] ``; up to three
such brackets, as Metaflow's ``2023-04-29 06:01:12.977 [177/train/578 (pid 28936)] [09c561ee-...] ``,
databrickslabs/dolly#139; a level in brackets is a logger's record, not a source).
Under it a traceback's lines, a faulthandler's report or a
rank tag do not start their lines, so the segmenter could not read them; the line's time is read before the
column is dropped, and a paste with any line without the column keeps its lines as they are."""


_OPEN_FRAME_RE = re.compile(r'^\s*File "[^"\n]*$')
_FRAME_REST_RE = re.compile(r'^[^"\s][^"\n]*", line \d+(?:, in \S[^\n]*)?$')
"""A traceback's frame line cut inside its file's path (``  File "/opt/conda/.../distributed_c10`` -- a frame
line always closes its quote) and the rest of it on the next line
(``d.py", line 360, in init_process_group``):
a terminal's wrap of a paste too short to tell its width from (one long line), joined again."""


def unwrapped(fh: Any, width: int, on_bytes: Optional[Callable[[int], None]] = None,
              padded: bool = True) -> Iterator[Tuple[int, str]]:
    """``(number, text)`` of each line of the binary file ``fh`` (numbered from 1, newline dropped), the
    pieces of a line a terminal wrapped at ``width`` joined again under the first one's number (``width``
    0: every physical line as it is, but for a frame line cut inside its path, :data:`_OPEN_FRAME_RE`).
    ``on_bytes(n)``: the size of every physical line read; ``padded``: see :func:`_continued`."""
    frame: Optional[Tuple[int, str]] = None
    for number, text in _rows(fh, width, on_bytes, padded):
        if frame is not None:
            if _FRAME_REST_RE.match(text):
                yield frame[0], frame[1] + text
                frame = None
                continue
            yield frame
            frame = None
        if _OPEN_FRAME_RE.match(text):
            frame = (number, text)
            continue
        yield number, text
    if frame is not None:
        yield frame


def _rows(fh: Any, width: int, on_bytes: Optional[Callable[[int], None]], padded: bool
          ) -> Iterator[Tuple[int, str]]:
    """:func:`unwrapped`'s terminal-width joining."""
    held: Optional[Tuple[int, str, str, str]] = None  # number, joined text, first piece, last piece
    for number, raw in enumerate(fh, 1):
        if on_bytes is not None:
            on_bytes(len(raw))
        text = raw.decode("utf-8", "replace").rstrip("\r\n")
        if held is not None:
            if _continued(held[2], held[3], text, width, padded):
                held = (held[0], held[1] + text, held[2], text)
                continue
            yield held[0], held[1]
            held = None
        if width and len(text) == width:
            held = (number, text, text, text)
            continue
        yield number, text
    if held is not None:
        yield held[0], held[1]


def paste_indent(path: Path, head: Optional[List[str]] = None) -> str:
    """The indent every non-blank line of the file's first :data:`INDENT_SCAN_LINES` starts with when it is a
    tab or at least 4 spaces (a paste indented as a markdown code block, or quoted in an e-mail); else ``""``.
    The reader drops it, so ``Traceback (most recent call last):`` is at the top level again. Less than 4
    spaces is mostly a traceback cut at the top, its frames' own indent: it is the paste's only when a line
    Python prints at column 0 sits at it -- a traceback's header anywhere, or an exception line as the last
    non-blank line scanned, where Python prints it (an error pasted under a sentence indented by two spaces,
    ``  AssertionError: FSDP assumes ...``, Lumina-mGPT#18). An exception-shaped line among others (a metric
    named by its class, ``  MeanSquaredError: 0.0213``; a retried request's warning) is not one (hR3
    MEDIUM-4)."""
    common: Optional[str] = None
    lines = []
    for text in _head_or(path, head) or ():
        line = clean_line(text)
        if not line.strip():
            continue
        lead = line[:len(line) - len(line.lstrip(" \t"))]
        common = lead if common is None else _shared_start(common, lead)
        if not common:
            return ""
        lines.append(line)
    if not common:
        return ""
    if common.startswith("\t") or common.startswith("    "):
        return common
    at_column_0 = [line[len(common):] for line in lines if not line[len(common)].isspace()]
    if any(text == _HEADER.rstrip("\n") for text in at_column_0):
        return common
    last = lines[-1][len(common):]
    return common if not last[:1].isspace() and _EXCEPTION_LINE_RE.match(last) else ""


@dataclass
class LogScan:
    """What one cheap pass over a log file found (no segmenting)."""

    lines: int                    # physical lines, blank ones included (line numbers run 1..lines)
    first_ns: Optional[int]       # earliest and latest line timestamps
    last_ns: Optional[int]
    ranks: List[int]              # ranks named by prefixes, plus the file's rank if a line had none
    named: List[int] = field(default_factory=list)  # ranks unprefixed lines name as their own (see below)

    def own_rank(self, rank: int) -> int:
        """The rank of the file's unprefixed lines: ``rank``, unless the file has no rank prefix at all, was
        given as rank 0 (the default of a pasted log) and its text names exactly one rank as its own --
        c10d's ``[Rank N]`` tag on its own message (a ``ProcessGroupNCCL`` record of the default group),
        ``NCCL communicator was aborted on rank N``, mp.spawn's ``-- Process N terminated with the following
        error:``, Megatron's ``Rank N: found NaN`` / ``Rank N, node ..., device D, iteration``: then the
        paste is that rank's output (its earlier lines too: the CUDA assertion before a rank's watchdog
        line, the OOM warning before the spawn failure)."""
        if rank != 0 or self.ranks != [rank] or len(self.named) != 1:
            return rank
        return self.named[0]


_SELF_RANK_RE = re.compile(
    r"ProcessGroupNCCL\.cpp:\d+\] \[(?:PG [^\]\n]{0,80}\(default_pg\) )?Rank (?P<a>\d{1,7})\]"
    r"|NCCL communicator was aborted on rank (?P<b>\d{1,7})"
    r"|^-- Process (?P<c>\d{1,7}) terminated with the following error:"
    r"|\bRank (?P<d>\d{1,7})(?:: found NaN|, node [^,\n]{1,200}, device \d+, iteration)")
"""How a process's own output names its rank (what :meth:`LogScan.own_rank` reads)."""
_SELF_RANK_NEEDLES = ("Rank ", "rank ", "-- Process ")


def scan_log(path: Path, rank: int = 0, *, on_bytes: Optional[Callable[[int], None]] = None) -> LogScan:
    """One pass over ``path``: line count, earliest and latest line timestamp (a paste's stamps may go back:
    two processes' clocks, a yearless glog stamp beside a dated one), ranks present (``on_bytes(n)``: the
    size of every line read)."""
    head = _head_lines(path)
    year, dated = paste_dated(path, head)
    previous = dated  # a yearless stamp is read nearest the stamp before it (the first dated before any)
    first: Optional[int] = None
    last: Optional[int] = None
    ranks: Dict[int, None] = {}
    named: Dict[int, None] = {}
    indent, numbered, labelled, width, padded, relay = paste_shape(path, head)
    del head
    physical = [0]

    def counted(n: int) -> None:
        physical[0] += 1
        if on_bytes is not None:
            on_bytes(n)

    with open(path, "rb") as fh:
        for _number, raw in unwrapped(fh, width, counted, padded):
            if not raw.strip():
                continue
            line = clean_line(raw)
            if numbered:
                line = drop_line_number(line)
            elif labelled:
                line = task_label_as_prefix(line)
            if indent and line.startswith(indent):
                line = line[len(indent):]
            found = line_stamp_year(line, year, previous)
            if found is not None:  # the earliest and the latest: a paste's stamps need not be in order
                previous = found[0]
                first = found[0] if first is None else min(first, found[0])
                last = found[0] if last is None else max(last, found[0])
                year = found[2] or year
            if relay:
                line = line[relay:]
            prefixed, text = split_prefix(line)
            ranks[rank if prefixed is None else prefixed] = None
            if prefixed is None and len(named) < 2 and any(n in text for n in _SELF_RANK_NEEDLES) and \
                    (m := _SELF_RANK_RE.search(text)) is not None:
                named[int(next(g for g in m.groups() if g is not None))] = None
    return LogScan(physical[0], first, last, sorted(ranks), sorted(named))
