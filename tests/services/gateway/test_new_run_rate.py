"""A project that starts new runs faster than TRAINGUARD_PROJECT_NEW_RUNS_PER_S is answered 429 before
anything of its request is queued, while its own live runs and every other project go on (the soak's
`tiny_runs` attack: 10,000 one-event runs, then 200 a second, took the processor from the other tenants)."""

from __future__ import annotations

from pathlib import Path

from tests.services.gateway.embedded_server import event, live_server
from trainguard_server.gateway.run_rate import NewRunLimiter

S = 1_000_000_000


def test_the_bucket_admits_a_burst_then_the_rate_and_never_limits_a_known_run() -> None:
    limiter = NewRunLimiter(rate=10.0, burst=3, remember=100)
    assert limiter.admit("p", ["a", "b", "c"], 0) is None
    wait = limiter.admit("p", ["d"], 0)
    assert wait is not None and abs(wait - 0.1) < 1e-9          # one token comes back in 0.1 s
    assert limiter.admit("p", ["a", "b", "c", "a"], 0) is None  # known runs take no token
    assert limiter.admit("q", ["x", "y", "z"], 0) is None       # another project has its own bucket
    assert limiter.admit("p", ["d"], S // 10) is None
    assert limiter.admit("p", ["e", "f"], S // 10) == 0.2       # refused: takes nothing
    assert limiter.admit("p", ["e", "f"], 3 * S // 10) is None
    assert limiter.admit("p", list("ghijk"), 100 * S) == 0.3    # more than the burst: wait for a full one
    assert NewRunLimiter(rate=0.0, burst=1, remember=1).admit("p", list("abc"), 0) is None  # off


def test_the_least_recently_seen_run_is_forgotten_first() -> None:
    limiter = NewRunLimiter(rate=1.0, burst=10, remember=2)
    assert limiter.admit("p", ["a", "b"], 0) is None
    assert limiter.admit("p", ["a"], 0) is None       # a seen again: b is now the oldest
    assert limiter.admit("p", ["c"], 0) is None       # b forgotten
    assert limiter.admit("p", ["a", "c"], 0) is None  # still known: no token
    tokens_before = limiter._buckets["p"].tokens
    assert limiter.admit("p", ["b"], 0) is None and limiter._buckets["p"].tokens == tokens_before - 1


def test_a_flood_of_new_runs_is_refused_while_live_runs_go_on(tmp_path: Path) -> None:
    with live_server(tmp_path / "data", project_new_runs_per_s=5.0, project_new_runs_burst=20) as live:
        assert live.post_events([event("live", 0)]).status_code == 200
        flood = live.post_events([event(f"tiny-{i}") for i in range(19)])
        assert flood.status_code == 200, flood.text                       # the rest of the burst
        refused = live.post_events([event(f"tiny-{i}") for i in range(19, 519)])
        assert refused.status_code == 429, refused.text
        assert "new runs faster than 5/s" in refused.json()["detail"]
        assert float(refused.headers["Retry-After"]) > 0
        assert live.post_events([event("live", 1)]).status_code == 200    # a live run is never limited
        assert live.post_events([event("tiny-3", 1)]).status_code == 200  # nor an admitted one
        assert "trainguard_ingest_new_run_limited_total 1" in live.client.get("/metrics").text
        expected = {"live", *(f"tiny-{i}" for i in range(19))}  # nothing of the refused request was queued

        def runs() -> set:
            answer = live.get("/api/v1/runs", limit=200)
            return {r["run_id"] for r in answer.json()["items"]} if answer.status_code == 200 else set()

        live.wait_for(lambda: runs() == expected)
