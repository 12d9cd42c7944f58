"""Log files → log lines and exceptions: every real captured traceback keeps the fingerprint the whole-text
parser (and the SDK, live) gives it; ranks are demultiplexed; levels, timestamps and filtering."""

from __future__ import annotations

import re
from datetime import datetime
from pathlib import Path
from typing import List

import pytest

from trainguard.core.tracebacks import parse_traceback_text
from trainguard_server.replay.logs import LogItem, LogReader, clean_line, line_level, scan_log, split_prefix
from trainguard_server.replay.times import leading_stamp, leading_timestamp, number_to_ns, parse_time_value

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "tracebacks"
TRACEBACKS = sorted(FIXTURES.glob("*.txt"))


def _items(path: Path, rank: int = 0, min_level: str = "") -> List[LogItem]:
    return list(LogReader(path, rank, min_level=min_level))


@pytest.mark.parametrize("path", TRACEBACKS, ids=[p.name for p in TRACEBACKS])
def test_every_captured_traceback_keeps_its_fingerprint(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    expected = [(e.stream, e.fingerprint().hash, e.exc_type) for e in parse_traceback_text(text)
                if not e.relation]
    found = [i for i in _items(path) if i.kind == "exception"]
    assert [(i.payload["fingerprint"], i.payload["type"]) for i in found] == [(h, t) for _, h, t in expected]
    for item, (stream, _, _) in zip(found, expected):
        assert item.rank == (int(stream[4:]) if stream.startswith("rank") else 0)
        payload = item.payload
        assert payload["fingerprint_version"] == "fp:v1" and payload["mechanism"] == "log"
        assert payload["handled"] is False and payload["traceback"] and isinstance(payload["frames"], list)
        assert all(0 <= h["frame_index"] < len(payload["frames"]) for h in payload["hints"])


def test_torchrun_log_routes_ranks_and_keeps_launcher_records() -> None:
    path = FIXTURES / "torchrun_two_ranks.txt"
    items = _items(path)
    exceptions = [i for i in items if i.kind == "exception"]
    assert [(i.rank, i.payload["type"]) for i in exceptions] == [
        (0, "RuntimeError"), (1, "RuntimeError"),
        (0, "torch.distributed.elastic.multiprocessing.errors.ChildFailedError")]
    # rank 0 and 1 failed the same way with different sizes: one fingerprint
    assert exceptions[0].payload["fingerprint"] == exceptions[1].payload["fingerprint"]
    records = [i for i in items if i.kind == "log"]
    assert records and all(i.level == "ERROR" and i.message.startswith("E1129") for i in records)
    assert [i.line for i in items] == sorted(i.line for i in items)
    assert all(i.time_ns is not None for i in items[2:])  # after the first glog timestamp
    scan = scan_log(path)
    assert scan.ranks == [0, 1] and scan.first_ns is not None and scan.lines == len(
        path.read_text().splitlines())


def test_mixed_log_lines_tracebacks_timestamps_and_levels(tmp_path: Path) -> None:
    handled = (FIXTURES / "chained_cause_context.txt").read_text().rstrip("\n").splitlines()
    crash = (FIXTURES / "shape_mismatch_linear.txt").read_text().rstrip("\n").splitlines()
    lines = ["\x1b[32m2026-11-29 08:00:00,000 INFO train: starting\x1b[0m",
             "2026-11-29 08:00:01,000 WARNING train: gradient overflow, skipping step",
             "epoch 1:  10%|#  | 1/10\repoch 1:  20%|## | 2/10",
             *handled,
             "2026-11-29 08:00:05,000 INFO train: resumed",
             "",
             "NCCL WARN Call to connect returned Connection refused",
             *crash]
    path = tmp_path / "train.log"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    items = _items(path)
    kinds = [(i.kind, i.level) for i in items]
    assert kinds == [("log", "INFO"), ("log", "WARNING"), ("log", ""), ("exception", "CRITICAL"),
                     ("log", "INFO"), ("log", "WARNING"), ("exception", "CRITICAL")]
    assert items[0].message == "2026-11-29 08:00:00,000 INFO train: starting"
    assert items[2].message == "epoch 1:  20%|## | 2/10"
    first = 4
    assert items[3].line == first and items[3].last_line == first + len(handled) - 1
    assert items[3].payload["chain"] and items[3].payload["fingerprint"] == \
        parse_traceback_text("\n".join(handled))[-1].fingerprint().hash
    assert items[6].payload["fingerprint"] == parse_traceback_text("\n".join(crash))[-1].fingerprint().hash
    t1 = leading_timestamp("2026-11-29 08:00:01,000", 2026)
    t5 = leading_timestamp("2026-11-29 08:00:05,000", 2026)
    assert [i.time_ns for i in items] == [t1 - 10**9, t1, t1, t1, t5, t5, t5]
    kept = _items(path, min_level="WARNING")
    assert [(i.kind, i.level) for i in kept] == [("log", "WARNING"), ("exception", "CRITICAL"),
                                                 ("log", "WARNING"), ("exception", "CRITICAL")]


def test_interleaved_ranks_are_assembled_separately(tmp_path: Path) -> None:
    crash = (FIXTURES / "shape_mismatch_linear.txt").read_text().rstrip("\n").splitlines()
    lines: List[str] = []
    for k, line in enumerate(crash):
        lines.append(f"[rank1]:{line}")
        lines.append(f"[rank0]:step {k} loss 0.5 WARNING slow")
    path = tmp_path / "all.log"
    path.write_text("\n".join(lines) + "\n")
    items = _items(path)
    exc = [i for i in items if i.kind == "exception"]
    assert len(exc) == 1 and exc[0].rank == 1
    assert exc[0].payload["fingerprint"] == parse_traceback_text("\n".join(crash))[-1].fingerprint().hash
    assert sum(1 for i in items if i.kind == "log" and i.rank == 0) == len(crash)
    assert [i.line for i in items] == sorted(i.line for i in items)


# the level rules as plain regexes, run on every line (line_level rules lines out with cheaper tests first)
_REFERENCE_LEVEL = re.compile(r"\b(CRITICAL|FATAL|ERROR|WARNING|WARN|INFO|DEBUG)\b|\b\w*(Warning):")
_REFERENCE_ERROR = re.compile(r"Segmentation fault|core dumped|Bus error|^Killed\b|\bAborted\b|out of memory",
                              re.IGNORECASE)
_LEVEL_WORDS = {"FATAL": "CRITICAL", "WARN": "WARNING", "Warning": "WARNING"}


def _reference_level(line: str) -> str:
    glog = re.match(r"^\[?([IWEF])\d{3,4} \d\d:\d\d:\d\d", line) or re.match(r"^\[([IWEF]) [\w.]+:\d+\]", line)
    if glog:
        return {"I": "INFO", "W": "WARNING", "E": "ERROR", "F": "CRITICAL"}[glog.group(1)]
    match = _REFERENCE_LEVEL.search(line[:120])
    if match:
        word = match.group(1) or match.group(2)
        return _LEVEL_WORDS.get(word, word)
    return "ERROR" if _REFERENCE_ERROR.search(line) else ""


def test_line_level_matches_the_plain_rules_on_every_captured_line() -> None:
    lines = [line for path in sorted((FIXTURES.parent).rglob("*")) if path.is_file()
             for line in path.read_text(encoding="utf-8", errors="replace").splitlines()]
    lines += ["killed by signal 9", "Killed", "process ABORTED", "CUDA error: OUT OF MEMORY", "abortedx",
              "bus errors", "WARNINGS: none", "xWarning: y", "Warning:", "kill", "INFOx", "INFO: step 3",
              "I1129 08:12:43.061 ProcessGroupNCCL.cpp:1 init", "CRITICAL: disk full", "FATAL x"]
    assert len(lines) > 5000
    levels = [line_level(line) for line in lines]
    assert levels == [_reference_level(line) for line in lines]
    assert {"", "INFO", "WARNING", "ERROR", "CRITICAL"} <= set(levels)


def test_line_helpers_and_timestamps() -> None:
    assert split_prefix("[rank12]: boom") == (12, "boom")
    assert split_prefix("[default3]:boom") == (3, "boom")
    assert split_prefix("[host7]: boom") == (None, "boom")
    assert clean_line("\x1b[1;31mred\x1b[0m\r\n") == "red"
    assert line_level("[E1129 08:12:43.061727749 ProcessGroupNCCL.cpp:632] timeout") == "ERROR"
    assert line_level("/x/y.py:3: UserWarning: deprecated") == "WARNING"
    assert line_level("Segmentation fault (core dumped)") == "ERROR"
    assert line_level("step 3 loss 0.1") == ""
    local = int(datetime(2026, 11, 29, 8, 12, 43).timestamp()) * 10**9
    assert leading_timestamp("[E1129 08:12:43.061727749 x]", 2026) == local + 61727749
    assert leading_timestamp("I1129 08:12:43.5 x", 2026) == local + 500_000_000
    assert leading_timestamp("2026-11-29T08:12:43Z rest", 1) == 1795939963 * 10**9
    assert leading_timestamp("no time here", 2026) is None
    assert number_to_ns(1795939963) == 1795939963 * 10**9
    assert number_to_ns(1795939963123) == 1795939963123 * 10**6
    assert number_to_ns(1795939963123456) == 1795939963123456 * 10**3
    assert number_to_ns(12.5) is None and number_to_ns(float("nan")) is None
    assert parse_time_value("1795939963.25") == 1795939963250 * 10**6
    assert parse_time_value("yesterday") is None


def test_stamps_have_the_precision_they_were_written_with(tmp_path: Path) -> None:
    local = int(datetime(2026, 11, 29, 8, 12, 43).timestamp()) * 10**9
    assert leading_stamp("2026-11-29 08:12:43,061 INFO x", 2026) == (local + 61_000_000, 10**6)
    assert leading_stamp("I1129 08:12:43.061727 x", 2026) == (local + 61_727_000, 10**3)
    assert leading_stamp("[E1129 08:12:43.061727749 x]", 2026) == (local + 61_727_749, 1)
    assert leading_stamp("I1129 08:12:43.5 x", 2026) == (local + 500_000_000, 10**8)
    assert leading_stamp("2026-11-29T08:12:43Z rest", 1) == (1795939963 * 10**9, 10**9)
    assert leading_stamp("2026-11-29T08:12:43.0611234567Z", 1) == (1795939963 * 10**9 + 61_123_456, 1)
    assert leading_stamp("no time here", 2026) is None
    crash = (FIXTURES / "shape_mismatch_linear.txt").read_text().rstrip("\n")
    path = tmp_path / "train.log"
    path.write_text("2026-11-29 08:12:43,061 WARNING train: step 3\n" + crash + "\n")
    line, exception = _items(path)
    # the traceback has no stamp of its own: the line's before it, with its precision
    assert (line.time_ns, line.precision_ns) == (exception.time_ns, exception.precision_ns) == (
        local + 61_000_000, 10**6)


def test_below_the_level_the_reader_keeps_what_the_classifier_recognises(tmp_path: Path) -> None:
    """A job whose telling line carries no level (a watchdog line without its glog prefix): at
    the default --log-level WARNING the line is below the level, and still reaches the classifier; a
    plain progress line at the same level does not."""
    from trainguard_server.replay.recognised import recognised

    log = tmp_path / "rank0.log"
    log.write_text("step 10 loss 2.31\n"
                   "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=3, OpType=ALLREDUCE) "
                   "ran for 600000 milliseconds before timing out.\n"
                   "step 11 loss 2.30\n", encoding="utf-8")
    plain = list(LogReader(log, 0, min_level="WARNING"))
    kept = list(LogReader(log, 0, min_level="WARNING", keep_below=recognised))
    assert [i.line for i in kept] == [2] and "Watchdog caught collective operation timeout" in kept[0].message
    assert plain == []  # what the default import did before: the error line never reached the classifier


# ---------------------------------------------------------------- pasted text (issue 17: real users' logs)
# the lines below are cut from logs in tests/fixtures/wild (their source.txt names the threads)

def test_c10_short_dates_and_undated_records_have_their_level_and_time() -> None:
    assert line_level("[E626 06:24:44.903881913 ProcessGroupNCCL.cpp:616] [Rank 1] Watchdog caught") == "ERROR"
    assert line_level("[E ProcessGroupNCCL.cpp:458] [Rank 0] Watchdog caught collective") == "ERROR"
    assert line_level("W0321 02:07:08.408271 140 torch/distributed/run.py:793] ") == "WARNING"
    june = leading_stamp("[E626 06:24:44.903881913 ProcessGroupNCCL.cpp:616] x", 2025)
    assert june is not None and datetime.fromtimestamp(june[0] / 1e9).strftime("%m-%d %H:%M") == "06-26 06:24"
    jan = leading_stamp("E121 10:00:00.000 x", 2025)  # January 21, not a month 12 with day "1 "
    assert jan is not None and datetime.fromtimestamp(jan[0] / 1e9).strftime("%m-%d") == "01-21"


def test_line_number_columns_and_ray_prefixes_are_not_part_of_the_line() -> None:
    assert split_prefix("[80746] [rank0]:[E321 02:07:08.408271257 ProcessGroupNCCL.cpp:607] x") == \
        (0, "[E321 02:07:08.408271257 ProcessGroupNCCL.cpp:607] x")
    assert split_prefix("  12 | RuntimeError: boom") == (None, "RuntimeError: boom")
    assert split_prefix("(RayWorkerWrapper pid=4009) [rank1]:[E ProcessGroupNCCL.cpp:563] x") == \
        (1, "[E ProcessGroupNCCL.cpp:563] x")


def test_a_bare_exception_line_and_a_traceback_cut_at_the_top_are_exceptions(tmp_path: Path) -> None:
    path = tmp_path / "pasted.log"
    path.write_text("epoch 3 step 200\n"
                    "RuntimeError: mat1 and mat2 shapes cannot be multiplied (511x2 and 3x4096)\n"
                    "\n"
                    '  File "/content/datasets.py", line 67, in __getitem__\n'
                    "    img = Image.open(self.images[i], mode='r')\n"
                    "KeyError: 0\n")
    exc = [i for i in _items(path, min_level="WARNING") if i.kind == "exception"]
    assert [(e.payload["type"], e.line) for e in exc] == [("RuntimeError", 2), ("KeyError", 4)]
    assert exc[1].payload["frames"][-1]["function"] == "__getitem__"
    # a live job's output (the agent) keeps the old rule: only a printed header opens a traceback
    from trainguard_server.replay.logs import LogSegmenter
    seg = LogSegmenter(0, headless=False)
    for n, line in enumerate(path.read_text().splitlines(), 1):
        seg.feed(n, line, None)
    assert not [i for i in seg.flush() if i.kind == "exception"]


def test_a_traceback_without_its_exception_line_is_not_an_unknown_crash(tmp_path: Path) -> None:
    path = tmp_path / "cut.log"
    path.write_text("Traceback (most recent call last):\n"
                    '  File "train.py", line 10, in <module>\n'
                    "    main()\n"
                    "[E ProcessGroupNCCL.cpp:737] [Rank 3] NCCL watchdog thread terminated with exception\n")
    items = _items(path)
    assert not [i for i in items if i.kind == "exception"]
    assert any("NCCL watchdog" in i.message for i in items)


def test_a_log_that_keeps_nothing_sends_its_tail(tmp_path: Path) -> None:
    quiet = tmp_path / "quiet.log"
    quiet.write_text("".join(f"iter {i}: loss 0.{i}\n" for i in range(80)) + "**Killed**\n")
    kept = [i.message for i in LogReader(quiet, min_level="WARNING", tail=5)]
    assert kept == ["iter 76: loss 0.76", "iter 77: loss 0.77", "iter 78: loss 0.78", "iter 79: loss 0.79",
                    "**Killed**"]
    assert LogReader(quiet, min_level="WARNING").stats.below_level == 0  # nothing read yet
    assert [i for i in LogReader(quiet, min_level="WARNING")] == []       # tail 0: nothing, as before
    loud = tmp_path / "loud.log"
    loud.write_text("iter 1\niter 2\nERROR: disk quota exceeded\niter 3\n")
    assert [i.message for i in LogReader(loud, min_level="WARNING", tail=5)] == ["ERROR: disk quota exceeded"]
