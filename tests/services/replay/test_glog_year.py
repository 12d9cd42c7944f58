"""Yearless glog stamps (``E0101 00:00:03.100 ...``) take the year that puts them nearest the stamps around
them: a paste crossing a new year keeps its order and span (before, the glog lines took the dated lines' year
blindly and landed a year away, where the gateway refused them out_of_range)."""

from __future__ import annotations

import os
from datetime import datetime
from pathlib import Path
from typing import List

from trainguard_server.replay import Importer, LocalBackend, ReplayOptions
from trainguard_server.replay.logs import LogReader, scan_log
from trainguard_server.replay.times import leading_stamp_year

WATCHDOG = ("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE, "
            "NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600027 milliseconds before timing out.")


def _ns(*args: int) -> int:
    return int(datetime(*args).timestamp()) * 10**9  # type: ignore[arg-type]


def _times(path: Path) -> List[int]:
    return [item.time_ns for item in LogReader(path, 0, min_level="") if item.time_ns is not None]


def _write(tmp_path: Path, lines: List[str], year_saved: int = 2033) -> Path:
    path = tmp_path / "log.txt"
    path.write_text("\n".join(lines) + "\n")
    saved = _ns(year_saved, 6, 1, 12, 0, 0) // 10**9
    os.utime(path, (saved, saved))  # saved in another year than the paste's
    return path


def test_a_yearless_stamp_is_read_in_the_year_nearest_the_stamp_given() -> None:
    line = "E0101 00:00:03 ProcessGroupNCCL.cpp:1] x"
    assert leading_stamp_year(line, 2024) == (_ns(2024, 1, 1, 0, 0, 3), 10**9, None)  # no near: as before
    assert leading_stamp_year(line, 2024, _ns(2024, 12, 31, 23, 59, 58)) == (_ns(2025, 1, 1, 0, 0, 3), 10**9, 2025)
    assert leading_stamp_year(line, 2024, _ns(2024, 1, 2, 0, 0, 0)) == (_ns(2024, 1, 1, 0, 0, 3), 10**9, None)
    before = "E1231 23:59:59 x.cpp:1] y"
    assert leading_stamp_year(before, 2025, _ns(2025, 1, 1, 0, 0, 2)) == (_ns(2024, 12, 31, 23, 59, 59), 10**9, 2024)
    # an ISO date states its own year whatever is near
    assert leading_stamp_year("2024-05-01 12:00:00,000 x", 2030, 0) == (_ns(2024, 5, 1, 12), 10**6, 2024)


def test_feb_29_is_read_in_the_leap_year_nearest() -> None:
    found = leading_stamp_year("E0229 10:00:00 x.cpp:1] y", 2025, _ns(2025, 1, 20, 0, 0, 0))
    assert found is not None and found[0] == _ns(2024, 2, 29, 10, 0, 0)


def test_glog_lines_after_a_dated_line_cross_the_new_year(tmp_path: Path) -> None:
    path = _write(tmp_path, ["2024-12-31 23:59:58,000 - INFO - step 10",
                             f"[E0101 00:00:03.100 ProcessGroupNCCL.cpp:632] {WATCHDOG}",
                             "E0101 00:00:04.000 ProcessGroupNCCL.cpp:1]  terminate called"])
    got = _times(path)
    assert got == [_ns(2024, 12, 31, 23, 59, 58), _ns(2025, 1, 1, 0, 0, 3) + 100_000_000, _ns(2025, 1, 1, 0, 0, 4)]
    scan = scan_log(path)
    assert (scan.first_ns, scan.last_ns) == (got[0], got[-1])


def test_glog_lines_before_the_first_dated_line_take_its_nearest_year(tmp_path: Path) -> None:
    path = _write(tmp_path, ["E1231 23:59:50.000 a.cpp:1] first", "2025-01-01 00:00:02,000 - INFO - dated",
                             "E0101 00:00:05.000 b.cpp:1] after"])
    assert _times(path) == [_ns(2024, 12, 31, 23, 59, 50), _ns(2025, 1, 1, 0, 0, 2), _ns(2025, 1, 1, 0, 0, 5)]
    scan = scan_log(path)
    assert scan.last_ns is not None and scan.first_ns is not None and scan.last_ns - scan.first_ns == 15 * 10**9


def test_a_paste_of_glog_lines_only_crossing_the_new_year_keeps_its_order(tmp_path: Path) -> None:
    # no dated line: the first stamp takes the year, of the file's and the one before, nearest the file's
    # modification time and not after it (saved 2030-06-01: December 31 is of 2029 -- before, of 2030, half
    # a year after the file was saved); the next the year nearest the stamp before it
    path = _write(tmp_path, ["E1231 23:59:50.000 a.cpp:1] first", "E0101 00:00:05.000 b.cpp:1] after"],
                  year_saved=2030)
    assert _times(path) == [_ns(2029, 12, 31, 23, 59, 50), _ns(2030, 1, 1, 0, 0, 5)]
    scan = scan_log(path)
    assert (scan.first_ns, scan.last_ns) == (_ns(2029, 12, 31, 23, 59, 50), _ns(2030, 1, 1, 0, 0, 5))


