"""One live 4-rank DDP job under torchrun (gloo, CPU): a rank made 2.5x slower in compute from step 5 and
then stuck at step 42, so its peers' all-reduce times out. What the four SDKs wrote, through the engine:
one incident, the straggler (the slow rank), the collective timeout folded in as its consequence, and
the slow rank named within 30 steps of the slowdown. About 20 s on the 2-core machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

from trainguard_engine.catalogue import DetectionSettings
from trainguard_engine.pipeline import Pipeline

REPO = Path(__file__).resolve().parents[2]
JOB = REPO / "tests" / "fixtures" / "straggler" / "job.py"
SLOW_RANK, FROM_STEP, HANG_AT = 1, 5, 42


def _run(out: Path) -> subprocess.CompletedProcess:  # type: ignore[type-arg]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "sdk" / "src"), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", str(JOB),
           "--out", str(out), "--run-id", f"live-{os.getpid()}", "--steps", "55", "--slow", "compute",
           "--slow-rank", str(SLOW_RANK), "--factor", "2.5", "--from-step", str(FROM_STEP),
           "--hang-at", str(HANG_AT), "--hang-s", "30", "--timeout-s", "6"]
    return subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=180)


def test_a_slow_rank_that_times_the_collective_out_is_one_straggler_incident(tmp_path: Path) -> None:
    proc = _run(tmp_path)
    assert proc.returncode != 0, "the peers' all-reduce should have timed out"
    events: List[Dict[str, Any]] = []
    for path in sorted(tmp_path.glob("rank*.jsonl")):
        events += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    assert len({e["rank"] for e in events}) == 4, proc.stderr[-2000:]
    events.sort(key=lambda e: int(e["time_unix_nano"]))
    pipeline = Pipeline(DetectionSettings())
    named_at = -1
    for event in events:
        for inc in pipeline.process([event]).incidents:
            if inc.subtype == "straggler" and named_at < 0:
                named_at = inc.last_step
    pipeline.advance(int(events[-1]["time_unix_nano"]) + 60 * 10**9)
    standing = [i for i in pipeline.incidents() if not i.explained_by]
    summary = [(i.category, i.subtype, i.lead_rank, i.title) for i in standing]
    assert [(i.category, i.subtype) for i in standing] == [("perf", "straggler")], summary
    inc = standing[0]
    assert inc.lead_rank == SLOW_RANK, summary
    assert 0 <= named_at - FROM_STEP <= 30 and named_at < HANG_AT, named_at
    assert any(c.startswith("comm/timeout") for c in inc.consequences), inc.consequences
    timed_out = {e.rank for e in inc.evidence if "Timed out" in e.description or "timed out" in e.description}
    assert timed_out and SLOW_RANK not in timed_out, [e.description[:120] for e in inc.evidence]
