"""One run part in the state store that this code did not write must not stop the processor (hR6, stop 49,
HIGH-1): with ``started_ns`` ``"x"`` or ``1e400`` -- or ``last_event_ns`` ``1e400`` -- the pure engine restored
the run unchecked, the incident store's upsert of its record failed, and the processor retried that output
before anything new, forever: no project's records got through, ``stop()`` raised, and a restart met the same
part again. Now that run alone is quarantined at restore, its part deleted at the next checkpoint, and every
other run's records go through. Real SQLite queue and stores, a real restart (new handles on the same files);
each case on the engine this process loaded and, marked ``engine_pure``, on the pure modules (what wheels,
Docker and Flink ship)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest

from tests.engine.test_pipeline_poison import healthy_run
from tests.engine.test_restore_hostile_parts import tampered
from tests.services.processor.test_poison_run import Backend, _now
from trainguard_server.processor.embedded import PARTS_PREFIX, EmbeddedProcessor

Event = Dict[str, Any]

HOSTILE_PART = PARTS_PREFIX + "run/hostile%00h1"
CASES = [("started_ns", '"x"'), ("started_ns", "1e400"), ("last_event_ns", "1e400")]


def restart_with_a_tampered_part(root: Path, field: str, raw: str) -> Tuple[Backend, EmbeddedProcessor, List[Event]]:
    """Two projects' runs half published and processed, the hostile run's stored part given ``raw`` (JSON) as
    ``run.<field>``, then a restart on the same files (new handles) with the second halves published: the
    open backend (the caller closes it), the new processor (not yet run) and the calm run's events."""
    hostile, calm = _now(healthy_run("hostile", "h1")), _now(healthy_run("calm", "c1"))
    half_h, half_c = len(hostile) // 2, len(calm) // 2
    backend = Backend(root)
    backend.publish(hostile[:half_h])
    backend.publish(calm[:half_c])
    first = backend.processor()
    first.drain(30)
    first.stop(drain=False)
    backend.incidents.save_state(HOSTILE_PART, tampered(backend.incidents.load_state(HOSTILE_PART),
                                                         ("run", field), raw))
    backend.close()
    backend = Backend(root)
    again = backend.processor()
    backend.publish(hostile[half_h:])
    backend.publish(calm[half_c:])
    return backend, again, calm


def check_restart_with_a_tampered_part(root: Path, field: str, raw: str) -> None:
    backend, again, calm = restart_with_a_tampered_part(root, field, raw)
    try:
        again.drain(30)  # before: the upsert failed at every retry (ValueError / OverflowError)
        assert again.stats.errors == 0 and backend.queue.depth() == 0
        again.stop(drain=True)  # before: raised the upsert's error
        (run,) = backend.incidents.list_runs("calm").items
        assert run.last_event_ns == max(e["time_unix_nano"] for e in calm)
        assert backend.incidents.load_state(HOSTILE_PART) is None  # deleted at the checkpoint
        (stored,) = backend.incidents.list_runs("hostile").items
        assert type(stored.started_ns) is int and type(stored.last_event_ns) is int
    finally:
        backend.close()


@pytest.mark.parametrize("field,raw", CASES)
def test_a_tampered_run_part_stops_nothing(tmp_path: Path, field: str, raw: str) -> None:
    check_restart_with_a_tampered_part(tmp_path, field, raw)


@pytest.mark.engine_pure("the pure engine restored these parts unchecked (the shipped wheels run it)")
@pytest.mark.parametrize("field,raw", CASES)
def test_a_tampered_run_part_stops_nothing_pure(tmp_path: Path, field: str, raw: str) -> None:
    check_restart_with_a_tampered_part(tmp_path, field, raw)
