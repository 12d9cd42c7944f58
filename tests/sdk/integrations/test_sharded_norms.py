"""Issue 21: exact gradient norms under sharding (FSDP2 on 2 CPU ranks over gloo), without a collective.

Each rank's ``watch()`` reports the sum of squares of its share of the gradients (``grad/shard_sumsq``, per
layer too) -- it never reads a DTensor's full value, which would be a collective on the training thread or,
worse, on the SDK's own thread -- and the engine adds the shares of a step once every rank reported it
(trainguard_engine/shards.py). The combined global and per-layer norms must equal the norms of the full
gradients (``full_tensor()``, computed by the job itself) within 1e-5 relative, at every step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest

from tests.scenarios.corpus import load_events
from trainguard_engine import shards
from trainguard_engine.pipeline import Pipeline

PURE = pytest.mark.engine_pure("spies on shards.fold, which the compiled pipeline calls directly")
"""Why the tests marked with it run on the pure engine when the compiled one is loaded
(tests/support/engine_pure.py): they watch or replace engine internals, which compiled callers do not see;
the module's other tests run compiled."""

JOB = Path(__file__).resolve().parents[2] / "fixtures" / "fsdp" / "job.py"


@PURE
def test_fsdp2_norms_are_the_full_gradients_norms(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = dict(os.environ, OUT=str(tmp_path), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(JOB)], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    reference: List[Dict[str, Any]] = json.loads((tmp_path / "reference.json").read_text())
    events = load_events(sorted(tmp_path.glob("events-*.jsonl")))
    names = {p["name"] for e in events for p in e.get("metrics", {}).get("points", [])}
    assert "grad/shard_sumsq" in names and "grad/global_norm" not in names  # shares only, from each rank
    combined: List[Any] = []  # every (name, step, norm) the engine combined, as its detectors got them
    fold = shards.fold

    def spy(*args: Any) -> Any:
        out = fold(*args)
        combined.extend(out)
        return out
    monkeypatch.setattr(shards, "fold", spy)
    pipeline = Pipeline()
    pipeline.process(events)
    (record,) = pipeline.runs()
    run = pipeline.run_state(record.project, record.run_id)
    assert run is not None and sorted(run.ranks) == [0, 1]
    history = run.ranks[0].history
    got = {step: v for step, (v, _t) in history["grad/global_norm"].items()}
    assert sorted(got) == list(range(len(reference)))
    for step, ref in enumerate(reference):
        assert abs(got[step] - ref["global"]) <= 1e-5 * ref["global"], (step, got[step], ref["global"])
        for layer, norm in ref["layers"].items():
            (value,) = [v for n, s, v in combined if n == f"grad/layer/{layer}" and s == step]
            assert abs(value - norm) <= 1e-5 * max(norm, 1e-12), (step, layer, value, norm)
    # nothing waits any more: every step's shares were combined once and dropped
    assert all(not steps for r in run.ranks.values() for steps in r.detectors.get("shards", {}).values())
