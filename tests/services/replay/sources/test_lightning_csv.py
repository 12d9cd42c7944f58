"""A real PyTorch Lightning run's ``CSVLogger`` ``metrics.csv`` (sparse rows, ``*_step``/``*_epoch`` copies,
``LearningRateMonitor``'s ``lr-SGD``, Lightning's ``grad_norm`` utility), read by :class:`CsvSource`."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any, Dict

import torch
from torch import nn

from trainguard_server.replay.sources.csv_table import CsvSource
from trainguard_server.replay.sources.registry import find_runs


def test_metrics_csv_of_a_real_lightning_run(tmp_path: Path) -> None:
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import LearningRateMonitor
    from pytorch_lightning.loggers import CSVLogger
    from pytorch_lightning.utilities import grad_norm

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            self.log("train_loss", loss, on_step=True, on_epoch=True)
            return loss

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            self.log_dict(grad_norm(self, norm_type=2))

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    torch.manual_seed(0)
    x = torch.randn(32, 4)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)),
                                         batch_size=8)
    logger = CSVLogger(str(tmp_path), name="lightning_logs")
    trainer = pl.Trainer(max_epochs=2, accelerator="cpu", devices=1, logger=logger, log_every_n_steps=1,
                         callbacks=[LearningRateMonitor(logging_interval="step")], enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Lit(), loader)
    path = Path(logger.log_dir) / "metrics.csv"
    rows = list(csv.DictReader(path.open()))
    per_step = [r for r in rows if r.get("train_loss_step")]
    assert len(per_step) == 8

    src = CsvSource(path)
    records = list(src)
    with_loss = [r for r in records if "loss" in r.values]
    assert [r.step for r in with_loss] == [int(r["step"]) for r in per_step]
    assert [r.values["loss"] for r in with_loss] == [float(r["train_loss_step"]) for r in per_step]
    norms: Dict[str, float] = with_loss[0].values
    assert norms["grad/global_norm"] == float(per_step[0]["grad_2.0_norm_total"])
    assert norms["grad/layer/net.0.weight"] == float(per_step[0]["grad_2.0_norm/net.0.weight"])
    assert any(r.values.get("opt/lr") == 0.05 for r in records)
    said = "\n".join(src.recognizer.report.lines())
    assert "loss <- 'train_loss_step'" in said and "opt/lr <- 'lr-SGD'" in said
    assert "ignored 'train_loss_epoch': an epoch aggregate" in said
    assert [(r.name, [f for _, f in r.inputs]) for r in find_runs(tmp_path)] == [
        ("lightning_logs/version_0", ["csv"])]
