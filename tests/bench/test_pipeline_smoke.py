"""bench/pipeline.py --quick runs to completion against real servers (trainguard serve, the gateway and
processor roles, a Tansu broker) and prints every labelled figure of the side-by-side table (no timing
asserts: the numbers are whatever this machine gives). Its Flink phase is skipped here: the conformance
test runs that job."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_quick_run_prints_the_side_by_side_table() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "pipeline.py"), "--quick", "--skip", "flink"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    n = r"[0-9.]+"
    for pattern in (
        rf"^embedded_ingest events_per_s={n} ",
        rf"^embedded processor_alone events_per_s={n} backlog_left={n}$",
        rf"^kafka_ingest events_per_s={n} ",
        rf"^kafka processor_alone events_per_s={n} backlog_left={n}$",
        r"^embedded_latency event_to_incident probes=\d+ p50_ms=",
        r"^kafka_latency event_to_incident probes=\d+ p50_ms=",
        rf"^summary embedded +{n} +{n} ",
        rf"^summary kafka +{n} +{n} ",
        rf"^summary gateway_to_kafka_events_per_s={n} target=120000 ratio={n} (OK|BELOW)$",
        rf"^summary ratios kafka/embedded: ingest={n} processor={n}$",
        rf"^processor_alone shape=sdk16 events=\d+ .* speedup={n} target=25$",
        rf"^summary processor_alone_env500_over_embedded_grpc_ingest={n} target=0.5 (OK|BELOW)$",
    ):
        assert re.search(pattern, out, re.MULTILINE), (pattern, out[-3000:])
    figures = json.loads(out.strip().splitlines()[-1])
    for path in ("embedded", "kafka"):  # every figure measured: events went through both paths
        assert figures[path]["ingest"] > 0 and figures[path]["processor"] > 0, figures
        assert figures[path]["p50"] > 0, figures
