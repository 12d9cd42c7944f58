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