def test_a_glog_only_paste_is_read_in_the_files_year_up_to_a_day_after_it_was_saved(tmp_path: Path) -> None:
    # saved 2030-06-01 12:00: a stamp of that morning, or of the next day (another clock or time zone), is of
    # 2030; one two days later can only be of 2029
    for stamp, year in (("E0601 09:00:00.000", 2030), ("E0602 11:00:00.000", 2030), ("E0603 12:00:00.000", 2029)):
        path = _write(tmp_path, [f"{stamp} a.cpp:1] x"], year_saved=2030)
        month, day = int(stamp[1:3]), int(stamp[3:5])
        assert _times(path) == [_ns(year, month, day, int(stamp[6:8]), 0, 0)], stamp


def test_the_watchdog_timeout_of_a_new_year_paste_is_imported(tmp_path: Path) -> None:
    # before: the glog line read in 2024 lay 365 days before the dated line, the import was shifted to end near
    # the server clock and the gateway refused the glog line out_of_range -- the run showed no timeout
    path = _write(tmp_path, ["2024-12-31 23:59:58,000 - INFO - step 10",
                             f"[E0101 00:00:03.100 ProcessGroupNCCL.cpp:632] {WATCHDOG}"])
    backend = LocalBackend(tmp_path / "data")
    try:
        summary = Importer(ReplayOptions(run_id="newyear", logs=[(0, path)]), backend).run()
        backend.finish()
        assert not summary.rejected
        kinds = {f"{i['category']}/{i['subtype']}" for i in backend.incidents("newyear")}
    finally:
        backend.close()
    assert "comm/timeout" in kinds


def test_the_summary_says_how_many_events_were_refused_as_older_than_the_window(tmp_path: Path) -> None:
    # a paste spanning 46 days: the import is shifted to end near the server clock, its oldest events fall
    # before the gateway's max past age (30 days) and are refused -- the summary says so, and how many
    import io

    from trainguard_server.replay.report import print_summary

    path = _write(tmp_path, ["2024-01-15 10:00:00,000 - ERROR - RuntimeError: CUDA error: an illegal memory access",
                             "2024-03-01 10:00:00,000 - INFO - step 10",
                             "2024-03-01 10:05:00,000 - ERROR - launcher failed"])
    backend = LocalBackend(tmp_path / "data")
    try:
        summary = Importer(ReplayOptions(run_id="span", logs=[(0, path)]), backend).run()
        backend.finish()
    finally:
        backend.close()
    assert summary.too_old_expected and "more than the backend's window" in summary.time_note
    # in the files' own times: a cutoff between the paste's first and last lines (its day moves with the wall
    # clock's time of day -- the shift keeps times of day -- so only the range is asserted)
    import re

    cutoff = re.search(r"events before (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)", summary.time_note)
    assert cutoff is not None, summary.time_note
    assert "2024-01-15 10:00:00" < cutoff.group(1) < "2024-03-01 10:00:00", summary.time_note
    assert summary.rejected["out_of_range"] >= 2  # the rank's START and the January line
    out = io.StringIO()
    print_summary(summary, out)
    text = out.getvalue()
    assert f"rejected out_of_range: {summary.rejected['out_of_range']} (older than the backend's max past age" in text


def test_a_paste_within_the_window_says_nothing_of_it(tmp_path: Path) -> None:
    path = _write(tmp_path, ["2024-03-01 10:00:00,000 - INFO - step 10", "2024-03-01 10:05:00,000 - ERROR - failed"])
    backend = LocalBackend(tmp_path / "data")
    try:
        summary = Importer(ReplayOptions(run_id="short", logs=[(0, path)]), backend).run()
        backend.finish()
    finally:
        backend.close()
    assert not summary.too_old_expected and "window (max past age" not in summary.time_note
    assert not summary.rejected


def test_a_glog_only_29_february_is_read_in_the_last_leap_year(tmp_path: Path) -> None:
    # found by the stop-40 review: saved 2029 (no 29 February), the stamp could not be read in 2029 and the
    # paste kept 2029 -- its lines then had no time at all; it is of 2028, the last year that has the day
    path = _write(tmp_path, ["E0229 10:00:00.000 a.cpp:1] x"], year_saved=2029)
    assert _times(path) == [_ns(2028, 2, 29, 10, 0, 0)]
