"""Cross-rank root-cause correlation (DESIGN §4 "Correlation", seed 000 §3.5): the earliest signal leads,
and what a failure causes on other ranks is evidence on it, not an incident of its own. Pure; the rules
are specified in docs/correlation.md (rule 7, a memory exhaustion explains the communication failures
and DataLoader worker deaths around it: :func:`_exhaustion_around`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import AbstractSet, Dict, FrozenSet, List, Mapping, Optional, Sequence, Set, Tuple

from .catalogue import DetectionSettings, kinds_with_role
from .detectors import fmt_duration
from .incidents import Finding, add_timeline, apply, refresh_ranks, resolve
from .records import Evidence, TimelineEntry
from .state import IncidentState, RankState, RunState

Kind = Tuple[str, str]

CAUSES: Tuple[Kind, ...] = kinds_with_role("cause")
"""Kinds that make the collectives of the other ranks fail (rule 1): role ``cause`` in the catalogue."""

CONSEQUENCES: Tuple[Kind, ...] = kinds_with_role("consequence")
"""Kinds that are the other ranks' view of a failure elsewhere (rule 1): role ``consequence``."""

NUMERIC: Tuple[Kind, ...] = kinds_with_role("numeric")
_NON_FINITE_TEXT = re.compile(r"\b(nan|inf|infinity|non-?finite|not finite)\b", re.IGNORECASE)
"""An exception whose message says the values went non-finite (a job's own ``isfinite`` guard raising,
``FloatingPointError``, anomaly mode) after a non-finite loss or gradient is that incident's consequence."""

PEER_FAILURES: Tuple[Kind, ...] = kinds_with_role("peer-failure")
"""Kinds a silent rank can explain (rule 2): role ``peer-failure``."""

COMM_FAILURES: Tuple[Kind, ...] = kinds_with_role("comm-failure")
TERMINATION_CAUSES: Tuple[Kind, ...] = (*CAUSES, *COMM_FAILURES)
"""A rank terminated by its launcher (``process/terminated``) after any of these on another rank is
that failure's consequence: torchrun stops the survivors when one rank fails. A rank terminated while it
is in an open stall is the stall's (it was killed because it hung)."""
EXITS_AFTER_FAILURE: Tuple[Kind, ...] = (("process", "terminated"), ("process", "exit"))
"""A rank terminated, or a launcher's line that a rank exited non-zero (torchrun's ``failed (exitcode: 1)``),
after one of ``TERMINATION_CAUSES`` on the run is that failure's consequence, as is a terminated rank in
its own open stall."""
CRASH_EXIT: Kind = ("process", "exit")
EXCEPTION: Kind = ("process", "exception")
TEARDOWN_RULE = "deepspeed.launcher-teardown"
SPAWN_RERAISE_RULE = "mp.spawn.reraise"
"""``detectors.process.SPAWN_RERAISE_RULE``: mp.spawn's parent re-raising a worker's failure from ``join``
(a ``process/exception`` that reads as nothing more specific)."""
NAMELESS_EXIT_RULES = frozenset({TEARDOWN_RULE, SPAWN_RERAISE_RULE})
"""Launcher exit reports that name no global rank: DeepSpeed's teardown (a PID), mp.spawn's re-raise (the
process index it names is the worker's index on its node; the parent's own stream is no rank's)."""
LAUNCHER_EXIT_RULES = frozenset({"torchrun.worker-failed", "torchrun.summary-without-root", "launcher.signal",
                                 TEARDOWN_RULE, SPAWN_RERAISE_RULE})
"""Classifier rules of a launcher's line that a worker exited (torchrun's ``failed (exitcode: 1) local_rank:
R`` or failure entry, DeepSpeed's ``exits with return code = 1`` and ``Killing subprocess``): a
``process/exit`` incident whose evidence is only such lines is the launcher's report of an error it did not
see. When the rank it names (any rank, when the line names none: DeepSpeed's teardown) then prints its own
error text -- a pasted log interleaves the launcher's stream with the worker's, or prints the entry's
``traceback :`` field after its exit code -- that error is the cause and the exit its consequence
(:func:`_own_error_after`), however they were ordered. mp.spawn's parent re-raising a worker's failure
(``SPAWN_RERAISE_RULE``, a ``process/exception`` incident) is such a report too: ``join`` raises only after
a worker failed, so any worker's own error text, printed before or after it, is its cause."""
LAUNCHER_REPORTS: Tuple[Kind, ...] = (("process", "exit"), ("process", "killed"), ("process", "terminated"))
RANK_LOST: Kind = ("comm", "rank-lost")
SIGABRT = 6
"""A launcher's line that the rank a peer reported lost (``Connection closed by localRank q``) exited by a
signal (SIGSEGV, SIGFPE, SIGBUS ...; not an abort) is that rank's crash, and the incident is it
(:func:`_crash_leads`): the peer saw the process go away because it crashed."""
STALLED: Kind = ("progress", "stalled")
KILLED: Kind = ("process", "killed")
STRAGGLER: Kind = ("perf", "straggler")
STRAGGLER_KEY = "perf:straggler"
WAITED_ON: Tuple[Kind, ...] = (("comm", "timeout"), ("comm", "failure"))
"""A collective timeout (or the communication failure a peer then reports) while a named straggler is
still open is that straggler's consequence (issue 23): its peers were waiting on it, so the culprit is
the slow rank, not the rank whose watchdog fired first."""
REGRESSION: Kind = ("perf", "throughput-regression")
"""A throughput regression still open when a straggler is named is the straggler's consequence (issue 23)
when the straggler began by the time the job slowed (at most ``straggler_window`` judged steps after the
regression's onset): a rank forming slowly (its per-step ratio near ``straggler_ratio``) holds every rank
back, the job's step time crosses ``regression_ratio`` first, and the rank is named later. A regression
that began long before the straggler did is a change of its own and stays."""

AMP_OVERFLOW: Kind = ("memory", "amp-overflow")
AFTER_AMP_OVERFLOW: Tuple[Kind, ...] = (("loss", "non_finite"), ("gradient", "nan-source"))
"""A loss or gradient that goes non-finite while an fp16 loss-scale collapse (memory/amp-overflow) that began
earlier is still open is that collapse's consequence: the scaler had been halving its scale over steps
whose gradients overflowed (and were skipped) before the values themselves went NaN -- the earliest
signal leads. A non-finite value first, and the scale collapsing after it, stays the non-finite incident.
Only where the scaler's per-step skips are unknown (a log's text): a run whose ranks report ``amp/overflow``
tells a skipped step's NaN (the scaler's job, never an incident) from a NaN on a step it applied."""

SCALER_GAVE_UP_RULE = "numeric.loss-scale-minimum"
"""The classifier rule of the loss scaler's own fatal error: DeepSpeed's ``Current loss scale already at
minimum - cannot decrease scale anymore. Exiting run.``, fairseq's ``FloatingPointError: Minimum loss scale
reached``. Unlike an overflow notice or a collapsing scale (observations: the run goes on skipping steps),
the scaler raised and the process ends because of it: a memory/amp-overflow incident with such evidence is
a failure of the run, and a rank's exit (or a launcher's report of one) after it is its consequence
(:func:`_scaler_gave_up_before`)."""

