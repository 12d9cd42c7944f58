"""trainguard.wire: dict <-> Envelope for every payload kind, equivalence with json_format, precise errors."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Set, Tuple

import pytest

pytest.importorskip("google.protobuf")

from google.protobuf import json_format
from google.protobuf.message import Message

from trainguard import wire
from trainguard.core import events as ev
from trainguard.v1 import events_pb2, ingest_pb2

REPO = Path(__file__).resolve().parents[2]
NAN, INF = math.nan, math.inf
T0 = 1_764_000_000_123_456_789  # beyond 2**53: int64 must not go through a float

BASE = {
    "project": "llm", "run_id": "5f0c" * 8, "trace_id": "torchelastic-1234", "host": "node-17", "pid": 4242,
    "rank": 3, "local_rank": 3, "world_size": 8, "run_name": "llama-7b-sft", "sdk": "trainguard-python/0.1.0",
    "group_rank": -1,
}
FRAMES = [
    {"filename": "/opt/app/train.py", "module": "train", "function": "main", "lineno": 88, "in_app": True,
     "context_line": "loss.backward()"},
    {"filename": "/usr/lib/python3/site-packages/torch/_tensor.py", "module": "torch._tensor",
     "function": "backward", "lineno": 521, "in_app": False, "context_line": "torch.autograd.backward("},
]


def _samples() -> Dict[str, Dict[str, Any]]:
    """One envelope per payload kind (two for metrics and lifecycle), built with trainguard.core.events."""
    e = ev.envelope
    return {
        "metrics": e(BASE, "metrics", ev.metrics_payload(
            {"loss": 2.25, "grad/global_norm": NAN, "amp/scale": INF, "grad/layer/encoder.0": -INF, "lr": 0}),
            step=1200, time_unix_nano=T0),
        "metrics_alert": e(BASE, "metrics", ev.metrics_payload(
            {"loss": NAN}, alert="non_finite:loss",
            recent=[("loss", 1198, 2.5), ("loss", 1199, INF), ("grad/global_norm", 1199, 1e6)]),
            step=1200, time_unix_nano=T0 + 1, severity="ERROR"),
        "exception": e(BASE, "exception", {
            "type": "torch.OutOfMemoryError",
            "message": "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 3; 79.15 GiB total capacity)",
            "frames": FRAMES, "fingerprint": "ab" * 16, "fingerprint_version": "fp:v1",
            "message_template":
                "CUDA out of memory. Tried to allocate <size> (GPU <n>; <size> total capacity)",
            "hints": [{"frame_index": 0, "contributes": True, "reason": "in-app"},
                      {"frame_index": 1, "contributes": False, "reason": "library frame"}],
            "handled": True, "mechanism": "capture_exception", "thread": "MainThread",
            "traceback":
                "Traceback (most recent call last):\n  ...\ntorch.OutOfMemoryError: CUDA out of memory",
            "chain": [{"type": "RuntimeError", "message": "NCCL error", "relation": "cause",
                       "frames": FRAMES[:1]},
                      {"type": "KeyError", "message": "'x'", "relation": "context", "frames": []}],
            "context": ev.string_map({"memory_summary": "|  Allocated memory  | 77.1 GiB |", "device": 3}),
            "recent_metrics": [{"name": "loss", "step": 1199, "value": ev.wire_float(NAN)},
                               {"name": "grad/global_norm", "step": 1199, "value": 3.5}],
        }, step=1200, time_unix_nano=T0 + 2, severity="CRITICAL"),
        "lifecycle_start": e(BASE, "lifecycle", {
            "phase": "START", "argv": ["train.py", "--lr", "3e-4", "--name=ünïcødé"], "python": "3.11.7",
            "torch": "2.13.0+cpu", "cuda": "12.4",
            "tags": ev.string_map({"k8s.pod": "train-0", "slurm.job_id": 991}),
            "config": ev.string_map({"lr": 3e-4, "batch_size": 64, "amp": True}),
        }, step=-1, time_unix_nano=T0 + 3),
        "lifecycle_exit": e(BASE, "lifecycle", {
            "phase": "EXIT", "exit_code": 137, "signal": 9, "reason": "signal",
            "sdk_stats": {"sent": 1234.0, "dropped.queue_full": 3.0, "spooled": 0.0,
                          "overhead_ms": ev.wire_float(INF)},
        }, step=5000, time_unix_nano=T0 + 4, severity="WARNING"),
        "heartbeat": e(BASE, "heartbeat", {
            "last_step": 4999, "last_step_time_unix_nano": T0 - 10**9, "step_time_ewma_s": 0.42,
            "uptime_s": 3600.5, "sdk_stats": {"queue": 12.0, "dropped": 0.0},
        }, step=4999, time_unix_nano=T0 + 5),
        "log": e(BASE, "log", {
            "logger": "transformers.trainer", "level": "WARNING",
            "message": "损失出现 NaN ✗ — gradient overflow, skipping step", "source": "logging",
        }, step=4999, time_unix_nano=T0 + 6, severity="WARNING"),
        "memory": e(BASE, "memory", {
            "device": "cuda:3", "allocated": 77 * 2**30, "reserved": 79 * 2**30, "active": 76 * 2**30,
            "max_allocated": 78 * 2**30, "total_capacity": 80 * 2**30, "free": 2**29, "fragmentation": 0.0380,
            "num_alloc_retries": 17, "num_ooms": 1, "rss": 12 * 2**30,
            "summary": "|===| PyTorch CUDA memory summary",
            "stats": {"allocation.all.current": 1523.0, "inactive_split_bytes.all.peak": 2.5e9},
        }, step=4999, time_unix_nano=T0 + 7, severity="ERROR"),
    }


SAMPLES = _samples()


MAP_FIELDS = {"context", "tags", "config", "sdk_stats", "stats"}


def _canonical(value: Any, top: bool = True) -> Any:
    """``value`` as envelope_to_dict emits it: default-valued fields dropped (not map entries)."""
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            v = v if k in MAP_FIELDS else _canonical(v, False)
            if top and k in ev.PAYLOAD_KINDS:
                out[k] = v  # a set payload stays even when empty
            elif v not in (0, "", False, [], {}, None) or (isinstance(v, float) and v != v):
                out[k] = v
        return out
    if isinstance(value, list):
        return [_canonical(v, False) for v in value]
    return value


def _same(a: Any, b: Any) -> bool:
    """Message equality that is exact for NaN (bytes of a deterministic serialization)."""
    return bool(a.SerializeToString(deterministic=True) == b.SerializeToString(deterministic=True))


# ------------------------------------------------------------------------------------------ round trips

@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_round_trip_dict_envelope_dict(name: str) -> None:
    d = SAMPLES[name]
    msg = wire.envelope_from_dict(d)
    assert isinstance(msg, events_pb2.Envelope)
    assert msg.WhichOneof("payload") == ev.payload_kind(d)
    assert wire.envelope_to_dict(msg) == _canonical(d)
    # the output is valid JSON in the same mapping and parses back to the same message
    again = wire.envelope_to_dict(msg)
    assert _same(wire.envelope_from_dict(json.loads(ev.encode_event(again))), msg)
    # the binary form round-trips too
    assert _same(events_pb2.Envelope.FromString(msg.SerializeToString()), msg)


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_same_message_as_json_format(name: str) -> None:
    d = SAMPLES[name]
    ours = wire.envelope_from_dict(d)
    theirs = json_format.ParseDict(d, events_pb2.Envelope())
    assert _same(ours, theirs)
    assert _same(json_format.ParseDict(wire.envelope_to_dict(ours), events_pb2.Envelope()), theirs)


def test_values_survive() -> None:
    metrics = wire.envelope_from_dict(SAMPLES["metrics"]).metrics
    values = {p.name: p.value for p in metrics.points}
    assert math.isnan(values["grad/global_norm"]) and values["amp/scale"] == INF
    assert values["grad/layer/encoder.0"] == -INF and values["loss"] == 2.25
    alert = wire.envelope_from_dict(SAMPLES["metrics_alert"])
    assert alert.metrics.alert == "non_finite:loss" and alert.severity == events_pb2.ERROR
    assert [(p.name, p.step) for p in alert.metrics.recent][1] == ("loss", 1199)
    assert alert.time_unix_nano == T0 + 1  # exact beyond 2**53
    exc = wire.envelope_from_dict(SAMPLES["exception"]).exception
    assert exc.frames[1].in_app is False and exc.chain[0].frames[0].lineno == 88
    assert exc.context["device"] == "3" and math.isnan(exc.recent_metrics[0].value)
    start = wire.envelope_from_dict(SAMPLES["lifecycle_start"]).lifecycle
    assert start.phase == events_pb2.Lifecycle.START and start.config["amp"] == "True"
    exit_ = wire.envelope_from_dict(SAMPLES["lifecycle_exit"]).lifecycle
    assert exit_.sdk_stats["overhead_ms"] == INF and exit_.exit_code == 137
    memory = wire.envelope_from_dict(SAMPLES["memory"]).memory
    assert memory.total_capacity == 80 * 2**30 and memory.stats["inactive_split_bytes.all.peak"] == 2.5e9
    out = wire.envelope_to_dict(wire.envelope_from_dict(SAMPLES["metrics"]))
    assert {p["name"]: p.get("value") for p in out["metrics"]["points"]}["grad/global_norm"] == "NaN"
    assert out["group_rank"] == -1 and out["time_unix_nano"] == T0 and isinstance(out["step"], int)


def test_samples_cover_every_field_of_the_schema() -> None:
    """A field added to events.proto must get a sample here (and so a round-trip test)."""
    def all_fields(desc: Any, seen: Set[str]) -> Set[str]:
        names: Set[str] = set()
        if desc.full_name in seen:
            return names
        seen.add(desc.full_name)
        for fd in desc.fields:
            names.add(fd.full_name)
            if fd.message_type is not None and not fd.message_type.GetOptions().map_entry:
                names |= all_fields(fd.message_type, seen)
        return names

    def used(msg: Any) -> Set[str]:
        names: Set[str] = set()
        for fd, value in msg.ListFields():
            names.add(fd.full_name)
            if fd.message_type is not None and not fd.message_type.GetOptions().map_entry:
                for item in ([value] if isinstance(value, Message) else value):
                    names |= used(item)
        return names

    covered: Set[str] = set()
    for d in SAMPLES.values():
        covered |= used(wire.envelope_from_dict(d))
    assert all_fields(events_pb2.Envelope.DESCRIPTOR, set()) - covered == set()


def test_include_defaults_lists_every_field() -> None:
    msg = wire.envelope_from_dict({"event_id": "e1", "heartbeat": {}})
    assert wire.envelope_to_dict(msg) == {"event_id": "e1", "heartbeat": {}}
    full = wire.envelope_to_dict(msg, include_defaults=True)
    assert set(full) == {f for f in ev.ENVELOPE_FIELDS} | {"heartbeat"}
    assert full["severity"] == "SEVERITY_UNSPECIFIED" and full["rank"] == 0
    assert full["heartbeat"] == {"last_step": 0, "last_step_time_unix_nano": 0, "step_time_ewma_s": 0.0,
                                 "uptime_s": 0.0, "sdk_stats": {}}


# --------------------------------------------------------------------------------- JSON mapping details

def test_proto3_json_mapping_variants_are_accepted() -> None:
    d = {"eventId": "e2", "runId": "r", "step": "42", "timeUnixNano": str(T0), "severity": 3, "rank": 2.0,
         "pid": None, "metrics": {"points": [{"name": "loss", "value": "1.5", "step": "-1"},
                                            {"name": "gn", "value": "Infinity"}, {"name": "x", "value": 7}]}}
    msg = wire.envelope_from_dict(d)
    assert _same(msg, json_format.ParseDict(d, events_pb2.Envelope()))
    assert (msg.event_id, msg.step, msg.time_unix_nano, msg.severity, msg.rank) == ("e2", 42, T0, 3, 2)
    assert [p.value for p in msg.metrics.points] == [1.5, INF, 7.0]
    assert wire.envelope_to_dict(msg)["severity"] == "WARNING"


BAD: List[Tuple[Dict[str, Any], str]] = [
    ({"bogus": 1}, 'Envelope: unknown field "bogus" (trainguard.v1.Envelope has: event_id,'),
    ({"metrics": {"points": [{"name": "a", "value": 1}, {"name": "b", "vaule": 2}]}},
     'Envelope.metrics.points[1]: unknown field "vaule" (trainguard.v1.Metric has: name, value, step)'),
    ({"metrics": {"points": [{"name": "a", "value": "nan"}]}},
     'Envelope.metrics.points[0].value: expected a double, got "nan" (use "NaN", "Infinity" or "-Infinity")'),
    ({"metrics": {"points": [{"name": "a", "value": True}]}}, "points[0].value: expected a double, got true"),
    ({"rank": True}, "Envelope.rank: expected an integer, got true"),
    ({"step": "12x"}, 'Envelope.step: expected an integer, got "12x"'),
    ({"step": 1.5}, "Envelope.step: expected an integer, got 1.5"),
    ({"pid": 2**31}, "Envelope.pid: 2147483648 is out of range for int32"),
    ({"step": str(2**63)}, "Envelope.step: \"9223372036854775808\" is out of range for int64"),
    ({"severity": "LOUD"}, 'Envelope.severity: unknown trainguard.v1.Severity value "LOUD"'),
    ({"host": 7}, "Envelope.host: expected a string, got 7"),
    ({"host": "bad \ud800 surrogate"}, "Envelope.host: string is not valid UTF-8"),
    ({"lifecycle": {"argv": "train.py"}}, 'Envelope.lifecycle.argv: expected an array, got "train.py"'),
    ({"lifecycle": {"argv": ["a", None]}}, "Envelope.lifecycle.argv[1]: expected a string, got null"),
    ({"lifecycle": {"tags": {"a": 1}}}, 'Envelope.lifecycle.tags["a"]: expected a string, got 1'),
    ({"heartbeat": {"sdk_stats": {"a": "x"}}},
     'Envelope.heartbeat.sdk_stats["a"]: expected a double, got "x"'),
    ({"memory": {"stats": {"a": None}}}, 'Envelope.memory.stats["a"]: map value is null'),
    ({"exception": {"frames": [{"in_app": 1}]}},
     "Envelope.exception.frames[0].in_app: expected true or false"),
    ({"exception": {"chain": [{"frames": [{}, {"lineno": "x"}]}]}},
     'Envelope.exception.chain[0].frames[1].lineno: expected an integer, got "x"'),
    ({"log": "oops"}, 'Envelope.log: expected an object, got "oops"'),
    ({"metrics": {}, "log": {}}, "Envelope: oneof 'payload' has more than one member set: metrics, log"),
    ({"run_id": "a", "runId": "b"}, "Envelope: field 'run_id' given twice (as 'run_id' and as 'runId')"),
]


@pytest.mark.parametrize(("d", "message"), BAD, ids=[f"{i}-{m.split(':')[0]}" for i, (_, m) in
                                                     enumerate(BAD)])
def test_malformed_input_is_rejected_with_the_field_path(d: Dict[str, Any], message: str) -> None:
    with pytest.raises(wire.WireError) as info:
        wire.envelope_from_dict(d)
    assert message in str(info.value)
    assert str(info.value).startswith(info.value.path + ": ")


def test_json_format_rejects_them_too() -> None:
    """Our rejections are json_format's, except where json_format is laxer (listed, deliberate)."""
    laxer = {"Envelope: field 'run_id' given twice", "points[0].value: expected a double, got true"}
    for d, message in BAD:
        if any(message.startswith(m) for m in laxer):
            continue
        with pytest.raises((json_format.ParseError, ValueError, TypeError)):
            json_format.ParseDict(d, events_pb2.Envelope())


