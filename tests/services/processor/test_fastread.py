"""processor/_fastread.c, the optional native reader of queue records: read_request with it gives exactly
what it gives through protobuf alone (decode.read_request_protobuf, the fallback) -- the same envelopes
(ReadEnvelopes field by field and type by type, dicts key by key), the same points (floats bit for bit) --
or raises where protobuf raises.

The reader is compiled here from its source (processor/native.py, the compiler Python was built with), so
these tests run it whether or not the installed package carries a built copy; the fallback is the other
side of every comparison. Cases: every recorded stream of the golden set, SDK-shaped and 500-envelope
requests, hand-written wire bytes protobuf reads in its own way (fields repeated, out of order, unknown,
with another wire type; the payload oneof switched; int32 fields sent as 64-bit varints; strings that are
not UTF-8; truncated bytes) and 3,000 seeded random mutations of real records.
"""

from __future__ import annotations

import importlib.util
import math
import random
import struct
from pathlib import Path
from typing import Any, Callable, Iterator, List, Optional, Tuple

import pytest

from tests.engine.test_pipeline_golden import streams
from trainguard import wire
from trainguard.core import events as ev
from trainguard_engine.pipeline import Pipeline, ReadEnvelope
from trainguard_server.processor import decode, native

STREAMS = streams()


