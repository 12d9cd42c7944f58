"""``trainguard demo``: start the embedded server, run real small PyTorch trainings instrumented with the
SDK (a healthy one, one whose loss blows up to NaN, one that crashes, one that stops making progress),
show their progress live, then print what the backend found for each and where to look next."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from ..api.read_client import ReadClient
from ..config import Settings
from ..server import EmbeddedServer

# the thresholds a demo can afford: seconds, not the production minutes (documented in the output)
DEMO_DETECTION = {"stall_min_s": 4.0, "lost_after_s": 60.0}
EXPECTED = {"healthy": None, "diverging": ("loss", "gradient"), "crashing": ("process", "memory"),
            "stalling": ("progress",)}


@dataclass
class DemoRun:
    kind: str
    transport: str
    run_id: str
    proc: Optional[subprocess.Popen[bytes]] = None
    exit_code: Optional[int] = None
    killed_by_demo: bool = False
    incidents: List[Dict[str, Any]] = field(default_factory=list)
    run: Dict[str, Any] = field(default_factory=dict)


def run_demo(data_dir: str = ".data/demo", quick: bool = False) -> int:
    """Run the demo; returns 0 when every training got the expected finding and the healthy one none."""
    root = Path(data_dir).resolve()
    shutil.rmtree(root, ignore_errors=True)
    settings = Settings(data_dir=root / "server", http_port=0, grpc_port=0,
                        detection_overrides=json.dumps(DEMO_DETECTION), snapshot_every_s=1.0)
    server = EmbeddedServer(settings)
    server.start()
    tokens = server.tokens
    assert tokens is not None
    api = ReadClient(server.http_url, tokens.read, timeout=5)
    print(f"TrainGuard demo — embedded server: API {server.http_url}, gRPC {server.grpc_url}, data {root}")
    print(f"demo thresholds (production defaults are minutes): {DEMO_DETECTION}\n")
    steps = 60 if quick else 240
    stamp = time.strftime("%H%M%S")
    runs = [DemoRun("healthy", "grpc", f"demo-healthy-{stamp}"),
            DemoRun("diverging", "http", f"demo-diverging-{stamp}"),
            DemoRun("crashing", "grpc", f"demo-crashing-{stamp}"),
            DemoRun("stalling", "http", f"demo-stalling-{stamp}")]
    started = time.monotonic()
    try:
        for demo_run in runs:
            demo_run.proc = _launch(demo_run, server, tokens.ingest, tokens.project, steps, root)
        _watch(runs, api, started, timeout=60 if quick else 120)
        for demo_run in runs:
            demo_run.run = api.get(f"/api/v1/runs/{demo_run.run_id}") or {}
            page = api.get(f"/api/v1/runs/{demo_run.run_id}/incidents") or {"items": []}
            demo_run.incidents = page["items"]
    finally:
        for demo_run in runs:
            if demo_run.proc is not None and demo_run.proc.poll() is None:
                demo_run.proc.kill()
                demo_run.proc.wait()
        server.stop()
    ok = _report(runs, server, tokens.read, time.monotonic() - started)
    return 0 if ok else 1


def _launch(demo_run: DemoRun, server: EmbeddedServer, token: str, project: str, steps: int,
            root: Path) -> subprocess.Popen[bytes]:
    endpoint = server.grpc_url if demo_run.transport == "grpc" else server.http_url
    env = dict(os.environ, TRAINGUARD_ENDPOINT=endpoint, TRAINGUARD_TOKEN=token,
               TRAINGUARD_PROJECT=project, TRAINGUARD_RUN_ID=demo_run.run_id,
               TRAINGUARD_HEARTBEAT_INTERVAL="1", TRAINGUARD_FLUSH_INTERVAL="0.2",
               TRAINGUARD_SPOOL_DIR=str(root / "spool"))
    log = open(root / f"{demo_run.kind}.log", "wb")
    return subprocess.Popen([sys.executable, "-m", "trainguard_server.demo.trainings", demo_run.kind,
                             "--steps", str(steps), "--step-sleep", "0.01"],
                            env=env, stdout=log, stderr=subprocess.STDOUT)


def _watch(runs: List[DemoRun], api: ReadClient, started: float, timeout: float) -> None:
    """Print one status line per second until every training ended (the stalled one is killed once
    TrainGuard has flagged it — as an operator would)."""
    last_line = ""
    while time.monotonic() - started < timeout:
        cells = []
        for demo_run in runs:
            assert demo_run.proc is not None
            if demo_run.exit_code is None and demo_run.proc.poll() is not None:
                demo_run.exit_code = demo_run.proc.returncode
            run = api.get(f"/api/v1/runs/{demo_run.run_id}") or {}
            status = run.get("status", "starting")
            if (demo_run.kind == "stalling" and demo_run.exit_code is None and status == "stalled"):
                demo_run.proc.send_signal(signal.SIGKILL)
                demo_run.killed_by_demo = True
            cells.append(f"{demo_run.kind}: step {run.get('last_step', '-')} {status}"
                         f" ({run.get('open_incidents', 0)} open)")
        line = f"[{time.monotonic() - started:5.1f}s] " + " | ".join(cells)
        if line[9:] != last_line[9:]:
            print(line, flush=True)
            last_line = line
        if all(r.exit_code is not None for r in runs):
            time.sleep(1.5)  # let the last events through the pipeline
            return
        time.sleep(0.5)


def _report(runs: List[DemoRun], server: EmbeddedServer, read_token: str, elapsed: float) -> bool:
    print(f"\nWhat TrainGuard found ({elapsed:.0f}s):\n")
    ok = True
    for demo_run in runs:
        code = demo_run.exit_code
        how = "killed by the demo after TrainGuard flagged it" if demo_run.killed_by_demo else f"exit {code}"
        print(f"■ {demo_run.kind} — run {demo_run.run_id} via {demo_run.transport}, {how}, "
              f"status {demo_run.run.get('status', '?')}, last step {demo_run.run.get('last_step', '?')}")
        if not demo_run.incidents:
            print("    no incidents")
        for inc in demo_run.incidents:
            print(f"    {inc['severity'].upper()} {inc['category']}/{inc['subtype']} from step "
                  f"{inc['first_step']} (rank {inc['lead_rank']}): {inc['title']}")
            if inc.get("fingerprint"):
                print(f"      fingerprint {inc['fingerprint']}")
            for check in inc.get("checks", [])[:3]:
                print(f"      check: {check}")
        expected = EXPECTED[demo_run.kind]
        categories = {inc["category"] for inc in demo_run.incidents}
        if expected is None:
            ok &= not demo_run.incidents
        else:
            ok &= bool(categories & set(expected))
    base = f"http://127.0.0.1:{Settings().http_port}"
    print(f"\nLook closer: `trainguard serve --data-dir {server.data_dir}` reopens this data, then")
    print(f"  curl -H 'Authorization: Bearer {read_token}' {base}/api/v1/runs")
    print(f"  curl -H 'Authorization: Bearer {read_token}' {base}/api/v1/incidents")
    print(f"  curl -H 'Authorization: Bearer {read_token}' '{base}/api/v1/search?q=shapes'")
    print(f"  {base}/docs  (OpenAPI)")
    print("\nresult: " + ("every run classified as expected" if ok else "UNEXPECTED findings (see above)"))
    return ok
