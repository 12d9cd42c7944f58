"""When the SDK tries a batch again (transport/worker.py ``retry_delay``): its own backoff is jittered, and a
server's Retry-After is honoured -- never sooner -- but spread, so the ranks of a large job refused at one
instant (a project's waiting-call bound, security.md H37) do not all come back together every Retry-After
(before stop 43 every rank retried at exactly Retry-After: one herd, refused again as one)."""

from __future__ import annotations

import random

from trainguard.transport.worker import RETRY_AFTER_SPREAD, retry_delay


def test_retry_after_is_never_cut_short() -> None:
    rnd = random.Random(1)
    for backoff in (0.05, 1.0, 30.0):
        for retry_after in (0.5, 1.0, 3.0):
            for _ in range(200):
                assert retry_delay(backoff, retry_after, rnd.random) >= retry_after


def test_many_ranks_refused_together_come_back_spread_over_the_window() -> None:
    rnd = random.Random(2)
    delays = [retry_delay(0.05, 2.0, rnd.random) for _ in range(1000)]  # backoff far below Retry-After
    assert min(delays) >= 2.0 and max(delays) <= 2.0 * (1 + RETRY_AFTER_SPREAD)
    buckets = {int((d - 2.0) / (2.0 * RETRY_AFTER_SPREAD) * 10) for d in delays}
    assert len(buckets) >= 9  # spread over the whole window, not one instant
    assert len({round(d, 6) for d in delays}) > 900


def test_without_retry_after_the_backoff_is_jittered_between_half_and_all_of_it() -> None:
    rnd = random.Random(3)
    delays = [retry_delay(4.0, None, rnd.random) for _ in range(1000)]
    assert min(delays) >= 2.0 and max(delays) <= 4.0
    assert max(delays) - min(delays) > 1.5
    assert retry_delay(4.0, None, lambda: 0.0) == 2.0 and retry_delay(4.0, None, lambda: 1.0) == 4.0
