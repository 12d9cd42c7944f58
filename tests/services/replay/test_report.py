"""The progress display: one redrawn line on a terminal, plain lines now and then otherwise."""

from __future__ import annotations

import io
from typing import List

from trainguard_server.replay.report import Progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_redraws_one_line_on_a_terminal() -> None:
    now: List[float] = [100.0]
    out = _Terminal()
    progress = Progress(out, clock=lambda: now[0])
    progress.start(4 * 2**20)
    progress.add_bytes(2**20)
    progress.update(100)          # not yet due
    assert out.getvalue() == ""
    now[0] += 2.0
    progress.update(5000)
    assert out.getvalue() == "\rreplay:  25.0% of 4.0 MiB read, 5,000 events sent (2,500 events/s, 2 s)\x1b[K"
    progress.add_bytes(3 * 2**20)
    progress.finish()
    assert out.getvalue().endswith("\rreplay: 100.0% of 4.0 MiB read, 5,000 events sent (2,500 events/s, 2 s)"
                                   "\x1b[K\n")


def test_progress_prints_plain_lines_elsewhere_and_can_be_silenced() -> None:
    now: List[float] = [0.0]
    out = io.StringIO()
    progress = Progress(out, clock=lambda: now[0])
    progress.start(1000)
    for second in range(1, 31):
        now[0] = float(second)
        progress.add_bytes(10)
        progress.update(second * 10)
    lines = out.getvalue().splitlines()
    assert len(lines) == 3  # one every 10 s
    assert lines[0] == "replay:  10.0% of 1000 B read, 90 events sent (9 events/s, 10 s)"
    assert lines[2].startswith("replay:  30.0% of 1000 B read, 290 events sent")
    quiet = io.StringIO()
    silent = Progress(quiet, enabled=False, clock=lambda: now[0])
    silent.start(10)
    now[0] += 100
    silent.update(5)
    silent.finish()
    assert quiet.getvalue() == ""


def test_the_summary_says_what_was_recognised_and_where_each_incident_came_from(tmp_path) -> None:
    from trainguard_server.replay import Importer, LocalBackend, ReplayOptions
    from trainguard_server.replay.report import print_status, print_summary

    log = tmp_path / "train.log"  # cut from tests/fixtures/wild/comm-watchdog-* (real watchdog lines)
    log.write_text(
        "epoch 0 step 10 loss 2.31\n"
        "[rank1]:[E626 06:24:44.903881913 ProcessGroupNCCL.cpp:616] [Rank 1] Watchdog caught collective operation "
        "timeout: WorkNCCL(SeqNum=808, OpType=ALLREDUCE, NumelIn=9801523, NumelOut=9801523, Timeout(ms)=600000) "
        "ran for 600020 milliseconds before timing out.\n"
        "epoch 0 step 11 loss 2.30\n"
        "RuntimeError: CUDA error: an illegal memory access was encountered\n")
    backend = LocalBackend(tmp_path / "data")
    try:
        summary = Importer(ReplayOptions(run_id="r1", logs=[(0, log)]), backend).run()
        backend.finish()
        incidents = backend.incidents("r1")
    finally:
        backend.close()
    out = io.StringIO()
    print_summary(summary, out)
    assert "4 lines, 1 recognised by the classifier" in out.getvalue()  # the exception is counted apart
    out = io.StringIO()
    print_status({"run_id": "r1"}, incidents, out, origins=summary.origins)
    text = out.getvalue()
    assert "comm/timeout" in text and "from train.log:2\n" in text
    assert "memory/cuda-error" in text and "from train.log:2, 4\n" in text  # the timeout is its evidence too