OOM: Kind = ("memory", "oom")
OOM_EXPLAINS: Tuple[Kind, ...] = (("comm", "failure"), ("comm", "rank-lost"), ("comm", "timeout"))
"""What a memory exhaustion explains within ``oom_explains_s`` of it, before or after (rule 7), besides a
DataLoader worker's death (:data:`_WORKER_DIED`)."""
DEVICE_FAULT: Kind = ("memory", "cuda-error")
"""A CUDA device fault: the rank that hit it stops entering collectives, so a communication failure or
rank loss reported by other ranks that began up to ``device_fault_explains_s`` before it (pasted ranks'
lines in no time order) is its consequence too (rule 7); one that began after it already is (rule 1)."""
WORKER_DEATHS: Tuple[Kind, ...] = (("process", "exception"), ("process", "exit"), ("process", "killed"))
_WORKER_DIED = re.compile(r"DataLoader worker \(pids?\b", re.IGNORECASE)
"""torch's ``DataLoader worker (pid(s) N) exited unexpectedly`` / ``... is killed by signal``: the main
process saw a worker die (the OOM killer's usual victim)."""

HEARTBEAT_SLACK = 2.5
"""A rank is silent when it missed this many of its own heartbeat intervals (and rank_lost_grace_s)."""


def _kind(st: IncidentState) -> Kind:
    return st.record.category, st.record.subtype


def find_cause(run: RunState, at_ns: int, exclude: str = "",
               kinds: Tuple[Kind, ...] = CAUSES,
               reporters: FrozenSet[int] = frozenset(),
               reading: Optional[float] = None) -> Optional[IncidentState]:
    """The open incident of ``run`` of one of ``kinds`` whose earliest signal is at or before ``at_ns``
    (the earliest such; None if there is none). ``reporters``: the ranks whose own error text the caller's
    finding is -- a launcher's exit report for one of them is no cause of it (see
    :data:`LAUNCHER_EXIT_RULES`). ``reading``: how specifically the finding's own error text reads
    (:func:`_reading_confidence`; None: not error text) -- an incident that began at the same instant on one
    of ``reporters`` and reads less specifically is no cause of it: it is the generic report of that error
    (rule 9, :func:`_named_same_moment`, folds it the other way)."""
    best: Optional[IncidentState] = None
    best_first = 0
    for st in run.incidents.values():
        if st.key == exclude or not st.is_open or st.record.explained_by or \
                (_kind(st) not in kinds and not st.extra.get("consequences")):
            continue  # an incident that already explains consequences stays their cause, whatever its kind
        if reporters and _reports_exit_of(st, reporters):
            continue  # the launcher's report that this rank exited: its own error explains that, not v.v.
        if reading is not None and _generic_same_moment(run, st, at_ns, reporters, reading):
            continue
        first = _began(run, st)
        if first and first <= at_ns and (best is None or (first, st.key) < (best_first, best.key)):
            best, best_first = st, first
    return best


def _launcher_exit_ranks(st: IncidentState) -> Optional[FrozenSet[int]]:
    """For an open ``process/exit`` incident made only of launcher exit lines (:data:`LAUNCHER_EXIT_RULES`)
    that explains nothing: the global ranks those lines are about (the rank a line names, else the stream
    that printed it; a local rank is taken for the global one, as on one node); empty for DeepSpeed's
    teardown, which names a PID only. None for any other incident."""
    kind = _kind(st)
    if kind not in (CRASH_EXIT, EXCEPTION) or not st.is_open or st.record.explained_by or \
            st.extra.get("consequences"):
        return None
    ranks: Set[int] = set()
    for ev in st.record.evidence:
        value = ev.value if isinstance(ev.value, Mapping) else {}
        rule = value.get("rule")
        if not ev.rule.startswith(REPORTED) or rule not in LAUNCHER_EXIT_RULES or \
                (kind == EXCEPTION) != (rule == SPAWN_RERAISE_RULE):
            return None  # an exit code the rank itself sent, or anything else: not a launcher's report only
        if rule == SPAWN_RERAISE_RULE:
            if _relays_worker_exception(value):
                return None  # the worker's own error, relayed by join: a cause, not a launcher's report only
            continue  # names no global rank: any worker's error is its cause
        facts = value.get("facts")
        facts = facts if isinstance(facts, Mapping) else {}
        named = facts.get("rank")
        if isinstance(named, int) and not isinstance(named, bool):
            ranks.add(named)
        elif rule != TEARDOWN_RULE and ev.rank >= 0:
            ranks.add(ev.rank)
    return frozenset(ranks)


def _relays_worker_exception(value: Mapping[str, object]) -> bool:
    """Whether an mp.spawn re-raise (``SPAWN_RERAISE_RULE`` evidence ``value``) carries the worker's own
    exception: its classified facts name an exception type other than the re-raise's own --
    ``ProcessRaisedException: -- Process 1 terminated with the following error: Traceback ... AttributeError:
    ...`` relays the worker's ``AttributeError``, and is that worker's error report (the worker's lead, a
    cause of its peers' collective failures), not a launcher's word that some worker failed. Old torch's
    bare ``Exception:`` (its message cut, or only ``-- Process 3 terminated with the following error:``)
    names none."""
    facts = value.get("facts")
    worker = facts.get("exc_type") if isinstance(facts, Mapping) else None
    return isinstance(worker, str) and worker not in ("", "Exception", value.get("exc_type"))


def _names_global_rank(st: IncidentState) -> bool:
    """Whether one of launcher exit report ``st``'s lines names a global rank: not only a local one
    (:func:`_local_only`), and not DeepSpeed's teardown (a PID)."""
    for ev in st.record.evidence:
        value = ev.value if isinstance(ev.value, Mapping) else {}
        facts = value.get("facts")
        facts = facts if isinstance(facts, Mapping) else {}
        if value.get("rule") in NAMELESS_EXIT_RULES:
            continue
        if "rank" not in facts or not _local_only(facts, value.get("lines")):
            return True
    return False


def _local_only(facts: Mapping[str, object], lines: object) -> bool:
    """Whether a launcher line's named rank is only its local rank (``rank`` equal to ``local_rank``, and the
    line no failure entry's ``exitcode  :`` field, whose ``rank :`` field is global)."""
    if facts.get("local_rank") != facts.get("rank"):
        return False
    said = " ".join(str(x) for x in lines) if isinstance(lines, list) else ""
    return "exitcode  :" not in said


def _reports_exit_of(st: IncidentState, reporters: FrozenSet[int]) -> bool:
    """Whether ``st`` is a launcher's exit report (:func:`_launcher_exit_ranks`) about a rank of
    ``reporters`` (any, for DeepSpeed's teardown)."""
    ranks = _launcher_exit_ranks(st)
    return ranks is not None and (not ranks or not ranks.isdisjoint(reporters))


def _teardown_only(st: IncidentState) -> bool:
    """Whether ``st``'s evidence is DeepSpeed's teardown (``Killing subprocess``) only."""
    return all(isinstance(ev.value, Mapping) and ev.value.get("rule") == TEARDOWN_RULE
               for ev in st.record.evidence)