def test_unknown_fields_can_be_ignored_explicitly() -> None:
    d = dict(SAMPLES["metrics"], future_field={"x": 1})
    d["metrics"] = dict(d["metrics"], points=[dict(p, unit="s") for p in d["metrics"]["points"]])
    with pytest.raises(wire.WireError, match='unknown field "unit"'):
        wire.envelope_from_dict(d)
    with pytest.raises(wire.WireError, match=r'^Envelope: unknown field "future_field"'):
        wire.envelope_from_dict(dict(SAMPLES["metrics"], future_field=1))
    msg = wire.envelope_from_dict(d, ignore_unknown_fields=True)
    assert _same(msg, wire.envelope_from_dict(SAMPLES["metrics"]))
    assert _same(msg, json_format.ParseDict(d, events_pb2.Envelope(), ignore_unknown_fields=True))


def test_input_dicts_are_not_modified() -> None:
    d = {"eventId": "e", "pid": None, "metrics": {"points": [{"name": "a", "value": "NaN"}]}}
    before = json.dumps(d)
    wire.envelope_from_dict(d)
    assert json.dumps(d) == before


# ----------------------------------------------------------------------------------------------- batches

def test_http_json_body_parses_into_an_ingest_request() -> None:
    events: List[Dict[str, Any]] = list(SAMPLES.values())
    body = ev.encode_batch(events)
    parsed = json_format.Parse(body, ingest_pb2.IngestRequest())
    assert len(parsed.events) == len(events)
    assert _same(parsed, wire.ingest_request_from_dicts(events))
    assert wire.ingest_request_to_dicts(parsed) == [_canonical(e) for e in events]


