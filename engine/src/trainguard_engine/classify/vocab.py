"""The vocabulary fallback: a general reading of error text that no specific rule recognised.

The specific rules (:data:`~trainguard_engine.classify.RULES`) know exact messages -- PyTorch's allocator,
NCCL's WARN lines, torchrun's summary. Real logs also fail in wordings no rule has seen: another
framework's or device's allocator, a shell's report, a scheduler's signal. This layer reads such text by
small vocabularies written from the **catalogue's definitions** of each kind (what the kind *means*, not
any corpus log), and only where the specific rules gave nothing or the generic ``python.exception``
(:func:`classify_fallback` is never consulted otherwise, so it cannot move a specific verdict of one text).

**Which lines.** Not a record at an info / debug / warning level, nor NCCL's or c10d's own records
(:data:`_QUIET`: the specific rules read those), nor a source line a traceback quotes (:data:`_CODE`); of
the others only *error-bearing* lines (:data:`ERROR_MARKERS`: ``error``, ``exception``, ``fatal``,
``killed``, ``abort``, ``fail``, ``signal`` / ``SIGxxx``, ``exit``, ``core dumped``, ``out of memory``,
``timed out`` ...) of the last :data:`MAX_VOCAB_LINES` lines; an exception is read as Python prints it,
``Type: message``, so its first line is error-bearing by its type.

**Scores.** Per line, each vocabulary scores the sum of its distinct terms' weights; a kind's score is its
best line's. A term that names the kind alone weighs 2 (``out of memory``, ``ResourceExhausted``,
``exit code 137``, ``SIGBUS``); communication and loss need two words of
different roles on one line (a collective word *and* a failure word; ``loss`` *and* ``nan``/``inf``), 1
each. The kind with the highest score at least :data:`MIN_SCORE` wins; ties go by :data:`PRECEDENCE`
(memory, communication, loss, then the process's end: the most causal first, as :data:`RULES` are
ordered). Below :data:`MIN_SCORE`: nothing.

**Kinds** (the catalogue's meaning in brackets):

* memory/oom (the process ran out of device memory): ``out of [device|GPU|...] memory``, ``OOM`` (not
  the OOM-killer, not a counter), ``ResourceExhausted`` / ``RESOURCE_EXHAUSTED``, ``cannot / failed to /
  unable to allocate``, ``allocation failed``, ``insufficient / not enough memory``, ``malloc failed`` --
  not on a line about host memory (``MemoryError``, ``Errno 12``, ``bad_alloc``).
* comm/* (ranks could not talk): a collective word (NCCL, RCCL, HCCL, gloo, MPI, c10d, Horovod, oneCCL,
  collective, allreduce/allgather/reduce_scatter/alltoall, rendezvous, barrier, process group) with a
  failure word (timeout / timed out / deadline exceeded, failed, abort, error, refused, reset, closed,
  lost, unreachable). Start-up words (rendezvous, init, connect, bootstrap, store) -> init-failure,
  else a timeout -> timeout, else a lost peer (reset, closed, died, lost, unreachable) -> rank-lost,
  else failure.
* loss/non_finite (the loss is NaN or Inf): ``loss`` with ``nan`` / ``inf`` / ``non-finite`` on one
  line that says something went wrong (an error marker, or ``invalid`` / ``detected`` / ``encountered`` /
  ``diverged`` / ``stopping``); a best-so-far ``improved from inf`` or a counter (``nan iterations: 0``)
  is not.
* process/exception, a file system refusing a write (the catalogue has no kind of its own for it): ``No
  space left on device``, ``Disk quota exceeded``, ``Read-only file system`` (3: a full disk outweighs
  ``ResourceExhausted``), ``Permission denied`` (2).
* process/* (how the process ended): an exit status (``exit code N``, ``exit status N``, ``return code
  N``) or a signal's name (``SIGKILL``, ``SIGTERM``, ``SIGBUS`` ...) on an error-bearing line, read through
  the catalogue's exit table (:func:`~trainguard_engine.catalogue.classify_exit`): SIGKILL / 137
  process/killed, SIGTERM / SIGINT process/terminated, SIGABRT / SIGBUS memory/oom-or-cuda-error when the
  text names CUDA or a GPU (the catalogue's refinement) else process/exit, any other non-zero
  process/exit. Exit code 1 (the catalogue's Python exception) and 0 add nothing. The words a shell or a
  launcher prints (``Killed``, ``Aborted``, ``Segmentation fault``, ``signal N``, the OOM-killer) are not in
  this vocabulary: ``launcher.signal`` reads them, and what it deliberately leaves (prose, a shell's abort
  left to the exit path) stays left.

An exception is read by its own line (``Type: first line of the message``); a text by its error-bearing
lines.

**Recovered or hypothetical** (:data:`_RECOVERED`): a line that says the program retries, falls back, or
states a setting or what *would* fail (``retrying in 1 s``, ``falling back``, ``timeout set to 1800 s``,
``a collective that takes longer will fail``) states no failure and is not read.

**Confidence.** An exception's reading, or a line that carries an explicit error mark (:data:`_MARKED`:
an exception type ``SomethingError:``, ``ERROR`` / ``FATAL`` / ``CRITICAL``, a glog ``E`` / ``F`` record,
``[ERROR]``, ``error:`` / ``fatal:`` at its start, ``terminate called``, ``what():``), has
:data:`CONFIDENCE` (0.6, at the default of ``log_min_confidence``: such a log line opens an incident); any
other line's reading has :data:`UNMARKED_CONFIDENCE` (0.5, below it: a live log record -- whose level word
the SDK does not put in the message -- or an unmarked printed line does not open an incident on its
wording alone). A deployment that raises ``log_min_confidence`` above 0.6 keeps the layer off log lines
altogether (exceptions always open an incident).

Pure, bounded: each line is cut to :data:`MAX_VOCAB_LINE_CHARS` and every pattern is one precompiled
regex search.
"""

