"""The agent's live capture never withholds later errors behind an unsettled item (hR's review of 7beeef3).

A pasted or saved log holds an item that reports a failure only if the run did not go on (c10d's warning for
one connect attempt, an inline exception after a sentence) until a progress line drops it or the end emits it --
and every later item waits behind it. A live tail cannot wait: during a hang no progress line and no end ever
come, so the watchdog's timeout that follows would never be sent. The agent's segmenter emits such items at once
(the engine judges a live connect-attempt warning itself: tests/engine/test_live_connect_retry.py)."""

from __future__ import annotations

from typing import List, Tuple

from trainguard_server.replay.logs import LogSegmenter

LINES = [
    "[W socket.cpp:663] [c10d] The client socket has failed to connect to [localhost]:29500 (errno: 99 - Cannot "
    "assign requested address).",
    "Loading data shards ...",
    "[E ProcessGroupNCCL.cpp:475] [Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, "
    "OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=1800000) ran for 1800524 milliseconds before timing out.",
    "ERROR: rank 0 lost contact with rank 3 (NCCL communicator aborted)",
]


def _released_live(segmenter: LogSegmenter) -> List[Tuple[str, int]]:
    got: List[Tuple[str, int]] = []
    for number, line in enumerate(LINES, 1):
        segmenter.feed(number, line, 1_000 * number)
        got += [(item.kind, item.line) for item in segmenter.take()]
    return got


def test_the_agents_segmenter_releases_the_watchdog_timeout_before_any_end() -> None:
    from trainguard_server.agent import capture

    made: List[LogSegmenter] = []
    real = capture.LogSegmenter

    def spy(*args: object, **kwargs: object) -> LogSegmenter:
        made.append(real(*args, **kwargs))  # type: ignore[arg-type]
        return made[-1]

    capture.LogSegmenter = spy  # type: ignore[assignment,misc]
    try:
        capture.OutputCapture("stderr", 0, builder=None, emit=lambda events: None)  # type: ignore[arg-type]
    finally:
        capture.LogSegmenter = real  # type: ignore[misc]
    assert made and made[0].hold_unsettled is False
    released = _released_live(made[0])
    assert [line for _kind, line in released] == [1, 3, 4]  # the warning, then the watchdog and the ERROR line


def test_a_paste_still_holds_the_warning_until_it_knows_whether_the_run_went_on() -> None:
    paste = LogSegmenter(0, min_level="WARNING", headless=True)
    assert _released_live(paste) == []  # everything waits behind the unsettled warning
    assert [item.line for item in paste.flush()] == [1, 3, 4]  # the end: the run did not go on