def test_ingest_request_from_dicts_names_the_bad_event() -> None:
    events = [SAMPLES["log"], SAMPLES["memory"], {"event_id": "x", "log": {"level": 5}}]
    with pytest.raises(wire.WireError) as info:
        wire.ingest_request_from_dicts(events)
    assert info.value.index == 2
    assert str(info.value) == 'events[2]: Envelope.log.level: expected a string, got 5'


def test_prepare_batch_keeps_good_events_and_reports_bad_ones() -> None:
    events = [SAMPLES["log"], {"event_id": "bad1", "bogus": 1}, SAMPLES["metrics"], "not an object"]
    batch = wire.prepare_batch(events)  # type: ignore[arg-type]
    assert batch.indices == [0, 2]
    assert [e.event_id for e in batch.request.events] == [SAMPLES["log"]["event_id"],
                                                         SAMPLES["metrics"]["event_id"]]
    assert [(r["index"], r["event_id"], r["code"]) for r in batch.rejected] == [
        (1, "bad1", "invalid_field"), (3, "", "invalid_field")]
    assert batch.rejected[0]["message"].startswith('Envelope: unknown field "bogus"')


# ------------------------------------------------------------------------------------ optional extras

def test_import_trainguard_and_v1_without_protobuf() -> None:
    code = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.startswith(("google.protobuf", "grpc")):
            raise ImportError("blocked " + name)