from __future__ import annotations

import re
from typing import Dict, List, Optional, Tuple

from ..catalogue import SIGNAL_NAMES, classify_exit
from .text import MAX_LINE_CHARS, Classification, _shorten

PREFIX = "vocab."
"""Every rule name of this layer starts with it (``vocab.memory``, ``vocab.comm``, ``vocab.loss``,
``vocab.process``)."""
MIN_SCORE = 2
"""The least score of a kind for a reading (a term naming the kind alone weighs 2, a word of a pair 1)."""
CONFIDENCE = 0.6
"""The confidence of an exception's reading or a marked line's (see the module docstring: at
``log_min_confidence``'s default)."""
UNMARKED_CONFIDENCE = 0.5
"""The confidence of a reading of a line without an explicit error mark (below ``log_min_confidence``'s
default: such a log line alone opens no incident)."""
MAX_VOCAB_LINES = 200
"""Lines of a text read, from its end (errors come last)."""
MAX_VOCAB_LINE_CHARS = 2_000
"""Characters of one line read."""
PRECEDENCE = ("io", "memory", "comm", "loss", "process")
"""The vocabularies; ties between their scores go to the earlier one here."""

_I = re.IGNORECASE
ERROR_MARKERS = re.compile(
    r"errors?\b|exception|fatal|killed|abort|fail|terminat|signal|\bsig[a-z]{3,4}\b|exit|core dumped"
    r"|segmentation fault|out of (?:\w+ )?memory|\boom\b|panic|exhausted|cannot|can't|unable to"
    r"|insufficient|not enough|timed out|timing out|(?<!=)time ?out(?!\s*(?:\(\w+\))?\s*=)|deadline|bad_alloc"
    r"|non-?finite|not finite", _I)
"""What makes a line error-bearing (read as :func:`_error_bearing`: the literal alternatives by ``in`` tests
on the lower-cased line, the rest by :data:`_MARKER_REST` -- the same answer, faster)."""
_MARKER_WORDS = ("exception", "fatal", "killed", "abort", "fail", "terminat", "signal", "exit", "core dumped",
                 "segmentation fault", "panic", "exhausted", "cannot", "can't", "unable to", "insufficient",
                 "not enough", "timed out", "timing out", "deadline", "bad_alloc", "not finite")
