"""A terminal's hard wrap that falls right after a piece that cannot end a line -- a label's colon and its
one space (``thread: ``) or a log tag and its space (``NCCL WARN ``) -- is joined again even when the next
piece starts like a line of its own (a bracket, an ``...Error`` word): replay logs.py's ``_OPEN_END_RE``
(issue 17, stop 40, h17c; found by bench/wild/stress.py's wrap80 over the tuned part)."""

from __future__ import annotations

from pathlib import Path
from typing import List

from trainguard_server.replay.logs import LogReader, paste_wrap, unwrapped

from .local_import import WILD, imported, pasted, shown


def _wrapped80(tmp_path: Path, case: str) -> Path:
    """A tuned wild log as an 80-column terminal cuts it (pieces of 80 characters, copied as is)."""
    rows: List[str] = []
    for line in (WILD / case / "log.txt").read_text(encoding="utf-8").splitlines():
        rows.extend([line[i:i + 80] for i in range(0, len(line), 80)] or [""])
    return pasted(tmp_path, rows)


def _messages(path: Path) -> List[str]:
    return [i.message.rstrip() for i in LogReader(path, 0, min_level="")]


def test_a_cuda_assert_wrapped_after_thread_colon_is_one_line_again(tmp_path: Path) -> None:
    # mem-device-assert-thc-index-select-large-signature-ipnet-4-1 (tuned): each kernel-assert line breaks at
    # 80 columns right after 'thread: ', its '[47,0,0] Assertion `srcIndex < srcSelectDimSize` failed.' on
    # the next row -- taken for a line of its own (a bracket), the assert was never read
    case = "mem-device-assert-thc-index-select-large-signature-ipnet-4-1"
    path = _wrapped80(tmp_path, case)
    assert paste_wrap(path)[0] == 80
    texts = _messages(path)
    assert any("thread: [47,0,0] Assertion `srcIndex < srcSelectDimSize` failed." in t for t in texts), texts
    assert shown(imported(path))[:1] == ["memory/cuda-error"]


def test_an_nccl_warn_wrapped_after_its_tag_is_one_line_again(tmp_path: Path) -> None:
    # comm-init-ring-loop-hostid-1 (tuned): 'NCCL WARN ' ends the first row, 'Error : ring 0 does not loop back
    # to start (14 != 0)' the next -- an '...Error' word, so before a line of its own and the warning lost
    case = "comm-init-ring-loop-hostid-1"
    path = _wrapped80(tmp_path, case)
    texts = _messages(path)
    assert any(t.endswith("NCCL WARN Error : ring 0 does not loop back to start (14 != 0)") for t in texts), texts
    assert shown(imported(path))[:1] == ["comm/init-failure"]


def test_only_an_open_end_joins_a_piece_that_starts_like_a_line(tmp_path: Path) -> None:
    rows = ["a" * 72 + "thread: ", "[1,0,0] Assertion `x` failed.",      # open end: joins
            "b" * 70 + "NCCL WARN ", "Error : ring 0",                    # open end: joins
            "c" * 79 + ":", "[E ProcessGroupNCCL.cpp:1] next line",      # colon without its space: no
            "d" * 72 + "thread: ", "  File \"x.py\", line 1",              # indented next piece: no
            "e" * 78 + ": ", "[rank1]: x"]                                # a full row ending in a label: goes on
    path = pasted(tmp_path, rows)
    with path.open("rb") as fh:
        got = [(n, len(t)) for n, t in unwrapped(fh, 80, padded=False)]
    assert got == [(1, 80 + 29), (3, 80 + 14), (5, 80), (6, 36), (7, 80), (8, 21), (9, 90)]
    # a padded screen's end of line (two spaces) never joins
    rows = ["f" * 77 + ":  ", "[x] y", "g" * 60]
    path = pasted(tmp_path, rows)
    with path.open("rb") as fh:
        assert [n for n, _ in unwrapped(fh, 80, padded=True)] == [1, 2, 3]
