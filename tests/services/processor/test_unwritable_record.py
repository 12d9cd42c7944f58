"""A record the incident store can never take is dropped, counted and logged -- it does not hold the
partition's other records and checkpoints back (the lead, stop 49, after hR6's HIGH-1). The route: a stored run
part whose ``started_ns`` is an int beyond SQLite's signed 64 bits (the restore's kind checks accept any int,
as the pipeline keeps any int an event gave it); the run's record then fails the upsert with OverflowError.
Before, the processor retried that output before anything new, forever: no project's records got through and
``stop()`` raised. A store that is *unavailable* (ConnectionError, OSError) is still retried: see
test_embedded_rounds.py."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tests.services.processor.test_hostile_state_part import restart_with_a_tampered_part
from trainguard_server.api.deps import Services
from trainguard_server.observability import render_prometheus


def test_a_record_beyond_the_stores_types_is_dropped_not_retried_forever(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # an int: restored (the kind checks take any int); SQLite's INTEGER cannot hold it
    backend, again, calm = restart_with_a_tampered_part(tmp_path, "started_ns", str(2**63 + 5))
    try:
        with caplog.at_level(logging.ERROR, logger="trainguard.processor"):
            again.drain(30)  # before: OverflowError at every retry, the queue never drained
        assert again.stats.errors == 0 and backend.queue.depth() == 0
        assert again.stats.rejected_records >= 1
        assert any("refused run 'h1' of project 'hostile' for good" in r.getMessage() for r in caplog.records)
        again.stop(drain=True)  # before: raised the upsert's OverflowError
        (run,) = backend.incidents.list_runs("calm").items
        assert run.last_event_ns == max(e["time_unix_nano"] for e in calm)
        text = render_prometheus(Services(events=backend.events, metrics=backend.metrics,
                                          incidents=backend.incidents, projects=backend.projects,
                                          queue=backend.queue, processor=again))
        assert f"trainguard_processor_rejected_records_total {float(again.stats.rejected_records)}" in text
    finally:
        backend.close()
