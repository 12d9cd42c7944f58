"""A real W&B offline run (``wandb.init(mode="offline")``: its ``run-<id>.wandb`` transaction log), read by
:class:`WandbRunSource` with wandb's own protobuf classes."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from trainguard_server.cli import main
from trainguard_server.replay.sources.registry import detect, find_runs
from trainguard_server.replay.sources.wandb_run import WandbRunSource


def test_offline_run_history_nested_booleans_units(tmp_path: Path, monkeypatch: Any, capsys: Any) -> None:
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    run = wandb.init(project="p", dir=str(tmp_path), mode="offline", settings=wandb.Settings(
        x_stats_sampling_interval=0.1, console="off"))  # system stats every 0.1 s (default 15 s)
    for step in range(12):
        time.sleep(0.05)
        run.log({"train/loss": 1.0 / (step + 1), "train/grad_norm": 2.0,
                 "grad_norm": {"encoder.layer.0": 0.1 * step, "head": 0.2},
                 "clipped": step % 3 == 0, "peak_memory_mb": 800.0 + step, "phase": "train"}, step=step)
    run.finish(exit_code=3)
    wandb.teardown()  # stop the wandb-core service this test started
    folders = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(folders) == 1 and detect(folders[0]) == "wandb"

    src = WandbRunSource(folders[0])
    every = list(src)
    records = [r for r in every if "loss" in r.values]
    assert [r.step for r in records] == list(range(12))
    rss = [r for r in every if "mem/rss" in r.values]  # the system stats' process RSS, at the last step
    assert rss and len(every) == len(records) + len(rss)
    assert all(50 * 2**20 < r.values["mem/rss"] < 8 * 2**30 and 0 <= r.step < 12 for r in rss)
    assert all(r.time_ns is not None for r in records)
    last = records[-1].values
    assert last["loss"] == pytest.approx(1 / 12) and last["grad/global_norm"] == 2.0
    assert last["grad/layer/encoder.layer.0"] == pytest.approx(1.1) and last["grad/layer/head"] == 0.2
    assert [r.values["grad/clip_triggered"] for r in records[:4]] == [1.0, 0.0, 0.0, 1.0]
    assert last["mem/max_allocated"] == (800.0 + 11) * 1e6  # MB: decimal
    assert src.stats.non_numeric["phase"] == 12
    assert src.exit_code() == 3  # the run's exit record
    assert [r.name for r in find_runs(tmp_path)] == [f"wandb/{folders[0].name}"]

    os.environ.pop("WANDB_MODE", None)
    code = main(["replay", "--dry-run", "--quiet", str(tmp_path / "wandb")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "nothing imported" in out and f"{len(every)} records" in out and "rank 0: 3" in out
    assert "mem/rss <- 'proc.memory.rss_mib' (MiB)" in out
    assert "grad/clip_triggered <- 'clipped'" in out and "ignored 'phase': not a number (12 values)" in out