sys.meta_path.insert(0, Block())
import trainguard, trainguard.v1, trainguard.core.events
try:
    import trainguard.wire
except ImportError as exc:
    assert "pip install 'trainguard[proto]'" in str(exc), exc
else:
    raise AssertionError("trainguard.wire imported without protobuf")
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env=_env())
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def _env() -> Dict[str, str]:
    """The environment for a child interpreter that imports this same trainguard."""
    src = Path(wire.__file__).parent.parent  # the directory holding the trainguard package under test
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(src), str(REPO), env.get("PYTHONPATH")]))
    return env


def test_docs_wire_format_examples_are_valid() -> None:
    """Every JSON example in docs/wire-format.md parses (envelopes strictly, with our converter)."""
    text = (REPO / "docs" / "wire-format.md").read_text(encoding="utf-8")
    blocks = [b.split("```", 1)[0] for b in text.split("```json\n")[1:]]
    kinds = set()
    for block in blocks:
        doc = json.loads(block)
        if "accepted" in doc:
            json_format.ParseDict(doc, ingest_pb2.IngestResponse())
            continue
        msg = wire.envelope_from_dict(doc)
        kinds.add(msg.WhichOneof("payload"))
        assert _same(msg, json_format.ParseDict(doc, events_pb2.Envelope()))
    assert kinds == set(ev.PAYLOAD_KINDS)


