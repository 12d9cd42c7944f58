"""Distinct metric names per run are bounded at the gateway (``run_max_metric_names``): before, 10 requests of
20,000 new names made 200,000 series in one run. Now an envelope that would take its run past the bound is
rejected alone -- code ``too_many_metric_names``, naming the run, the count and the setting -- while the rest
of the request (other runs, the run's known names) is queued and stored, and the count survives a restart
(it starts from the metric store's names). Against ``trainguard serve`` (EmbeddedServer on 127.0.0.1), with
a bound of 100 so the test stays small."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest

from tests.services.gateway.embedded_server import LiveServer, event, live_server

CAP = 100


def _metrics(run_id: str, names: List[str], step: int = 1) -> Dict[str, Any]:
    return event(run_id, step, metrics={"points": [{"name": n, "value": 0.5} for n in names]})


def _names(live: LiveServer, run_id: str) -> List[str]:
    r = live.get(f"/api/v1/runs/{run_id}/metrics/summary", limit=1000)
    return [m["name"] for m in r.json()] if r.status_code == 200 else []


def test_new_names_past_the_bound_are_rejected_alone_and_the_rest_stored(tmp_path: Path) -> None:
    with live_server(tmp_path, run_max_metric_names=CAP) as live:
        first = [f"layer/{i:03d}" for i in range(60)]
        assert live.post_events([_metrics("capped", first)]).json()["accepted"] == 1
        flood = [f"flood/{i:05d}" for i in range(20_000)]
        request = [_metrics("capped", flood[:60], step=2),                  # would make 120 > 100
                   _metrics("capped", ["loss", *first[:5]], step=2),        # 1 new (loss): 61 <= 100
                   _metrics("other", [f"other/{i}" for i in range(90)]),    # another run: its own count
                   _metrics("capped", flood, step=3)]                       # 20,000 new
        r = live.post_events(request)
        assert r.status_code == 200
        body = r.json()
        assert body["accepted"] == 2, body
        assert [(x["index"], x["code"]) for x in body["rejected"]] == [(0, "too_many_metric_names"),
                                                                       (3, "too_many_metric_names")]
        assert body["rejected"][0]["event_id"] == request[0]["event_id"]
        assert body["rejected"][0]["message"] == (
            "events[0].metrics: run 'capped' has 60 distinct metric names and this event adds 60 new names "
            "('flood/00000' and 59 more), past the 100 a run may have (TRAINGUARD_RUN_MAX_METRIC_NAMES); "
            "nothing of this event was queued. Events naming only the run's metrics so far are accepted")
        live.wait_for(lambda: len(_names(live, "other")) == 90 and "loss" in _names(live, "capped"))
        assert sorted(_names(live, "capped")) == sorted(["loss", *first])  # no flood/ series was made
        # up to the bound is accepted; one more is not; known names always are
        more = [f"more/{i:02d}" for i in range(CAP - 61)]
        assert live.post_events([_metrics("capped", more, step=4)]).json()["accepted"] == 1
        over = live.post_events([_metrics("capped", ["one-too-many"], step=5)]).json()
        assert over["accepted"] == 0 and over["rejected"][0]["code"] == "too_many_metric_names"
        assert live.post_events([_metrics("capped", [*more, "loss"], step=6)]).json()["accepted"] == 1
        live.wait_for(lambda: len(_names(live, "capped")) == CAP)
        assert live.server.gateway is not None
        assert live.server.gateway.stats.snapshot()["rejected"] == {"too_many_metric_names": 3}

    # a restarted gateway starts from the stored names: the run is still at its bound
    with live_server(tmp_path, run_max_metric_names=CAP) as live:
        again = live.post_events([_metrics("capped", ["after-restart"], step=7),
                                  _metrics("capped", ["loss"], step=7)]).json()
        assert again["accepted"] == 1, again
        assert [x["code"] for x in again["rejected"]] == ["too_many_metric_names"]
        assert "has 100 distinct metric names" in again["rejected"][0]["message"]


@pytest.mark.parametrize("cap", [0])
def test_zero_turns_the_bound_off(tmp_path: Path, cap: int) -> None:
    with live_server(tmp_path, run_max_metric_names=cap) as live:
        r = live.post_events([_metrics("free", [f"m{i}" for i in range(300)])]).json()
        assert r == {"accepted": 1, "duplicates": 0, "rejected": []}


def test_the_message_shows_a_long_name_cut(tmp_path: Path) -> None:
    with live_server(tmp_path, run_max_metric_names=1) as live:
        long_name = "x" * 1_000  # under max_metric_name_length (1,024)
        r = live.post_events([_metrics("long", ["loss"]), _metrics("long", [long_name], step=2)]).json()
        assert r["accepted"] == 1
        message = r["rejected"][0]["message"]
        assert f"adds 1 new name ('{'x' * 80}...'), past the 1 a run may have" in message and len(message) < 400


def test_runs_forgotten_past_the_memory_budget_are_counted_again_from_the_store() -> None:
    from trainguard_server.gateway.metric_names import MetricNameCap

    stored = {("p", "a"): ["x", "y", "z"]}  # what the metric store holds
    asked: List[str] = []

    def seed(project: str, run_id: str) -> List[str]:
        asked.append(run_id)
        return stored.get((project, run_id), [])

    def envelope(*names: str) -> Tuple[str, ...]:  # a metric batch's point names, as the gateway reads them
        return names

    cap = MetricNameCap(3, budget=4 * 81, seed=seed)  # 4 one-character names' worth (1 + NAME_OVERHEAD each)
    assert cap.refusals("p", [(0, "a", envelope("x", "y"))]) == {}   # known from the store: admitted
    assert list(cap.refusals("p", [(1, "a", envelope("w"))])) == [1]  # a 4th name for run a
    assert cap.refusals("p", [(2, "b", envelope("q", "r"))]) == {}   # 3 + 2 names > budget 4: a forgotten
    assert cap.names("p", "a") == 0 and cap.names("p", "b") == 2
    assert list(cap.refusals("p", [(3, "a", envelope("w"))])) == [3]  # run a is read again from the store
    assert asked == ["a", "b", "a"]
    assert MetricNameCap(0, budget=1).refusals("p", [(0, "a", envelope(*"abcdef"))]) == {}  # 0: off


def test_a_metric_name_longer_than_the_bound_refuses_its_event_alone(tmp_path: Path) -> None:
    with live_server(tmp_path, max_metric_name_length=100) as live:
        r = live.post_events([_metrics("names", ["loss", "n" * 101]), _metrics("names", ["loss", "n" * 100])])
        body = r.json()
        assert body["accepted"] == 1, body  # was 2: any name up to max_string_length (65,536) was a series
        assert body["rejected"][0]["code"] == "too_large"
        assert body["rejected"][0]["message"] == ("events[0].metrics.points[1].name: 101 characters exceeds "
                                                  "max_metric_name_length=100 (TRAINGUARD_MAX_METRIC_NAME_LENGTH)")
