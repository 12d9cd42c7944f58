"""A real MLflow file store (``mlflow.log_metrics`` with ``file:`` tracking), read as files by
:class:`MlflowRunSource`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from trainguard_server.replay.sources.mlflow_store import MlflowRunSource
from trainguard_server.replay.sources.registry import find_runs


def test_file_store_run_merged_by_step(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store behind this
    import mlflow

    mlflow.set_tracking_uri((tmp_path / "mlruns").as_uri())
    with mlflow.start_run(run_name="r1") as run:
        for step in range(10):
            mlflow.log_metrics({"train/loss": 1.0 / (step + 1), "grad_norm": 0.5 + step,
                                "peak_memory_mib": 100.0 + step}, step=step)
            if step % 2 == 0:
                mlflow.log_metric("lr", 0.01, step=step)
    folder = tmp_path / "mlruns" / run.info.experiment_id / run.info.run_id
    assert MlflowRunSource.detect(folder)
    src = MlflowRunSource(folder)
    records = list(src)
    assert [r.step for r in records] == list(range(10))
    assert records[3].values == {"loss": pytest.approx(0.25), "grad/global_norm": 3.5,
                                 "mem/max_allocated": 103.0 * 2**20}
    assert records[4].values["opt/lr"] == 0.01
    assert all(r.time_ns is not None and r.time_ns % 1_000_000 == 0 for r in records)
    with mlflow.start_run(run_name="deleted") as gone:
        mlflow.log_metric("loss", 1.0, step=0)
    mlflow.delete_run(gone.info.run_id)  # lifecycle_stage: deleted (until mlflow gc)
    assert [(p, f) for r in find_runs(tmp_path) for p, f in r.inputs] == [(folder, "mlflow")]
    assert src.exit_code() == 0  # FINISHED
    with mlflow.start_run(run_name="r2") as failed:
        mlflow.log_metric("loss", 1.0, step=0)
        mlflow.end_run(status="FAILED")
    assert MlflowRunSource(tmp_path / "mlruns" / failed.info.experiment_id / failed.info.run_id).exit_code() == 1
    (folder / "metrics" / "grad_norm").write_text("garbage\n", encoding="utf-8")
    src = MlflowRunSource(folder)
    assert len(list(src)) == 10 and src.stats.malformed == 1
