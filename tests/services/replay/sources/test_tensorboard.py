"""TensorBoard event files written by the real ``torch.utils.tensorboard.SummaryWriter``, read by
:class:`TensorBoardSource` (the ``tensorboard`` package's reader) and imported end to end."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, List

import torch
from torch.utils.tensorboard import SummaryWriter

from trainguard_server.cli import main
from trainguard_server.replay.sources.registry import detect
from trainguard_server.replay.sources.tensorboard import TensorBoardSource
from trainguard_server.storage.sqlite import open_sqlite_stores


def _write(run: Path, steps: int, diverge_at: int = -1) -> List[float]:
    """A run as a user's loop writes it: names of HF/Lightning style, memory in MiB, a clip flag."""
    writer = SummaryWriter(str(run))
    losses = []
    for step in range(steps):
        loss = 2.0 * math.exp(-step / 30) + 0.05 * math.sin(step)
        if diverge_at >= 0 and step >= diverge_at:
            loss = 2.0 * 1.35 ** (step - diverge_at + 4)
        losses.append(loss)
        writer.add_scalar("train/loss", loss, step)
        writer.add_scalar("train/grad_norm", 1.0 + 0.01 * step, step)
        writer.add_scalar("grad_norm/encoder.layer.0", 0.5, step)
        writer.add_scalar("grad_norm/decoder.out", 0.25, step)
        writer.add_scalar("train/learning_rate", 1e-3, step)
        writer.add_scalar("gpu_mem_allocated_mib", 512.0 + step, step)
        writer.add_scalar("grad_clipped", float(step % 2), step)
        if step % 10 == 0:
            writer.add_histogram("weights", torch.randn(16), step)
            writer.add_scalar("eval/acc", 0.5, step, new_style=True)
    writer.close()
    return losses


def test_reads_scalars_by_step_with_times_names_and_units(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "exp1"
    before = time.time_ns()
    losses = _write(run, 30)
    assert detect(run) == "tensorboard"
    src = TensorBoardSource(run)
    records = list(src)
    assert [r.step for r in records] == list(range(30))
    assert all(before <= (r.time_ns or 0) <= time.time_ns() for r in records)
    first = records[0].values
    assert first["loss"] == float(torch.tensor(losses[0], dtype=torch.float32))  # TB stores float32
    assert first["grad/global_norm"] == 1.0 and first["opt/lr"] == float(torch.tensor(1e-3))
    assert first["grad/layer/encoder.layer.0"] == 0.5 and first["grad/layer/decoder.out"] == 0.25
    assert first["mem/allocated"] == 512.0 * 2**20  # MiB -> bytes
    assert first["grad/clip_triggered"] == 0.0 and records[1].values["grad/clip_triggered"] == 1.0
    assert first["eval/acc"] == 0.5  # a new-style (tensor) scalar
    assert src.stats.non_numeric["weights"] == 3  # histograms are not scalars: counted, skipped
    said = "\n".join(src.recognizer.report.lines())
    assert "loss <- 'train/loss'" in said and "grad/layer/* <- grad_norm/* (2 layers)" in said
    assert "mem/allocated <- 'gpu_mem_allocated_mib' (MiB)" in said


def test_import_of_a_diverging_run_finds_the_divergence(tmp_path: Path, capsys: Any) -> None:
    run = tmp_path / "tb"
    _write(run, 60, diverge_at=40)
    data = tmp_path / "data"
    code = main(["replay", "--data-dir", str(data), "--run-id", "tb-run", "--quiet", str(run)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "tensorboard: " in out and "60 records" in out
    stores = open_sqlite_stores(data)
    try:
        page = stores.incidents.list_incidents("default", run_id="tb-run", limit=50)
    finally:
        stores.close()
    found = {(i.category, i.subtype) for i in page.items}
    assert ("loss", "divergence") in found, (found, out)
    assert min(i.first_step for i in page.items if i.category == "loss") >= 35


def test_add_scalars_children_are_the_runs_per_layer_norms(tmp_path: Path) -> None:
    """``add_scalars("grad_norm", {layer: norm})`` writes one subfolder per layer (events tagged
    ``grad_norm``): they belong to the run, as per-layer norms, not runs of their own."""
    from trainguard_server.replay.sources.registry import find_runs

    run = tmp_path / "logs" / "exp"
    writer = SummaryWriter(str(run))
    for step in range(6):
        writer.add_scalar("train/loss", 1.0 / (step + 1), step)
        writer.add_scalars("grad_norm", {"encoder.0": 0.5 + step, "head": 0.25}, step)
    writer.close()
    assert sorted(p.name for p in run.iterdir() if p.is_dir()) == ["grad_norm_encoder.0", "grad_norm_head"]
    assert [(r.name, [f for _, f in r.inputs]) for r in find_runs(tmp_path / "logs")] == [("exp", ["tensorboard"])]
    records = list(TensorBoardSource(run))
    assert [r.step for r in records] == list(range(6))
    assert records[5].values == {"loss": float(torch.tensor(1 / 6)), "grad/layer/encoder.0": 5.5,
                                 "grad/layer/head": 0.25}


def test_a_torn_event_file_imports_what_was_written_and_says_so(tmp_path: Path) -> None:
    run = tmp_path / "tb"
    _write(run, 20)
    (path,) = list(run.iterdir())
    data = path.read_bytes()
    path.write_bytes(data[:-7])  # a job killed mid-write: the last record torn
    src = TensorBoardSource(run)
    records = list(src)
    assert [r.step for r in records] == list(range(20))  # the torn event was one of step 19's scalars
    assert src.stats.malformed == 1 and "torn or damaged record" in src.stats.malformed_lines[0][1]