def _reporters(evidence: Sequence[Evidence]) -> FrozenSet[int]:
    """The ranks whose own error text ``evidence`` is: each reporting evidence's rank and the rank its
    classified facts name (``[Rank 3] ...`` printed on another stream)."""
    ranks: Set[int] = set()
    for ev in evidence:
        if not ev.rule.startswith(REPORTED):
            continue
        if ev.rank >= 0:
            ranks.add(ev.rank)
        facts = ev.value.get("facts") if isinstance(ev.value, Mapping) else None
        named = facts.get("rank") if isinstance(facts, Mapping) else None
        if isinstance(named, int) and not isinstance(named, bool) and named >= 0:
            ranks.add(named)
    return frozenset(ranks)


OWN_ERRORS: Tuple[Kind, ...] = tuple(k for k in TERMINATION_CAUSES if k not in LAUNCHER_REPORTS)
"""What a worker's own error text can be when it explains its launcher's exit report."""
TEARDOWN_CAUSES: Tuple[Kind, ...] = (*OWN_ERRORS, KILLED)
"""What explains DeepSpeed's teardown (an exit report naming no rank): a worker's own error, or the launcher's
own line naming the failed worker by a signal (``... '--local_rank=7' ...] exits with return code = -9``,
which it prints after the teardown: process/killed; a plain code joins the teardown's process/exit)."""


def _own_error_after(run: RunState, st: IncidentState, ranks: FrozenSet[int]) -> Optional[IncidentState]:
    """The incident of the error text the rank(s) of launcher exit report ``st`` printed at or after it:
    an open, unexplained incident of :data:`OWN_ERRORS` (of :data:`TEARDOWN_CAUSES` for DeepSpeed's
    teardown); any rank's when the report names no global rank -- only a *local* one (torchrun's ``failed
    (exitcode: 1) local_rank: 0``, DeepSpeed's ``--local_rank=0``: on a second node local rank 0 is global
    rank 8, and error text names global ranks) or a PID (DeepSpeed's teardown); the one whose such text came
    first. mp.spawn's re-raise (``SPAWN_RERAISE_RULE``): any rank's, printed at any time (``join`` raises
    only after a worker failed; the worker's stderr and the parent's interleave either way); never another
    launcher report. None when there is none."""
    began = 0 if _kind(st) == EXCEPTION else st.record.first_ns
    kinds = TEARDOWN_CAUSES if _teardown_only(st) else OWN_ERRORS
    if not _names_global_rank(st):
        ranks = frozenset()  # a local rank (or a PID) says nothing of the global rank the error text names
    best: Optional[IncidentState] = None
    best_at = 0
    for other in run.incidents.values():
        if other is st or not other.is_open or other.record.explained_by or _kind(other) not in kinds or \
                _launcher_exit_ranks(other) is not None:
            continue
        times = [ev.time_ns for ev in other.record.evidence
                 if ev.time_ns >= began and (not ranks or not ranks.isdisjoint(_reporters((ev,))))]
        if times and (best is None or (min(times), other.key) < (best_at, best.key)):
            best, best_at = other, min(times)
    return best


def _began(run: RunState, st: IncidentState) -> int:
    """When the incident's cause began. A rank killed by a signal is reported at its exit (by the launcher,
    often long after); it died after its last progress, so that is when its peers' trouble can start."""
    first = st.record.first_ns
    if _kind(st) == KILLED:
        rank = run.ranks.get(st.extra.get("killed_rank", st.record.lead_rank))
        if rank is not None and rank.progress_ns:
            return min(first, rank.progress_ns) if first else rank.progress_ns
    return first


def _remember_killed(cause: IncidentState) -> None:
    """Note which rank a process/killed incident is about, before consequences add other ranks to it (it
    stays the lead: a consequence reported at the same time on a lower rank does not take it)."""
    if _kind(cause) == KILLED:
        cause.extra.setdefault("killed_rank", cause.record.lead_rank)


def _killed_as_rank_lost(run: RunState, cause: IncidentState, consequence: Kind,
                         settings: DetectionSettings) -> None:
    """A rank killed by a signal whose peers' collectives then failed is the lost rank (DESIGN §4
    comm/rank-lost: the survivors' errors are consequences): the incident becomes comm/rank-lost, led by
    the killed rank."""
    if _kind(cause) != KILLED or consequence[0] != "comm":
        return
    q = int(cause.extra["killed_rank"])
    rank = run.ranks.get(q)
    step = rank.max_step if rank is not None else cause.record.first_step
    cause.extra["lead"] = q
    began = _began(run, cause)
    said = (f"rank {q} was killed by a signal after its last progress (step {step}); its peers' collectives "
            f"failed after that: their errors are consequences")
    summary = (f"Rank {q} was killed by a signal (SIGKILL: the OOM-killer, a preemption) after step {step}, "
               f"and its peers' collectives then failed. Find out why rank {q} was killed (host `dmesg` "
               f"for the OOM-killer, the scheduler's preemption log).")
    apply(run, Finding(
        "comm", "rank-lost", cause.key, q, step, began, relabel=True, counts=False, update_values=True,
        values={"detail": f"rank {q} was killed at step {step}: its peers' collectives failed", "rank": q,
                "step": step},
        evidence=[Evidence(rule="correlation.killed_peer", description=said, step=step, time_ns=began,
                           rank=q)],
        summary=summary), settings)
    refresh_ranks(cause)


def _exit_signal(finding: Finding) -> int:
    """The signal a launcher's exit line says ended the rank (torchrun's ``failed (exitcode: -N)``, the
    failure table's ``Signal N (SIG...)``), from the finding's classified facts; 0 when it names none."""
    for ev in finding.evidence:
        facts = ev.value.get("facts") if isinstance(ev.value, dict) else None
        if not isinstance(facts, dict):
            continue
        signal, code = facts.get("signal"), facts.get("exitcode")
        if isinstance(signal, int) and signal > 0:
            return signal
        if isinstance(code, int) and code < 0:
            return -code
    return 0


def _lost_rank_crashed(cause: IncidentState, finding: Finding) -> bool:
    """Whether ``finding`` (a launcher's line that rank q exited by a signal) is the lost rank of
    ``cause`` (a comm/rank-lost whose lead q was named by another rank's report, NCCL's ``Connection
    closed by localRank q``) dying of its own crash: the peer saw q's process go away *because* it crashed.
    Not an abort (SIGABRT after a communication failure is the watchdog's teardown)."""
    q = finding.rank
    if _kind(cause) != RANK_LOST or q < 0 or cause.record.lead_rank != q:
        return False
    if not any(ev.rank >= 0 and ev.rank != q for ev in cause.record.evidence):
        return False  # the lost rank is the reporter itself: no peer saw it go away
    signal = _exit_signal(finding)
    return signal > 0 and signal != SIGABRT


def _crash_leads(run: RunState, cause: IncidentState, finding: Finding) -> Finding:
    """``cause`` relabelled as the lost rank's crash (``finding``'s kind, led by its rank): the peers'
    connection-closed reports become its consequence (comm/rank-lost on the reporting ranks)."""
    q = finding.rank
    reporters = sorted({ev.rank for ev in cause.record.evidence if ev.rank >= 0 and ev.rank != q})
    cause.extra["lead"] = q
    _note_consequence(cause, RANK_LOST, reporters)
    rank = run.ranks.get(q)
    if rank is not None and rank.exc_key == finding.key:
        rank.exc_key = cause.key
    said = (f"rank {q} exited by signal {_exit_signal(finding)} after its peers saw its connection close: "
            f"the lost rank crashed, the peers' reports are consequences")
    evidence = [*finding.evidence, Evidence(rule="correlation.crashed_peer", description=said,
                                            step=finding.step, time_ns=finding.time_ns, rank=q)]
    return Finding(finding.category, finding.subtype, cause.key, q, finding.step, finding.time_ns,
                   host=finding.host, seen_ns=finding.seen_ns, seen_step=finding.seen_step,
                   event_id=finding.event_id, evidence=evidence, timeline=finding.timeline,
                   values=finding.values, summary=finding.summary, relabel=True)


