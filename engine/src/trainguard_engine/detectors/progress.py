"""No progress: stalled runs (alive, no step) and lost runs (silent, never exited).

**Stalled** (``progress/stalled``), on every heartbeat of a rank that has not exited: the rank is stalled
when ``heartbeat time - last progress`` exceeds
:meth:`~trainguard_engine.catalogue.DetectionSettings.stall_threshold_s` of the run's step time (its
slowest rank's; the SDK's own measurement when it sends one). "Last progress" is the later of the event
time at which the rank's step last advanced and the SDK's ``last_step_time_unix_nano``; before any
progress, the rank's start. Only heartbeats can say a rank is alive, so only heartbeats open a stall, and
only event times are used: deterministic. All stalled ranks of a run share one incident per episode (slot
``stall:<n>``); it begins when the lead rank stopped (``first_ns``) at its last step (``first_step``: the
last step that completed; the rank is stuck in the one after). Each heartbeat refreshes the rank's
evidence (how long, against which threshold). A rank leaves the stall when it progresses again or exits;
the incident resolves when no rank is left -- unless a rank left it by a non-zero exit or a signal (a hung
job killed by a person, a time limit or a watchdog): then the hang is why the run failed and the incident
stays open, with the termination as evidence (see :mod:`trainguard_engine.correlate`).

**Lost** (``progress/lost``), from :func:`check_lost`, which the pipeline's ``advance(now_ns)`` calls
with the processor's clock: a run that has not ended (some rank never sent an EXIT) and sent no event at
all for longer than ``lost_after_s``. One incident per episode (slot ``lost:<n>``) listing the ranks that
never exited, led by the one silent longest; it resolves when an event newer than the silence arrives.
"""

from __future__ import annotations

import re
from typing import AbstractSet, List, Optional, Tuple

from ..catalogue import DetectionSettings
from ..extract import as_str
from ..incidents import Finding, add_timeline, resolve
from ..records import Evidence, TimelineEntry
from ..state import RankState, RunState
from . import fmt_duration
from .base import Detector, EventInfo

STALL_PREFIX = "stall:"
LOST_PREFIX = "lost:"


def _stall_slot(run: RunState, rank: RankState) -> Tuple[str, bool]:
    """(the key of the run's open stall incident, or of the next episode's; whether ``rank`` is not in it
    yet, i.e. joining it counts as a new report)."""
    current = run.open_incident(STALL_PREFIX)
    if current is None:
        return f"{STALL_PREFIX}{run.episodes.get('stall', 0) + 1}", True
    return current.key, str(rank.rank) not in current.extra.get("stalled", {})


def on_heartbeat(run: RunState, rank: RankState, time_ns: int, event_id: str,
                 settings: DetectionSettings) -> Optional[Finding]:
    """A stall finding when ``rank`` (its heartbeat already observed) has made no progress for too long."""
    if rank.exited:
        return None
    since = rank.progress_ns or rank.started_ns or rank.first_ns
    stalled_for = (time_ns - since) / 1e9
    step_time = run.step_time()
    threshold = settings.stall_threshold_s(step_time)
    if stalled_for <= threshold:
        return None
    key, joins = _stall_slot(run, rank)
    step = rank.max_step
    how = (f"clamp({settings.stall_factor:g} x step time {step_time:.3g} s, {settings.stall_min_s:g} s, "
           f"{settings.stall_max_s:g} s)" if step_time > 0 else "stall_max_s: step time unknown")
    evidence = Evidence(
        rule="progress.stalled",
        description=(f"rank {rank.rank}: heartbeats arrive but no progress since step {step} for "
                     f"{fmt_duration(stalled_for)}; threshold {fmt_duration(threshold)} = {how}"),
        step=step, time_ns=time_ns, rank=rank.rank, metric="seconds_without_progress",
        threshold=threshold, value=round(stalled_for, 3),
        window=[{"step": step, "value": round(stalled_for, 3)}], event_id=event_id)
    timeline = [TimelineEntry(time_ns=since, step=step, rank=rank.rank,
                              what=f"rank {rank.rank}: last progress (step {step})"),
                TimelineEntry(time_ns=time_ns, step=step, rank=rank.rank,
                              what=f"rank {rank.rank}: no progress for {fmt_duration(stalled_for)} "
                                   f"(threshold {fmt_duration(threshold)}): stalled")] if joins else []
    return Finding(
        "progress", "stalled", key, rank.rank, step, since, seen_ns=time_ns, host=rank.host,
        event_id=event_id, evidence=[evidence], timeline=timeline,
        values={"stalled_for": fmt_duration(stalled_for), "step": step, "rank": rank.rank},
        summary=(f"Rank {rank.rank} is alive (heartbeats arrive) but has made no progress since step {step}, "
                 f"for longer than {fmt_duration(threshold)} ({how}): a communication hang, a deadlock or "
                 f"a blocked data pipeline."),
        counts=joins, replace_evidence=True, update_values=True)


