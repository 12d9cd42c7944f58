"""bench/kill9.py --quick SIGKILLs a real ``trainguard serve`` (SQLite queue) and, on a Tansu broker, the
``trainguard processor`` and ``gateway`` roles mid-ingest, and prints every labelled line: a line per kill,
the counts per backend and the summary. The figures are not asserted (they are what the bench measures),
only that each is printed as a number."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_quick_run_prints_every_labelled_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "kill9.py"), "--quick",
                           "--data-dir", str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    n = r"[0-9.]+"
    patterns = [r"^env python=\S+ cpus=\d+ ", r"^config backends=sqlite,kafka kills=2 "]
    for backend, targets in (("sqlite", ("serve", "serve")), ("kafka", ("processor", "gateway"))):
        for i, target in enumerate(targets, 1):
            patterns.append(rf"^kill backend={backend} n={i} target={target} up_s={n} acked_before=\d+ "
                            rf"queue_depth_before=\S+ back_after_s={n} failed_sends_meanwhile=\d+$")
        patterns += [
            rf"^result backend={backend} kills=2 acked_events=\d+ lost=\d+ \(raw \d+, metric \d+\) "
            rf"duplicated_rows=-?\d+ double_counted=-?\d+ \(cluster count \d+, exceptions stored \d+\) "
            rf"resent_after_failure=\d+ stored_unacked=\d+ settle_s={n} stop_exit_code=-?\d+ failed_sends=\S+$",
            rf"^summary backend={backend} kills=2 acknowledged=\d+ lost=\d+ duplicated=-?\d+ "
            rf"double_counted=-?\d+ resent_after_failure=\d+$",
        ]
    for pattern in patterns:
        assert re.search(pattern, out, re.MULTILINE), f"missing /{pattern}/ in:\n{out}"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
