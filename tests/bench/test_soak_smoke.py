"""bench/soak.py --quick runs both phases against real ``trainguard serve`` subprocesses and prints every
labelled line: the prober's figures per phase, the hostile tenant's answers and the server's counters, the
side-by-side summary (no timing asserts: the numbers are whatever this machine gives)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_quick_run_prints_every_labelled_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "soak.py"), "--quick", "--seconds", "3",
                           "--data-dir", str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    n = r"[0-9.]+"
    t = r"(?:[0-9.]+|inf|nan)"  # a latency: a probe that never saw its incident reads inf
    patterns = [r"^env python=\S+ grpcio=\S+ protobuf=\S+ cpus=\d+ ", r"^config seconds_per_phase=3 "]
    for phase in ("calm", "hostile"):
        patterns += [
            rf"^{phase} probes=\d+ incidents_found=\d+ first_step_ok=\d+/\d+ kinds=\S* probe_errors=\S+$",
            rf"^{phase} event_to_incident via=poll p50_ms={t} p99_ms={t} max_ms={t}$",
            rf"^{phase} event_to_incident via=sse p50_ms={t} p99_ms={t} max_ms={t}$",
            rf"^{phase} timeline from_s=0 to_s=2 probes=\d+ poll_p50_ms={t} poll_max_ms={t}$",
            rf"^{phase} long_run steps=\d+ nan_step=\d+ incident=\S+ first_step_ok=(yes|no) poll_ms={t}",
            rf"^{phase} background accepted_events=\d+ events_per_s={n} \(asked 2x{n}\) errors=\S+$",
            rf"^{phase} server cpu_pct={n} machine_busy_pct={n} queue_depth_max={n} "
            rf"processing_lag_max_s={n} readyz=\d+",
            rf"^{phase} metrics trainguard_runs_quarantined_total={n}$",
            rf"^{phase} metrics trainguard_project_quota_evictions_total\S*={n}$",
        ]
    for attack in ("poison", "tiny_runs", "idle_streams", "gzip_bomb", "deep_event", "deep_body"):
        patterns.append(rf"^hostile hostile_answers attack={attack} \S+=\d+")
    patterns += [
        r"^hostile hostile_notes tiny_runs_sent=\d+ ",
        r"^hostile hostile_poison sent_as=(json|grpc) runs=\d+ with_incident=\d+$",
        r"^hostile hostile_poison incident_lr_growth=\S+$",
        r"^summary figure +without_hostile +with_hostile +ratio$",
        rf"^summary event_to_incident_poll_p50_ms +{t} +{t} +{t}$",
        rf"^summary event_to_incident_poll_p99_ms +{t} +{t} +{t}$",
        rf"^summary event_to_incident_sse_p50_ms +{t} +{t} +{t}$",
        rf"^summary event_to_incident_sse_p99_ms +{t} +{t} +{t}$",
        r"^summary incidents_found +\d+/\d+ +\d+/\d+$",
    ]
    for pattern in patterns:
        assert re.search(pattern, out, re.MULTILINE), f"missing /{pattern}/ in:\n{out}"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