def on_exit(run: RunState, rank: RankState, time_ns: int, event_id: str,
            settings: DetectionSettings) -> Optional[Finding]:
    """A stall seen only at the end: ``rank`` exited non-zero or by a signal after going without progress
    for longer than the stall threshold, and no heartbeat had shown it (heartbeats off, too sparse, or a
    run imported by ``trainguard replay``, which has none). The hang is why it was killed: the stall opens
    (or the rank joins the open one) from its last progress, with the exit as what showed it. Call before
    the rank is marked as having left the stall (``on_progress``)."""
    if not (rank.exit_code != 0 or rank.exit_signal != 0):
        return None
    current = run.open_incident(STALL_PREFIX)
    if current is not None and str(rank.rank) in current.extra.get("stalled", {}):
        return None
    since = rank.progress_ns or rank.started_ns or rank.first_ns
    stalled_for = (time_ns - since) / 1e9
    threshold = settings.stall_threshold_s(run.step_time())
    if not since or stalled_for <= threshold:
        return None
    key, _joins = _stall_slot(run, rank)
    step = rank.max_step
    evidence = Evidence(
        rule="progress.stalled_until_exit",
        description=(f"rank {rank.rank}: no progress after step {step} for {fmt_duration(stalled_for)} "
                     f"(threshold {fmt_duration(threshold)}), then it exited with code {rank.exit_code}"
                     + (f" (signal {rank.exit_signal})" if rank.exit_signal else "")
                     + ": it was hung when it was stopped"),
        step=step, time_ns=time_ns, rank=rank.rank, metric="seconds_without_progress", threshold=threshold,
        value=round(stalled_for, 3), window=[{"step": step, "value": round(stalled_for, 3)}],
        event_id=event_id)
    timeline = [TimelineEntry(time_ns=since, step=step, rank=rank.rank,
                              what=f"rank {rank.rank}: last progress (step {step})")]
    return Finding(
        "progress", "stalled", key, rank.rank, step, since, seen_ns=time_ns, host=rank.host,
        event_id=event_id, evidence=[evidence], timeline=timeline,
        values={"stalled_for": fmt_duration(stalled_for), "step": step, "rank": rank.rank},
        summary=(f"Rank {rank.rank} made no progress after step {step} for {fmt_duration(stalled_for)} "
                 f"(longer than {fmt_duration(threshold)}) and was then stopped: it was hung -- a "
                 f"communication hang, a deadlock or a blocked data pipeline. No heartbeat showed the stall "
                 f"while it lasted (heartbeats off or a replayed run)."),
        update_values=True)


ALIVE_HEARTBEATS = 2.5
"""A rank counts as alive (for the processing-time stall check) while its last heartbeat is less than this
many of its own heartbeat intervals old."""


