"""Exceptions, error text in logs, and the exit-code decision path (DESIGN §4, seed 000 §3.5).

Everything here goes through the error-text classifier (:mod:`trainguard_engine.classify`):

* An **uncaught exception** (``handled`` false; handled ones too with ``incident_on_handled_exceptions``)
  is classified from its type and message (and, when that says only "a Python exception", from its
  chained causes, so a wrapper does not hide an OOM).

  - **comm/\\* or memory/\\*** (a CUDA OOM, a CUDA error, an NCCL watchdog timeout, a collective mismatch,
    a lost peer, a rendezvous failure, ...): it opens or joins the run's incident **of that kind** (slot
    ``text:<category>/<subtype>``), so the same failure reported by many ranks -- as exceptions or as log
    lines -- is one incident listing them all. The title is the classifier's headline (what was parsed:
    "CUDA OOM on GPU 0: tried to allocate 20.00 MiB with 3.19 MiB free of 79.15 GiB"); the evidence's
    ``value`` is ``{"rule", "confidence", "facts", "lines", "exc_type"}``.
  - anything else opens or joins the incident of its fingerprint (slot ``exc:<fingerprint>``) as
    ``process/exception`` (``process/terminated`` for KeyboardInterrupt), as before. Model-side errors
    (shape / device / index), DataLoader worker errors and autograd anomaly NaNs keep that kind; the
    summary names what the classifier recognised and what to check.

* A **log record** (``event["log"]``: the SDK's logging integration, later the agent's log tailer) whose
  message classifies as comm/\\* or memory/\\* with at least ``log_min_confidence`` opens or joins the same
  ``text:<kind>`` incident (``log_text_incidents`` turns this off). A repeated identical signal (same rank,
  rule and parsed facts: NCCL prints its watchdog line three times) adds nothing.

* A rank's note that **another** rank's watchdog timed out (NCCL's "Received a dump signal due to a
  collective timeout from rank N", printed by every rank, the lagging one included) is a relayed report:
  it opens the ``comm/timeout`` incident for rank N only provisionally (the first direct report takes over
  its title and summary) and does not make the noting rank a reporter (its evidence rule is
  ``relay.text``), so correlation can still name it as the lagging rank.

* faulthandler's ``Fatal Python error: Aborted`` (or a segfault's) from a rank that already reported an
  error is how that error ended the process (the abort after a watchdog timeout): evidence on that
  incident (``exception.fatal``), not an ``oom-or-cuda-error`` of its own.

* The incident a rank's error text opened is the one its exit explains (``RankState.exc_key``). A non-zero
  **exit** goes through :func:`~trainguard_engine.catalogue.classify_exit`. When that incident exists and the
  exit rule refines (exit 1; 134/135 and SIGABRT/SIGBUS: the abort after an NCCL watchdog timeout), names
  the same kind (KeyboardInterrupt then exit 130), or is a communication exit (255) after a communication
  error, the exit is evidence on that incident (a generic ``process/exception`` becomes
  ``memory/oom-or-cuda-error`` on a 134). Otherwise the exit opens or joins the incident of its kind (slot
  ``exit:<category>/<subtype>``), so e.g. every rank SIGKILLed at once is one ``process/killed`` incident.
  Exit 0 opens nothing.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import AbstractSet, Any, Dict, List, Mapping, Optional, Sequence, Tuple

from trainguard.core.events import wire_float

from ..catalogue import EXIT_REASON_MEANINGS, DetectionSettings, classify_exit, kind
from ..classify import Classification, classify_chain, classify_text
from ..classify.c10d import connect_retry
from ..classify.torchrun import SINGLE_PROCESS_REPORTERS
from ..diagnosis import cuda_in_use
from ..extract import as_int, as_str, recent_points
from ..incidents import Finding
from ..records import Evidence, TimelineEntry
from ..state import RankState, RunState
from . import first_line
from .base import Detector, EventInfo

GENERIC_EXCEPTION = ("process", "exception")
FATAL_RULE = "python.fatal-error"
RELAY_RULE = "nccl.dump-signal"
"""A rank's note that *another* rank's watchdog timed out ("Received a dump signal due to a collective
timeout from rank N"): a relayed report, see :func:`on_log`."""
TEXT_CATEGORIES = ("comm", "memory", "loss", "gradient")
"""Classified error text of these categories opens an incident of its own kind (one per run)."""
NUMERIC_TEXT_KINDS = (("loss", "non_finite"), ("gradient", "nan-source"), ("memory", "amp-overflow"))
"""Numerical failures a job states in words: taken from text only while no rank of the run sends metrics
or heartbeats (an instrumented job's metrics arrive later than its printed line, in batches; the loss,
gradient and memory detectors judge the numbers themselves, with the step they happened at)."""
TEARDOWN_RULE = "deepspeed.launcher-teardown"
CONNECT_RULE = "c10d.rendezvous"
"""The rule that reads c10d's warning for one failed connect attempt (``[W socket.cpp:N] [c10d] The client
socket has failed to connect to ...``): torch prints it per attempt while the master comes up, healthy runs
too, so a LIVE record of it opens nothing (whether the attempts ended in a failure only the raised error or
an error-level line says); a replayed log's reader passes it on only when the log did not go on training
after it (tags ``replay: true``, set by ``trainguard replay``)."""
LAUNCHER_RULES = ("torchrun.worker-failed", "launcher.signal", "dataloader.worker", TEARDOWN_RULE)
LAUNCHER_KINDS = (("process", "killed"), ("process", "exit"), ("process", "terminated"))
"""Log lines in which a launcher (or the DataLoader, of its workers: "Unexpected bus error encountered in
worker") says a process was ended by a signal open that exit's kind even when no exit event reaches
TrainGuard (a pasted log); so does a launcher's line naming a rank's non-zero exit code (torchrun's
``failed (exitcode: N) local_rank: R``, DeepSpeed's ``exits with return code = N``, and its teardown
``Killing subprocess PID``, which names no rank and so leads no incident): ``process/exit``, and the worker's
own traceback, when printed, is an incident of its own -- the exit report's cause even when printed after it
(correlation folds the exit into it: ``correlate.LAUNCHER_EXIT_RULES``). An abort is not one (after a
watchdog timeout it is the teardown: the exit path decides)."""
SPAWN_RERAISE_RULE = "mp.spawn.reraise"
"""``torch.multiprocessing.spawn``'s parent re-raising a worker's failure from ``join`` (old torch's bare
``Exception: `` -- its message may be empty in a paste --, ``ProcessRaisedException: -- Process N terminated
with the following error: ...``) that reads as nothing more specific than a Python exception: the launcher's
report of a worker's failure, as torchrun's ``ChildFailedError`` is. Its evidence's ``value`` is ``{"rule":
SPAWN_RERAISE_RULE, "confidence": 0.0, "facts", "lines", "exc_type"}``, so that correlation reads it as a
launcher exit report (``correlate.LAUNCHER_EXIT_RULES``): the worker's own error text, printed before or
after it, is its cause."""
LAUNCHER_SIGNAL_RULE = "launcher.signal"
"""The classifier rule of a launcher's own report that a worker ended (``classify.torchrun``). Launchers raise
some of these in their own process: ``torch.multiprocessing.spawn``'s ``ProcessExitedException: process N
terminated with exit code 1`` (or ``... with signal SIGKILL``) from ``join``, ``torch.distributed.launch``'s
``CalledProcessError: Command '[... '--local_rank=3' ...]' returned non-zero exit status 1``. Raised, its
evidence's ``value`` is ``{"rule", "confidence", "facts", "lines", "exc_type"}`` -- what the same report
printed as log text gets -- so that correlation reads it as the launcher exit report it is
(``correlate.LAUNCHER_EXIT_RULES``): the worker's own traceback, which a paste often prints after the
parent's, is its cause. The index such a report names is the worker's on its node (``facts["local_rank"]``),
so any rank's error text may be that worker's."""
SPAWN_MODULE_TAIL = "torch/multiprocessing/spawn.py"
SPAWN_JOIN = "join"


def spawn_reraise(frames: object) -> bool:
    """Whether an exception's innermost frame (``frames``: ``[{"filename", "function", ...}]``, outermost
    first) is ``join`` in ``torch/multiprocessing/spawn.py``: mp.spawn's parent re-raising a worker's
    failure."""
    if not isinstance(frames, Sequence) or isinstance(frames, str) or not frames:
        return False
    last = frames[-1]
    if not isinstance(last, Mapping) or last.get("function") != SPAWN_JOIN:
        return False
    filename = last.get("filename")
    return isinstance(filename, str) and filename.replace("\\", "/").endswith(SPAWN_MODULE_TAIL)


SCALE_RULE = "numeric.loss-scale"
"""An fp16 loss-scale line: a finding when the scale collapsed (see :func:`_scale_collapsed`)."""
SCALE_STATE_KEY = "amp"
"""``RankState.detectors[SCALE_STATE_KEY]``: ``{"last": the last scale a line moved to, "run": reductions in
a row below amp_text_calibration_scale}`` (plain JSON)."""


def _numeric_text_wanted(run: RunState, found: Classification, settings: DetectionSettings,
                         rank: Optional[RankState] = None) -> bool:
    """Whether numerical text ``found`` may open its kind in ``run`` (always True for other text); a
    loss-scale line also advances ``rank``'s run of reductions (without ``rank``: only the scale's floor)."""
    if (found.category, found.subtype) not in NUMERIC_TEXT_KINDS:
        return True
    if any(r.history or r.last_hb_ns for r in run.ranks.values()):
        return False
    if found.rule != SCALE_RULE:
        return True
    return _scale_collapsed(found, settings, rank)


def _scale_collapsed(found: Classification, settings: DetectionSettings, rank: Optional[RankState]) -> bool:
    """Whether a loss-scale line says the fp16 scale collapsed rather than calibrated.

    A dynamic loss scaler halves its scale on every step whose gradients overflow (and skips that step),
    and grows it back only after a window of clean steps. A healthy run prints a few halvings while the
    scaler searches down from its initial scale, then stays put or oscillates (a line at a higher scale than
    the rank's last one means it grew back in between: the count starts again). A collapse is either the
    scale at or below ``amp_text_max_scale`` (it no longer scales the gradients up), or
    ``amp_text_collapse_reductions`` reductions in a row, none grown back, below
    ``amp_text_calibration_scale``: that many consecutive overflowing, skipped steps under the usual initial
    scale. Halvings above it are the search from a larger initial scale (2^32) and do not count."""
    scale = found.facts.get("scale")
    if not isinstance(scale, (int, float)):
        return False
    low = scale <= settings.amp_text_max_scale
    if rank is None:
        return low
    state: Dict[str, Any] = rank.detectors.setdefault(SCALE_STATE_KEY, {"last": None, "run": 0})
    last = state.get("last")
    if isinstance(last, (int, float)):
        if scale > last:
            state["run"] = 0  # grown back since the last line: the overflows stopped for a window
        reduced = scale < last
    else:  # the rank's first line: a reduction when it says so (an overflow line), not a printed value
        reduced = any("overflow" in line.lower() for line in found.lines)
    if reduced and scale < settings.amp_text_calibration_scale:
        state["run"] = int(state.get("run", 0)) + 1
    state["last"] = float(scale)
    return low or int(state["run"]) >= settings.amp_text_collapse_reductions


def _scale_said(found: Classification, rank: RankState) -> Classification:
    """A collapsing loss-scale line's classification naming the run of reductions it ends
    (``reductions_in_a_row`` in its facts, and in its headline when there is more than one)."""
    run = int(rank.detectors.get(SCALE_STATE_KEY, {}).get("run", 0))
    if run < 2:
        return found
    return replace(found, facts={**found.facts, "reductions_in_a_row": run},
                   headline=f"{found.headline}, {run} reductions in a row without growing back")


def exception_key(fingerprint: str) -> str:
    return f"exc:{fingerprint}"


def text_key(category: str, subtype: str) -> str:
    """The incident slot of classified error text of one kind: one per run per kind."""
    return f"text:{category}/{subtype}"


def on_exception(run: RunState, rank: RankState, event: Mapping[str, Any], body: Mapping[str, Any],
                 fingerprint: str, step: int, time_ns: int, settings: DetectionSettings) -> Optional[Finding]:
    """The finding for one exception event (None for a handled exception, unless configured)."""
    handled = bool(body.get("handled"))
    if handled and not settings.incident_on_handled_exceptions:
        return None
    exc_type = as_str(body.get("type")) or "<unknown exception>"
    message = as_str(body.get("message"))
    chain = body.get("chain")
    frames = body.get("frames")
    found = classify_chain(exc_type, message, chain if isinstance(chain, Sequence) else (),
                           frames if isinstance(frames, Sequence) and not isinstance(frames, str) else ())
    mechanism = as_str(body.get("mechanism")) or ("capture_exception" if handled else "uncaught")
    rule = "exception.handled" if handled else "exception.uncaught"
    event_id = as_str(event.get("event_id"))
    if found.rule == FATAL_RULE and not handled:
        notice = _death_notice(run, rank, found, step, time_ns, event_id)
        if notice is not None:
            return notice
        if found.kind == "memory/oom-or-cuda-error" and cuda_in_use(rank) is False:
            # faulthandler's "Aborted" on a CPU-only job (an SDK spool delivered after the death): an abort
            found = replace(found, category="process", subtype="exit",
                            note="an abort on a rank where CUDA is not in use: neither a CUDA OOM nor a CUDA "
                                 "error -- a C++ exception or assertion, or a library that gave up")
    together = _aborted_together(run, rank, found, settings) if not handled else None
    if together is not None:
        found = _as_teardown(found, together)
    if found.category in TEXT_CATEGORIES and _numeric_text_wanted(run, found, settings, rank):
        key = text_key(*ABORT_KIND) if together is not None else text_key(found.category, found.subtype)
        if not handled:
            rank.exc_key = key
        finding = _text_finding(run, rank, found, key, rule, f"{exc_type} ({mechanism})", step, time_ns,
                                event_id, fingerprint=fingerprint, exc_type=exc_type)
        if finding is not None and together is not None:
            finding = replace(finding, relabel=True, update_values=True)  # the abort incident, re-read
        return finding
    category, subtype = (found.category, found.subtype) if found.category == "process" else GENERIC_EXCEPTION
    line = first_line(message)
    detail = f"{exc_type}: {line}" if line else exc_type
    if found.rule.startswith("torchrun."):
        detail = found.headline  # the launcher's summary: name the root-cause rank, not a "=====" line
    loss_context = [{"step": s, "value": wire_float(v)}
                    for n, s, v in recent_points(event) if settings.is_loss(n)][-settings.evidence_window:]
    key = exception_key(fingerprint)
    rank.exc_key = key if not handled else rank.exc_key
    lead = named_rank(found.facts, rank.rank)
    recognised = _recognised(found)
    value: Any = exc_type
    if (category, subtype) == GENERIC_EXCEPTION and not handled and spawn_reraise(frames):
        # mp.spawn's parent reporting a worker's failure: a launcher's exit report (see SPAWN_RERAISE_RULE)
        value = {"rule": SPAWN_RERAISE_RULE, "confidence": 0.0, "facts": _jsonable(found.facts),
                 "lines": [detail], "exc_type": exc_type}
    elif found.rule == LAUNCHER_SIGNAL_RULE and not handled:
        # a launcher's exit report raised in its own process: read as its line in a log (LAUNCHER_SIGNAL_RULE)
        value = {"rule": found.rule, "confidence": found.confidence, "facts": _jsonable(found.facts),
                 "lines": list(found.lines), "exc_type": exc_type}
    evidence = Evidence(
        rule=rule, description=f"rank {rank.rank} raised {detail} at step {step} ({mechanism})" + (
            f"; classified {found.rule}" if recognised else ""),
        step=step, time_ns=time_ns, rank=rank.rank, value=value, window=loss_context, event_id=event_id)
    timeline = TimelineEntry(time_ns=time_ns, step=step, rank=rank.rank,
                             what=f"rank {rank.rank} raised {detail}")
    summary = (f"{exc_type} on rank {rank.rank} at step {step} (fingerprint {fingerprint[:12]}): "
               f"{line or 'no message'}. ")
    if recognised:
        summary += f"{found.headline} ({found.rule})" + (f": {found.note}. " if found.note else ". ")
    summary += "Read the traceback: the innermost in-app frame is where to start."
    return Finding(category, subtype, key, lead, step, time_ns, host=rank.host if lead == rank.rank else "",
                   event_id=evidence.event_id, evidence=[evidence], timeline=[timeline],
                   values={"detail": detail, "step": step, "exc_type": exc_type}, summary=summary,
                   fingerprint=fingerprint)


def _death_notice(run: RunState, rank: RankState, found: Classification, step: int, time_ns: int,
                  event_id: str) -> Optional[Finding]:
    """faulthandler's ``Fatal Python error: Aborted`` (or a segfault's) printed after this rank already
    reported an error is how that error killed the process -- the abort after an NCCL watchdog timeout,
    ``terminate called after throwing ...`` -- so it is evidence on that error's incident, not a new one
    (None when the rank reported nothing before)."""
    explained = run.incidents.get(rank.exc_key) if rank.exc_key else None
    if explained is None or explained.record.explained_by:
        return None
    said = found.headline or found.rule
    evidence = Evidence(rule="exception.fatal", description=f"rank {rank.rank}: {said} -- the process died "
                        f"of the error it reported before ({explained.record.title})",
                        step=step, time_ns=time_ns, rank=rank.rank, value={"rule": found.rule,
                                                                           "facts": _jsonable(found.facts)},
                        event_id=event_id)
    timeline = TimelineEntry(time_ns=time_ns, step=step, rank=rank.rank, what=f"rank {rank.rank}: {said}")
    record = explained.record
    return Finding(record.category, record.subtype, explained.key, rank.rank, -1, time_ns, host=rank.host,
                   event_id=event_id, evidence=[evidence], timeline=[timeline], counts=False)


def on_log(run: RunState, rank: RankState, event: Mapping[str, Any], body: Mapping[str, Any], step: int,
           time_ns: int, settings: DetectionSettings) -> Optional[Finding]:
    """The finding for one log record whose message is comm/* or memory/* error text (None otherwise)."""
    if not settings.log_text_incidents:
        return None
    message = as_str(body.get("message"))
    if not message.strip():
        return None
    found = classify_text(message)
    if found is None or (found.category not in TEXT_CATEGORIES and not (
            found.rule in LAUNCHER_RULES and (found.category, found.subtype) in LAUNCHER_KINDS)):
        return None
    if found.rule == CONNECT_RULE and run.tags.get("replay") != "true" and connect_retry(message):
        return None  # one attempt of a live run: its failure arrives as the raised error / an [E ...] line
    if not _numeric_text_wanted(run, found, settings, rank):
        return _overflow_notice(run, rank, event, body, found, step, time_ns, settings)
    if found.rule == SCALE_RULE:
        found = _scale_said(found, rank)
    if found.confidence < settings.log_min_confidence and found.rule != SCALE_RULE:
        return None  # a scale line's own test is _scale_collapsed
    together = _aborted_together(run, rank, found, settings)
    if together is not None:
        found = _as_teardown(found, together)
    key = text_key(*ABORT_KIND) if together is not None else text_key(found.category, found.subtype)
    if found.facts.get("from_frames") and key in run.incidents:
        return None  # the C++ stack of an error already reported (its message line came first) adds nothing
    origin = as_str(body.get("logger")) or as_str(body.get("source")) or "log"
    about = found.facts.get("timed_out_rank")
    if found.rule == RELAY_RULE and isinstance(about, int) and about != rank.rank:
        # what this rank was told about another: it names where the timeout happened, but this rank was not
        # in the collective (the lagging rank prints it too), and the glog time of the note may even precede
        # the timed-out rank's own line. It opens the incident provisionally, for that rank; the first
        # direct report takes over its title and summary, and this rank is not counted as a reporter
        return _text_finding(run, rank, found, key, "relay.text", f"log {origin}", step, time_ns,
                             as_str(event.get("event_id")), about=about)
    rank.exc_key = key  # the exit this error leads to (an abort after a watchdog timeout) is evidence on it
    finding = _text_finding(run, rank, found, key, "log.text", f"log {origin}", step, time_ns,
                            as_str(event.get("event_id")))
    if finding is not None and (found.category, found.subtype) == AMP_KIND:
        finding = replace(finding, severity=kind(*AMP_KIND).severity)  # raises an info notice's incident
    if finding is not None and together is not None:
        finding = replace(finding, relabel=True, update_values=True)  # the abort incident, re-read
    if finding is not None and "rank" not in found.facts and (
            found.facts.get("from_frames") or found.rule == TEARDOWN_RULE):
        # a C++ stack alone names no rank, and a paste is read as rank 0's: it is some rank's, not a lead;
        # DeepSpeed's launcher stopping its workers is about all of them (the failed one is named elsewhere)
        finding = replace(finding, rank=-1, host="")
    return finding


AMP_KIND = ("memory", "amp-overflow")
NOTICE_SEVERITY = "info"


def _overflow_notice(run: RunState, rank: RankState, event: Mapping[str, Any], body: Mapping[str, Any],
                     found: Classification, step: int, time_ns: int,
                     settings: DetectionSettings) -> Optional[Finding]:
    """An fp16 overflow line that is no collapse (``amp_text_overflow_notice``): memory/amp-overflow at
    severity info, provisional (a collapse later on takes over its title and summary and raises its
    severity), for a run without metrics; None for any other line, or a line that only prints a scale."""
    if not settings.amp_text_overflow_notice or found.rule != SCALE_RULE:
        return None
    if any(r.history or r.last_hb_ns for r in run.ranks.values()):
        return None  # the GradScaler's own metrics speak for an instrumented job
    if not (found.facts.get("overflow") or any(_says_overflow(line) for line in found.lines)):
        return None  # a progress line printing its scale is no overflow
    scale = found.facts.get("scale")
    said = (f"fp16 overflow, loss scale now {_scale_text(scale)}" if isinstance(scale, (int, float))
            else "fp16 overflow, step skipped")
    notice = replace(found, headline=f"{said} (most likely the loss scaler calibrating; no collapse)",
                     note="a dynamic loss scaler skips the steps whose fp16 gradients overflow and halves "
                     "its scale; a few at the start or now and then are how it finds its scale -- an "
                     "incident only if they keep coming or the scale falls towards 1")
    origin = as_str(body.get("logger")) or as_str(body.get("source")) or "log"
    key = text_key(*AMP_KIND)
    finding = _text_finding(run, rank, notice, key, "log.text", f"log {origin}", step, time_ns,
                            as_str(event.get("event_id")))
    if finding is None:
        return None
    st = run.incidents.get(key)
    still_notice = st is None or bool(st.extra.get("provisional"))  # its title follows the latest scale
    return replace(finding, severity=NOTICE_SEVERITY, provisional=True, update_values=still_notice)


def _scale_text(scale: float) -> str:
    return f"{scale:.0f}" if 1 <= scale < 1e15 and scale == int(scale) else f"{scale:g}"


def _says_overflow(line: str) -> bool:
    low = line.lower()
    return "overflow" in low or "reducing to" in low or "reducing loss scale" in low


def _recognised(found: Classification) -> bool:
    """Whether the classifier said more than "a Python exception"."""
    return found.rule != "python.exception" and not found.rule.startswith("type:")


def _jsonable(facts: Mapping[str, Any]) -> Dict[str, Any]:
    """A JSON-clean deep copy of the classifier's facts (the evidence is stored and snapshotted)."""
    data = json.loads(json.dumps(dict(facts), default=str, allow_nan=False))
    return data if isinstance(data, dict) else {}


def _seen(run: RunState, key: str, rank: int, rule: str, facts: Mapping[str, Any]) -> bool:
    """The incident in ``key`` already has this rank's evidence for this rule with these facts."""
    st = run.incidents.get(key)
    if st is None:
        return False
    for ev in st.record.evidence:
        value = ev.value
        if ev.rank == rank and isinstance(value, dict) and value.get("rule") == rule and \
                value.get("facts") == facts:
            return True
    return False


def _text_finding(run: RunState, rank: RankState, found: Classification, key: str, rule: str, source: str,
                  step: int, time_ns: int, event_id: str, *, fingerprint: str = "",
                  exc_type: str = "", about: int = -1) -> Optional[Finding]:
    """The finding of classified error text ``found`` seen on ``rank``; ``about`` >= 0: a relayed report
    of what happened on rank ``about`` (provisional, the incident's member is ``about``)."""
    facts = _jsonable(found.facts)
    if _seen(run, key, rank.rank, found.rule, facts):
        return None
    value: Dict[str, Any] = {"rule": found.rule, "confidence": found.confidence, "facts": facts,
                             "lines": list(found.lines)}
    if exc_type:
        value["exc_type"] = exc_type
    said = found.lines[0] if found.lines else ""
    evidence = Evidence(
        rule=rule, description=f"rank {rank.rank} at step {step}, {source}: {found.headline}"
        + (f' -- "{said}"' if said else ""),
        step=step, time_ns=time_ns, rank=rank.rank, value=value, event_id=event_id)
    timeline = TimelineEntry(time_ns=time_ns, step=step, rank=rank.rank,
                             what=f"rank {rank.rank}: {found.headline}")
    if about >= 0:
        return Finding(found.category, found.subtype, key, about, -1, time_ns, event_id=event_id,
                       evidence=[evidence], timeline=[timeline], counts=False, provisional=True,
                       values={"detail": found.headline, "step": step, "rank": about},
                       summary=_text_summary(found, rank.rank, step, source))
    lead = named_rank(found.facts, rank.rank)
    return Finding(found.category, found.subtype, key, lead, step, time_ns,
                   host=rank.host if lead == rank.rank else "", event_id=event_id, evidence=[evidence],
                   timeline=[timeline], values={"detail": found.headline, "step": step, "rank": lead},
                   summary=_text_summary(found, rank.rank, step, source), fingerprint=fingerprint)


def named_rank(facts: Mapping[str, Any], default: int) -> int:
    """The rank the text itself names (``[Rank 3] ...``, ``Rank 3: found NaN``, ``around rank 11``, a
    launcher's ``--local_rank=7``, torchrun's root cause, ``-- Process 1 terminated``) -- what the error is
    about, whichever stream printed it (a pasted log is read as rank 0's) -- else ``default``."""
    for key in ("rank", "root_cause_rank"):
        named = facts.get(key)
        if isinstance(named, int) and not isinstance(named, bool) and 0 <= named < 1 << 20:
            return named
    return default


ABORT_KIND = ("memory", "oom-or-cuda-error")
ABORT_RULES = ("torchrun.child-failed", "torchrun.worker-failed", "launcher.signal")
"""Rules by which a launcher reports how a worker ended (its failure summary, its per-worker lines)."""
TIMEOUT_KIND = ("comm", "timeout")


def aborted_ranks(rule: str, facts: Mapping[str, Any], default: int) -> List[int]:
    """The ranks a launcher's text says were ended by SIGABRT and nothing else: torchrun's failure summary's
    entries with signal 6 (when its root cause printed no traceback of its own), or the rank one
    per-worker line names (``failed (exitcode: -6) local_rank: 3``, ``Signal 6 (SIGABRT) received by PID``;
    ``default``: the stream that printed it, when the line names none). Empty for anything else."""
    if rule == "torchrun.child-failed":
        if facts.get("root_cause_rule"):
            return []  # the root cause printed its own error: that is what it died of
        failures = facts.get("failures")
        return sorted({f["rank"] for f in (failures if isinstance(failures, list) else [])
                       if isinstance(f, Mapping) and f.get("signal") == 6 and isinstance(f.get("rank"), int)})
    if rule not in ABORT_RULES or facts.get("reporter") in SINGLE_PROCESS_REPORTERS:
        return []  # a debugger's, an IDE's or a shell's report of one process is no launcher's worker rank
    signal = facts.get("signal")
    exitcode = facts.get("exitcode")
    if signal == 6 or (signal is None and exitcode == -6):
        return [named_rank(facts, default)]
    return []


def _aborted_together(run: RunState, rank: RankState, found: Classification,
                      settings: DetectionSettings) -> Optional[List[int]]:
    """``aborts_together_timeout_ranks`` (default 1) or more distinct ranks of the run ended by a bare
    SIGABRT (this text's and the abort incident's earlier ones, that incident holding nothing else) while no
    collective timeout of the run is reported in words and CUDA is not known to be unused on this rank: the
    sorted ranks, else None.

    Why a timeout: a CUDA OOM or CUDA error raised in Python ends its process with exit code 1 and its
    message, not an abort; a SIGABRT with no error of its own is C++ giving up -- in a distributed job above
    all the NCCL watchdog taking the process down after a collective timed out (torch >= 2 does so by
    default). Every wild-corpus thread that settles a one-rank bare abort says so (a collective timeout, or
    the network under it failing); the launcher shows only the first rank whose watchdog fired, having
    stopped the others (SIGTERM) at that first failure. Several ranks listed as aborted on their own died
    within the same moment: their watchdogs hit the same collective's deadline together. A CPU-only rank has
    no NCCL watchdog: its abort is left alone."""
    need = settings.aborts_together_timeout_ranks
    if need <= 0 or found.kind != "/".join(ABORT_KIND) or text_key(*TIMEOUT_KIND) in run.incidents \
            or cuda_in_use(rank) is False:
        return None
    mine = aborted_ranks(found.rule, found.facts, rank.rank)
    if not mine:
        return None
    ranks = set(mine)
    st = run.incidents.get(text_key(*ABORT_KIND))
    if st is not None:
        for ev in st.record.evidence:
            value = ev.value if isinstance(ev.value, Mapping) else {}
            said = value.get("facts")
            earlier = aborted_ranks(str(value.get("rule", "")), said if isinstance(said, Mapping) else {},
                                    ev.rank)
            if not earlier:
                return None  # the abort incident holds other evidence (an exit code, a CUDA stack): not ours
            ranks.update(earlier)
    return sorted(ranks) if len(ranks) >= need else None


def _as_teardown(found: Classification, ranks: Sequence[int]) -> Classification:
    """``found`` (a bare SIGABRT) read as the NCCL watchdog's teardown of ``ranks`` after a timeout."""
    shown = ", ".join(str(r) for r in ranks[:16]) + (" ..." if len(ranks) > 16 else "")
    if len(ranks) == 1:
        headline = (f"Collective timeout (inferred): rank {shown} aborted by SIGABRT with no error of its "
                    "own -- the NCCL watchdog's teardown; its timeout lines are not in the text")
        note = ("a rank aborting on its own is, in a distributed job, its NCCL watchdog taking the process "
                "down after a collective did not complete in time (or its transport failed): look above for "
                "the watchdog's lines, and for the rank that never reached the collective (stuck, slower, or "
                "dead); if there is none, an async CUDA error or a C++ assertion remain possible")
    else:
        headline = (f"Collective timeout (inferred): {len(ranks)} ranks ({shown}) aborted by SIGABRT "
                    "together -- the NCCL watchdog's teardown; its timeout lines are not in the text")
        note = ("several ranks aborting on their own at the same moment is each one's NCCL watchdog taking "
                "its process down after a collective did not complete in time: find the rank that never "
                "reached the collective (stuck, slower, or dead) in the output above")
    return replace(found, category=TIMEOUT_KIND[0], subtype=TIMEOUT_KIND[1],
                   facts={**found.facts, "aborted_ranks": list(ranks[:64])}, headline=headline, note=note)


def _text_summary(found: Classification, rank: int, step: int, source: str) -> str:
    text = f"{found.headline} (rank {rank}, step {step}, from {source}; rule {found.rule})."
    if found.note:
        text += f" {found.note[0].upper()}{found.note[1:]}."
    facts = found.facts
    lagging = facts.get("lagging_ranks")
    if isinstance(lagging, list) and lagging:
        text += f" Lagging rank(s): {', '.join(str(r) for r in lagging[:16])} -- start with them."
    if facts.get("collective_call_site"):
        text += f" The collective was called from {facts['collective_call_site']}."
    return text


def on_exit(run: RunState, rank: RankState, body: Mapping[str, Any], step: int, time_ns: int,
            event_id: str, settings: DetectionSettings) -> Optional[Finding]:
    """The finding for a lifecycle EXIT of ``rank`` (already recorded on it); None for a clean exit."""
    verdict = classify_exit(as_int(body.get("exit_code"), 0), as_int(body.get("signal"), 0))
    if verdict is None:
        return None
    reason = as_str(body.get("reason"))
    said = verdict.describe() + (f", reason {reason}" if reason else "")
    meaning = EXIT_REASON_MEANINGS.get(reason, verdict.meaning)
    description = f"rank {rank.rank} exited with {said}: {meaning}"
    evidence = Evidence(rule="exit.code", description=description,
                        step=step, time_ns=time_ns, rank=rank.rank, metric="exit_code",
                        value=verdict.exit_code, event_id=event_id)
    timeline = TimelineEntry(time_ns=time_ns, step=step, rank=rank.rank,
                             what=f"rank {rank.rank} exited with {said}")
    explained = run.incidents.get(rank.exc_key) if rank.exc_key else None
    exit_kind = (verdict.category, verdict.subtype)
    if explained is not None:
        kind_then = (explained.record.category, explained.record.subtype)
        same_family = verdict.category == "comm" and kind_then[0] == "comm"
        if verdict.refine or kind_then == exit_kind or same_family:
            category, subtype, relabel = kind_then[0], kind_then[1], False
            if kind_then == GENERIC_EXCEPTION and exit_kind != GENERIC_EXCEPTION:
                category, subtype, relabel = verdict.category, verdict.subtype, True
            else:  # the exit code's generic meaning ("OOM or a CUDA error" for 134) says less than the error
                evidence = Evidence(rule="exit.code", description=f"rank {rank.rank} exited with {said}: how "
                                    f"the {kind_then[0]}/{kind_then[1]} it reported ended the process",
                                    step=step, time_ns=time_ns, rank=rank.rank, metric="exit_code",
                                    value=verdict.exit_code, event_id=event_id)
            return Finding(category, subtype, explained.key, rank.rank, -1, time_ns, host=rank.host,
                           event_id=event_id, evidence=[evidence], timeline=[timeline], counts=False,
                           relabel=relabel)
    if exit_kind == ("memory", "oom-or-cuda-error") and cuda_in_use(rank) is False:
        # a CPU-only job cannot run out of CUDA memory: say what is known, not the GPU's usual story
        exit_kind = ("process", "exit")
        meaning = (f"aborted ({verdict.describe()}: abort() -- a C++ exception or assertion, a fatal "
                   "runtime error, or a library that gave up); CUDA is not in use on this rank (a CPU-only "
                   "torch build, no CUDA memory reported), so it is neither a CUDA OOM nor a CUDA error")
        evidence = Evidence(rule="exit.code", description=f"rank {rank.rank} exited with {said}: {meaning}",
                            step=step, time_ns=time_ns, rank=rank.rank, metric="exit_code",
                            value=verdict.exit_code, event_id=event_id)
    values: Dict[str, Any] = {"detail": said, "step": step, "exit_code": verdict.exit_code}
    summary = f"Rank {rank.rank} exited with {said} at step {step}: {meaning}."
    if rank.exc_key:
        summary += " It had reported an error before (see that incident)."
    return Finding(exit_kind[0], exit_kind[1], f"exit:{exit_kind[0]}/{exit_kind[1]}",
                   rank.rank, step, time_ns, host=rank.host, event_id=event_id, evidence=[evidence],
                   timeline=[timeline], values=values, summary=summary)


class Process(Detector):
    """How a process failed: uncaught exceptions (one incident per fingerprint), error text the job
    printed (the classifier), and the exit-code decision path."""

    name = "process"
    kinds: Tuple[str, ...] = ("process/exception", "process/killed", "process/terminated", "process/exit",
                              "memory/oom", "memory/oom-or-cuda-error", "memory/cuda-error", "comm/failure",
                              "comm/init-failure", "comm/timeout", "comm/mismatch", "comm/rank-lost",
                              "gradient/nan-source", "loss/non_finite", "memory/amp-overflow")
    section = "process"
    names_only = True

    def wants(self, rank: RankState, names: AbstractSet[str], settings: DetectionSettings) -> bool:
        return False  # no metric batch is an exception, a log line or an exit

    def on_exception(self, run: RunState, rank: RankState, event: EventInfo, fingerprint: str,
                     settings: DetectionSettings) -> List[Finding]:
        found = on_exception(run, rank, event.envelope, event.body, fingerprint, event.step, event.time_ns,
                             settings)
        return [found] if found is not None else []

    def on_log(self, run: RunState, rank: RankState, event: EventInfo,
               settings: DetectionSettings) -> List[Finding]:
        if as_str(event.body.get("source")).startswith("agent:"):  # the agent's reports: progress's
            return []
        found = on_log(run, rank, event.envelope, event.body, event.step, event.time_ns, settings)
        return [found] if found is not None else []

    def on_exit(self, run: RunState, rank: RankState, event: EventInfo,
                settings: DetectionSettings) -> List[Finding]:
        found = on_exit(run, rank, event.body, event.step, event.time_ns, event.event_id, settings)
        return [found] if found is not None else []