def _by_id(run: RunState, incident_id: str) -> Optional[IncidentState]:
    for st in run.incidents.values():
        if st.record.incident_id == incident_id:
            return st
    return None


def _note_consequence(cause: IncidentState, kind: Kind, ranks: List[int]) -> None:
    """Remember on ``cause`` that ``kind`` happened on ``ranks`` because of it; render the list."""
    table: Dict[str, List[int]] = cause.extra.setdefault("consequences", {})
    name = f"{kind[0]}/{kind[1]}"
    listed = table.setdefault(name, [])
    for r in ranks:
        if r >= 0 and r not in listed:
            listed.append(r)
    listed.sort()
    cause.record.consequences = [
        f"{k} on rank{'s' if len(v) > 1 else ''} {', '.join(str(r) for r in v[:16])}"
        + (" ..." if len(v) > 16 else "") for k, v in sorted(table.items())]


def _as_consequence(finding: Finding, cause: IncidentState) -> Finding:
    """``finding`` re-addressed to ``cause``: evidence and timeline say it is a consequence."""
    cause_name = f"{cause.record.category}/{cause.record.subtype}"
    how = f"a consequence of the {cause_name} that began"
    if cause.record.lead_rank >= 0:
        how += f" on rank {cause.record.lead_rank}"
    if cause.record.first_step >= 0:
        how += f" at step {cause.record.first_step}"
    evidence = [Evidence(rule=ev.rule, description=f"{ev.description} -- {how}", step=ev.step,
                         time_ns=ev.time_ns, rank=ev.rank, metric=ev.metric, threshold=ev.threshold,
                         value=ev.value, window=ev.window, event_id=ev.event_id) for ev in finding.evidence]
    timeline = [TimelineEntry(time_ns=t.time_ns, step=t.step, rank=t.rank, what=f"{t.what} ({how})")
                for t in finding.timeline]
    return Finding(cause.record.category, cause.record.subtype, cause.key, finding.rank, finding.step,
                   finding.time_ns, host=finding.host, seen_ns=finding.seen_ns, seen_step=finding.seen_step,
                   event_id=finding.event_id, evidence=evidence, timeline=timeline, counts=False,
                   replace_evidence=finding.replace_evidence)


def _skips_reported(run: RunState) -> bool:
    """Whether a rank of ``run`` reports the GradScaler's per-step overflow flag (``amp/overflow``)."""
    return any("amp/overflow" in rank.history for rank in run.ranks.values())


def route(run: RunState, finding: Finding, settings: DetectionSettings) -> Finding:
    """The finding to apply for ``finding`` (rule 1): itself, or its consequence form addressed to the
    incident that explains it. Keeps the reporting rank's ``exc_key`` pointing at the cause, so that its
    exit joins the cause too -- the rank the finding names and the rank whose stream printed it (a
    launcher's ``--local_rank=3 ... exits with return code = 1`` printed on rank 0's stream)."""
    kind = (finding.category, finding.subtype)
    cause: Optional[IncidentState] = None
    current = run.incidents.get(finding.key)
    if current is not None and current.record.explained_by:
        cause = _by_id(run, current.record.explained_by)
        kind = _kind(current)
    elif kind in EXITS_AFTER_FAILURE:
        cause = find_cause(run, finding.time_ns, exclude=finding.key, kinds=TERMINATION_CAUSES) or \
            _stall_of(run, finding.rank) or _scaler_gave_up_before(run, finding.time_ns)
        if cause is not None and kind == CRASH_EXIT and _lost_rank_crashed(cause, finding):
            return _crash_leads(run, cause, finding)
    elif kind == ("process", "killed") and current is None:
        cause = _stall_of(run, finding.rank)  # a hung rank SIGKILLed by a watchdog or the scheduler
    elif kind in CONSEQUENCES:
        cause = find_cause(run, finding.time_ns or finding.seen_ns, exclude=finding.key,
                           reporters=_reporters(finding.evidence),
                           reading=_evidence_confidence(finding.evidence)) or \
            _straggler_for(run, kind, finding.time_ns or finding.seen_ns)
    elif kind == STALLED and current is None:
        cause = _hang_incident(run, finding.time_ns)
    elif kind == ("process", "exception") and _NON_FINITE_TEXT.search(str(finding.values.get("detail", ""))):
        cause = find_cause(run, finding.time_ns, exclude=finding.key, kinds=NUMERIC)
    elif kind in AFTER_AMP_OVERFLOW and current is None and not _skips_reported(run):
        cause = find_cause(run, finding.time_ns or finding.seen_ns, exclude=finding.key,
                           kinds=(AMP_OVERFLOW,))
        if cause is not None and cause.record.severity == "info":
            cause = None  # an overflow notice (a scaler calibrating, amp_text_overflow_notice) is no collapse
    if cause is None or cause.key == finding.key:
        return finding
    _remember_killed(cause)
    if _kind(cause) == KILLED and cause.record.lead_rank >= 0:
        cause.extra.setdefault("lead", cause.extra["killed_rank"])  # the killed rank, not a consequence's
    for reporter in {finding.rank, *(ev.rank for ev in finding.evidence)}:
        # the stream that printed it too (a launcher's line naming another rank): its exit joins the cause
        rank = run.ranks.get(reporter)
        if rank is not None and rank.exc_key == finding.key:
            rank.exc_key = cause.key
    _killed_as_rank_lost(run, cause, kind, settings)
    _note_consequence(cause, kind, [finding.rank])
    return _as_consequence(finding, cause)


def explain(run: RunState, settings: DetectionSettings) -> List[IncidentState]:
    """Rule 1 after the fact: fold every open consequence incident whose cause began earlier into that
    cause, and resolve it as explained; rule 7: a memory exhaustion explains the communication failures
    and worker deaths around it. Returns the incidents changed (causes and consequences)."""
    changed: List[IncidentState] = []
    for st in list(run.incidents.values()):
        if st.record.explained_by:
            continue
        kind = _kind(st)
        cause: Optional[IncidentState] = None
        if kind == STALLED:
            cause = _ended_in(run, st, settings)
        elif not st.is_open:
            continue
        elif kind == ("process", "terminated"):
            cause = find_cause(run, st.record.first_ns, exclude=st.key, kinds=TERMINATION_CAUSES)
        elif kind in CONSEQUENCES:
            cause = find_cause(run, st.record.first_ns, exclude=st.key,
                               reporters=_reporters(st.record.evidence),
                               reading=_reading_confidence(st)) or \
                _straggler_for(run, kind, st.record.first_ns)
        elif kind in (CRASH_EXIT, EXCEPTION) and (exited := _launcher_exit_ranks(st)) is not None:
            cause = _own_error_after(run, st, exited)
            if cause is not None:
                cause.extra.setdefault("lead", cause.record.lead_rank)  # the erring rank, not the launcher's
                _fold_into(run, st, cause, settings)
                changed += [st, cause]
                continue
        elif kind == REGRESSION:
            cause = _straggler_slowing(run, st, settings)
        if cause is None and kind != STALLED:
            cause = _exhaustion_around(run, st, settings)
            if cause is not None and cause.record.lead_rank >= 0:
                cause.extra.setdefault("lead", cause.record.lead_rank)  # the exhausted rank leads
        why = ""
        if cause is None and kind != STALLED:
            cause = _named_same_moment(run, st)
            why = SAME_MOMENT_WHY
        if cause is None:
            continue
        _fold_into(run, st, cause, settings, why)
        if kind == STALLED:
            cause.extra["hang"] = True
        changed += [st, cause]
    return changed


