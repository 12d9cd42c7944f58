"""Webhook messages carry what a training job wrote: an exception message ``<!channel> ...
<https://phish.example/login|TrainGuard: sign in again>`` reached Slack unescaped -- paging the whole channel
and showing a disguised link -- and a run id could do the same. Now ``&``, ``<`` and ``>`` from the job are
escaped as Slack's formatting rules ask (the dashboard link stays a link). ``trainguard serve`` in the test
process (EmbeddedServer on 127.0.0.1) fed over HTTP ingest, posting to a real local receiver."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from tests.services.gateway.embedded_server import event, live_server
from tests.services.test_notify import Receiver
from tests.support.waiting import poll

HOSTILE = "<!channel> urgent: <https://phish.example/login|TrainGuard: sign in again> & retry"
RUN = "job<!here>&1"


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def test_a_hostile_exception_message_reaches_the_webhook_as_text(receiver: Receiver, tmp_path: Path) -> None:
    with live_server(tmp_path / "data", webhook_url=receiver.url, webhook_min_severity="error",
                     dashboard_url="http://tg.example:4318") as live:
        crash = {"event_id": uuid.uuid4().hex, "run_id": RUN, "step": 5, "severity": "CRITICAL",
                 "time_unix_nano": time.time_ns(),
                 "exception": {"type": "RuntimeError", "message": HOSTILE,
                               "frames": [{"filename": "train.py", "function": "main", "lineno": 9,
                                           "in_app": True}]}}
        r = live.post_events([event(RUN, step=4), crash])
        assert r.json()["accepted"] == 2, r.text
        assert poll(lambda: bool(receiver.bodies), 30), "no webhook message"
    text = receiver.bodies[0]["text"]
    assert "<!channel>" not in text and "<https://phish" not in text and "<!here>" not in text  # was in it
    assert ("&lt;!channel&gt; urgent: &lt;https://phish.example/login|TrainGuard: sign in again&gt; &amp; "
            "retry") in text
    assert "run `job&lt;!here&gt;&amp;1`" in text
    assert "<http://tg.example:4318/ui/#/incidents/" in text  # our own link is still a link
