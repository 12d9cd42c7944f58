"""processor/decode.py: one pass from queue bytes to envelope dicts and points, equal to the generic path.

Every recorded stream of the golden set (scenario corpus, demo fixtures, NCCL jobs) goes through the wire
as the gateway publishes it; the fast decoder must give, envelope by envelope, exactly the dict of
``wire.envelope_to_dict`` and the points of ``extract.metric_points`` (non-finite values included).
"""

from __future__ import annotations

import math
from typing import Any, Dict, List

import pytest

from tests.engine.test_pipeline_golden import streams
from trainguard import wire
from trainguard.v1 import ingest_pb2
from trainguard_engine.extract import metric_points
from trainguard_server.processor.decode import decode_request

STREAMS = streams()


def _same_points(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is b
    return len(a) == len(b) and all(
        (n1, s1) == (n2, s2) and (v1 == v2 or (math.isnan(v1) and math.isnan(v2)))
        for (n1, s1, v1), (n2, s2, v2) in zip(a, b))


@pytest.mark.parametrize("name", sorted(STREAMS))
def test_fast_decode_equals_generic(name: str) -> None:
    events, _settings = STREAMS[name]
    envelopes: List[Dict[str, Any]] = events()
    request = wire.prepare_batch(envelopes).request
    value = request.SerializeToString()
    fast, points = decode_request(value)
    generic = [wire.envelope_to_dict(m) for m in ingest_pb2.IngestRequest.FromString(value).events]
    assert len(fast) == len(generic) == len(points)
    for got, want, pts in zip(fast, generic, points):
        assert got == want
        assert list(got) == list(want)  # the same key order (stored payloads are serialised as given)
        assert _same_points(pts, metric_points(want) if "metrics" in want else None)


def test_non_finite_and_own_steps() -> None:
    """A batch spanning steps with NaN/Inf values and a zero value: the cases the fast path spells out."""
    from trainguard.core import events as ev

    ident = {"project": "p", "run_id": "r", "rank": 3, "world_size": 4}
    body = {"points": [{"name": "loss", "value": "NaN", "step": 7}, {"name": "grad/global_norm",
                                                                    "value": "Infinity"},
                       {"name": "lr", "value": 0.0, "step": 9}, {"name": "", "value": 1.0},
                       {"name": "x", "value": "-Infinity", "step": -1}]}
    envelope = ev.envelope(ident, "metrics", body, step=5, time_unix_nano=1, event_id="e1")
    value = wire.prepare_batch([envelope]).request.SerializeToString()
    (got,), (pts,) = decode_request(value)
    (msg,) = ingest_pb2.IngestRequest.FromString(value).events
    want = wire.envelope_to_dict(msg)
    assert got == want and list(got) == list(want)
    assert _same_points(pts, metric_points(want))
    assert [(n, s) for n, s, _v in pts] == [("loss", 7), ("grad/global_norm", 5), ("lr", 9), ("x", 5)]