_MARKER_REST = re.compile(
    r"errors?\b|\bsig[a-z]{3,4}\b|out of (?:\w+ )?memory|\boom\b|(?<!=)time ?out(?!\s*(?:\(\w+\))?\s*=)"
    r"|non-?finite", _I)


def _error_bearing(line: str, low: str) -> bool:
    """Whether :data:`ERROR_MARKERS` matches ``line`` (``low``: the line lower-cased)."""
    return any(word in low for word in _MARKER_WORDS) or _MARKER_REST.search(line) is not None
_QUIET = re.compile(
    r"^\W{0,8}(?:\S+ ){0,3}?(?:\[?\w+\]:)?\[?[IWD]\d{3,4} \d\d:"
    r"|(?:^|[\s\[])[IWD] [\w/.-]+\.(?:cc|cpp|h|py):\d+\]"
    r"|\b(?:INFO|DEBUG|TRACE|WARN|WARNING|NOTICE)\b|\w*Warning\b|\bwarn\("
    r"|\bNCCL (?:INFO|WARN)\b")
_OWN = re.compile(r"\bNCCL (?:INFO|WARN)\b|ProcessGroup\w*\.(?:cpp|hpp):\d+\]"
                  r"|^\W{0,4}(?:\[\w+\]:)?\s*(?:exitcode|error_file|local_rank|host|time)\s+:")
"""Lines that are not read: a record at an info / debug / warning level (glog's ``I``/``W``/``D`` heads, an
``INFO`` / ``WARNING`` word, Python's ``...Warning``) states no failure, unless it also says ``ERROR`` /
``FATAL`` / ``CRITICAL`` (:data:`_LOUD`); and the records of the sources the specific rules read
(:data:`_OWN`: NCCL's own ``NCCL WARN`` / ``NCCL INFO`` lines, c10d's ``ProcessGroup*.cpp`` records, at
any level, torchrun's failure table rows ``exitcode : -6``) are theirs."""
_CODE = re.compile(r"^\W{0,12}(?:-->\s*\d+\s+)?(?:raise |return |if |elif |def |assert )"
                   r"|^\s*[\w.\[\]]+\s*=\s*[\w.]+\(")
"""A source line a traceback quotes (``raise RuntimeError("... failed")``, ``pg = ProcessGroupGloo(...,
timeout=timeout)``): code, not what happened (the exception line that follows is read)."""
_LOUD = re.compile(r"\b(?:ERROR|FATAL|CRITICAL)\b|^\W{0,8}(?:\S+ ){0,3}?(?:\[?\w+\]:)?\[?[EF]\d{3,4} \d\d:"
                   r"|(?:^|[\s\[])[EF] [\w/.-]+\.(?:cc|cpp|h|py):\d+\]")
_RECOVERED = re.compile(
    r"\bretr(?:y|ying|ies)\b|\bfall(?:ing|s)? back\b|\bfallback\b|\b(?:will|would|may|might|could|can)"
    r" (?:fail|time ?out|be killed|run out)|\bset to\b|\btime ?out\s*[:=]\s*\d|\bignor(?:e|ed|ing)\b"
    r"|\bskipp(?:ed|ing)\b|\b(?:errors?|failures?|issues?|problems?) such as\b"
    r"(?! (?:this|these|that|those)\b)", _I)
"""A line saying the program recovers, or what would happen, or naming failures by example (Ray Train's
``TrainingFailedError: ... (assuming that the error is not caused by your own application logic, but rather
an error such as OOM), you can restart the run ...``, ray-project/ray#47974): not a failure (see the module
docstring); ``problems such as this`` points back at a failure the line states, and is no example (hR3
LOW-8)."""
_MARKED = re.compile(
    r"\b[A-Z]\w*(?:Error|Exception|Exhausted|NotMet)\b\s*:|\b(?:ERROR|FATAL|CRITICAL)\b|\[error\]"
    r"|^\W{0,8}(?:\S+ ){0,3}?(?:\[?\w+\]:)?\[?[EF]\d{3,4} \d\d:"
    r"|(?:^|[\s\[])[EF] [\w/.-]+\.(?:cc|cpp|h|py):\d+\]"
    r"|^\W{0,4}(?:error|fatal)\s*:|terminate called|what\(\):")
