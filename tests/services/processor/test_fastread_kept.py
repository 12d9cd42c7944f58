"""The native reader keeps the short ASCII strings it decoded (names, project, run id, host...) across calls
(processor/_fastread.c ``kept``): a request's strings are then the very objects of an earlier request's --
never another value: whatever earlier calls left in the table (colliding slots, non-ASCII and long strings,
thousands of distinct names), every string read equals what protobuf reads."""

from __future__ import annotations

from typing import Any, List

from tests.services.processor.test_fastread import _check, native_on, reader  # noqa: F401 (fixtures)
from trainguard import wire
from trainguard.core import events as ev


def _request(names: List[str], host: str, step: int) -> bytes:
    ident = {"project": "proj", "run_id": "run-kept", "trace_id": "t", "host": host, "pid": 1, "rank": 0,
             "local_rank": 0, "world_size": 1, "run_name": "n", "sdk": "s"}
    return wire.prepare_batch([ev.envelope(ident, "metrics", ev.metrics_payload({n: 1.0 for n in names}),
                                           step=step, time_unix_nano=step, event_id=f"e{step}")]
                              ).request.SerializeToString()


def test_strings_of_earlier_requests_are_the_same_objects(native_on: Any) -> None:  # noqa: F811
    first = native_on.read(_request(["loss", "lr"], "node-0", 1))
    second = native_on.read(_request(["loss", "lr"], "node-0", 2))
    (header1, _count1, points1), (header2, _count2, points2) = first[0], second[0]
    assert header1[1] is header2[1] and header1[2] is header2[2] and header1[6] is header2[6]
    assert points1[0][0] is points2[0][0] == "loss"
    assert header1[0] == "e1" and header2[0] == "e2"  # event ids: one each


def test_whatever_the_table_holds_every_string_reads_as_protobuf_reads_it(native_on: Any) -> None:  # noqa: F811
    """5,000 distinct names (many per slot), non-ASCII ones (never kept), 128- and 129-byte ones (the longest
    kept and one past it), names that differ in one byte, each read twice in turn: equal to protobuf's."""
    names = [f"metric/{i:05d}" for i in range(5000)] + ["löss", "名前", "x" * 128, "x" * 129, "x" * 127 + "y"]
    for round_ in range(2):
        for at in range(0, len(names), 50):
            _check(_request(names[at:at + 50], f"host-{at % 7}", 1 + at + round_))