def stall_deadline_ns(run: RunState, rank: RankState, settings: DetectionSettings) -> int:
    """When ``rank`` becomes stalled if it makes no progress (0: not applicable -- exited, lost, already
    in the open stall, or fewer than two heartbeats seen, so its liveness cannot be judged)."""
    if rank.exited or rank.lost_ns or rank.hb_interval_s <= 0:
        return 0
    current = run.open_incident(STALL_PREFIX)
    if current is not None and str(rank.rank) in current.extra.get("stalled", {}):
        return 0
    since = rank.progress_ns or rank.started_ns or rank.first_ns
    if not since:
        return 0
    return since + int(settings.stall_threshold_s(run.step_time()) * 1e9) + 1


def check_stalled(run: RunState, now_ns: int, settings: DetectionSettings) -> List[Tuple[RankState, Finding]]:
    """The stall check of :func:`on_heartbeat` at ``now_ns`` (the processor's clock), for ranks whose
    deadline passed while they are alive (last heartbeat within ALIVE_HEARTBEATS of their interval): a
    runtime that calls ``Pipeline.advance`` at ``Pipeline.next_timer_ns`` flags a hang at the threshold
    itself, not at the first heartbeat after it."""
    out = []
    for rank in run.ranks.values():
        deadline = stall_deadline_ns(run, rank, settings)
        if not deadline or now_ns < deadline:
            continue
        if now_ns - rank.last_hb_ns > ALIVE_HEARTBEATS * rank.hb_interval_s * 1e9:
            continue  # silent: not known to be alive (lost-run and lost-rank rules handle silence)
        finding = on_heartbeat(run, rank, now_ns, "", settings)
        if finding is not None:
            out.append((rank, finding))
    return out


def joined_stall(run: RunState, rank: RankState, key: str) -> None:
    """Remember that ``rank`` is in the stall incident ``key``, as of its current progress."""
    st = run.incidents[key]
    st.extra.setdefault("stalled", {})[str(rank.rank)] = rank.progress_ns or rank.started_ns or rank.first_ns
    run.episodes["stall"] = max(run.episodes.get("stall", 0), int(key[len(STALL_PREFIX):]))


def on_progress(run: RunState, rank: RankState, time_ns: int, settings: DetectionSettings) -> None:
    """``rank`` progressed or exited: it leaves an open stall, which resolves when no rank is left."""
    current = run.open_incident(STALL_PREFIX)
    if current is None:
        return
    stalled = current.extra.get("stalled", {})
    since = stalled.get(str(rank.rank))
    if since is None or (not rank.exited and rank.progress_ns <= since):
        return
    del stalled[str(rank.rank)]
    killed = rank.exited and (rank.exit_code != 0 or rank.exit_signal != 0)
    what = (f"rank {rank.rank} exited (code {rank.exit_code})" if rank.exited
            else f"rank {rank.rank} progressed again (step {rank.max_step})")
    if killed:  # ended by a failure or a signal while stalled: the hang is why the run failed
        current.extra["killed"] = True
        what += " while stalled"
    if stalled or current.extra.get("killed"):
        add_timeline(current.record, TimelineEntry(time_ns=time_ns, step=rank.max_step, rank=rank.rank,
                                                   what=what), settings)
        current.dirty = True
    else:
        resolve(current, time_ns, rank.max_step, rank.rank, what + "; no rank is stalled any more", settings)