"""An explicit error mark on a line (see the module docstring, **Confidence**)."""
_LOSS_MARKERS = re.compile(r"non-?finite|not finite|invalid|detected|encountered|diverg|stopp|halt", _I)
"""A loss line is read only when it says something went wrong (or an error marker is on it): a plain ``loss:
nan`` in a metrics line is the specific rules' (numeric.loss-non-finite)."""

_Vocabulary = Tuple[Tuple[str, "re.Pattern[str]", int], ...]
_MEMORY: _Vocabulary = tuple((name, re.compile(p, _I), w) for name, p, w in (
    ("out of memory", r"out of (?:\w+ ){0,2}memory", 2),
    ("OOM", r"\boom\b(?![-_ ]?kill)(?!\s*[:=|]?\s*\d)", 2),  # not a counter ('| oom 0 |')
    ("resource exhausted", r"resource_?exhausted|resource exhausted", 2),
    ("cannot allocate", r"(?:cannot|can't|could not|couldn't|failed to|unable to) allocate", 2),
    ("allocation failed", r"alloc(?:ation|ate)? (?:failed|failure|error)", 2),
    ("insufficient memory", r"(?:insufficient|not enough) (?:\w+ )?memory|memory (?:is )?not enough", 2),
    ("malloc failed", r"malloc(?:\(\))? (?:failed|failure|error)", 2),
))
_HOST_MEMORY = re.compile(r"\bMemoryError\b|\berrno 12\b|\benomem\b|\bbad_alloc\b", _I)
"""Host memory running out (Python's ``MemoryError``, the OS's ``[Errno 12] Cannot allocate memory``, C++'s
``std::bad_alloc``): the catalogue's memory/oom is the *device*'s memory, so such a line is not read as it
(the host OOM-killer's SIGKILL is process/killed)."""
_IO: _Vocabulary = tuple((name, re.compile(p, _I), w) for name, p, w in (
    ("no space left", r"no space left on device|\berrno 28\b|\benospc\b", 3),
    ("disk quota", r"disk quota exceeded|\berrno 122\b|\bedquot\b", 3),
    ("read-only file system", r"read-only file system|\berrno 30\b", 3),
    ("permission denied", r"permission denied|\berrno 13\b", 2),
))
"""A file system refusing a write (a checkpoint, a cache): the catalogue has no kind of its own for it, a
Python exception's (process/exception) -- here so that TensorFlow's ``ResourceExhaustedError: ... No space
left on device`` is not read as memory (3 outweighs the memory vocabulary's 2)."""
_TIMEOUT = r"timed out|timing out|(?<!=)time ?out(?!\s*(?:\(\w+\))?\s*=)|deadline exceeded"
"""A timeout stated (not a setting: ``timeout=...``, ``Timeout(ms)=1800000``, ``scenario=timeout``)."""
_COMM_WORD = re.compile(
    r"(?<![/=])\b(?:nccl|rccl|hccl|gloo|mpi|c10d|horovod|oneccl)(?:\b(?![/.]\w)|_)|collective|all_?reduce"
    r"|all-reduce|all_?gather|reduce_?scatter|all_?to_?all|rendezvous|\bbarrier\b|process ?group", _I)
_COMM_FAIL = re.compile(_TIMEOUT + r"|fail|abort"
                        r"|errors?\b|unhandled|refused|reset"
                        r"|closed|\blost\b|unreachable|\bdied\b", _I)
_COMM_INIT = re.compile(r"rendezvous|\binit|\bconnect(?:ing|ed)?\b|refused|bootstrap|\bstore\b|set ?up"
                        r"|establish", _I)
_COMM_TIMEOUT = re.compile(_TIMEOUT, _I)
_COMM_LOST = re.compile(r"reset|closed|\blost\b|unreachable|\bdied\b", _I)
_LOSS = re.compile(r"\bloss(?:es)?\b|_loss\b|\bloss_", _I)
_LOSS_VALUE = re.compile(r"\b(?:nan|-?inf)\b(?![`'\u2019]\w)(?!\s+(?:iterations?|steps?|counts?|batches)\b)"
                         r"|infinity|non-?finite|not finite", _I)
