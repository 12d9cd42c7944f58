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


class GatedPosts(Posts):
    """A slow webhook: the first post waits until ``gate`` is set (as 4 tries of a 5 s timeout would);
    ``inside`` is set once the sender is in it."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.inside = threading.Event()

    def __call__(self, url: str, data: bytes, timeout: float) -> None:
        self.inside.set()
        assert self.gate.wait(30)
        super().__call__(url, data, timeout)


def _accounted(texts: List[str]) -> int:
    """The incidents posted on their own plus those counted in summaries."""
    return sum(int(t.split("... and ")[1].split(" more")[0]) if "... and " in t else 1 for t in list(texts))


def test_a_s_flood_during_a_slow_post_does_not_drop_b_s_incident() -> None:
    """F9 (stop 45): the queue's bound (``max_queue``) was one for all projects and an incident past it was
    dropped -- not posted, not summarised -- after its id was remembered as sent. While the sender sat in a
    slow post, A's queued flood made B's one incident vanish, and B's next update was deduplicated."""
    now = [1000.0]
    posts = GatedPosts()
    notifier = WebhookNotifier("http://hook", max_per_minute=5, max_queue=20, clock=lambda: now[0], post=posts)
    notifier(PipelineOutput(incidents=[incident("A", 0)]))
    assert posts.inside.wait(10)  # the sender is inside its first post
    notifier(PipelineOutput(incidents=[incident("A", k) for k in range(1, 31)]))  # A's flood meanwhile
    notifier(PipelineOutput(incidents=[incident("B", 0)]))  # B's one critical incident
    posts.gate.set()
    assert poll(lambda: posts.count() == 5, 10)  # the minute's 5
    now[0] += 61.0  # the next minute: the summary of A's excess
    assert poll(lambda: _accounted(posts.texts) == 32, 10)  # every incident posted or summarised (before: 21, 11 dropped)
    notifier(PipelineOutput(incidents=[incident("B", 0)]))  # B's incident updated later
    time.sleep(0.3)
    notifier.close()
    own = [t for t in posts.texts if "... and " not in t]
    assert sum("NaN loss B0" in t for t in own) == 1  # before: never posted
    assert "NaN loss B0" in posts.texts[1]  # B's turn comes right after the post A's flood waited on
    assert all("B:" not in t for t in posts.texts if "... and " in t)  # only A's excess is summarised
    assert _accounted(posts.texts) == 32 and notifier.stats.deduplicated == 1


def test_the_queue_stays_bounded_and_each_project_keeps_its_share() -> None:
    posts = GatedPosts()
    notifier = WebhookNotifier("http://hook", max_per_minute=1_000_000, max_queue=30, post=posts)
    notifier(PipelineOutput(incidents=[incident("A", 0)]))
    assert posts.inside.wait(10)
    notifier(PipelineOutput(incidents=[incident("A", k) for k in range(1, 101)]))
    notifier(PipelineOutput(incidents=[incident("B", k) for k in range(100)]))
    notifier(PipelineOutput(incidents=[incident("C", k) for k in range(5)]))
    posts.gate.set()
    assert poll(lambda: any("... and " in t for t in posts.texts), 10)
    time.sleep(0.3)
    notifier.close()
    own = [t for t in posts.texts if "... and " not in t]
    assert len(own) == 1 + 30  # the post A's flood waited on + the queue, never more than max_queue
    by = {p: sum(f"NaN loss {p}" in t for t in own) for p in "ABC"}
    # A filled the queue alone; B, then C, under their share (30 over the projects waiting) took room from
    # the project waiting the most (its newest incident held): A and B keep at least their share of 10
    assert by == {"A": 1 + 12, "B": 13, "C": 5}, by  # before: A 1 + 30, B and C dropped
    assert _accounted(posts.texts) == 206
    summary = next(t for t in posts.texts if "... and " in t)
    assert "A: 88" in summary and "B: 87" in summary and "C:" not in summary
