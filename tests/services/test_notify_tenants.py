"""security.md H51: one project's flood of incidents must not hide another project's behind the webhook's
summary.

The webhook sends at most ``max_per_minute`` messages a minute, server-wide; what exceeded it was folded into
one "N more incidents" summary -- every incident queued while the minute was full, whatever its project. So
a project whose runs raise incidents by the hundred (a sweep of diverging jobs, or a hostile tenant) had
every other project's new incidents summarised away. Now the next message is the waiting one of the project
with the fewest in the minute, and only projects that had their share of the minute are summarised; another
project's incident waits for the next free slot and is sent on its own."""

from __future__ import annotations

import json
import threading
import time
from typing import List

from tests.support.waiting import poll
from trainguard_engine.pipeline import PipelineOutput
from trainguard_engine.records import Incident
from trainguard_server.notify import STATE_KEY, WebhookNotifier
from trainguard_server.storage.memory import MemoryIncidentStore


def incident(project: str, k: int) -> Incident:
    return Incident(incident_id=f"{project}-{k}", project=project, run_id=f"run-{k}", category="loss",
                    subtype="non_finite", severity="critical", status="open", title=f"NaN loss {project}{k}",
                    first_step=10, lead_rank=0)


class Posts:
    def __init__(self) -> None:
        self.texts: List[str] = []
        self.lock = threading.Lock()

    def __call__(self, url: str, data: bytes, timeout: float) -> None:
        with self.lock:
            self.texts.append(data.decode())

    def count(self) -> int:
        with self.lock:
            return len(self.texts)


def test_b_s_incident_is_sent_on_its_own_while_a_floods() -> None:
    now = [1000.0]
    posts = Posts()
    notifier = WebhookNotifier("http://hook", max_per_minute=5, clock=lambda: now[0], post=posts)
    notifier(PipelineOutput(incidents=[incident("A", k) for k in range(20)]))
    assert poll(lambda: posts.count() == 5, 10)
    notifier(PipelineOutput(incidents=[incident("B", 0)]))  # the minute is full of A's
    time.sleep(0.6)
    assert posts.count() == 5 and notifier.stats.suppressed == 15  # A's 15 held; B's waits
    now[0] += 61.0
    assert poll(lambda: posts.count() == 7, 10)
    notifier.close()
    b_s, summary = posts.texts[5], posts.texts[6]
    assert "NaN loss B0" in b_s  # before: held too, "... and 16 more" with no sign of B
    assert "15 more TrainGuard incident(s)" in summary and "A: 15" in summary and "B:" not in summary


def test_two_projects_flooding_together_take_turns() -> None:
    now = [1000.0]
    posts = Posts()
    notifier = WebhookNotifier("http://hook", max_per_minute=4, clock=lambda: now[0], post=posts)
    notifier(PipelineOutput(incidents=[incident("A", k) for k in range(10)] +
                            [incident("B", k) for k in range(10)]))
    assert poll(lambda: posts.count() == 4, 10)
    time.sleep(0.5)
    notifier.close()
    firsts = [t.split("NaN loss ")[1][0] for t in posts.texts[:4]]
    assert sorted(firsts) == ["A", "A", "B", "B"]  # before: A, A, A, A
    assert notifier.stats.suppressed == 16


def test_one_project_alone_keeps_the_whole_minute() -> None:
    now = [1000.0]
    posts = Posts()
    notifier = WebhookNotifier("http://hook", max_per_minute=5, clock=lambda: now[0], post=posts)
    notifier(PipelineOutput(incidents=[incident("A", k) for k in range(8)]))
    assert poll(lambda: posts.count() == 5, 10)
    time.sleep(0.5)
    assert posts.count() == 5 and notifier.stats.suppressed == 3
    now[0] += 61.0
    assert poll(lambda: posts.count() == 6, 10)
    notifier.close()
    assert "3 more TrainGuard incident(s)" in posts.texts[-1] and "A: 3" in posts.texts[-1]


def test_another_projects_10000_incidents_do_not_make_b_s_open_incident_posted_again() -> None:
    """H52: the ids sent were forgotten oldest first whatever their project, so after 10,000 of A's
    incidents B's open incident -- re-emitted at each update -- was posted a second time."""
    now = [1000.0]
    posts = Posts()
    notifier = WebhookNotifier("http://hook", max_per_minute=1_000_000, max_queue=20_000, clock=lambda: now[0],
                               post=posts)
    notifier(PipelineOutput(incidents=[incident("B", 0)]))
    notifier(PipelineOutput(incidents=[incident("A", k) for k in range(10_000)]))
    notifier(PipelineOutput(incidents=[incident("B", 0)]))  # B's incident updated (more evidence)
    assert poll(lambda: posts.count() >= 10_001, 30)
    time.sleep(0.3)
    notifier.close()
    assert sum("NaN loss B0" in t for t in posts.texts) == 1  # before: 2
    assert notifier.stats.deduplicated == 1


def test_what_was_sent_survives_a_restart_by_project() -> None:
    store = MemoryIncidentStore()
    posts = Posts()
    first = WebhookNotifier("http://hook", state=store, post=posts)
    first(PipelineOutput(incidents=[incident("B", 0), incident("A", 0)]))
    assert poll(lambda: posts.count() == 2, 10)
    first.close()
    again = WebhookNotifier("http://hook", state=store, post=posts)  # a restart re-emits both
    again(PipelineOutput(incidents=[incident("B", 0), incident("A", 0)]))
    time.sleep(0.3)
    again.close()
    assert posts.count() == 2 and again.stats.deduplicated == 2


def test_ids_saved_before_the_projects_were_kept_are_still_not_sent_twice() -> None:
    store = MemoryIncidentStore()
    store.save_state(STATE_KEY, json.dumps(["B-0"]).encode())  # the format saved before H52
    posts = Posts()
    notifier = WebhookNotifier("http://hook", state=store, post=posts)
    notifier(PipelineOutput(incidents=[incident("B", 0)]))
    time.sleep(0.3)
    notifier.close()
    assert posts.count() == 0 and notifier.stats.deduplicated == 1