@pytest.fixture(scope="module")
def reader(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The native reader, built from the source into a temporary folder and loaded from there."""
    built = native.build(tmp_path_factory.mktemp("fastread"), quiet=False)
    assert built is not None, "the native reader did not compile (a C compiler and Python's headers needed)"
    spec = importlib.util.spec_from_file_location("trainguard_server.processor._fastread", built)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    prepared = decode.prepare_native(module)
    assert prepared is module, "the native reader refused this schema or these classes (decode.prepare_native)"
    return module


@pytest.fixture()
def native_on(reader: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setattr(decode, "NATIVE", reader)
    return reader


def _bits(value: float) -> bytes:
    return struct.pack("<d", value)


def _same_value(a: Any, b: Any) -> None:
    assert type(a) is type(b), (a, b)
    if isinstance(a, float):
        assert _bits(a) == _bits(b), (a, b)  # NaN payloads too: the reader copies the double's 8 bytes
    else:
        assert a == b, (a, b)


def _same_tree(a: Any, b: Any) -> None:
    """A dict the reader made equals wire's all the way down: every nested dict's keys in the same order
    (the memory dict, its stats), every float bit for bit (hR7's F1.2: a top-level test missed the order)."""
    assert type(a) is type(b), (a, b)
    if isinstance(a, dict):
        assert list(a) == list(b), (list(a), list(b))
        for key in a:
            _same_tree(a[key], b[key])
    elif isinstance(a, list):
        assert len(a) == len(b), (a, b)
        for x, y in zip(a, b):
            _same_tree(x, y)
    else:
        _same_value(a, b)


def _same(got: Tuple[List[Any], List[Any]], want: Tuple[List[Any], List[Any]]) -> None:
    """read_request's results equal: envelope by envelope, field by field, point by point."""
    (envs, points), (want_envs, want_points) = got, want
    assert len(envs) == len(want_envs) == len(points) == len(want_points)
    for env, want_env, pts, want_pts in zip(envs, want_envs, points, want_points):
        assert type(env) is type(want_env)
        if isinstance(env, ReadEnvelope):
            for slot in ReadEnvelope.__slots__:
                a, b = getattr(env, slot), getattr(want_env, slot)
                if slot in ("raw", "body"):
                    assert type(a) is type(b)
                    assert dict(a) == dict(b) and list(a) == list(b)
                else:
                    _same_value(a, b)
            assert env.body.count == want_env.body.count
        else:
            _same_tree(env, want_env)
        if want_pts is None:
            assert pts is None
            continue
        assert len(pts) == len(want_pts)
        for p, q in zip(pts, want_pts):
            assert type(p) is tuple and len(p) == 3
            for a, b in zip(p, q):
                _same_value(a, b)


def _outcome(read: Callable[[bytes], Any], value: bytes) -> Any:
    try:
        return read(value)
    except Exception as exc:  # what protobuf raises on bytes it cannot parse
        return type(exc)


def _read_by_five(values: List[bytes]) -> Iterator[Tuple[List[Any], List[Any]]]:
    """read_request over ``values`` five records at a time (a processor chunk): each chunk's envelopes and points."""
    for i in range(0, len(values), 5):
        envs: List[Any] = []
        pts: List[Any] = []
        for value in values[i:i + 5]:
            e, p = decode.read_request(value)
            envs += e
            pts += p
        yield envs, pts


def _check(value: bytes) -> Any:
    """read_request (native on) against the protobuf path on ``value``; the native reader's own answer."""
    got = _outcome(decode.read_request, value)
    want = _outcome(decode.read_request_protobuf, value)
    if isinstance(want, type):
        assert isinstance(got, type), f"protobuf raised {want.__name__}, the native path read it"
    else:
        assert not isinstance(got, type), f"the native path raised {got}"
        _same(got, want)
    return decode.NATIVE.read(value)


@pytest.mark.parametrize("name", sorted(STREAMS))
def test_streams_read_the_same(name: str, native_on: Any) -> None:
    events, _settings = STREAMS[name]
    envelopes = events()
    for i in range(0, len(envelopes), 9):
        _check(wire.prepare_batch(envelopes[i:i + 9]).request.SerializeToString())


def _sdk_request(rank: int, step: int) -> List[Any]:
    ident = {"project": "bench", "run_id": "run-1", "trace_id": "run-1", "host": f"node-{rank // 8}",
             "pid": 1000 + rank, "rank": rank, "local_rank": rank % 8, "world_size": 16, "group_rank": rank // 8,
             "run_name": "n", "sdk": "trainguard-python/test"}
    return [ev.envelope(ident, "metrics", ev.metrics_payload({"time/step_s": 0.25, "grad/global_norm": 1.0 + rank,
                                                              "grad/clip_triggered": 0.0, "opt/lr": 3e-4}),
                        step=step, time_unix_nano=10**18 + step, event_id=f"e-{rank}-{step}-h"),
            ev.envelope(ident, "metrics", ev.metrics_payload({"loss": 2.0 - step * 1e-3, "lr": 3e-4}), step=step,
                        time_unix_nano=10**18 + step + 1, event_id=f"e-{rank}-{step}-l"),
            ev.envelope(ident, "memory", {"device": "cuda:0", "allocated": 5} if rank == 0 else
                        {"device": f"cuda:{rank % 8}", "allocated": 5 << 30, "reserved": 6 << 30, "free": 1,
                         "fragmentation": 0.25 if step != 2 else math.nan, "num_ooms": step == 300,
                         "rss": 3 << 30, "summary": "|  PyTorch CUDA memory summary  |",
                         "stats": {"num_alloc_retries": 0.0, "active_bytes.all.peak": 5e9,
                                   "allocation.all.current": 1.0e4 + step, "inactive_split.all": -0.0}},
                        step=step, time_unix_nano=10**18 + step + 2, event_id=f"e-{rank}-{step}-m")]


def _values() -> List[bytes]:
    out = [wire.prepare_batch(_sdk_request(rank, step)).request.SerializeToString()
           for rank in (0, 5) for step in (1, 2, 300)]
    ident = {"project": "bench", "run_id": "env", "rank": 0, "world_size": 1}
    names = ("loss", "lr", "grad/global_norm", "throughput/samples_per_s", "amp/scale")
    batch = [ev.envelope(ident, "metrics", ev.metrics_payload(dict(zip(names, (2.5, 3e-4, 0.5, 1200.0 + i,
                                                                               65536.0)))),
                         step=i + 1, time_unix_nano=10**18 + i, event_id=f"env-{i}") for i in range(500)]
    out.append(wire.prepare_batch(batch).request.SerializeToString())
    return out


def test_benchmark_shapes(native_on: Any) -> None:
    """SDK-shaped requests (two plain batches and a memory event, with and without stats) and a 500-envelope
    one: the plain batches and the memory events are the native reader's (a memory event as its dict)."""
    for value in _values():
        rows = _check(value)
        assert rows is not None and all(row is not None for row in rows)
        envelopes, _points = decode.read_request(value)
        for row, env in zip(rows, envelopes):
            assert isinstance(row, dict) == isinstance(env, dict)
            if isinstance(env, dict):
                assert "memory" in env and row == env and list(row) == list(env)


# --- hand-written wire bytes --------------------------------------------------------------------------

def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _field(number: int, wire_type: int, payload: bytes) -> bytes:
    return _varint(number << 3 | wire_type) + payload


def _string(number: int, text: Any) -> bytes:
    data = text if isinstance(text, bytes) else text.encode()
    return _field(number, 2, _varint(len(data)) + data)


def _int(number: int, value: int) -> bytes:
    return _field(number, 0, _varint(value))


def _point(name: Any = "loss", value: Optional[float] = 1.5, step: Optional[int] = None,
           extra: bytes = b"") -> bytes:
    body = _string(1, name) if name is not None else b""
    if value is not None:
        body += _field(2, 1, _bits(value))
    if step is not None:
        body += _int(3, step)
    return _string(1, body + extra)


def _header(run_id: Any = "r", **over: Any) -> bytes:
    out = _string(1, over.get("event_id", "e1")) + _string(2, over.get("project", "p"))
    if run_id is not None:
        out += _string(3, run_id)
    return out + _int(7, over.get("rank", 3)) + _int(9, over.get("world", 4)) + _int(10, over.get("step", 5)) + \
        _int(11, over.get("time", 10**18))


def _request(*envelopes: bytes) -> bytes:
    return b"".join(_string(1, e) for e in envelopes)


def _metrics(*points: bytes, extra: bytes = b"") -> bytes:
    return _string(20, b"".join(points) + extra)


def _memory(fields: bytes) -> bytes:
    return _string(25, fields)


def _entry(key: Any = "k", value: Optional[float] = 1.0, extra: bytes = b"") -> bytes:
    body = _string(1, key) if key is not None else b""
    if value is not None:
        body += _field(2, 1, _bits(value))
    return _string(13, body + extra)


MEMORY_CASES = {  # a MemorySnapshot's bytes (payload field 25)
    "empty": _memory(b""),
    "every field": _memory(_string(1, "cuda:1") + b"".join(_int(n, n << 30) for n in (2, 3, 4, 5, 6, 7)) +
                           _field(8, 1, _bits(0.125)) + _int(9, 2) + _int(10, 1) + _int(11, 5 << 30) +
                           _string(12, "summary\n|===|") + _entry("b", 2.0) + _entry("a", 1.0)),
    "fields reversed": _memory(_entry("z", 1.0) + _string(12, "s") + _int(11, 1) + _field(8, 1, _bits(0.5)) +
                               _int(2, 9) + _string(1, "cpu")),
    "zeros": _memory(_string(1, "") + _int(2, 0) + _field(8, 1, _bits(0.0)) + _string(12, "")),
    "negative and huge": _memory(_int(2, -5) + _int(3, (1 << 63) - 1) + _int(4, -(1 << 63))),
    "fragmentation NaN": _memory(_field(8, 1, _bits(math.nan))),
    "fragmentation +inf": _memory(_field(8, 1, _bits(math.inf))),
    "fragmentation -inf": _memory(_field(8, 1, _bits(-math.inf))),
    "fragmentation -0.0": _memory(_field(8, 1, _bits(-0.0))),
    "fragmentation tiny": _memory(_field(8, 1, _bits(5e-324))),
    "stats sorted, last value wins": _memory(_entry("b", 1.0) + _entry("a", 2.0) + _entry("b", 3.0) +
                                             _entry("B", 4.0) + _entry("é", 5.0) + _entry("a.b", 6.0)),
    "stats non-finite and zero": _memory(_entry("n", math.nan) + _entry("i", math.inf) + _entry("m", -math.inf) +
                                         _entry("z", 0.0) + _entry("nz", -0.0)),
    "stats entry without key": _memory(_entry(None, 2.0)),
    "stats entry without value": _memory(_entry("k", None)),
    "stats entry empty": _memory(_string(13, b"")),
    "stats entry fields reversed": _memory(_string(13, _field(2, 1, _bits(2.0)) + _string(1, "k"))),
    "stats entry key repeated": _memory(_string(13, _string(1, "a") + _string(1, "b") + _field(2, 1, _bits(1.0)))),
    "stats entry unknown field": _memory(_entry(extra=_int(3, 1))),
    "stats entry value as varint": _memory(_string(13, _string(1, "k") + _int(2, 1))),
    "stats entry bad utf-8 key": _memory(_entry(b"k\xff")),
    "stats entry truncated": _memory(_string(13, _string(1, "k") + b"\x11\x00")),
    "field repeated": _memory(_int(2, 1) + _int(2, 2)),
    "device repeated": _memory(_string(1, "a") + _string(1, "b")),
    "unknown field": _memory(_int(14, 1)),
    "unknown string field": _memory(_string(20, "x")),
    "int field as string": _memory(_string(2, "x")),
    "device as varint": _memory(_int(1, 1)),
    "fragmentation as varint": _memory(_int(8, 1)),
    "fragmentation as fixed32": _memory(_field(8, 5, b"\0\0\0\0")),
    "bad utf-8 device": _memory(_string(1, b"cu\xffda")),
    "bad utf-8 summary": _memory(_string(12, b"\xed\xa0\x80")),
    "truncated double": _memory(_field(8, 1, b"\0\0\0")),
    "11-byte varint": _memory(_field(2, 0, b"\xff" * 10 + b"\x01")),
    "group": _memory(_field(2, 3, b"") + _field(2, 4, b"")),
}
"""MemorySnapshot payloads: the native reader builds the dicts of those protobuf reads plainly and leaves
the others (a field twice, unknown fields, other wire types, bad UTF-8) to protobuf."""
MEMORY_TAKEN = ("empty", "every field", "fields reversed", "zeros", "negative and huge", "fragmentation NaN",
                "fragmentation +inf", "fragmentation -inf", "fragmentation -0.0", "fragmentation tiny",
                "stats sorted, last value wins", "stats non-finite and zero", "stats entry without key",
                "stats entry without value", "stats entry empty", "stats entry fields reversed")

CASES = {
    "plain": _request(_header() + _metrics(_point(), _point("lr", 3e-4, 9))),
    "empty request": b"",
    "empty batch": _request(_header() + _metrics()),
    "no run id": _request(_header(run_id=None) + _metrics(_point())),
    "empty run id": _request(_header(run_id="") + _metrics(_point())),
    "alert": _request(_header() + _metrics(_point(), extra=_string(2, "non_finite:loss"))),
    "alert then emptied": _request(_header() + _metrics(_point(), extra=_string(2, "x") + _string(2, ""))),
    "recent": _request(_header() + _metrics(_point(), extra=_string(3, _string(1, "loss")))),
    "metrics twice (merged)": _request(_header() + _metrics(_point()) + _metrics(_point("lr"))),
    "oneof switched away": _request(_header() + _metrics(_point()) + _string(22, _int(1, 1))),
    "oneof switched to metrics": _request(_header() + _string(22, _int(1, 1)) + _metrics(_point())),
    "header repeated": _request(_header() + _string(2, "q") + _int(7, 9) + _metrics(_point())),
    "fields reversed": _request(_metrics(_point(step=4)) + _int(11, 7) + _int(10, 2) + _string(3, "r") +
                                _string(1, "e")),
    "negative int32": _request(_header(rank=-1, world=-5) + _int(6, -7) + _metrics(_point())),
    "int32 from a wide varint": _request(_header(rank=(1 << 40) + 3, world=(1 << 33) + 2) + _metrics(_point())),
    "negative steps": _request(_header(step=-1) + _metrics(_point(step=-1), _point("lr", step=0))),
    "huge step": _request(_header(step=(1 << 63) - 1) + _metrics(_point(step=(1 << 63) + 5))),
    "non-finite values": _request(_header() + _metrics(_point(value=math.nan), _point("a", math.inf),
                                                       _point("b", -math.inf), _point("c", -0.0),
                                                       _point("d", None), _point("e", 5e-324))),
    "NaN payloads": _request(_header() + _metrics(
        *(_point(name, struct.unpack("<d", raw)[0]) for name, raw in (
            ("quiet", b"\x01\x00\x00\x00\x00\x00\xf8\x7f"), ("negative", b"\x00\x00\x00\x00\x00\x00\xf8\xff"),
            ("signalling", b"\x01\x00\x00\x00\x00\x00\xf0\x7f"))))),
    "nameless points": _request(_header() + _metrics(_point(""), _point(None, 2.0), _point("x"))),
    "point fields repeated": _request(_header() + _metrics(_point("a", 1.0, 2, extra=_string(1, "b") +
                                                                  _field(2, 1, _bits(7.0)) + _int(3, 8)))),
    "point unknown field": _request(_header() + _metrics(_point(extra=_int(9, 1) + _string(10, "z")))),
    "point field of another wire type": _request(_header() + _metrics(_point(extra=_int(2, 1)))),
    "batch unknown field": _request(_header() + _metrics(_point(), extra=_int(7, 1))),
    "envelope unknown fields": _request(_header() + _int(40, 1) + _string(41, "z") +
                                        _field(42, 5, b"\0\0\0\0") + _field(43, 1, b"\0" * 8) +
                                        _metrics(_point())),
    "envelope field 16 (unknown)": _request(_header() + _int(16, 1) + _metrics(_point())),
    "envelope known field, another wire type": _request(_header() + _int(2, 1) + _metrics(_point())),
    "string field as varint": _request(_header() + _int(5, 1) + _metrics(_point())),
    "request unknown field": _string(2, "x") + _request(_header() + _metrics(_point())) + _int(3, 1),
    "request events as varint": _int(1, 5),
    "severity and others": _request(_header() + _int(8, 2) + _int(12, 3) + _int(15, -1) + _string(14, "sdk") +
                                    _string(4, "t") + _string(5, "h") + _string(13, "n") + _metrics(_point())),
    "bad utf-8 name": _request(_header() + _metrics(_point(b"lo\xffss"))),
    "bad utf-8 project": _request(_header(project=b"p\xc3") + _metrics(_point())),
    "bad utf-8 sdk": _request(_header() + _string(14, b"\xed\xa0\x80") + _metrics(_point())),
    "bad utf-8 alert": _request(_header() + _metrics(_point(), extra=_string(2, b"\xff"))),
    "group wire type": _request(_header() + _field(30, 3, b"") + _field(30, 4, b"") + _metrics(_point())),
    "field number 0": _request(_header() + _field(0, 0, b"\x01") + _metrics(_point())),
    "11-byte varint": _request(_header() + _field(7, 0, b"\xff" * 10 + b"\x01") + _metrics(_point())),
    "10-byte varint, top bits": _request(_header() + _field(10, 0, b"\xff" * 9 + b"\x7f") + _metrics(_point())),
    # length prefixes padded with 0x80 bytes: upb takes at most 5 bytes (hR's review, stop 42)
    "6-byte batch length": bytes.fromhex("0a0b1a0172a201808080808000"),
    "5-byte batch length": bytes.fromhex("0a0a1a0172a2018080808000"),
    "6-byte point length": _request(_header() + _string(20, b"\x0a\x80\x80\x80\x80\x80\x00")),
    "6-byte unknown field length": _request(_header() + b"\xca\x02\x80\x80\x80\x80\x80\x00" +
                                            _metrics(_point())),
    "truncated": _request(_header() + _metrics(_point()))[:-3],
    "truncated length": _request(_header() + _metrics(_point())) + b"\x0a\x40\x0a",
    **{f"memory {name}": _request(_header() + _int(12, 2) + _string(14, "sdk/1") + payload)
       for name, payload in MEMORY_CASES.items()},
    "memory, every header field": _request(_string(1, "e") + _string(2, "p") + _string(3, "r") + _string(4, "t") +
                                           _string(5, "h") + _int(6, 7) + _int(7, -1) + _int(8, 3) + _int(9, 8) +
                                           _int(10, -1) + _int(11, 5) + _int(12, 5) + _string(13, "n") +
                                           _string(14, "s") + _int(15, -1) + _memory(_string(1, "cuda:0"))),
    "memory, no header": _request(_memory(_int(2, 1))),
    "memory, unknown severity": _request(_header() + _int(12, 9) + _memory(_int(2, 1))),
    "memory, negative severity": _request(_header() + _int(12, -2) + _memory(_int(2, 1))),
    "memory twice (merged)": _request(_header() + _memory(_int(2, 1)) + _memory(_int(3, 1))),
    "memory then metrics": _request(_header() + _memory(_int(2, 1)) + _metrics(_point())),
    "metrics then memory": _request(_header() + _metrics(_point()) + _memory(_int(2, 1))),
    "memory then log": _request(_header() + _memory(_int(2, 1)) + _string(24, _string(1, "hi"))),
    "memory, bad utf-8 header": _request(_header(project=b"p\xc3") + _memory(_int(2, 1))),
    "memory, header repeated": _request(_header() + _string(5, "h1") + _string(5, "h2") + _memory(_int(2, 1))),
    "mixed": _request(_header() + _metrics(_point()), _header(event_id="e2") + _string(24, _string(1, "hi")),
                      _header(event_id="e3") + _metrics(_point("lr", 2.0))),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_wire_cases(case: str, native_on: Any) -> None:
    _check(CASES[case])


def test_what_the_reader_takes(native_on: Any) -> None:
    """The native reader takes the plain batches (and leaves the rest to protobuf) where protobuf's reading
    is the plain one; it declines the whole request where its bytes need protobuf's judgement."""
    taken = native_on.read(CASES["mixed"])
    assert taken is not None and [row is None for row in taken] == [False, True, False]
    for case in ("alert", "recent", "no run id", "metrics twice (merged)", "oneof switched away",
                 "oneof switched to metrics"):
        assert native_on.read(CASES[case]) == [None], case
    for case in ("header repeated", "negative int32", "point fields repeated",
                 "envelope unknown fields", "request unknown field"):
        rows = native_on.read(CASES[case])
        assert rows is not None and rows[0] is not None, case
    for case in (*(f"memory {name}" for name in MEMORY_TAKEN), "memory, every header field", "memory, no header",
                 "memory, unknown severity", "memory, negative severity", "memory, header repeated"):
        rows = native_on.read(CASES[case])
        assert rows is not None and isinstance(rows[0], dict) and "memory" in rows[0], case
    for case in (*(f"memory {name}" for name in MEMORY_CASES if name not in MEMORY_TAKEN),
                 "memory twice (merged)", "memory then metrics", "metrics then memory", "memory then log",
                 "memory, bad utf-8 header"):
        assert native_on.read(CASES[case]) == [None], case
    for case in ("bad utf-8 name", "bad utf-8 sdk", "truncated", "11-byte varint", "group wire type",
                 "envelope known field, another wire type", "point field of another wire type"):
        assert native_on.read(CASES[case]) is None, case


def test_random_mutations(native_on: Any) -> None:
    """3,000 seeded mutations of real records (bytes flipped, dropped, inserted, cut) and 2,000 random byte
    strings: read_request with the native reader reads each one as protobuf does, or raises where protobuf
    raises."""
    rng = random.Random(15)
    values = _values()[:4] + list(CASES.values())
    for _ in range(3000):
        data = bytearray(rng.choice(values))
        for _ in range(rng.randint(1, 3)):
            if not data:
                break
            at = rng.randrange(len(data))
            how = rng.random()
            if how < 0.5:
                data[at] = rng.randrange(256)
            elif how < 0.7:
                del data[at]
            elif how < 0.9:
                data.insert(at, rng.randrange(256))
            else:
                del data[at:]
        _check(bytes(data))
    for _ in range(2000):  # random bytes, some behind a valid request's first bytes
        head = rng.choice(values)[:rng.randrange(40)] if rng.random() < 0.5 else b""
        _check(head + bytes(rng.randrange(256) for _ in range(rng.randrange(64))))


def test_bytes_only(native_on: Any) -> None:
    """The reader takes bytes only (immutable while read); a bytearray or memoryview is protobuf's."""
    value = _values()[0]
    assert native_on.read(value) is not None
    for other in (bytearray(value), memoryview(value)):
        assert native_on.read(other) is None
        _same(decode.read_request(other), decode.read_request_protobuf(value))  # type: ignore[arg-type]


def test_pipeline_the_same(native_on: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pipeline fed by read_request with and without the native reader: the same outputs, the same
    snapshot (a corpus stream, in chunks as the processor calls it)."""
    for name in sorted(STREAMS)[:6]:
        events, settings = STREAMS[name]
        envelopes = events()
        values = [wire.prepare_batch(envelopes[i:i + 7]).request.SerializeToString()
                  for i in range(0, len(envelopes), 7)]
        outputs = []
        for reader in (native_on, None):
            monkeypatch.setattr(decode, "NATIVE", reader)
            pipeline = Pipeline(settings)
            outs = []
            for envs, pts in _read_by_five(values):
                outs.append(pipeline.process(envs, pts))
            outputs.append((outs, pipeline.snapshot()))
        assert outputs[0] == outputs[1], name


def test_schema_check() -> None:
    """The generated schema is the one _fastread.c was written for (decode.schema_matches: when it fails,
    the reader is not used -- update the C with the schema); the package's own built copy, if any, is the
    one decode uses."""
    assert decode.schema_matches()
    assert decode.prepare_native(object()) is None  # not a reader (no VERSION): protobuf path
    assert native.target_name().startswith("_fastread") and native.target_name().endswith(".so")
    built = Path(decode.__file__).with_name(native.target_name())
    assert (decode.NATIVE is not None) == built.is_file()


def _message(fields: List[Tuple[str, int, bool]]) -> Any:
    """A real descriptor of a message ``M`` with int64 ``fields`` (name, number, proto3 ``optional``), in
    declaration order, from a pool of its own."""
    from google.protobuf import descriptor_pb2, descriptor_pool

    proto = descriptor_pb2.FileDescriptorProto(name="probe.proto", package="probe", syntax="proto3")
    message = proto.message_type.add(name="M")
    for name, number, optional in fields:
        field = message.field.add(name=name, number=number, type=descriptor_pb2.FieldDescriptorProto.TYPE_INT64,
                                  label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL)
        if optional:  # proto3 `optional`: a synthetic oneof of its own
            field.proto3_optional = True
            field.oneof_index = len(message.oneof_decl)
            message.oneof_decl.add(name=f"_{name}")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return pool.FindMessageTypeByName("probe.M")


@pytest.mark.parametrize("fields, taken", [
    ([("allocated", 2, False), ("reserved", 3, False), ("free", 7, False)], True),
    ([("reserved", 3, False), ("allocated", 2, False)], False),  # declared out of number order
    ([("allocated", 2, False), ("free", 7, True)], False)])      # `optional int64 free = 7`: wire writes 0
def test_a_schema_the_c_would_write_otherwise_is_refused(fields: List[Tuple[str, int, bool]], taken: bool) -> None:
    assert decode.written_as_c_writes(_message(fields)) is taken


class _Columns:
    """A metric store that keeps what the processor hands it (each round's MetricColumns, as lists)."""

    def __init__(self) -> None:
        self.rounds: List[Any] = []

    def put_columns(self, columns: Any) -> None:
        self.rounds.append((columns.count, [(key, [(name, tuple(map(list, cols))) for name, cols in by_name.items()])
                                            for key, by_name in columns.by_rank.items()]))


def _store_raw_rounds(values: List[bytes], reader: Any, monkeypatch: pytest.MonkeyPatch) -> List[Any]:
    """The metric store's columns of _store_raw over ``values`` (rounds of 5 records)."""
    import types

    from trainguard_server.processor.embedded import EmbeddedProcessor, ProcessorStats

    monkeypatch.setattr(decode, "NATIVE", reader)
    store = _Columns()
    fake = types.SimpleNamespace(metrics=store, events=types.SimpleNamespace(put=lambda stored: None),
                                 stats=ProcessorStats(),
                                 _write_metrics=store.put_columns)  # each chunk's columns (no write-behind)
    for envs, pts in _read_by_five(values):
        EmbeddedProcessor._store_raw(fake, envs, pts)  # type: ignore[arg-type]
    return store.rounds


def test_metric_columns_the_same(native_on: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The processor's metric columns (add_points in C for the plain batches, MetricColumns.add for the
    rest) equal MetricColumns.add's for every envelope: series in the same order, values of the same types
    bit for bit -- on every recorded stream (plain batches, alerts and recent context mixed) and the
    benchmark shapes."""
    values = _values()
    for name in sorted(STREAMS):
        events, _settings = STREAMS[name]
        envelopes = events()
        values += [wire.prepare_batch(envelopes[i:i + 7]).request.SerializeToString()
                   for i in range(0, len(envelopes), 7)]
    got = _store_raw_rounds(values, native_on, monkeypatch)
    want = _store_raw_rounds(values, None, monkeypatch)
    assert len(got) == len(want) and sum(count for count, _ in got) > 1000
    for (count, series), (want_count, want_series) in zip(got, want):
        assert count == want_count
        assert [(key, [n for n, _c in s]) for key, s in series] == \
            [(key, [n for n, _c in s]) for key, s in want_series]
        for (_key, by_name), (_k, want_by_name) in zip(series, want_series):
            for (_name, cols), (_n, want_cols) in zip(by_name, want_by_name):
                for col, want_col in zip(cols, want_cols):
                    assert len(col) == len(want_col)
                    for a, b in zip(col, want_col):
                        _same_value(a, b)


def test_add_points_refuses_what_is_not_a_point(reader: Any) -> None:
    """add_points takes (name, step, value) tuples only, and refuses before adding anything."""
    by_name: dict = {}
    with pytest.raises(TypeError):
        reader.add_points(by_name, 1, [("a", 1, 1.0), ["b", 2, 2.0]])
    with pytest.raises(TypeError):
        reader.add_points(by_name, 1, [("a", 1, 1.0), (b"b", 2, 2.0)])
    with pytest.raises(TypeError):
        reader.add_points(by_name, 1, [("a", 1, 1.0), ("b", 2)])
    assert by_name == {}
    assert reader.add_points(by_name, 7, [("a", 1, 1.0), ("a", 2, 2.0), ("b", 1, 0.5)]) == 3
    assert by_name == {"a": ([1, 2], [7, 7], [1.0, 2.0]), "b": ([1], [7], [0.5])}


def test_required_native_is_there() -> None:
    """With TRAINGUARD_REQUIRE_NATIVE=1 (what the test command sets: the package was installed with a
    compiler) the processor reads with the package's native reader -- a build that silently fell back to
    protobuf fails here. Without it, either path is valid (the other tests cover both)."""
    import os

    if os.environ.get("TRAINGUARD_REQUIRE_NATIVE") == "1":
        assert decode.NATIVE is not None, (
            f"TRAINGUARD_REQUIRE_NATIVE=1 but {native.target_name()} is not built beside processor/decode.py "
            "(python services/src/trainguard_server/processor/native.py builds it)")


def test_a_stale_build_is_refused_with_a_warning(monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """A module built from another source (its VERSION not decode's) is not used, and the log says so with
    the rebuild command (before, the fallback to protobuf was silent: hR's review, stop 42)."""
    import sys
    import types

    stale = types.ModuleType("trainguard_server.processor._fastread")
    stale.VERSION = decode.READER_VERSION - 1  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "trainguard_server.processor._fastread", stale)
    monkeypatch.setattr(sys.modules["trainguard_server.processor"], "_fastread", stale, raising=False)
    with caplog.at_level("WARNING", logger=decode.__name__):
        assert decode._native_reader() is None
    assert "is not used" in caplog.text and "trainguard_server.processor.native" in caplog.text
