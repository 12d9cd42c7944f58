"""bench/detection.py on three fast scenarios -- one live CPU training (crash), one recorded H200 stream
(gpu_oom) and one healthy live run -- both ways, against a real embedded server: the report's structure,
the JSON, and that runs detected on the recorded corpus are counted as detected (no timing asserts)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_reports_both_ways_with_matrix_scores_and_targets(tmp_path: Path) -> None:
    out_json = tmp_path / "detection.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "detection.py"), "--only",
                           "crash,gpu_oom,healthy_mlp", "--ways", "sdk,replay", "--json", str(out_json)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    for pattern in (
        r"^env python=\S+ torch=\S+ cpus=\d+ commit=",
        r"^corpus: 3 scenarios \(2 cpu, 1 gpu\), ways sdk,replay, cpu seed 0; server http://127\.0\.0\.1:\d+ ",
        r"^== way sdk: ",
        r"^== way replay: ",
        r"^crash\s+cpu\s+(grpc|http)\s+process/exception\s+.*process/exception",
        r"^gpu_oom\s+gpu\s+(grpc|http)\s+memory/oom\s+.*memory/oom",
        r"^healthy_mlp\s+cpu\s+(grpc|http)\s+healthy\s+",
        r"^confusion matrix \(rows: expected; columns: kinds found",
        r"^precision / recall per subtype$",
        r"^precision / recall per category$",
        r"^memory/oom\s+1\s+\d+\s+0\s+[0-9.]+\s+1\.00$",
        r"^process/exception\s+1\s+\d+\s+0\s+[0-9.]+\s+1\.00$",
        r"^  anomalous runs detected with the right category and subtype: 2/2 \(target: all\) OK$",
        r"^  incidents on healthy runs: \d+ on 1 runs \(target 0\) (OK|MISSED)$",
        r"^  crash crash: the EXIT event \(SDK clock\) -> process/exception incident with the exit, "
        r"queryable: [0-9.]+ s \(target < 1 s\) (OK|MISSED)$",
        r"^  crash gpu_oom: the gateway's ack of the first EXIT -> memory/oom incident with the exit, "
        r"queryable: [0-9.]+ s \(target < 1 s\) (OK|MISSED)$",
        r"^== both ways$",
        r"^  sdk\s+detected 2/2, exact \d/2, incidents on healthy runs \d+, harness errors 0$",
        r"^  replay\s+detected 2/2, exact \d/2, incidents on healthy runs \d+, harness errors 0$",
    ):
        assert re.search(pattern, out, re.MULTILINE), f"missing /{pattern}/ in:\n{out}"
    assert "HARNESS ERRORS" not in out
    doc = json.loads(out_json.read_text())
    assert doc["harness_errors"] == []
    assert set(doc["ways"]) == {"sdk", "replay"}
    for way in ("sdk", "replay"):
        result = doc["ways"][way]
        by_name = {s["name"]: s for s in result["scenarios"]}
        assert set(by_name) == {"crash", "gpu_oom", "healthy_mlp"}
        crash = by_name["crash"]
        assert "process/exception" in crash["kinds"] and not crash["error"]
        assert crash["exit_codes"] == {"0": 1} and crash["crash"]["ttd_s"] is not None
        assert "memory/oom" in by_name["gpu_oom"]["kinds"]
        assert result["confusion"]["process/exception"]["process/exception"] == 1
        assert result["confusion"]["memory/oom"]["memory/oom"] == 1
        summary = result["summary"]
        assert (summary["anomalous"], summary["detected"], summary["healthy"]) == (2, 2, 1)
        recall = {row["label"]: row["recall"] for row in result["precision_recall"]["subtype"]}
        assert recall["process/exception"] == recall["memory/oom"] == 1.0
    assert doc["ways"]["sdk"]["scenarios"][0]["delivery"] == "live"
    assert {s["delivery"] for s in doc["ways"]["replay"]["scenarios"]} == {"step-synchronous"}
