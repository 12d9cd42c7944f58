"""What reaches the server of a training killed right after its NaN: the figures of docs/reliability.md.

    python -m tests.sdk.hard_death_figures [--sdk-src DIR] [--runs N]

For each way to die (SIGKILL, ``os.abort()``, a C++ ``std::terminate``) it runs tests/sdk/hard_death_job.py
``N`` times against a fresh ``trainguard serve`` (400 steps, loss logged every step, NaN at step 300,
``flush_interval`` 2 s), then the next SDK process on the host, and counts what the server holds of the
killed run: the NaN alert, the reported exception, faulthandler's dump, the START event and the loss
points (301 logged: steps 0-299 and the NaN). ``--sdk-src`` runs an SDK from elsewhere (the code before a
change, e.g. ``git archive <commit> sdk/src | tar -x -C /tmp/old``) for both processes. Not a test: it
prints figures.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Dict, List

from tests.sdk.test_hard_death import (
    NAN_AT,
    REPO,
    exceptions,
    job_env,
    nan_alerts,
    next_process,
    run_events,
    run_job,
)
from tests.services.e2e.serve_process import ServeProcess

HOWS = ("sigkill", "abort", "terminate")


def measure(server: ServeProcess, how: str, spool: Path, sdk_src: Path) -> Dict[str, int]:
    run_id = f"figures-{how}-{uuid.uuid4().hex[:6]}"
    env = job_env(server.http_url, server.tokens["ingest"], run_id, spool)
    env["PYTHONPATH"] = f"{sdk_src}:{REPO}"
    run_job(env, "train", how, "--nan-at", str(NAN_AT))
    next_process(env)
    events = run_events(server, run_id)
    summary = {m["name"]: m for m in server.get(f"/api/v1/runs/{run_id}/metrics/summary")} if events else {}
    return {"nan_alert": len(nan_alerts(events)), "exception": len(exceptions(events, "FloatingPointError")),
            "fault_dump": len(exceptions(events, "Fatal Python error")),
            "start": sum(1 for e in events if e["kind"] == "lifecycle"),
            "loss_points": int(summary["loss"]["count"]) if "loss" in summary else 0}


def main(argv: List[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sdk-src", type=Path, default=REPO / "sdk" / "src")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        server = ServeProcess(Path(tmp) / "data").start()
        try:
            for how in HOWS:
                rows = [measure(server, how, Path(tmp) / f"spool-{how}-{i}", args.sdk_src)
                        for i in range(args.runs)]
                totals = {key: sum(r[key] for r in rows) for key in rows[0]}
                points = sorted(r["loss_points"] for r in rows)
                print(f"{how:10s} runs {args.runs}: NaN alert {totals['nan_alert']}/{args.runs}, exception "
                      f"{totals['exception']}/{args.runs}, faulthandler dump {totals['fault_dump']}/{args.runs}, "
                      f"START {totals['start']}/{args.runs}, loss points of 301 (min/median/max) "
                      f"{points[0]}/{points[len(points) // 2]}/{points[-1]}", flush=True)
        finally:
            server.stop()


if __name__ == "__main__":
    main(sys.argv[1:])