_MAP_ORDER_SCRIPT = """
import sys
from trainguard import wire
from trainguard.v1 import events_pb2
msg = events_pb2.Envelope.FromString(bytes.fromhex(sys.argv[1]))
d = wire.envelope_to_dict(msg)
print(",".join(d["lifecycle"]["tags"]) + "|" + ",".join(d["lifecycle"]["sdk_stats"]))
"""


def test_map_fields_read_in_sorted_key_order_in_every_process() -> None:
    """A parsed protobuf map's own order is its process's (upb seeds its hash tables per process): the dict
    read from the same bytes must not depend on the process (the pipeline workers read records the processor
    read too: processor/pool.py), so map keys come out sorted."""
    keys = [f"k{(i * 7919) % 101:03d}" for i in range(40)]
    msg = wire.envelope_from_dict({"event_id": "e", "project": "p", "run_id": "r", "lifecycle": {
        "phase": "START", "tags": {k: k for k in keys}, "sdk_stats": {k: 1.0 for k in keys}}})
    wanted = ",".join(sorted(keys)) + "|" + ",".join(sorted(keys))
    seen = set()
    for seed in ("1", "2", "3"):
        out = subprocess.run([sys.executable, "-c", _MAP_ORDER_SCRIPT, msg.SerializeToString().hex()],
                             capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONHASHSEED": seed})
        seen.add(out.stdout.strip())
    assert seen == {wanted}
