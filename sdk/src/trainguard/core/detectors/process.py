"""Uncaught exceptions and the exit-code decision path (DESIGN §4, seed 000 §3.5).

* An **uncaught exception** (``handled`` false; handled ones too with
  ``incident_on_handled_exceptions``) opens or joins the incident of its fingerprint (slot
  ``exc:<fingerprint>``): the same failure on many ranks is one incident listing them all. Its kind comes
  from the error text (:func:`~trainguard.core.catalogue.classify_exception`: ``torch.OutOfMemoryError`` /
  "CUDA out of memory" → ``memory/oom``; otherwise ``process/exception``).
* A non-zero **exit** goes through :func:`~trainguard.core.catalogue.classify_exit`. When the rank
  reported an uncaught exception before and the exit rule refines (exit 1; 134/135 and SIGABRT/SIGBUS) or
  names the same kind (KeyboardInterrupt then exit 130), the exit is evidence on that exception's
  incident (a generic ``process/exception`` becomes ``memory/oom-or-cuda-error`` on a 134). Otherwise
  the exit opens or joins the incident of its kind (slot ``exit:<category>/<subtype>``), so e.g. every
  rank SIGKILLed at once is one ``process/killed`` incident. Exit 0 opens nothing.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

from ..catalogue import DetectionSettings, classify_exception, classify_exit
from ..events import wire_float
from ..extract import as_int, as_str, recent_points
from ..incidents import Finding
from ..records import Evidence, TimelineEntry
from ..state import RankState, RunState
from . import first_line

GENERIC_EXCEPTION = ("process", "exception")


def exception_key(fingerprint: str) -> str:
    return f"exc:{fingerprint}"


def on_exception(run: RunState, rank: RankState, event: Mapping[str, Any], body: Mapping[str, Any],
                 fingerprint: str, step: int, time_ns: int, settings: DetectionSettings) -> Optional[Finding]:
    """The finding for one exception event (None for a handled exception, unless configured)."""
    handled = bool(body.get("handled"))
    if handled and not settings.incident_on_handled_exceptions:
        return None
    exc_type = as_str(body.get("type")) or "<unknown exception>"
    message = as_str(body.get("message"))
    category, subtype = classify_exception(exc_type, message)
    line = first_line(message)
    detail = f"{exc_type}: {line}" if line else exc_type
    mechanism = as_str(body.get("mechanism")) or ("capture_exception" if handled else "uncaught")
    loss_context = [{"step": s, "value": wire_float(v)}
                    for n, s, v in recent_points(event) if settings.is_loss(n)][-settings.evidence_window:]
    key = exception_key(fingerprint)
    rank.exc_key = key if not handled else rank.exc_key
    evidence = Evidence(
        rule="exception.handled" if handled else "exception.uncaught",
        description=f"rank {rank.rank} raised {detail} at step {step} ({mechanism})",
        step=step, time_ns=time_ns, rank=rank.rank, value=exc_type, window=loss_context,
        event_id=as_str(event.get("event_id")))
    timeline = TimelineEntry(time_ns=time_ns, step=step, rank=rank.rank,
                             what=f"rank {rank.rank} raised {detail}")
    return Finding(category, subtype, key, rank.rank, step, time_ns, host=rank.host,
                   event_id=evidence.event_id, evidence=[evidence], timeline=[timeline],
                   values={"detail": detail, "step": step, "exc_type": exc_type},
                   summary=(f"{exc_type} on rank {rank.rank} at step {step} (fingerprint "
                            f"{fingerprint[:12]}): {line or 'no message'}. Read the traceback: the "
                            f"innermost in-app frame is where to start."),
                   fingerprint=fingerprint)


def on_exit(run: RunState, rank: RankState, body: Mapping[str, Any], step: int, time_ns: int,
            event_id: str, settings: DetectionSettings) -> Optional[Finding]:
    """The finding for a lifecycle EXIT of ``rank`` (already recorded on it); None for a clean exit."""
    verdict = classify_exit(as_int(body.get("exit_code"), 0), as_int(body.get("signal"), 0))
    if verdict is None:
        return None
    reason = as_str(body.get("reason"))
    said = verdict.describe() + (f", reason {reason}" if reason else "")
    description = f"rank {rank.rank} exited with {said}: {verdict.meaning}"
    evidence = Evidence(rule="exit.code", description=description,
                        step=step, time_ns=time_ns, rank=rank.rank, metric="exit_code",
                        value=verdict.exit_code, event_id=event_id)
    timeline = TimelineEntry(time_ns=time_ns, step=step, rank=rank.rank,
                             what=f"rank {rank.rank} exited with {said}")
    explained = run.incidents.get(rank.exc_key) if rank.exc_key else None
    if explained is not None and (verdict.refine or (explained.record.category, explained.record.subtype)
                                  == (verdict.category, verdict.subtype)):
        inc = explained.record
        category, subtype, relabel = inc.category, inc.subtype, False
        exit_kind = (verdict.category, verdict.subtype)
        if (category, subtype) == GENERIC_EXCEPTION and exit_kind != GENERIC_EXCEPTION:
            category, subtype, relabel = verdict.category, verdict.subtype, True
        return Finding(category, subtype, explained.key, rank.rank, -1, time_ns, host=rank.host,
                       event_id=event_id, evidence=[evidence], timeline=[timeline], counts=False,
                       relabel=relabel)
    values: Dict[str, Any] = {"detail": said, "step": step, "exit_code": verdict.exit_code}
    summary = f"Rank {rank.rank} exited with {said} at step {step}: {verdict.meaning}."
    if rank.exc_key:
        summary += " It had raised an exception before (see that incident)."
    return Finding(verdict.category, verdict.subtype, f"exit:{verdict.category}/{verdict.subtype}",
                   rank.rank, step, time_ns, host=rank.host, event_id=event_id, evidence=[evidence],
                   timeline=[timeline], values=values, summary=summary)

