"""Regression (issue 20): the Flink job at parallelism 1 on a stream whose keyed state outgrows 5 MiB.

The stream is the one ``bench/scale.py`` reported it on: 16 SDK-shaped runs of 16 ranks and 100 steps
(bench/processor.py ``sdk_requests``, serialized IngestRequests as the gateway publishes them), all on one
subtask. With the mini-cluster's default checkpoint storage (the JobManager's memory, at most 5 MiB of state
per subtask) every checkpoint past that size failed, the job restored and failed again forever (the bench saw
PyFlink's worker fail re-registering state serializers on one of those restores, and a hang). The job now
checkpoints to files (processor/flink_main.py ``--checkpoint-dir``) and a bounded job fails after a few
restarts instead of looping. One real job on a local mini-cluster (~35 s on a loaded 2-core machine).
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

from tests.services.processor.test_flink_conformance import parts_in_order
from trainguard import wire
from trainguard_server.processor.flink_main import write_records
from trainguard_server.processor.flink_stages import PipelineBox, RunStage, decode_record, run_key_of

REPO = Path(__file__).resolve().parents[3]
FLINK_PYTHON = Path(os.environ.get("TRAINGUARD_FLINK_PYTHON", REPO / ".venv-flink" / "bin" / "python"))
RUNS, RANKS, STEPS = 16, 16, 100
MEMORY_STATE_LIMIT = 5 * 1024 * 1024  # Flink's JobManagerCheckpointStorage default maximum
TIMEOUT_S = 300  # before the fix the job never ended


def stream() -> List[bytes]:
    sys.path.insert(0, str(REPO / "bench"))
    try:
        from processor import sdk_requests  # bench/processor.py
    finally:
        sys.path.remove(str(REPO / "bench"))
    return [wire.prepare_batch(batch).request.SerializeToString()
            for r in range(RUNS) for batch in sdk_requests("bench", f"big-{r:02d}", RANKS, STEPS)]


def keyed_state_bytes(values: List[bytes]) -> int:
    """What the job's run stage holds at the end, pickled as PyFlink pickles it: the premise of the test."""
    stage = RunStage()
    states: Dict[str, PipelineBox] = {}
    for value in values:
        for item in decode_record(value):
            box = states[run_key_of(item)] = stage.box(states.get(run_key_of(item)))
            stage.on_record(box, item[1])
    for box in states.values():
        stage.flush(box)
    return sum(len(pickle.dumps(box)) for box in states.values())


def test_parallelism_1_with_state_over_the_memory_limit_finishes(tmp_path: Path) -> None:
    values = stream()
    assert keyed_state_bytes(values) > MEMORY_STATE_LIMIT
    source, out = tmp_path / "records.bin", tmp_path / "out"
    write_records(source, values)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO / "sdk" / "src"), str(REPO / "engine" / "src"), str(REPO / "services" / "src")]))
    proc = subprocess.run([str(FLINK_PYTHON), "-m", "trainguard_server.processor.flink_main", "--records",
                           str(source), "--out", str(out), "--parallelism", "1",
                           "--checkpoint-dir", str(tmp_path / "checkpoints")],
                          env=env, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs: Dict[str, dict] = {}
    for part in parts_in_order(out):
        for line in part.read_text(encoding="utf-8").splitlines():
            record = json.loads(line)
            if record["kind"] == "run":
                runs[record["record"]["run_id"]] = record["record"]
    assert sorted(runs) == [f"big-{r:02d}" for r in range(RUNS)]
    for run_id, record in runs.items():  # every record reached its run once: the last step, every rank
        assert record["last_step"] == STEPS, (run_id, record["last_step"])
        assert record["ranks"] == list(range(RANKS)), run_id
