"""The headless browser the dashboard tests drive (tests/support/browser.py), and the server they read: one
``trainguard serve`` for the whole package, fed by two real SDK-instrumented torch trainings (one whose
learning rate blows the loss up, one that crashes on a malformed batch, a short healthy one)."""

from __future__ import annotations

from typing import Any, Iterator, Tuple

import pytest

from tests.services.e2e.serve_process import ServeProcess
from tests.services.e2e.test_serve import _train
from tests.support.browser import chrome
from tests.support.waiting import poll

HEALTHY = "dashboard-healthy"  # a third run, for comparing more than two (no incident)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    driver = chrome()
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="package")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tuple[ServeProcess, str, str]]:
    # recorded runs are replayed into it too (test_rank_step_time_browser.py): accept their past event times
    server = ServeProcess(tmp_path_factory.mktemp("dashboard") / "data",
                          env={"TRAINGUARD_MAX_PAST_AGE_S": str(10 * 365 * 86400)}).start()
    try:
        diverging, crashing = "dashboard-diverging", "dashboard-crashing"
        for kind, run_id, steps in (("diverging", diverging, 80), ("crashing", crashing, 30),
                                    ("healthy", HEALTHY, 20)):
            proc = _train(kind, server.http_url, server.tokens["ingest"], run_id, steps=steps)
            proc.communicate(timeout=120)
        assert poll(lambda: (r := server.get_or_none(f"/api/v1/runs/{HEALTHY}")) and r["status"] != "running", 60)
        for run_id in (diverging, crashing):  # both processed to their end, with their incidents stored
            run_url = f"/api/v1/runs/{run_id}"
            assert poll(lambda u=run_url: (r := server.get_or_none(u)) and r["status"] != "running", 60), run_id
            assert poll(lambda u=run_url: (server.get_or_none(u + "/incidents") or {}).get("items"), 60), run_id
        yield server, diverging, crashing
    finally:
        server.stop()
