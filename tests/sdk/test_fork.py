"""A forked child (a DataLoader worker) is not the rank: it sends no heartbeat and no lifecycle event of
its own, while the process that called ``init()`` keeps its heartbeats; what the user logs or captures in
the child is still sent, under the child's pid."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Iterator

import pytest

import trainguard
from tests.sdk.scripting import of_kind, read_jsonl, run_python
from trainguard.guard import reset_warnings

HEARTBEAT_S = 0.05

DATALOADER_TRAINING = """
import os, time
import torch
from torch.utils.data import DataLoader, Dataset
import trainguard

trainguard.init(endpoint="file://{out}", project="t", spool_dir="", heartbeat_interval={hb},
                flush_interval={hb})


class Slow(Dataset):
    def __len__(self):
        return 24

    def __getitem__(self, i):
        time.sleep(0.05)  # workers live for many heartbeat intervals
        if i == 5:  # the user captures an error in a worker: that is still reported
            try:
                raise ValueError("bad sample 5")
            except ValueError:
                trainguard.capture_exception()
            trainguard.flush(5)
        return torch.full((4,), float(i))


loader = DataLoader(Slow(), batch_size=2, num_workers=2)
for step, batch in enumerate(loader):
    trainguard.log(step=step, loss=float(batch.mean()))
print("parent", os.getpid())
"""


def test_dataloader_workers_send_no_heartbeat_or_lifecycle(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    out = tmp_path / "events.jsonl"
    proc = run_python(DATALOADER_TRAINING.format(out=out, hb=HEARTBEAT_S))
    assert proc.returncode == 0, proc.stderr
    parent = int(proc.stdout.split()[-1])
    events = read_jsonl(out)
    heartbeats = of_kind(events, "heartbeat")
    assert len(heartbeats) >= 5  # the parent kept beating for the ~0.6 s the loader ran
    assert {e["pid"] for e in heartbeats} == {parent}
    lifecycle = of_kind(events, "lifecycle")
    assert [(e["pid"], e["lifecycle"]["phase"]) for e in lifecycle] == [(parent, "START"), (parent, "EXIT")]
    assert lifecycle[-1]["lifecycle"]["exit_code"] == 0
    (captured,) = of_kind(events, "exception")
    assert captured["exception"]["message"] == "bad sample 5"
    assert captured["pid"] != parent and captured["rank"] == lifecycle[0]["rank"]
    assert sorted(int(e["step"]) for e in of_kind(events, "metrics")) == list(range(12))
    assert {e["pid"] for e in of_kind(events, "metrics")} == {parent}


@pytest.fixture
def _clean() -> Iterator[None]:
    reset_warnings()
    yield
    trainguard.shutdown(timeout=2)


def test_a_forked_child_killed_by_sigterm_is_not_the_rank_exiting(tmp_path: Path, _clean: None) -> None:
    """os.fork() in the training process: the child inherits the SDK (its SIGTERM handler included), beats
    for nothing and, terminated as DataLoader shuts down a slow worker, reports no EXIT 143 for the rank."""
    out = tmp_path / "events.jsonl"
    trainguard.init(endpoint=f"file://{out}", project="p", spool_dir="", heartbeat_interval=HEARTBEAT_S,
                    flush_interval=HEARTBEAT_S, capture_exit=True, capture_uncaught=False)
    trainguard.log(step=7, loss=1.0)
    assert trainguard.flush(5)
    pid = os.fork()
    if pid == 0:  # the child: log once, live for many heartbeat intervals, then be terminated
        try:
            trainguard.log(step=8, loss=2.0)
            trainguard.flush(5)
            time.sleep(20 * HEARTBEAT_S)
            os.kill(os.getpid(), signal.SIGTERM)  # the SDK's handler runs, then the default disposition
            time.sleep(5)
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == -signal.SIGTERM
    time.sleep(4 * HEARTBEAT_S)
    assert trainguard.flush(5)
    events = read_jsonl(out)
    me = os.getpid()
    heartbeats = of_kind(events, "heartbeat")
    assert {e["pid"] for e in heartbeats} == {me} and len(heartbeats) >= 5
    assert [(e["pid"], e["lifecycle"]["phase"]) for e in of_kind(events, "lifecycle")] == [(me, "START")]
    assert [(e["pid"], e["step"]) for e in of_kind(events, "metrics")] == [(me, 7), (pid, 8)]
