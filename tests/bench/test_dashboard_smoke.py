"""bench/dashboard.py runs to completion against a real ``trainguard serve`` and headless Chromium and prints
its figures (no timing asserts: the numbers are whatever this machine gives)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_small_run_prints_api_and_page_load_figures() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "dashboard.py"), "--steps", "2000",
                           "--requests", "3", "--loads", "1"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    n = r"[0-9.,]+"
    for label in ("small", "big"):
        assert re.search(rf"^dashboard run={label} points={n} api_metrics p50_ms={n} p99_ms={n} "
                         rf"page_load p50_ms={n} max_ms={n}$", proc.stdout, re.MULTILINE), proc.stdout
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert figures["big"]["points"] == 2000 * 5 and figures["small"]["points"] == 200 * 5
    assert all(figures[r]["page_p50"] > 0 and figures[r]["api_p50"] > 0 for r in ("small", "big"))