SAME_MOMENT_WHY = "the same rank's more specific error at the same moment"


def _reading_confidence(st: IncidentState) -> Optional[float]:
    """How specific the error text of ``st`` is: the highest classifier confidence of its evidence
    (``value["confidence"]``: an exact PyTorch/NCCL/CUDA message with parsed fields ~0.9, a generic phrase
    ~0.5; 0 for an exception known by its type only). None when ``st`` is not made of a rank's own error
    text (and its exit) only -- a detector's or correlation's finding is never weighed this way."""
    return _evidence_confidence(st.record.evidence)


def _generic_same_moment(run: RunState, st: IncidentState, at_ns: int, reporters: FrozenSet[int],
                         reading: float) -> bool:
    """Rule 9 seen from the specific error (a finding that began at ``at_ns``, the own error text of
    ``reporters``, reading ``reading``): whether ``st`` is its generic report (:func:`_less_specific_at`)."""
    return _less_specific_at(run, st, at_ns, reporters, reading)


def _less_specific_at(run: RunState, generic: IncidentState, began: int, ranks: AbstractSet[int],
                      reading: float) -> bool:
    """Rule 9's one predicate (docs/correlation.md), used in both directions (:func:`_generic_same_moment`,
    :func:`_named_same_moment`): whether ``generic`` is the generic report of an error that began at
    ``began``, is the own error text of one of ``ranks`` and reads ``reading`` (its classifier confidence):
    ``generic`` began at that instant exactly, includes one of ``ranks`` (a first rank, or a rank whose text
    it is), is no numerical incident (a NaN, an explosion, the loss scaler's notice: observations, not a
    crash report), is made of error text only and reads strictly less specifically."""
    if not began or _began(run, generic) != began or _kind(generic) in NUMERIC or \
            _kind(generic) == AMP_OVERFLOW:
        return False
    if not any(r in generic.rank_first or r in _reporters(generic.record.evidence) for r in ranks):
        return False
    mine = _reading_confidence(generic)
    return mine is not None and mine < reading


def _evidence_confidence(evidence: Sequence[Evidence]) -> Optional[float]:
    """:func:`_reading_confidence` of a list of evidence."""
    best = 0.0
    for ev in evidence:
        if ev.rule.startswith(EXIT_RULES):
            continue  # how the reported error ended the process: no reading of its own
        if not ev.rule.startswith(REPORTED):
            return None
        value = ev.value if isinstance(ev.value, Mapping) else {}
        conf = value.get("confidence")
        if isinstance(conf, (int, float)) and not isinstance(conf, bool):
            best = max(best, float(conf))
    return best


def _named_same_moment(run: RunState, st: IncidentState) -> Optional[IncidentState]:
    """Rule 9 (docs/correlation.md): the open, unexplained incident that explains ``st`` because it is the
    same rank's more specific error at the same moment. A rank's generic report -- ``Fatal Python error:
    Aborted`` (out of memory *or* a CUDA error), a bare ``Exception:`` re-raised by ``mp.spawn``, the
    watchdog's ``Some NCCL operations have failed or timed out`` teardown, ``NCCL communicator was aborted``
    -- stamped with the same time as that rank's named error (an illegal memory access, the OOM, the
    ``Timeout at NCCL work``, an ``ncclRemoteError``) is what that error did to the process: log lines of one
    second, or unstamped lines that take their neighbour's stamp, cannot order them, and the earliest-signal
    rule is silent. ``st`` must be no numerical incident (a NaN, an explosion, the loss scaler's notice:
    observations, not a crash report); both must be made of error text only (:func:`_reading_confidence`);
    the other one must include ``st``'s lead rank and read strictly more specifically (higher classifier
    confidence); the most specific one wins (then the lower incident key, a deterministic order). None when
    there is none."""
    if _reading_confidence(st) is None or st.record.lead_rank < 0:
        return None
    best: Optional[IncidentState] = None
    best_conf = 0.0
    for other in run.incidents.values():
        if other is st or not other.is_open or other.record.explained_by:
            continue
        conf = _reading_confidence(other)
        lead = {st.record.lead_rank} & (set(other.rank_first) | _reporters(other.record.evidence))
        if conf is None or not _less_specific_at(run, st, _began(run, other), lead, conf):
            continue  # the other one must include st's lead rank and read more specifically
        if best is None or (-conf, other.key) < (-best_conf, best.key):
            best, best_conf = other, conf
    return best


def _exhausts_memory(st: IncidentState) -> bool:
    """Whether ``st`` is a memory exhaustion: a device OOM, or a process the OOM killer ended (the
    classifier's ``killer`` fact on its evidence)."""
    if _kind(st) == OOM:
        return True
    return _kind(st) == KILLED and any(
        isinstance(ev.value, dict) and isinstance(ev.value.get("facts"), dict)
        and ev.value["facts"].get("killer") == "oom-killer" for ev in st.record.evidence)


def _worker_died(st: IncidentState) -> bool:
    """Whether ``st`` is the main process's report that a DataLoader worker died."""
    return _kind(st) in WORKER_DEATHS and (
        bool(_WORKER_DIED.search(st.record.title))
        or any(_WORKER_DIED.search(ev.description) for ev in st.record.evidence[:4]))


def _exhaustion_around(run: RunState, st: IncidentState,
                       settings: DetectionSettings) -> Optional[IncidentState]:
    """Rule 7: the open memory exhaustion that explains ``st`` -- a communication failure, rank loss or
    DataLoader worker death (not itself a memory exhaustion) that began within ``oom_explains_s`` of it,
    before or after (the OOM killer's report comes after the kill it reports; pasted ranks' lines are in
    no time order) -- or the open CUDA device fault (:data:`DEVICE_FAULT`) that explains a communication
    failure or rank loss of other ranks that began up to ``device_fault_explains_s`` before it (one
    rank's illegal address beside its peers' watchdog timeouts, pasted rank after rank; a failure of the
    faulting rank alone, e.g. NCCL's own ``unhandled cuda error``, is not one). The earliest such; None when
    there is none."""
    if _exhausts_memory(st) or not (_kind(st) in OOM_EXPLAINS or _worker_died(st)):
        return None
    at = st.record.first_ns
    best: Optional[IncidentState] = None
    for other in run.incidents.values():
        if other is st or not other.is_open or other.record.explained_by:
            continue
        if _exhausts_memory(other):
            window = settings.oom_explains_s * 1e9
        elif _kind(other) == DEVICE_FAULT and _kind(st) in OOM_EXPLAINS and \
                set(st.rank_first) - set(other.rank_first):
            window = settings.device_fault_explains_s * 1e9  # a peer's report, not the rank's own error
        else:
            continue
        began = _began(run, other)
        after = at - began  # how long after the exhaustion ``st`` began (negative: before it)
        if not began or after < -window or (after > window and _kind(st) not in OOM_EXPLAINS):
            continue  # a communication failure any time after it is its consequence, as by rule 1
        if best is None or (began, other.key) < (_began(run, best), best.key):
            best = other
    return best


