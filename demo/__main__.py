"""Run the demo trainings with the SDK writing to local files, then show what it captured.

This is the embedded, server-less path: ``file://`` endpoints under ``.data/demo``. The backend
(``trainguard serve``) that classifies runs into incidents is built on top of these same events.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from demo.report import RunReport, summarise
from demo.trainings import KINDS as ALL_KINDS

KINDS = tuple(k for k in ALL_KINDS if k != "stalling")  # the server-less demo cannot see a stall


def main() -> int:
    root = Path(os.environ.get("TRAINGUARD_DEMO_DIR", ".data/demo")).resolve()
    root.mkdir(parents=True, exist_ok=True)
    procs = {}
    started = time.monotonic()
    print(f"TrainGuard demo: {len(KINDS)} real PyTorch trainings, SDK events under {root}\n")
    for kind in KINDS:
        out = root / f"{kind}.jsonl"
        out.unlink(missing_ok=True)
        env = dict(os.environ, TRAINGUARD_ENDPOINT=f"file://{out}", TRAINGUARD_SPOOL_DIR=str(root / "spool"))
        procs[kind] = (subprocess.Popen([sys.executable, "-m", "demo.trainings", kind], env=env,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True), out)
    reports: list[RunReport] = []
    for kind, (proc, out) in procs.items():
        _, stderr = proc.communicate(timeout=600)
        reports.append(summarise(kind, out, proc.returncode, stderr))
    for report in reports:
        print(report.render())
    print(f"done in {time.monotonic() - started:.1f}s; raw events: {root}/*.jsonl")
    healthy_ok = reports[0].exit_code == 0 and not reports[0].alerts
    return 0 if healthy_ok and all(r.finding for r in reports[1:]) else 1


if __name__ == "__main__":
    sys.exit(main())
