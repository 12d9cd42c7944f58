"""Summarise one run's captured events (a ``file://`` endpoint's JSON lines) for a person."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional


@dataclass
class RunReport:
    kind: str
    exit_code: int
    events: int = 0
    last_step: int = -1
    last_loss: Optional[Any] = None
    alerts: List[str] = field(default_factory=list)
    exception: Optional[Dict[str, Any]] = None
    reported_exit: Optional[Dict[str, Any]] = None
    finding: str = ""

    def render(self) -> str:
        lines = [f"== {self.kind}: exit code {self.exit_code}, {self.events} events, "
                 f"last step {self.last_step}"]
        if self.finding:
            lines.append(f"   finding: {self.finding}")
        else:
            lines.append(f"   healthy: last loss {self.last_loss}")
        if self.reported_exit:
            lines.append(f"   exit reported by the SDK: code {self.reported_exit.get('exit_code')} "
                         f"({self.reported_exit.get('reason')})")
        return "\n".join(lines) + "\n"


def summarise(kind: str, path: Path, exit_code: int, stderr: str) -> RunReport:
    """Read the events of one run and name what went wrong, if anything."""
    report = RunReport(kind=kind, exit_code=exit_code)
    if not path.exists():
        report.finding = f"no events captured (stderr: {stderr.strip()[-200:]})"
        return report
    with path.open(encoding="utf-8") as fh:
        events = [json.loads(line) for line in fh if line.strip()]
    report.events = len(events)
    for event in events:
        metrics = event.get("metrics")
        if metrics:
            report.last_step = max(report.last_step, int(event.get("step", -1)))
            for point in metrics.get("points", []):
                if point["name"] == "loss":
                    report.last_loss = point["value"]
            if metrics.get("alert"):
                recent = [p["value"] for p in metrics.get("recent", []) if p["name"] == "loss"][-5:]
                report.alerts.append(f"{metrics['alert']} at step {event['step']} (loss before: {recent})")
        if "exception" in event and report.exception is None:
            report.exception = event["exception"]
        lifecycle = event.get("lifecycle")
        if lifecycle and lifecycle.get("phase") == "EXIT":
            report.reported_exit = lifecycle
    if report.exception is not None:
        exc = report.exception
        frames = [f for f in exc.get("frames", []) if f.get("in_app")] or exc.get("frames", [])
        where = f"{frames[-1]['module']}.{frames[-1]['function']}" if frames else "?"
        report.finding = (f"crash {exc['type']}: {exc['message'][:120]} in {where} "
                          f"[fingerprint {exc.get('fingerprint', '?')[:12]}]")
    elif report.alerts:
        report.finding = report.alerts[0]
    return report