def _ended_in(run: RunState, stall: IncidentState, settings: DetectionSettings) -> Optional[IncidentState]:
    """The open communication failure a stall ended in: it began while the stall lasted, on a rank of
    the stall. A hang that ends in a collective timeout is one incident: the timeout's. The survivors of a
    lost rank stall waiting for it: a stall of other ranks that lasted past the lost rank's last event and
    began at most ``rank_lost_grace_s`` before it (a rank's last metrics can be lost with it, so its
    recorded last progress may be a few steps early) folds into the ``comm/rank-lost``."""
    s = stall.record
    end = s.resolved_ns if not stall.is_open else 2**63 - 1
    for st in run.incidents.values():
        if st is stall or not st.is_open or st.record.explained_by or _kind(st) not in COMM_FAILURES:
            continue
        began = st.record.first_ns
        if s.first_ns <= began <= end and set(st.rank_first) & set(stall.rank_first):
            return st
        lost = st.record.lead_rank
        if _kind(st) == ("comm", "rank-lost") and lost >= 0 and lost not in stall.rank_first and \
                began - settings.rank_lost_grace_s * 1e9 <= s.first_ns and end >= began:
            return st
    return None


def _straggler_for(run: RunState, kind: Kind, at_ns: int) -> Optional[IncidentState]:
    """The open ``perf/straggler`` incident named before ``at_ns`` that a ``kind`` (WAITED_ON) failure is
    the consequence of; None otherwise."""
    st = _open_straggler(run)
    if kind not in WAITED_ON or st is None or not st.record.first_ns or st.record.first_ns > at_ns:
        return None
    return st


def _open_straggler(run: RunState) -> Optional[IncidentState]:
    """The run's open ``perf/straggler`` incident that nothing explains; None when there is none."""
    st = run.incidents.get(STRAGGLER_KEY)
    if st is None or not st.is_open or st.record.explained_by or _kind(st) != STRAGGLER:
        return None
    return st


def _straggler_slowing(run: RunState, regression: IncidentState,
                       settings: DetectionSettings) -> Optional[IncidentState]:
    """The open ``perf/straggler`` that explains the open ``regression`` (:data:`REGRESSION`): it began no
    later than ``straggler_window`` steps after the regression did; None otherwise."""
    st = _open_straggler(run)
    if st is None:
        return None
    began, slowed = st.record.first_step, regression.record.first_step
    if began < 0 or slowed < 0 or began > slowed + settings.straggler_window:
        return None
    return st


def _scaler_gave_up_before(run: RunState, at_ns: int) -> Optional[IncidentState]:
    """The open, unexplained memory/amp-overflow incident whose evidence includes the loss scaler's own fatal
    error (:data:`SCALER_GAVE_UP_RULE`) at or before ``at_ns`` (the earliest such): what a rank's exit then
    follows from. None when there is none -- an overflow notice or a collapsing scale explains no exit."""
    best: Optional[IncidentState] = None
    best_at = 0
    for st in run.incidents.values():
        if _kind(st) != AMP_OVERFLOW or not st.is_open or st.record.explained_by:
            continue
        times = [ev.time_ns for ev in st.record.evidence
                 if isinstance(ev.value, Mapping) and ev.value.get("rule") == SCALER_GAVE_UP_RULE
                 and 0 < ev.time_ns <= at_ns]
        if times and (best is None or (min(times), st.key) < (best_at, best.key)):
            best, best_at = st, min(times)
    return best


def _stall_of(run: RunState, rank: int) -> Optional[IncidentState]:
    """The open stall ``rank`` is in: a hung process that is then terminated (by a person, the
    scheduler's time limit, a watchdog) was terminated *because* it hung."""
    for st in run.incidents.values():
        if _kind(st) == STALLED and st.is_open and not st.record.explained_by and rank in st.rank_first:
            return st
    return None


def _hang_incident(run: RunState, at_ns: int) -> Optional[IncidentState]:
    """The open communication failure that already absorbed a stall (a new stall episode of the same
    hang joins it instead of opening another incident)."""
    for st in run.incidents.values():
        if st.extra.get("hang") and st.is_open and not st.record.explained_by and st.record.first_ns <= at_ns:
            return st
    return None


def _fold_into(run: RunState, st: IncidentState, cause: IncidentState, settings: DetectionSettings,
               why: str = "") -> None:
    inc, target = st.record, cause.record
    _remember_killed(cause)
    name = f"{target.category}/{target.subtype}"
    for ev in inc.evidence:
        finding = Finding(inc.category, inc.subtype, st.key, ev.rank, ev.step, ev.time_ns, evidence=[ev])
        moved = _as_consequence(finding, cause)
        for e in moved.evidence:
            if len(target.evidence) < settings.max_evidence:
                target.evidence.append(e)
    for t in inc.timeline:
        add_timeline(target, TimelineEntry(time_ns=t.time_ns, step=t.step, rank=t.rank,
                                           what=f"{t.what} (a consequence of the {name})"), settings)
    for r, first in st.rank_first.items():
        if r not in cause.rank_first and len(cause.rank_first) < settings.max_incident_ranks:
            cause.rank_first[r] = first
            cause.changed()
    if st.rank_first:
        target.first_ns = min(target.first_ns, inc.first_ns) if target.first_ns else inc.first_ns
    if inc.first_step >= 0:
        target.first_step = inc.first_step if target.first_step < 0 else \
            min(target.first_step, inc.first_step)
    refresh_ranks(cause)
    for host in inc.hosts:
        if host not in target.hosts and len(target.hosts) < settings.max_incident_ranks:
            target.hosts.append(host)
    target.last_ns = max(target.last_ns, inc.last_ns)
    target.last_step = max(target.last_step, inc.last_step)
    _killed_as_rank_lost(run, cause, (inc.category, inc.subtype), settings)
    _note_consequence(cause, (inc.category, inc.subtype), sorted(st.rank_first))
    for rank in run.ranks.values():
        if rank.exc_key == st.key:
            rank.exc_key = cause.key
    inc.explained_by = target.incident_id
    resolve(st, inc.last_ns or inc.first_ns, inc.last_step, inc.lead_rank,
            f"explained by the {name} incident {target.incident_id} ({why or 'it began earlier'}"
            + (f", on rank {target.lead_rank}" if target.lead_rank >= 0 else "") + ")", settings)
    cause.dirty = True


def silence_grace_s(rank: RankState, settings: DetectionSettings) -> float:
    """How long ``rank`` may be silent before it counts as lost (rule 2)."""
    return max(settings.rank_lost_grace_s, HEARTBEAT_SLACK * rank.hb_interval_s)


_WAITS: FrozenSet[Kind] = frozenset(PEER_FAILURES) | frozenset(WAITED_ON)
"""The kinds :func:`check_lagging` (WAITED_ON) and :func:`check_silent_peers` (PEER_FAILURES) read."""


