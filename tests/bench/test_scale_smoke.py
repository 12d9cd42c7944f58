"""bench/scale.py --quick runs to completion against a real Tansu broker with real worker processes in one
consumer group and prints every labelled figure (no timing asserts: the numbers are whatever this machine
gives) -- and every published event is processed once per group (at least once after a rebalance), each
group's partitions split among its members; the big run's state in one part (mode=whole) and in rank parts
of which a checkpoint after a few ranks' step rewrites only theirs (mode=rank_parts)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_quick_run_prints_every_figure() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "scale.py"), "--quick", "--processors",
                           "1,2"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    n = r"[0-9.]+"
    for pattern in (
        r"^# bench/scale.py date=\S+ \S+ UTC host=\S+ machine=\S+ cpus=\d+ .*loadavg=",
        rf"^scale processors=1 events=\d+ records=\d+ wall_s={n} events_per_s={n} "
        rf"per_processor_events_per_s={n} ratio_to_1=1.00 partitions=12 ",
        rf"^scale processors=2 .* per_processor_events_per_s={n},{n} ratio_to_1={n} partitions=\d+,\d+ ",
        r"^note: \d+ cores here: ",
        rf"^checkpoint ranks=512 after_step=1 changed_ranks=512 mode=whole records=1024 process_s={n} "
        rf"checkpoint_s={n} parts=\d+ bytes=\d+ ",
        r"^checkpoint ranks=512 after_step=2 changed_ranks=512 mode=whole records=512 ",
        r"^checkpoint ranks=512 after_step=3 changed_ranks=32 mode=rank_parts records=32 ",
        rf"^checkpoint_split mode=rank_parts after_step=3 changed_ranks=32 bytes_ratio={n} time_ratio={n} ",
        rf"^checkpoint_split mode=rank_parts_full after_step=3 changed_ranks=32 bytes_ratio={n} ",
        r"^flink: not measured",
    ):
        assert re.search(pattern, out, re.MULTILINE), (pattern, out[-3000:])
    figures = json.loads(out.strip().splitlines()[-1])
    for group in figures["groups"]:
        assert group["events"] > 0 and group["records_processed"] >= group["records"]
        if group["rebalances"] == 0:  # one assignment each: every record exactly once
            assert group["events_processed"] == group["events"]
            assert group["records_processed"] == group["records"]
        assert sum(group["partitions"]) == 12 and all(group["partitions"])
    whole = [c for c in figures["checkpoint"] if c["mode"] == "whole"]
    split = [c for c in figures["checkpoint"] if c["mode"] == "rank_parts"]
    assert [c["changed_ranks"] for c in whole] == [c["changed_ranks"] for c in split] == [512, 512, 32]
    assert all(c["run_parts_stored"] == 1 and c["rank_parts_stored"] == 0 for c in whole)
    assert all(c["bytes"] > 0 for c in whole)  # the run got a step: its part is written again
    assert all(c["run_parts_stored"] == 1 and c["rank_parts_stored"] == 4 for c in split)  # 512 / 128
    assert all(c["largest_stored_bytes"] < w["largest_stored_bytes"] / 2 for c, w in zip(split, whole))
    # 32 of 512 ranks stepped: one rank part of four and the head are written, not the run
    assert split[2]["bytes"] < whole[2]["bytes"] / 2 and split[2]["parts"] == whole[2]["parts"] + 1
