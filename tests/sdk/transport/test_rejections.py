"""Issue 21: a job whose every event the backend refuses (a wrong token or project) is told so, loudly, once,
and at shutdown how many of its events were refused -- not just the first batch's "1 event(s)"."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

import trainguard
from tests.support.receivers import HttpReceiver
from trainguard.guard import reset_warnings
from trainguard.transport.worker import ALL_REJECTED_AFTER

FAST = dict(flush_interval=0.05, backoff_initial=0.05, backoff_max=0.2, heartbeat_interval=0, capture_exit=False,
            capture_uncaught=False)


@pytest.fixture(autouse=True)
def _clean() -> Iterator[None]:
    reset_warnings()
    yield
    trainguard.shutdown(timeout=2)


def test_every_event_refused_is_said_once_and_counted_at_shutdown(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    steps = ALL_REJECTED_AFTER + 20
    with HttpReceiver(token="right") as rx:
        trainguard.init(endpoint=rx.url, project="p", token="wrong", spool_dir=str(tmp_path), **FAST)
        for step in range(steps):
            trainguard.log(step=step, loss=1.0)
            if step % 10 == 0:
                trainguard.flush(1)
        trainguard.flush(2)
        trainguard.shutdown(timeout=5)
        assert rx.events == []
    err = capsys.readouterr().err
    assert err.count("was rejected by the backend") == 1, err  # once, however many batches followed
    assert "nothing of this job reaches TrainGuard" in err and "HTTP 401" in err
    summary = [line for line in err.splitlines() if "the backend rejected" in line and "this process sent" in line]
    assert len(summary) == 1 and f"rejected {steps + 1} of the {steps + 1} event(s)" in summary[0], err


def test_a_job_whose_events_arrive_hears_nothing_of_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with HttpReceiver(token="right") as rx:
        trainguard.init(endpoint=rx.url, project="p", token="right", spool_dir=str(tmp_path), **FAST)
        for step in range(ALL_REJECTED_AFTER + 5):
            trainguard.log(step=step, loss=1.0)
        trainguard.flush(5)
        trainguard.shutdown(timeout=5)
    assert "rejected" not in capsys.readouterr().err