def waits_open(run: RunState) -> bool:
    """Whether :func:`check_lagging` or :func:`check_silent_peers` can find or note anything in ``run``
    now: both read (and write: notes, lost ranks) only open, unexplained incidents of the kinds in
    ``_WAITS`` and return no finding without one, whatever the time. False lets a caller skip both (a
    run with only, say, an open loss plateau calls them on every event); their time semantics are
    unchanged, as they are judged at every call while such an incident is open."""
    for st in run.incidents.values():
        inc = st.record
        if (inc.category, inc.subtype) in _WAITS and not inc.explained_by and st.is_open:
            return True
    return False


def check_silent_peers(run: RunState, now_ns: int, settings: DetectionSettings) -> List[Finding]:
    """Rule 2 at ``now_ns`` (an event time of the run, or the processor's clock): findings that turn
    an open peer failure into ``comm/rank-lost`` led by the rank(s) silent since before it began. Marks
    those ranks lost."""
    out: List[Finding] = []
    for st in list(run.incidents.values()):
        inc = st.record
        if not st.is_open or inc.explained_by or _kind(st) not in PEER_FAILURES or not inc.first_ns:
            continue
        began = inc.first_ns
        silent = [r for r in run.ranks.values()
                  if not r.exited and not r.lost_ns and r.rank not in st.rank_first and r.last_ns < began
                  and now_ns - began > silence_grace_s(r, settings) * 1e9]
        for i, r in enumerate(sorted(silent, key=lambda r: (r.last_ns, r.rank))):
            r.lost_ns = now_ns
            quiet = (now_ns - r.last_ns) / 1e9
            reporters = ", ".join(str(x) for x in sorted(st.rank_first)[:16])
            what = (f"rank {r.rank} went silent after step {r.max_step} and never exited; rank(s) "
                    f"{reporters} then failed in a collective")
            evidence = Evidence(
                rule="correlation.silent_peer",
                description=(f"rank {r.rank}: last event at step {r.max_step}, before its peers' "
                             f"{inc.category}/{inc.subtype} began; silent for {fmt_duration(quiet)} "
                             f"(threshold {fmt_duration(silence_grace_s(r, settings))} = "
                             f"max(rank_lost_grace_s, {HEARTBEAT_SLACK:g} x its heartbeat interval)) with no "
                             f"exit: killed without a word (SIGKILL: the OOM-killer, a preemption) or its "
                             f"node died"),
                step=r.max_step, time_ns=r.last_ns, rank=r.rank, metric="seconds_silent",
                threshold=silence_grace_s(r, settings), value=round(quiet, 3))
            timeline = [TimelineEntry(time_ns=r.last_ns, step=r.max_step, rank=r.rank,
                                      what=f"rank {r.rank}: last event (step {r.max_step}), then silence"),
                        TimelineEntry(time_ns=now_ns, step=r.max_step, rank=r.rank, what=what)]
            out.append(Finding(
                "comm", "rank-lost", st.key, r.rank, r.max_step, r.last_ns, host=r.host,
                evidence=[evidence], timeline=timeline, relabel=(i == 0), update_values=True, counts=False,
                values={"detail": f"rank {r.rank} lost at step {r.max_step}: its peers' collectives failed",
                        "rank": r.rank, "step": r.max_step},
                summary=(f"Rank {r.rank} stopped sending anything after step {r.max_step} and never "
                         f"exited; its peers' collectives then failed ({inc.title}). The peers' errors "
                         f"are consequences: find out why rank {r.rank} died (host `dmesg` for the "
                         f"OOM-killer, the scheduler's preemption log, the node's health).")))
    return out


# ----------------------------------------------------------------------------------------------------
# who leads: the lagging rank of a timeout, the rank whose loss went non-finite first

REPORTED = ("exception.", "log.")
"""Evidence rules of a rank that reported the failure itself (error text), as opposed to ranks folded in
by correlation or by their exit."""
EXIT_RULES = ("exit.",)
"""Evidence rules of a rank's exit (its code, and what ended it)."""


def check_lagging(run: RunState, now_ns: int, settings: DetectionSettings) -> List[Finding]:
    """Name the lagging rank(s) of an open ``comm/timeout`` / ``comm/failure`` (DESIGN §4): ranks that were
    alive (a heartbeat at least max(3 x step time, one heartbeat interval) after their last progress, and
    recent when the failure began) but made no progress since before it and never reported it. Judged
    once per incident, when nobody is left to report (every rank exited or reported) or
    ``rank_lost_grace_s`` after the failure began. The first such rank (earliest last progress) leads."""
    out: List[Finding] = []
    for st in run.incidents.values():
        inc = st.record
        if st.extra.get("lagging_done") or not st.is_open or inc.explained_by or \
                _kind(st) not in WAITED_ON:
            continue
        began = st.extra.setdefault("began", inc.first_ns)
        reporters = {ev.rank for ev in inc.evidence if ev.rule.startswith(REPORTED)}
        settled = all(r.exited or r.lost_ns or r.rank in reporters for r in run.ranks.values())
        if not settled and now_ns - began <= settings.rank_lost_grace_s * 1e9:
            continue
        st.extra["lagging_done"] = True
        step_time = run.step_time()
        lagging = []
        for r in run.ranks.values():
            if r.rank in reporters or (r.exited and r.exit_ns < began) or not r.progress_ns or \
                    r.progress_ns >= began:
                continue
            stuck = (r.last_hb_ns - r.progress_ns) / 1e9
            if stuck > max(3 * step_time, r.hb_interval_s) and \
                    began - r.last_hb_ns <= silence_grace_s(r, settings) * 1e9:
                lagging.append(r)
        if not lagging:
            continue
        lagging.sort(key=lambda r: (r.progress_ns, r.rank))
        names = ", ".join(str(r.rank) for r in lagging[:16])
        st.extra["lead"] = lagging[0].rank
        inc.summary += (f" Lagging rank(s): {names} -- alive (heartbeats) but without progress since before "
                        f"the failure and silent about it: they never reached the collective; start with "
                        f"them.")
        for r in lagging:
            stuck = (r.last_hb_ns - r.progress_ns) / 1e9
            evidence = Evidence(
                rule="correlation.lagging_rank",
                description=(f"rank {r.rank}: last progress at step {r.max_step}, still heartbeating "
                             f"{fmt_duration(stuck)} later, and no error of its own: it was not in the "
                             f"collective its peers failed in"),
                step=r.max_step, time_ns=r.progress_ns, rank=r.rank, metric="seconds_without_progress",
                value=round(stuck, 3))
            out.append(Finding(inc.category, inc.subtype, st.key, r.rank, r.max_step, r.progress_ns,
                               host=r.host, evidence=[evidence], counts=False, timeline=[TimelineEntry(
                                   time_ns=r.progress_ns, step=r.max_step, rank=r.rank,
                                   what=f"rank {r.rank}: last progress (step {r.max_step}); lagging")]))
    return out


