"""Wordings the classifier reads since stop 48 (hL4), from the TUNED side's misses of the thirteenth fresh
batch (b63c02c, measured once before any change):

* PyTorch's ``RuntimeError: DataLoader worker (pid(s) N[, M]) exited unexpectedly`` names no signal, yet the
  worker process is gone without an exception of its own (a Python error in a worker is re-raised as ``Caught
  X in DataLoader worker process N``): the worker's abnormal exit, process/exit -- as a worker ``killed by
  signal: Bus error`` is -- not a plain exception (pytorch-chatbot#3 and DeepGlobe#31 read process/exception;
  the corpus labels every such paste process/exit, or process/killed when the kill is shown).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.test_classify_stop47_fresh11 import _log, _reading
from tests.services.replay.local_import import imported, shown
from trainguard_engine.classify import classify_text

WILD = Path(__file__).resolve().parents[1] / "fixtures" / "wild"
HEALTHY = Path(__file__).resolve().parents[1] / "fixtures" / "healthy48b"

CHATBOT = "proc-exit-dataloader-worker-exited-unexpectedly-raise-line-blank-pytorch-chatbot-3-1"
DEEPGLOBE = "proc-exit-dataloader-exited-then-windows-exit-code-0xc000001d-deepglobe-road-extraction-challenge-31-1"


@pytest.mark.parametrize("case", [CHATBOT, DEEPGLOBE])
def test_the_tuned_pastes(case: str) -> None:
    assert _reading(_log(case)) == ("process/exit", "dataloader.worker")
    assert shown(imported(WILD / case / "log.txt"))[:1] == ["process/exit"]


@pytest.mark.parametrize("line, kind", [
    ("RuntimeError: DataLoader worker (pid(s) 980) exited unexpectedly", "process/exit"),
    ("RuntimeError: DataLoader worker (pid(s) 7228, 10380, 9840, 12944) exited unexpectedly", "process/exit"),
    ("RuntimeError: DataLoader worker (pid 4567) is killed by signal: Killed. ", "process/killed"),
    ("RuntimeError: DataLoader worker (pid 4567) is killed by signal: Bus error. ", "process/exit"),
])
def test_a_dead_workers_report_is_its_exit(line: str, kind: str) -> None:
    found = classify_text(line)
    assert found is not None and (found.kind, found.rule) == (kind, "dataloader.worker")
    assert found.facts["pids"]


def test_a_workers_own_exception_stays_an_exception() -> None:
    text = ("Traceback (most recent call last):\n  File \"train.py\", line 9, in <module>\n"
            "    for batch in loader:\nValueError: Caught ValueError in DataLoader worker process 0.\n"
            "Original Traceback (most recent call last):\nValueError: bad sample 17\n")
    found = classify_text(text)
    assert found is not None and (found.kind, found.rule) == ("process/exception", "dataloader.worker")


@pytest.mark.parametrize("text", [
    "    raise RuntimeError('DataLoader worker (pid(s) {}) exited unexpectedly'.format(pids_str))\n",
    "If a DataLoader worker exited unexpectedly, try num_workers=0 first.\n",
    "Epoch 3: loss 0.41, 12 DataLoader workers, pin_memory=True\n",
])
def test_the_source_line_and_prose_open_no_worker_exit(text: str) -> None:
    found = classify_text(text)
    assert found is None or found.rule != "dataloader.worker"


@pytest.mark.parametrize("case", sorted(p.name for p in HEALTHY.iterdir()))
def test_healthy48b_pastes_open_nothing(case: str) -> None:
    """tests/fixtures/healthy48b: five real pastes of runs that were training (judged from their threads)."""
    assert classify_text((HEALTHY / case / "log.txt").read_text(encoding="utf-8")) is None
    assert shown(imported(HEALTHY / case / "log.txt")) == []
