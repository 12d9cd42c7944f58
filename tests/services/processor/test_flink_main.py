"""The bounded Flink job's input split (processor/flink_main.py ``partition_records``): one part per reader,
every run whole in one part and in its order, the parts even by records, nothing else changed."""

from __future__ import annotations

from typing import Any, Dict, List

from tests.scenarios.corpus import BY_NAME
from trainguard import wire
from trainguard_server.processor.flink_main import (
    BUNDLE_SIZE,
    build_parser,
    partition_records,
    read_records,
    write_records,
)
from trainguard_server.processor.flink_stages import decode_record, events_of


def records_of(events: List[Dict[str, Any]], size: int) -> List[bytes]:
    return [wire.ingest_request_from_dicts(events[i:i + size]).SerializeToString()
            for i in range(0, len(events), size)]


def run_ids(part: List[bytes]) -> List[str]:
    return [e["run_id"] for value in part for e in events_of(value)]


def event_ids(part: List[bytes], run_id: str) -> List[str]:
    return [e["event_id"] for value in part for e in events_of(value) if e["run_id"] == run_id]


def test_each_run_whole_in_one_part_in_order_and_the_parts_even() -> None:
    big, mid, small = (BY_NAME[n].events() for n in ("crash", "healthy_mlp", "nan_source"))
    for events, name in ((big, "big"), (mid, "mid"), (small, "small")):
        for e in events:
            e["run_id"] = name
    big, mid, small = big[:120], mid[:70], small[:60]
    # interleaved as a live stream is: one record of each run in turn
    streams = [records_of(big, 10), records_of(mid, 10), records_of(small, 10)]
    values = [s[i] for i in range(max(map(len, streams))) for s in streams if i < len(s)]
    parts = partition_records(values, 2)
    assert len(parts) == 2
    owners = {run: [i for i, part in enumerate(parts) if run in run_ids(part)] for run in ("big", "mid", "small")}
    assert owners == {"big": [0], "mid": [1], "small": [1]}  # largest first, then to the lighter part
    assert [len(p) for p in parts] == [12, 13]
    for run, events in (("big", big), ("mid", mid), ("small", small)):
        assert event_ids(parts[owners[run][0]], run) == [e["event_id"] for e in events]
    # each part keeps the stream's order: mid and small still alternate
    assert run_ids(parts[1])[:20] == ["mid"] * 10 + ["small"] * 10


def test_one_part_is_the_stream_and_mixed_records_split_by_run() -> None:
    crash, healthy = BY_NAME["crash"].events()[:3], BY_NAME["healthy_mlp"].events()[:2]
    mixed = wire.ingest_request_from_dicts(crash + healthy).SerializeToString()
    alone = wire.ingest_request_from_dicts(crash).SerializeToString()
    assert partition_records([alone, alone], 1) == [[alone, alone]]
    parts = partition_records([mixed, b"\xff\x00not protobuf"], 2)
    assert sorted(len(p) for p in parts) == [1, 1]  # garbage dropped, as the job's decode drops it
    assert sorted(raw for p in parts for raw in p) == sorted(raw for _, raw in decode_record(mixed))
    assert partition_records([], 2) == [[], []]


def test_records_file_round_trip(tmp_path: Any) -> None:
    values = records_of(BY_NAME["crash"].events()[:30], 7)
    assert write_records(tmp_path / "r.bin", values) == len(values)
    assert read_records(tmp_path / "r.bin") == values


def test_bundle_size_defaults_to_bundle_size_and_can_be_set() -> None:
    parser = build_parser()
    assert parser.parse_args(["--kafka", "k:9092"]).bundle_size == BUNDLE_SIZE == 100_000
    assert parser.parse_args(["--records", "r.bin", "--bundle-size", "1000"]).bundle_size == 1000