def pin_numeric_lead(run: RunState, settings: DetectionSettings) -> List[IncidentState]:
    """Lead a multi-rank non-finite incident with the rank whose loss went non-finite at the earliest
    *step* (DESIGN §4: one rank's NaN that all ranks then share through the all-reduce points at that
    rank's data), when exactly one rank did; event times across hosts cannot order ranks within a step.
    Returns the incidents whose lead changed."""
    changed = []
    for st in run.incidents.values():
        if not st.is_open or _kind(st) not in NUMERIC or len(st.rank_first) < 2:
            continue
        firsts = {}
        for r in st.rank_first:
            rank = run.ranks.get(r)
            if rank is None:
                continue
            steps = [rank.first_nonfinite[n][0] for n in settings.loss_metrics if n in rank.first_nonfinite]
            if steps:
                firsts[r] = min(steps)
        if not firsts:
            continue
        earliest = min(firsts.values())
        leaders = sorted(r for r, s in firsts.items() if s == earliest)
        others = sorted(s for r, s in firsts.items() if s != earliest)
        lead = leaders[0] if len(leaders) == 1 and (others or len(firsts) < len(st.rank_first)) else None
        if lead == st.extra.get("lead"):
            continue
        if lead is None:
            st.extra.pop("lead", None)
        else:
            st.extra["lead"] = lead
            note = (f"rank {lead}'s loss went non-finite first, at step {earliest}"
                    + (f"; the other ranks' from step {others[0]}" if others else
                       "; the other ranks' losses stayed finite")
                    + f": the NaN started in rank {lead}'s batch and reached the others through the "
                      f"gradient all-reduce")
            rank = run.ranks[lead]
            rules = {ev.rule for ev in st.record.evidence}
            if len(st.record.evidence) < settings.max_evidence and \
                    "correlation.first_non_finite_rank" not in rules:
                st.record.evidence.append(Evidence(
                    rule="correlation.first_non_finite_rank", description=note, step=earliest,
                    time_ns=rank.first_nonfinite.get(settings.loss_metrics[0], (earliest, 0))[1], rank=lead))
        refresh_ranks(st)
        st.dirty = True
        changed.append(st)
    return changed


# ----------------------------------------------------------------------------------------------------
# ranks that time out in different collectives: a mismatch, not a straggler

WATCHDOG_RULE = "nccl.watchdog-timeout"
"""The classifier rule whose facts (``seq_num``, ``op_type``, ``numel_in``, ``pg_id``) say which collective
a rank's watchdog gave up on."""


@dataclass
class _Work:
    """The collective one rank's watchdog gave up on."""

    seq: int
    op: str
    numel: Optional[int]
    pg: Optional[int]
    step: int

    def text(self) -> str:
        size = f" ({self.numel:,} elements)" if self.numel is not None else ""
        return f"{self.op} #{self.seq}{size}"

    def as_dict(self) -> Dict[str, object]:
        return {"seq_num": self.seq, "op_type": self.op, "numel_in": self.numel, "pg_id": self.pg}


def _opt_int(value: object) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _timed_out_works(st: IncidentState) -> Dict[int, _Work]:
    """rank -> the collective its watchdog timed out in (the lowest sequence number it reported), with the
    process group filled in from any of the rank's reports of that same work that named it."""
    works: Dict[int, _Work] = {}
    for ev in st.record.evidence:
        value = ev.value
        if ev.rank < 0 or not isinstance(value, dict) or value.get("rule") != WATCHDOG_RULE:
            continue
        facts = value.get("facts")
        seq = _opt_int(facts.get("seq_num")) if isinstance(facts, dict) else None
        if not isinstance(facts, dict) or seq is None:
            continue
        work = _Work(seq, str(facts.get("op_type") or "collective"), _opt_int(facts.get("numel_in")),
                     _opt_int(facts.get("pg_id")), ev.step)
        seen = works.get(ev.rank)
        if seen is None or work.seq < seen.seq:
            works[ev.rank] = work
        elif work.seq == seen.seq and seen.pg is None:
            seen.pg = work.pg
    return works


def _disagree(a: _Work, b: _Work) -> bool:
    """Two ranks' stuck collectives of one process group that cannot be the same call."""
    if a.pg is not None and b.pg is not None and a.pg != b.pg:
        return False
    if a.seq != b.seq:
        return True
    return a.op != b.op or (a.numel is not None and b.numel is not None and a.numel != b.numel)


def check_desync(run: RunState, settings: DetectionSettings) -> List[Finding]:
    """An open ``comm/timeout`` whose ranks' watchdogs gave up on *different* collectives of one process
    group is a ``comm/mismatch`` (the ranks issued different collectives). Sequence numbers count a
    process group's collectives in issue order on every rank, so a rank cannot have completed #n while a
    peer is still stuck in #n unless their #n calls disagreed (sizes, operation): NCCL does not check that,
    it may even return a wrong result, and the ranks drift apart until a watchdog fires -- rank A stuck in
    #n+1 while rank B is stuck in #n (or both in #n with different operations or sizes). A straggler gives
    every reporting rank the same stuck collective, a dead rank too. Process groups are compared only when
    both reports name theirs or neither does (a line without a ``[PG ID ...]`` prefix is taken to be in the
    same group as the other rank's report without one)."""
    out: List[Finding] = []
    for st in run.incidents.values():
        if not st.is_open or st.record.explained_by or _kind(st) != ("comm", "timeout"):
            continue
        works = _timed_out_works(st)
        if len(works) < 2:
            continue
        ranks = sorted(works, key=lambda r: (works[r].seq, r))
        pair = next(((a, b) for i, a in enumerate(ranks) for b in ranks[i + 1:]
                     if _disagree(works[a], works[b])), None)
        if pair is None:
            continue
        a, b = pair
        wa, wb = works[a], works[b]
        group = f" of process group {wa.pg}" if wa.pg is not None else ""
        detail = f"Collective desync{group}: rank {a} timed out in {wa.text()}, rank {b} in {wb.text()}"
        listed = "; ".join(f"rank {r}: {w.text()}" for r, w in sorted(works.items())[:16])
        why = (f"the ranks' watchdogs gave up on different collectives ({listed}). Collectives are numbered "
               f"in issue order on every rank, so a rank that got past #{wa.seq} while another is stuck in "
               f"it means their #{wa.seq} calls disagreed" if wa.seq != wb.seq
               else f"the ranks' watchdogs gave up on collective #{wa.seq} with different operations or "
                    f"sizes ({listed})")
        st.extra["lead"] = a
        evidence = Evidence(rule="correlation.desync", description=why, step=wa.step,
                            time_ns=st.record.first_ns, rank=a,
                            value={"works": {str(r): w.as_dict() for r, w in sorted(works.items())[:16]}})
        out.append(Finding(
            "comm", "mismatch", st.key, a, -1, st.record.first_ns, evidence=[evidence], relabel=True,
            update_values=True, counts=False, values={"detail": detail},
            timeline=[TimelineEntry(time_ns=st.record.first_ns, step=-1, rank=a, what=detail)],
            summary=(f"{detail}. This is a mismatch, not a slow rank: {why}. NCCL does not compare what the "
                     f"ranks pass (a size mismatch can even complete with wrong values before the ranks "
                     f"drift apart); find the collective whose shape, dtype, operation or call order "
                     f"depends on the rank (a rank-dependent `if`, an uneven last batch) -- "
                     f"TORCH_DISTRIBUTED_DEBUG=DETAIL makes torch raise at the first mismatched call, and "
                     f"the flight recorder dump (TORCH_FR_BUFFER_SIZE) lists each rank's collectives.")))
    return out
