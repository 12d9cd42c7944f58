"""Runs the worker pool leaves out of detection (hR's F8, hR2's G1 of stop 46).

A run whose records end the pipeline worker that runs them -- every time, alone, after a fresh rebuild
(:meth:`~.pool.PipelinePool.process_runs`) -- is marked here by ``(project, run id)`` (run ids repeat across
projects: the queue key alone would leave out another tenant's run). Its later records are stored and
committed but not given to detection while the mark holds. The mark is shown (``/readyz`` problem naming the
project and run, ``/metrics`` counter and gauge) and expires: at the first successful checkpoint at least
``hold_s`` after it was set, so the run is tried again (a transient cause -- memory pressure -- does not
silence it for the process's life; a real poison is found again, after :data:`~.pool.ISOLATE_AFTER` failed
chunks)."""

from __future__ import annotations

import logging
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

log = logging.getLogger("trainguard.processor")

RunId = Tuple[str, str]
"""(project, run id)."""
HOLD_S = 60.0
"""How long a run stays left out at least before the next successful checkpoint tries it again."""
WHY = "its records ended the pipeline worker that ran them, alone, after a fresh rebuild, every time"


def project_of(envelopes: Sequence[Any]) -> str:
    """The project of a queue record's decoded ``envelopes`` (one request: one project), "" when none."""
    for env in envelopes:
        project = getattr(env, "project", None) if not isinstance(env, Mapping) else env.get("project")
        if project is not None:
            return str(project)
    return ""


class LeftOutRuns:
    """The runs left out of detection now (run -> when marked, time.monotonic()), and how many were, ever."""

    def __init__(self, hold_s: float = HOLD_S) -> None:
        self.hold_s = max(0.0, float(hold_s))
        self.runs: Dict[RunId, float] = {}
        self.total = 0  # marks set since the start (/metrics counter)

    def __contains__(self, run: object) -> bool:
        return run in self.runs

    def __bool__(self) -> bool:
        return bool(self.runs)

    def __iter__(self) -> Any:
        return iter(self.runs)

    def mark(self, run: RunId, failed_chunks: int) -> None:
        """Leave ``run`` out from now (logged)."""
        self.runs[run] = time.monotonic()
        self.total += 1
        log.error("run %r of project %r left out of detection: %s (%d chunks failed in a row before); its "
                  "records are stored but not detected on until the first successful checkpoint %.0f s from "
                  "now tries it again; every other run goes on", run[1], run[0], WHY, failed_chunks,
                  self.hold_s)

    def expire(self, now: Optional[float] = None) -> List[RunId]:
        """After a successful checkpoint: the marks held ``hold_s`` or longer are lifted (returned)."""
        now = time.monotonic() if now is None else now
        done = [run for run, since in self.runs.items() if now - since >= self.hold_s]
        for run in done:
            del self.runs[run]
            log.warning("run %r of project %r: given to detection again (left out for %.0f s)",
                        run[1], run[0], self.hold_s)
        return done

    def by_project(self) -> Dict[str, int]:
        """Runs left out now, per project (/metrics gauge)."""
        out: Dict[str, int] = {}
        for project, _ in self.runs:
            out[project] = out.get(project, 0) + 1
        return out

    def problems(self) -> List[str]:
        """One line per run left out now (/readyz shows them as notes, /metrics counts them)."""
        return [f"run {run!r} of project {project!r} left out of detection ({WHY}): its records are stored, "
                f"not detected on; tried again at the first checkpoint after {self.hold_s:.0f} s"
                for project, run in sorted(self.runs)]
