"""security.md H49: a metric-name seed that cannot read the store logs one line per 10 s, not one traceback
per run.

During a connection burst past the open-files limit (H46) every run the gateway does not remember asks the
metric store for its names and fails; :class:`MetricNameCap` logged a warning *with a traceback* for each,
so one tenant's burst of many runs filled the server's log (and its disk) for everyone. Now the failure is
logged at most once per ``SEED_FAILURE_LOG_EVERY_S`` with how many runs failed since the last line; the
known ``OutOfFiles`` without a traceback. What the cap does is unchanged: such a run counts its names from
then on."""

from __future__ import annotations

import errno
import logging
from typing import Iterable, List, Tuple

import pytest

from trainguard_server.gateway import metric_names
from trainguard_server.gateway.metric_names import SEED_FAILURE_LOG_EVERY_S, MetricNameCap, Seed
from trainguard_server.storage.sqlite import TooManyOpenFiles

LOGGER = metric_names.__name__


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def failing_seed(exc: Exception) -> Seed:
    def seed(project: str, run_id: str) -> Iterable[str]:
        raise exc
    return seed


def cap_with(exc: Exception) -> Tuple[MetricNameCap, Clock]:
    cap = MetricNameCap(cap=5, budget=10**6, seed=failing_seed(exc))
    clock = cap.seed_log.clock = Clock()
    return cap, clock


def burst(cap: MetricNameCap, runs: int, first: int = 0) -> None:
    for i in range(first, first + runs):
        assert cap.refusals("B", [(0, f"run-{i}", ["loss"])]) == {}  # admitted: counted from now


def records(caplog: pytest.LogCaptureFixture) -> List[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER]


def test_a_burst_of_failing_seeds_logs_one_line_per_window(caplog: pytest.LogCaptureFixture) -> None:
    cap, clock = cap_with(TooManyOpenFiles("/data/metrics.db: too many open files", "too many open files"))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        burst(cap, 200)
        assert len(records(caplog)) == 1  # before: 200, each with a traceback
        clock.now += SEED_FAILURE_LOG_EVERY_S - 0.5
        burst(cap, 50, first=200)
        assert len(records(caplog)) == 1
        clock.now += 0.5
        burst(cap, 1, first=250)
    lines = records(caplog)
    assert len(lines) == 2
    assert "run 'run-0' of project 'B'" in lines[0].getMessage() and "(1 run(s) since" in lines[0].getMessage()
    assert "(250 run(s) since the last such line" in lines[1].getMessage()  # 249 left out + this one
    assert "too many open files" in lines[1].getMessage()
    assert not any(r.exc_info for r in lines)  # the known cause: no traceback


def test_an_unexpected_seed_error_keeps_its_traceback_once_per_window(caplog: pytest.LogCaptureFixture) -> None:
    cap, _ = cap_with(OSError(errno.EIO, "Input/output error"))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        burst(cap, 30)
    lines = records(caplog)
    assert len(lines) == 1 and lines[0].exc_info
    assert "OSError: [Errno 5] Input/output error" in lines[0].getMessage()


def test_a_run_whose_seed_failed_still_counts_its_names_from_then_on() -> None:
    cap, _ = cap_with(TooManyOpenFiles("x", "too many open files"))
    assert cap.refusals("B", [(0, "r", ["a", "b", "c"])]) == {}
    refused = cap.refusals("B", [(1, "r", ["d", "e", "f"])])  # 3 + 3 > 5
    assert list(refused) == [1] and refused[1][0] == metric_names.CODE
    assert cap.names("B", "r") == 3
