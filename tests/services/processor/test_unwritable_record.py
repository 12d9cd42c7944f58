"""A record the incident store can never take is dropped, counted and logged -- it does not hold the
partition's other records and checkpoints back (the lead, stop 49, after hR6's HIGH-1). The route: a stored run
part whose ``started_ns`` is an int beyond SQLite's signed 64 bits (the restore's kind checks accept any int,
as the pipeline keeps any int an event gave it); the run's record then fails the upsert with OverflowError.
Before, the processor retried that output before anything new, forever: no project's records got through and
``stop()`` raised. A store that is *unavailable* (ConnectionError, OSError) is still retried: see
test_embedded_rounds.py."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from tests.engine.test_pipeline_poison import healthy_run
from tests.services.processor.test_poison_run import Backend, _now
from trainguard_server.api.deps import Services
from trainguard_server.observability import render_prometheus
from trainguard_server.processor.embedded import PARTS_PREFIX

HOSTILE_PART = PARTS_PREFIX + "run/hostile%00h1"


def test_a_record_beyond_the_stores_types_is_dropped_not_retried_forever(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    hostile, calm = _now(healthy_run("hostile", "h1")), _now(healthy_run("calm", "c1"))
    half_h, half_c = len(hostile) // 2, len(calm) // 2
    backend = Backend(tmp_path)
    backend.publish(hostile[:half_h])
    backend.publish(calm[:half_c])
    first = backend.processor()
    first.drain(30)
    first.stop(drain=False)
    doc = json.loads(backend.incidents.load_state(HOSTILE_PART))
    doc["run"]["started_ns"] = 2**63 + 5  # an int: restored; SQLite's INTEGER cannot hold it
    backend.incidents.save_state(HOSTILE_PART, json.dumps(doc).encode())
    backend.close()

    backend = Backend(tmp_path)  # a restart on the same files
    try:
        again = backend.processor()
        backend.publish(hostile[half_h:])
        backend.publish(calm[half_c:])
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
