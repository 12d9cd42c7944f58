"""bench/ingest.py --quick runs to completion against a real ``trainguard serve`` and prints every labelled
figure (no timing asserts: the numbers are whatever this machine gives)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_quick_run_prints_every_labelled_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "ingest.py"), "--quick",
                           "--data-dir", str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    n = r"[0-9.]+"
    t = r"(?:[0-9.]+|inf)"  # a latency: a probe that never saw its incident reads inf (no timing asserts)
    load = rf"events_per_s={n} batches_per_s={n} batch=\d+ ack_p50_ms={n} ack_p99_ms={n} server_cpu_pct={n} " \
           rf"clients_cpu_pct={n} others_cpu_pct={n} errors=\S+"
    for pattern in (
        r"^env python=\S+ grpcio=\S+ protobuf=\S+ cpus=\d+ ",
        rf"^grpc_prebuilt {load}",
        rf"^grpc_prebuilt server_threads cpu_pct=\s*{n} ",
        rf"^grpc_prebuilt processor events_per_s={n} ingested_per_s={n} queue_depth_end={n} "
        rf"processing_lag_s={n} kept_up=(yes|no)$",
        rf"^grpc_sdk {load}",
        rf"^http_json {load}",
        rf"^http_protobuf {load}",
        rf"^latency background_events_per_s={n} \(asked {n}\) processed_per_s={n} processing_lag_s={n} "
        rf"kept_up=(yes|no)",
        rf"^latency event_to_incident probes=\d+ p50_ms={t} p99_ms={t} max_ms={t} ack_p50_ms={n} "
        rf"ack_p99_ms={n} poll_ms={n} incidents=\S+",
        rf"^latency_sdk event_to_incident probes=1 p50_ms={t} max_ms={t}",
        rf"^summary grpc_events_per_s={n} target=120000 ratio={n} (OK|BELOW)$",
        r"^summary processor_events_per_s=",
        rf"^summary grpc_sdk_events_per_s={n} ",
        rf"^summary http_json_events_per_s={n}$",
        rf"^summary http_protobuf_events_per_s={n}$",
        rf"^summary event_to_incident_p50_ms={t} p99_ms={t} target_p99_ms=1000 (OK|OVER) ",
        rf"^summary sdk_event_to_incident_p50_ms={t} max_ms={t}$",
        rf"^processor_alone shape=sdk16 events=\d+ records=\d+ events_per_s={n} cpu_us_per_event={n} "
        rf"baseline=HEAD baseline_events_per_s={n} baseline_cpu_us_per_event={n} speedup={n} target=25$",
        r"^summary processor_alone shape=env500 .* target=5$",
        rf"^summary processor_alone_env500_over_grpc_ingest={n} target=0.5 (OK|BELOW)$",
    ):
        assert re.search(pattern, out, re.MULTILINE), f"missing /{pattern}/ in:\n{out}"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
