"""bench/sdk_overhead.py --quick runs to completion and prints every labelled figure (no timing asserts)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_quick_run_prints_every_labelled_line() -> None:
    env = dict(os.environ)
    env.pop("TRAINGUARD_ENDPOINT", None)
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "sdk_overhead.py"), "--quick"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    number = r"[0-9.]+"
    for pattern in (
        r"^env python=\S+ torch=\S+ device=cpu",
        rf"^log_call plain_fn_ns={number}$",
        rf"^log_call disabled_ns={number} ratio_vs_plain={number}$",
        rf"^log_call enabled_ns={number} ratio_vs_plain={number} target_ns=5000 goal_ns=2000 (OK|OVER)$",
        rf"^log_call enabled_sustained_ns={number} ",
        rf"^train_step\[mlp\] device=cpu blocks=\d+x\d+ median_off_ms={number} median_on_ms={number} "
        rf"overhead_ratio={number} pair_ratio_median={number}",
        rf"^train_step\[transformer\] device=cpu .* overhead_ratio={number}",
        r"^sdk_stats \{",
    ):
        assert re.search(pattern, out, re.MULTILINE), f"missing /{pattern}/ in:\n{out}"
    assert "Traceback" not in proc.stderr
