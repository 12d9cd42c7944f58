"""One live 4-rank DDP job under torchrun (gloo, CPU): a rank made 4x slower in compute from step 15 and
then stuck at step 65 (after the 10-step warm-up, with a margin for a loaded host), so
its peers' all-reduce times out. What the four SDKs wrote, through the engine: one incident, the
straggler (the slow rank), named before the timeout, with the collective timeout folded in as its
consequence. About 20 s on the 2-core machine. (At 3x and a hang at step 55 it was named at steps 34-51 in
16 of 18 runs and missed twice: four ranks on two cores share the CPU, so the slow rank's own time is over
1.7x its peers' on only ~2/3 of the steps and the 18-of-28 sign test sat at its edge; this test is about the
timeout's folding -- the detector's sensitivity is measured by bench/straggler.py.)"""

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
SLOW_RANK, FROM_STEP, HANG_AT, FACTOR = 1, 15, 65, 4.0


def _run(out: Path) -> subprocess.CompletedProcess:  # type: ignore[type-arg]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "sdk" / "src"), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", str(JOB),
           "--out", str(out), "--run-id", f"live-{os.getpid()}", "--steps", str(HANG_AT + 10), "--slow", "compute",
           "--slow-rank", str(SLOW_RANK), "--factor", str(FACTOR), "--from-step", str(FROM_STEP),
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
    (inc,) = [i for i in standing if i.subtype == "straggler"]
    assert inc.lead_rank == SLOW_RANK, summary
    # named before the collective timed out (the 30-step bound is asserted on the recorded runs, which are
    # deterministic; live on a loaded 2-core host the lag varies: bench/straggler.py reports it)
    assert FROM_STEP <= named_at < HANG_AT, named_at
    # the peers that timed out waiting for it are its consequence, never an incident of their own; which
    # rank's watchdog fires first varies live (the stuck slow rank's own may too, and may stand apart --
    # tests/engine/test_straggler.py asserts the whole folding on a recorded run)
    timed_out = {e.rank for e in inc.evidence if "Timed out" in e.description or "timed out" in e.description}
    assert SLOW_RANK not in timed_out, [e.description[:120] for e in inc.evidence]
    others = [s for s in summary if s[1] != "straggler"]
    assert all(s[:3] == ("comm", "timeout", SLOW_RANK) for s in others), summary
    assert timed_out or others, summary  # the timeout was seen, folded in or the slow rank's own
