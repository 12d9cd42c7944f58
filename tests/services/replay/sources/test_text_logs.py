"""Megatron-LM and DeepSpeed text logs, produced with the frameworks' own format strings.

Megatron-LM: ``megatron/training/training.py``, ``training_log()`` (NVIDIA/Megatron-LM): the
``log_string`` built below is that function's, field by field, in its order and with its format specs.
DeepSpeed: ``deepspeed/runtime/engine.py``, ``DeepSpeedEngine._report_progress`` logs
``f"step={step}, skipped={self.skipped_steps}, lr={lr}, mom={mom}"`` through ``deepspeed.utils.log_dist``
(``[Rank 0] `` prefix) on DeepSpeed's logger (format ``[%(asctime)s] [%(levelname)s]
[%(filename)s:%(lineno)d:%(funcName)s] %(message)s``); its fp16 optimizer prints the OVERFLOW line below.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, List

import pytest

from trainguard_server.cli import main
from trainguard_server.replay.sources.deepspeed import DeepSpeedLogSource
from trainguard_server.replay.sources.megatron import MegatronLogSource
from trainguard_server.replay.sources.registry import detect
from trainguard_server.storage.sqlite import open_sqlite_stores


def megatron_line(now: datetime, iteration: int, train_iters: int, consumed: int, elapsed_s: float,
                  learning_rate: float, batch_size: int, losses: dict, loss_scale: float, grad_norm: float,
                  skipped: int, nans: int) -> str:
    log_string = f" [{now.strftime('%Y-%m-%d %H:%M:%S')}]"
    log_string += f' iteration {iteration:8d}/{train_iters:8d} |'
    log_string += f' consumed samples: {consumed:12d} |'
    log_string += f' elapsed time per iteration (ms): {elapsed_s * 1000.0:.1f} |'
    log_string += f' learning rate: {learning_rate:.6E} |'
    log_string += f' global batch size: {batch_size:5d} |'
    for key, avg in losses.items():
        log_string += f' {key}: {avg:.6E} |'
    log_string += f' loss scale: {loss_scale:.1f} |'
    log_string += f' grad norm: {grad_norm:.3f} |'
    log_string += f' number of skipped iterations: {skipped:3d} |'
    log_string += f' number of nan iterations: {nans:3d} |'
    return log_string


def _megatron_log(path: Path, iters: int = 60, blow_at: int = 40) -> List[float]:
    start = datetime(2026, 3, 1, 12, 0, 0)
    lines = ["using world size: 1, data-parallel size: 1", "> building GPT model ..."]
    losses = []
    for it in range(1, iters + 1):
        loss = 8.0 * 0.97 ** it if it < blow_at else 8.0 * 0.97 ** blow_at * 1.4 ** (it - blow_at + 3)
        losses.append(loss)
        lines.append(megatron_line(start + timedelta(seconds=0.5 * it), it, iters, it * 32, 0.5, 1.5e-4, 32,
                                   {"lm loss": loss}, 65536.0 if it < 20 else 32768.0, 1.0 + 0.01 * it,
                                   1 if it == 20 else 0, 0))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return losses


def test_megatron_lines(tmp_path: Path, capsys: Any) -> None:
    path = tmp_path / "train.log"
    losses = _megatron_log(path)
    assert detect(path) == "megatron"
    src = MegatronLogSource(path)
    records = list(src)
    assert [r.step for r in records] == list(range(1, 61))
    first = records[0].values
    assert first["loss"] == float(f"{losses[0]:.6E}") and first["opt/lr"] == 1.5e-4
    assert first["amp/scale"] == 65536.0 and first["grad/global_norm"] == 1.01
    assert first["time/step_s"] == 0.5  # "(ms)" -> seconds
    assert records[19].values["amp/overflow"] == 1.0 and first["amp/overflow"] == 0.0
    assert records[1].time_ns is not None and records[0].time_ns is not None
    assert records[1].time_ns - records[0].time_ns in (0, 10**9)  # second precision
    said = "\n".join(src.recognizer.report.lines())
    assert "loss <- 'lm loss'" in said and "time/step_s <- 'elapsed time per iteration (ms)' (ms)" in said
    assert "ignored 'consumed samples': bookkeeping" in said
    data = tmp_path / "data"
    code = main(["replay", "--data-dir", str(data), "--run-id", "meg", "--quiet", str(path)])
    out = capsys.readouterr().out
    assert code == 0, out
    stores = open_sqlite_stores(data)
    try:
        found = {(i.category, i.subtype) for i in stores.incidents.list_incidents("default", run_id="meg").items}
    finally:
        stores.close()
    assert ("loss", "divergence") in found, out


def test_deepspeed_progress_and_overflow_lines(tmp_path: Path) -> None:
    path = tmp_path / "ds.log"
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter(
        "[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:%(funcName)s] %(message)s"))
    log = logging.getLogger("DeepSpeed-test")
    log.propagate = False
    log.setLevel(logging.INFO)
    log.addHandler(handler)
    skipped = 0
    for step in range(1, 11):
        if step == 6:
            skipped += 1
            log.info("[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 65536, reducing to 32768")
        lr, mom = [1e-4 * step], [(0.9, 0.999)]
        log.info(f"[Rank 0] step={step}, skipped={skipped}, lr={lr}, mom={mom}")
    handler.close()
    log.removeHandler(handler)
    assert detect(path) == "deepspeed"
    records = list(DeepSpeedLogSource(path))
    assert [r.step for r in records] == list(range(1, 11))
    assert [r.values["amp/overflow"] for r in records] == [0.0] * 5 + [1.0] + [0.0] * 4
    assert records[5].values["amp/scale"] == 32768.0 and "amp/scale" not in records[6].values
    assert records[2].values["opt/lr"] == pytest.approx(3e-4) and all(r.time_ns for r in records)