def check_lost(run: RunState, now_ns: int, settings: DetectionSettings) -> List[Finding]:
    """Lost findings when ``run`` has not ended and has been silent for longer than lost_after_s.

    Runs imported by ``trainguard replay`` (tag ``replay=true``) are never lost: their events are old by
    nature, and silence after the import is the end of the file, not of the job."""
    if run.lost or not run.ranks or run.ended() or run.tags.get("replay") == "true":
        return []
    silent = (now_ns - run.last_event_ns) / 1e9
    if silent <= settings.lost_after_s:
        return []
    key = f"{LOST_PREFIX}{run.episodes.get('lost', 0) + 1}"
    alive = sorted((r for r in run.ranks.values() if not r.exited and not r.lost_ns),
                   key=lambda r: (r.last_ns, r.rank))
    if any(r.lost_ns for r in run.ranks.values()) and not alive:
        return []  # the silent ranks are named by their comm/rank-lost incident already
    if alive:
        names = ", ".join(str(r.rank) for r in alive[:16]) + (" ..." if len(alive) > 16 else "")
        missing = f"no exit from rank(s) {names}"
    else:  # every rank seen exited, but fewer than world_size ever reported
        alive = sorted(run.ranks.values(), key=lambda r: (r.last_ns, r.rank))
        missing = f"only {len(run.ranks)} of {run.world_size} ranks ever reported"
    findings = []
    for i, r in enumerate(alive):
        timeline = [TimelineEntry(time_ns=r.last_ns, step=r.max_step, rank=r.rank,
                                  what=f"rank {r.rank}: last event (step {r.max_step})")]
        evidence = []
        if i == 0:
            evidence.append(Evidence(
                rule="progress.lost",
                description=(f"no event from the run for {fmt_duration(silent)} (threshold "
                             f"{fmt_duration(settings.lost_after_s)}) and {missing}"),
                step=run.last_step(), time_ns=now_ns, rank=r.rank, metric="seconds_silent",
                threshold=settings.lost_after_s, value=round(silent, 3)))
            timeline.append(TimelineEntry(time_ns=now_ns, step=run.last_step(), rank=r.rank,
                                          what=f"no event for {fmt_duration(silent)}: lost"))
        findings.append(Finding(
            "progress", "lost", key, r.rank, r.max_step, r.last_ns, seen_ns=now_ns, host=r.host,
            evidence=evidence, timeline=timeline, counts=i == 0,
            values={"silent_for": fmt_duration(settings.lost_after_s), "step": run.last_step()},
            summary=(f"No event from this run for {fmt_duration(silent)} and {missing}: the process or its "
                     f"node died without a word (SIGKILL by the OOM-killer or a preemption sends nothing), "
                     f"or the network path to TrainGuard is broken.")))
    return findings


def on_alive(run: RunState, rank: RankState, time_ns: int, settings: DetectionSettings) -> None:
    """An event newer than the silence arrived: a lost run is back."""
    if not run.lost or time_ns <= run.lost_since_ns:
        return
    run.lost = False
    current = run.open_incident(LOST_PREFIX)
    if current is not None:
        resolve(current, time_ns, rank.max_step, rank.rank,
                f"rank {rank.rank} is sending events again (step {rank.max_step})", settings)


# --------------------------------------------------------------------------- the sidecar agent's reports

HANG_SOURCE = "agent:hang"
"""``LogRecord.source`` of the agent's hang report (``trainguard agent``: no step and no output)."""
PROGRESS_SOURCE = "agent:progress"
"""``LogRecord.source`` of the agent's note that a reported hang ended (progress again)."""
_HANG_RE = re.compile(r"^trainguard agent: no progress for (?P<quiet>[\d.]+) s "
                      r"\(threshold (?P<threshold>[\d.]+) "
                      r"s = (?P<how>[^\n]*)\); last step (?P<step>-?\d+)")
_STACKS_HEADER = "Python stacks ("
STACK_EXCERPT_LINES = 8


def hang_headline(quiet_s: float, threshold_s: float, how: str, last_step: int) -> str:
    """The first line of a hang report (what :func:`on_agent_report` parses)."""
    return (f"trainguard agent: no progress for {quiet_s:.1f} s (threshold {threshold_s:.1f} s = {how}); "
            f"last step {last_step}")


def _stack_excerpt(message: str) -> str:
    at = message.find(_STACKS_HEADER)
    if at < 0:
        return ""
    lines = [ln.strip() for ln in message[at:].splitlines()[1:] if ln.strip()]
    return " | ".join(lines[:STACK_EXCERPT_LINES])[:600]


