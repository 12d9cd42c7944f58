"""Detection, discovery of the runs in a folder tree, deterministic run ids and idempotent re-import,
times from a step-time column, and the message for a missing optional reader."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Dict, List

from torch.utils.tensorboard import SummaryWriter

from trainguard_server.cli import main
from trainguard_server.replay import Importer, ReplayOptions
from trainguard_server.replay.backends import DryRunBackend
from trainguard_server.replay.sources.discover import plan
from trainguard_server.replay.sources.registry import find_runs
from trainguard_server.storage.sqlite import open_sqlite_stores


def _tree(root: Path) -> None:
    writer = SummaryWriter(str(root / "tb" / "run-a"))
    for step in range(5):
        writer.add_scalar("loss", 1.0 / (step + 1), step)
    writer.close()
    (root / "jobs" / "j1").mkdir(parents=True)
    (root / "jobs" / "j1" / "metrics.jsonl").write_text(
        "".join(json.dumps({"iter": s, "train_loss": 2.0 - 0.1 * s, "step_time_ms": 200.0}) + "\n"
                for s in range(6)))
    (root / "jobs" / "j1" / "train.log").write_text("starting\nWARNING: slow step\n")
    (root / "jobs" / "j2").mkdir(parents=True)
    (root / "jobs" / "j2" / "metrics.csv").write_text("step,loss,clipped\n0,1.0,True\n1,0.9,False\n")
    (root / "notes").mkdir()
    (root / "notes" / "readme.txt").write_text("nothing to import here\n")


def test_tree_of_runs_ids_and_idempotent_import(tmp_path: Path, capsys: Any) -> None:
    root = tmp_path / "runs"
    _tree(root)
    found = find_runs(root)
    assert [(r.name, sorted(f for _, f in r.inputs), [p.name for p in r.logs]) for r in found] == [
        ("jobs/j1", ["jsonl"], ["train.log"]), ("jobs/j2", ["csv"], []), ("tb/run-a", ["tensorboard"], [])]
    ids = [p.run_id for p in plan([root])]
    assert ids == [p.run_id for p in plan([root])] and len(set(ids)) == 3
    assert [p.run_id for p in plan([root], run_id="night")] == ["night-jobs_j1", "night-jobs_j2", "night-tb_run-a"]

    data = tmp_path / "data"
    code = main(["replay", "--data-dir", str(data), "--quiet", "--no-wait", str(root)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "3 runs:" in out and "[jsonl]" in out and "[csv]" in out and "[tensorboard]" in out
    assert "times from the step-time field (time/step_s)" in out
    before = _stored(data, ids)
    code = main(["replay", "--data-dir", str(data), "--quiet", "--no-wait", str(root)])
    capsys.readouterr()
    assert code == 0
    assert _stored(data, ids) == before and len(before["events"]) == 3 * 2 + 1  # START+EXIT each, 1 log line


def _stored(data: Path, run_ids: List[str]) -> Dict[str, Any]:
    stores = open_sqlite_stores(data)
    try:
        return {"runs": [r.to_dict() for r in (stores.incidents.get_run("default", i) for i in run_ids) if r],
                "events": [e.event_id for i in run_ids
                           for e in stores.events.list_for_run("default", i, limit=1000).items],
                "metrics": [stores.metrics.names("default", i) for i in run_ids]}
    finally:
        stores.close()


def test_step_time_column_spaces_the_records(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0, "iteration_time_ms": 100.0 * (s + 1)}) + "\n"
                            for s in range(4)))
    options = ReplayOptions(run_id="st", inputs=[(0, path, "")], end_time_ns=10**18 + 10**9)
    importer = Importer(options, DryRunBackend())
    sources = importer.plan()
    assert sources[0].time_mode.startswith("from the step-time field")
    times = [item.time_ns for item in importer._metrics_items(sources[0])]
    steps = [b - a for a, b in zip(times, times[1:])]
    assert steps == [200_000_000, 300_000_000, 400_000_000] and times[-1] == importer.anchor + importer.shift


def test_missing_optional_reader_is_a_message(tmp_path: Path, monkeypatch: Any) -> None:
    run = tmp_path / "tb"
    writer = SummaryWriter(str(run))
    writer.add_scalar("loss", 1.0, 0)
    writer.close()
    monkeypatch.setitem(sys.modules, "tensorboard.backend.event_processing.event_file_loader", None)
    summary = Importer(ReplayOptions(run_id="x", inputs=[(0, run, "")]), DryRunBackend()).run()
    assert summary.error == "reading TensorBoard event files needs the 'tensorboard' package: pip install tensorboard"
    assert not summary.ok
