"""A real tiny HF ``Trainer`` run's ``trainer_state.json``, read by :class:`TrainerStateSource`."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Dict

import torch
from torch import nn

from trainguard_server.replay.sources.hf_log import HfLogSource
from trainguard_server.replay.sources.hf_trainer import TrainerStateSource
from trainguard_server.replay.sources.registry import detect, find_runs


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> Dict[str, torch.Tensor]:
        return {"loss": nn.functional.mse_loss(self.net(x), labels)}


def test_log_history_of_a_real_trainer_run(tmp_path: Path) -> None:
    from transformers import Trainer, TrainingArguments

    torch.manual_seed(0)
    x = torch.randn(64, 8)
    data = [{"x": x[i], "labels": x[i].sum().sin().reshape(1)} for i in range(64)]
    out = tmp_path / "hf-out"
    args = TrainingArguments(output_dir=str(out), max_steps=8, per_device_train_batch_size=8, logging_steps=2,
                             learning_rate=0.05, max_grad_norm=1.0, report_to=[], save_strategy="steps",
                             save_steps=4, use_cpu=True, disable_tqdm=True, dataloader_num_workers=0)
    trainer = Trainer(model=Regressor(), args=args, train_dataset=data)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):  # disable_tqdm: its PrinterCallback prints each log dict
        trainer.train()
    (tmp_path / "train.log").write_text(printed.getvalue(), encoding="utf-8")
    states = sorted(out.glob("checkpoint-*/trainer_state.json"))
    assert [p.parent.name for p in states] == ["checkpoint-4", "checkpoint-8"]
    history = json.loads(states[-1].read_text())["log_history"]
    logged = [h for h in history if "loss" in h]

    src = TrainerStateSource(states[-1])
    records = list(src)
    assert [r.step for r in records] == [h["step"] for h in logged] == [2, 4, 6, 8]
    for rec, h in zip(records, logged):
        assert rec.values["loss"] == h["loss"] and rec.values["grad/global_norm"] == h["grad_norm"]
        assert rec.values["opt/lr"] == h["learning_rate"]
        assert "epoch" not in rec.values and rec.time_ns is None
    said = "\n".join(src.recognizer.report.lines())
    assert "ignored 'epoch': bookkeeping (epoch counter)" in said
    # what it printed: the same dicts, without steps (numbered by position)
    log = tmp_path / "train.log"
    assert detect(log) == "hf-log"
    printed_src = HfLogSource(log)
    printed_records = list(printed_src)
    assert [r.step for r in printed_records] == [0, 1, 2, 3]
    assert [r.values["loss"] for r in printed_records] == [round(h["loss"], 4) for h in logged]  # as printed
    assert printed_src.recognizer.report.ignored["train_runtime"] == "end-of-training summary (HF log)"
    # the run in the tree: the latest checkpoint's state, once (and the printed log)
    runs = find_runs(tmp_path)
    assert [(r.name, [(p.relative_to(tmp_path).as_posix(), f) for p, f in r.inputs]) for r in runs] == [
        (".", [("train.log", "hf-log")]), ("hf-out", [("hf-out/checkpoint-8/trainer_state.json", "hf-trainer")])]
    # the end-of-training summary entry (train_loss = the run's mean) is no step's loss
    history.append({"epoch": 1.0, "step": 8, "total_flos": 1.0, "train_loss": 0.4, "train_runtime": 1.2,
                    "train_samples_per_second": 50.0, "train_steps_per_second": 6.0})
    final = tmp_path / "trainer_state.json"
    final.write_text(json.dumps({"log_history": history}))
    src = TrainerStateSource(final)
    assert [r.step for r in src] == [2, 4, 6, 8]
    assert src.recognizer.report.ignored["train_loss"] == "end-of-training summary (HF log_history)"