def on_agent_report(run: RunState, rank: RankState, source: str, message: str, time_ns: int, event_id: str,
                    settings: DetectionSettings) -> Optional[Finding]:
    """The agent's hang report (``source == HANG_SOURCE``) as a stall finding of ``rank`` -- the agent sees
    jobs without an SDK and the output of jobs whose SDK still heartbeats, and it attaches the process's
    Python stacks; a report of the end of the hang (``PROGRESS_SOURCE``) counts as progress. None for
    anything else (or a report that does not parse)."""
    if source == PROGRESS_SOURCE:
        if time_ns > rank.progress_ns:
            rank.progress_ns = time_ns
        on_progress(run, rank, time_ns, settings)
        return None
    if source != HANG_SOURCE or rank.exited:
        return None
    match = _HANG_RE.match(message)
    if match is None:
        return None
    quiet, threshold = float(match.group("quiet")), float(match.group("threshold"))
    step = max(int(match.group("step")), rank.max_step)
    since = time_ns - int(quiet * 1e9)
    key, joins = _stall_slot(run, rank)
    stacks = _stack_excerpt(message)
    description = (f"rank {rank.rank}: the agent saw no step and no output for {fmt_duration(quiet)}; "
                   f"threshold {fmt_duration(threshold)} = {match.group('how')}"
                   + (f"; stacks: {stacks}" if stacks else ""))
    evidence = Evidence(rule="agent.hang", description=description, step=step, time_ns=time_ns,
                        rank=rank.rank,
                        metric="seconds_without_progress", threshold=threshold, value=round(quiet, 3),
                        event_id=event_id)
    timeline = [TimelineEntry(time_ns=since, step=step, rank=rank.rank,
                              what=f"rank {rank.rank}: last step or output line"),
                TimelineEntry(time_ns=time_ns, step=step, rank=rank.rank,
                              what=f"agent: no progress for {fmt_duration(quiet)} (threshold "
                                   f"{fmt_duration(threshold)}): hung")] if joins else []
    return Finding(
        "progress", "stalled", key, rank.rank, step, since, seen_ns=time_ns, host=rank.host,
        event_id=event_id,
        evidence=[evidence], timeline=timeline,
        values={"stalled_for": fmt_duration(quiet), "step": step, "rank": rank.rank},
        summary=(f"Rank {rank.rank}'s process is alive but has printed nothing and advanced no step for "
                 f"{fmt_duration(quiet)} (the agent's threshold {fmt_duration(threshold)}): a communication "
                 f"hang, a deadlock or a blocked data pipeline. The report carries the last output lines and "
                 f"the process's Python stacks."),
        counts=joins, update_values=True)


class Progress(Detector):
    """Stalls (alive but no progress) from heartbeats, the agent's hang reports and exits; lost runs are
    the pipeline's timers (:func:`check_lost`, :func:`check_stalled`)."""

    name = "progress"
    kinds: Tuple[str, ...] = ("progress/stalled", "progress/lost")
    section = "progress"
    names_only = True

    def wants(self, rank: RankState, names: AbstractSet[str], settings: DetectionSettings) -> bool:
        return False  # metric batches are progress (RankState.observe_step), not findings

    def on_heartbeat(self, run: RunState, rank: RankState, event: EventInfo,
                     settings: DetectionSettings) -> List[Finding]:
        found = on_heartbeat(run, rank, event.time_ns, event.event_id, settings)
        return [found] if found is not None else []

    def on_log(self, run: RunState, rank: RankState, event: EventInfo,
               settings: DetectionSettings) -> List[Finding]:
        source = as_str(event.body.get("source"))
        if not source.startswith("agent:"):  # the job's own text: the process detector's
            return []
        found = on_agent_report(run, rank, source, as_str(event.body.get("message")), event.time_ns,
                                event.event_id, settings)
        return [found] if found is not None else []

    def on_exit(self, run: RunState, rank: RankState, event: EventInfo,
                settings: DetectionSettings) -> List[Finding]:
        found = on_exit(run, rank, event.time_ns, event.event_id, settings)
        return [found] if found is not None else []
