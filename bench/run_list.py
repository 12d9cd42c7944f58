#!/usr/bin/env python3
"""A page of runs as the API answers it (``GET /api/v1/runs``), in process, this checkout beside a baseline.

What the route does with the store, minus HTTP: ``list_runs(limit=200)`` on a SQLite incident store, then
``api.resolutions.runs`` (each run with open incidents recounted from its incidents and what people
resolved: issue 22). The store holds ``--runs`` runs (200), each with ``--incidents`` open incidents (3):
the pipeline's records of a recorded stream (``tests/scenarios/streams/crash.jsonl``: its run and its
incident), copied under new ids. Three cases, milliseconds per page (median of ``--pages``):

* ``list_only``   -- ``list_runs`` alone (the floor: no recount);
* ``none_resolved`` -- the page with every run's incidents open (the processor's figures stand, but every
  candidate's workflow is read);
* ``one_resolved`` -- a person resolved one incident of every run (each run recounted).

The baseline (``--baseline REF``, default ``HEAD``) is checked out with ``git worktree`` and measured by
this script in a subprocess on that checkout's sources, on the same data, the two taking turns
``--repeat`` times (the lowest figure of each is printed).

    python bench/run_list.py                      # ~20 s
    python bench/run_list.py --baseline 3a959a6   # before IncidentStore.get_workflows (issue 15)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
STREAM = REPO / "tests" / "scenarios" / "streams" / "crash.jsonl"


def _records(runs: int, incidents: int) -> Any:
    """``runs`` copies of the stream's run record, each with ``incidents`` copies of its first incident
    (open), all in project ``bench``."""
    from trainguard_engine.catalogue import DetectionSettings
    from trainguard_engine.pipeline import Pipeline

    envelopes = [json.loads(line) for line in STREAM.read_text().splitlines() if line.strip()]
    out = Pipeline(DetectionSettings()).process(envelopes)
    run, incident = out.runs[-1], out.incidents[-1]
    run_records, incident_records = [], []
    for r in range(runs):
        twin = copy.deepcopy(run)
        twin.project, twin.run_id, twin.last_event_ns = "bench", f"run-{r:04d}", run.last_event_ns + r
        twin.open_incidents, twin.health = incidents, "critical"
        run_records.append(twin)
        for i in range(incidents):
            inc = copy.deepcopy(incident)
            inc.project, inc.run_id, inc.incident_id = "bench", twin.run_id, f"inc-{r:04d}-{i}"
            inc.status, inc.resolved_ns, inc.first_ns = "open", 0, incident.first_ns + i
            incident_records.append(inc)
    return run_records, incident_records


def worker(runs: int, incidents: int, pages: int) -> Dict[str, float]:
    """Milliseconds per page (median) of each case, on a fresh SQLite store in a temporary folder."""
    from trainguard_server.api import resolutions
    from trainguard_server.storage.base import IncidentWorkflow
    from trainguard_server.storage.sqlite import SqliteIncidentStore

    root = Path(tempfile.mkdtemp(prefix="trainguard-run-list-"))
    try:
        store = SqliteIncidentStore(root / "incidents.db")
        run_records, incident_records = _records(runs, incidents)
        store.upsert_runs(run_records)
        store.upsert_incidents(incident_records)

        def page_ms(recount: bool) -> float:
            times = []
            for _ in range(pages):
                t0 = time.perf_counter()
                page = store.list_runs("bench", limit=200)
                if recount:
                    shown = resolutions.runs(store, page.items)
                    assert len(shown) == len(page.items)
                times.append(1e3 * (time.perf_counter() - t0))
            return statistics.median(times)

        out = {"list_only_ms": page_ms(False), "none_resolved_ms": page_ms(True)}
        for r in range(runs):
            store.save_workflow(IncidentWorkflow(project="bench", incident_id=f"inc-{r:04d}-0",
                                                 run_id=f"run-{r:04d}", resolved_by="bench", resolved_ns=1,
                                                 root_cause="bench"))
        out["one_resolved_ms"] = page_ms(True)
        shown = resolutions.runs(store, store.list_runs("bench", limit=200).items)
        out["open_after"] = float(sum(r.open_incidents for r in shown))
        store.close()
        return out
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run_checkout(checkout: Path, args: argparse.Namespace) -> Dict[str, float]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(p) for p in sorted(checkout.glob("*/src"))))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--runs", str(args.runs),
           "--incidents", str(args.incidents), "--pages", str(args.pages)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{checkout}: failed\n{proc.stderr[-3000:]}")
    result: Dict[str, float] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def _best(runs: List[Dict[str, float]]) -> Dict[str, float]:
    """The lowest of each case's figure over repeated runs (the least disturbed, on a loaded machine)."""
    return {key: min(r[key] for r in runs) for key in runs[0]}


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=200)
    p.add_argument("--incidents", type=int, default=3, help="open incidents per run")
    p.add_argument("--pages", type=int, default=30, help="pages per case (the median is printed)")
    p.add_argument("--baseline", default="HEAD", help="git ref to compare with ('none': skip)")
    p.add_argument("--repeat", type=int, default=3,
                   help="runs of each checkout, taking turns; the lowest figure of each case is printed")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.runs, args.incidents, args.pages)), flush=True)
        return 0
    print(f"env cpus={os.cpu_count()} python={sys.version.split()[0]} loadavg_1m={os.getloadavg()[0]:.2f} "
          f"runs={args.runs} incidents_per_run={args.incidents} pages={args.pages} repeat={args.repeat}",
          flush=True)
    if args.baseline == "none":
        results = {"this": _best([run_checkout(REPO, args) for _ in range(args.repeat)])}
    else:
        tmp = Path(tempfile.mkdtemp(prefix="trainguard-run-list-baseline-"))
        try:
            base = tmp / "baseline"
            subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(base),
                            args.baseline], check=True)
            try:
                turns: Dict[str, List[Dict[str, float]]] = {"this": [], "baseline": []}
                for _ in range(args.repeat):  # taking turns: load that comes and goes falls on both
                    turns["this"].append(run_checkout(REPO, args))
                    turns["baseline"].append(run_checkout(base, args))
                results = {label: _best(runs) for label, runs in turns.items()}
            finally:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base)],
                               check=False)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    this, base = results["this"], results.get("baseline", {})
    for case in ("list_only", "none_resolved", "one_resolved"):
        mine, theirs = this[f"{case}_ms"], base.get(f"{case}_ms", float("nan"))
        print(f"run_list case={case} ms_per_page={mine:.2f} baseline={args.baseline} "
              f"baseline_ms_per_page={theirs:.2f} speedup={theirs / mine:.2f}", flush=True)
    print(f"run_list open_incidents_after_resolving this={this['open_after']:.0f} "
          f"baseline={base.get('open_after', float('nan')):.0f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