"""A non-finite value (not a counter of them: Megatron's ``number of nan iterations: 0``)."""
_NOT_LOSS = re.compile(r"from -?inf\b|best\w* ?\w*[:=] ?-?inf\b", _I)

_SIG_NUMBERS: Dict[str, int] = {name.upper(): number for number, name in SIGNAL_NAMES.items()}
_SIGNAL_NAME = re.compile(r"\b(SIG[A-Z]{2,6})\b")
_EXIT_STATUS = re.compile(
    r"(?:exit ?code|exit status|exited with (?:code|status)|return ?code|returncode|exit value)"
    r"[\s:=]*\(?(-?\d{1,3})\b", _I)
_CUDA = re.compile(r"cuda|\bgpu\b|nccl|cudnn|cublas", _I)


_NEEDLES = ("error", "exception", "fatal", "kill", "abort", "fail", "termin", "sig", "exit", "core dumped",
            "fault", "out of", "oom", "panic", "exhaust", "cannot", "can't", "unable", "insufficient",
            "enough", "tim", "deadline", "alloc", "finite", "loss")
"""Lower-case substrings at least one of which every line :data:`ERROR_MARKERS` or a loss line's markers can
match contains: a line with none of them is skipped by ``in`` tests alone (speed only: the regexes decide)."""


def _error_lines(text: str) -> List[str]:
    out = []
    for whole in text[-MAX_VOCAB_LINES * MAX_VOCAB_LINE_CHARS:].splitlines()[-MAX_VOCAB_LINES:]:
        line = whole[:MAX_VOCAB_LINE_CHARS]
        low = line.lower()
        if not any(needle in low for needle in _NEEDLES):
            continue
        if not (_error_bearing(line, low)
                or ("loss" in low and _LOSS_MARKERS.search(line) and _LOSS.search(line))):
            continue
        if _OWN.search(line) or _CODE.search(line) or _RECOVERED.search(line) \
                or (_QUIET.search(line) and not _LOUD.search(line)):
            continue
        out.append(line)
    return out


def _io(line: str) -> Tuple[int, List[str]]:
    terms = [name for name, pattern, _w in _IO if pattern.search(line)]
    return max((w for name, _p, w in _IO if name in terms), default=0), terms


def _memory(line: str) -> Tuple[int, List[str]]:
    if _HOST_MEMORY.search(line):
        return 0, []
    terms = [name for name, pattern, _w in _MEMORY if pattern.search(line)]
    return sum(w for name, _p, w in _MEMORY if name in terms), terms


def _comm(line: str) -> Tuple[int, List[str], str]:
    word, fail = _COMM_WORD.search(line), _COMM_FAIL.search(line)
    if word is None or fail is None:
        return 0, [], ""
    if _COMM_INIT.search(line):
        subtype = "init-failure"
    elif _COMM_TIMEOUT.search(line):
        subtype = "timeout"
    elif _COMM_LOST.search(line):
        subtype = "rank-lost"
    else:
        subtype = "failure"
    return 2, [word.group(0), fail.group(0)], subtype


def _loss(line: str) -> Tuple[int, List[str]]:
    loss, value = _LOSS.search(line), _LOSS_VALUE.search(line)
    if loss is None or value is None or _NOT_LOSS.search(line):
        return 0, []
    return 2, [loss.group(0), value.group(0)]


def _process(line: str, text: str) -> Tuple[int, List[str], str]:
    """The process's end the line states: (score, terms, kind)."""
    code, sig, term = 0, 0, ""
    if (m := _SIGNAL_NAME.search(line)) is not None and m.group(1) in _SIG_NUMBERS:
        sig, term = _SIG_NUMBERS[m.group(1)], m.group(1)
    elif (m := _EXIT_STATUS.search(line)) is not None:
        code, term = int(m.group(1)), m.group(0)
    if not term:
        return 0, [], ""
    if sig and not code:
        code = 128 + sig
    verdict = classify_exit(code, sig)
    if verdict is None or (verdict.category, verdict.subtype) == ("process", "exception"):
        return 0, [], ""  # a clean exit, or exit code 1: the catalogue's Python exception, nothing more
    kind = f"{verdict.category}/{verdict.subtype}"
    if verdict.refine and verdict.category != "process" and _CUDA.search(text) is None:
        kind = "process/exit"  # an abort with no CUDA in sight: not the CUDA reading of the catalogue
    return 2, [term], kind


def classify_fallback(text: str, *, exception: bool = False) -> Optional[Classification]:
    """The vocabulary's reading of ``text`` (see the module docstring), or None when no kind scores
    :data:`MIN_SCORE`. Only for text that no specific rule recognised; ``exception``: the text is an
    exception's own line (``Type: message``), read at :data:`CONFIDENCE`."""
    if not text:
        return None
    best: Dict[str, Tuple[int, List[str], str, str]] = {}  # vocabulary -> (score, terms, kind, line)
    for line in _error_lines(text):
        score, terms = _memory(line)
        found = [("memory", score, terms, "memory/oom")]
        score, terms, subtype = _comm(line)
        found.append(("comm", score, terms, f"comm/{subtype}"))
        score, terms = _loss(line)
        found.append(("loss", score, terms, "loss/non_finite"))
        found.append(("process", *_process(line, text)))
        score, terms = _io(line)
        found.append(("io", score, terms, "process/exception"))
        for vocabulary, score, terms, kind in found:
            if score >= MIN_SCORE and score >= best.get(vocabulary, (0, [], "", ""))[0]:
                best[vocabulary] = (score, terms, kind, line)  # later lines win ties: errors come last
    if not best:
        return None
    vocabulary = max(best, key=lambda v: (best[v][0], -PRECEDENCE.index(v)))
    score, terms, kind, line = best[vocabulary]
    kind_category, _, subtype = kind.partition("/")
    line = line.strip()
    facts = {"vocabulary": terms, "score": score}
    confidence = CONFIDENCE if exception or _MARKED.search(line) else UNMARKED_CONFIDENCE
    return Classification(kind_category, subtype, PREFIX + vocabulary, confidence,
                          f"{kind} by its wording: {_shorten(line, 140)}", facts,
                          (_shorten(line, MAX_LINE_CHARS),),
                          f"no specific rule knows this message; its words ({', '.join(terms)}) are the "
                          f"catalogue's vocabulary of {kind}")


DOCS = {
    PREFIX + "io": "Fallback: a file system refusing a write -- `No space left on device`, `Disk quota "
    "exceeded`, `Read-only file system`, `Permission denied` (Errno 28 / 122 / 30 / 13) → process/exception "
    "(the catalogue's kind for it); outweighs the memory vocabulary on its line (TensorFlow's "
    "`ResourceExhaustedError: ... No space left on device` is a full disk)",
    PREFIX + "memory": "Fallback when no rule matched (or only `python.exception`): an error-bearing line "
    "in the general vocabulary of running out of memory -- `out of [device] memory`, `OOM`, "
    "`ResourceExhausted`, `cannot / failed to allocate`, `insufficient / not enough memory`, `malloc failed` "
    "→ memory/oom (confidence 0.6 for an exception or a line with an error mark, else 0.5); not a line "
    "about host memory (`MemoryError`, `Errno 12`, `bad_alloc`); no layer reading of a line that retries, "
    "falls back or states a setting",
    PREFIX + "comm": "Fallback: a collective word (NCCL, RCCL, HCCL, gloo, MPI, c10d, Horovod, collective, "
    "allreduce, rendezvous, barrier, process group) with a failure word on one error-bearing line → "
    "comm/init-failure (start-up words), comm/timeout, comm/rank-lost (reset, closed, lost) or comm/failure",
    PREFIX + "loss": "Fallback: `loss` with `nan` / `inf` / `non-finite` on one line (not `improved from "
    "inf`) → loss/non_finite",
    PREFIX + "process": "Fallback: an exit status (`exit code / status N`, `return code N`) or a signal's "
    "name (`SIGKILL`, `SIGTERM`, `SIGBUS`, ...) on an error-bearing line, read through the catalogue's exit "
    "table (SIGKILL/137 process/killed, SIGTERM/SIGINT process/terminated, SIGABRT/SIGBUS "
    "memory/oom-or-cuda-error when CUDA is named, else process/exit; exit 1 and 0 add nothing)",
}
"""The rules of this layer, for docs/classifier.md."""
