"""Hypothesis strategies for the fuzz suite: envelopes built from the wire schema, arbitrary JSON, bodies.

* :func:`envelope_dicts` walks ``trainguard.v1.Envelope``'s descriptor (the schema of
  proto/trainguard/v1/events.proto, so a new field is fuzzed without a change here) and draws dicts in the
  JSON mapping of docs/wire-format.md: every scalar over its whole range (int32/int64 bounds, doubles
  including NaN, +-Infinity, subnormals and -0.0 spelled as the mapping spells them), odd strings
  (control characters, astral planes, RTL marks, NUL), enums by name or number, repeated fields and maps,
  and one payload of the ``payload`` oneof. Strings and ids are drawn half the time from a small
  vocabulary of what training jobs really send (metric names, exception types, NCCL/CUDA messages, a few
  run ids) so that runs accumulate state and the detectors and classifier see inputs they act on.
  With ``wild`` > 0 a field's value is, with that probability, any JSON value instead (wrong types).
* :func:`json_values`: any JSON value (nested, huge integers, non-finite floats, any unicode).
* :func:`deep_json_text`: JSON text nested deeper than Python's JSON decoder can recurse.
"""

from __future__ import annotations

import base64
import functools
import math
from typing import Any, Callable, Dict, List, Optional, Tuple

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from hypothesis import strategies as st

from trainguard.v1 import events_pb2

INT32 = (-(2**31), 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)

METRIC_NAMES = ("loss", "train/loss", "eval/loss", "grad/global_norm", "grad_norm", "opt/lr", "lr",
                "amp/scale", "loss_scale", "grad/layer/encoder.0", "step_time", "tokens_per_s",
                "mem/allocated", "throughput")
EXCEPTION_TYPES = ("torch.OutOfMemoryError", "RuntimeError", "torch.distributed.DistBackendError",
                   "ValueError", "KeyboardInterrupt", "torch.cuda.OutOfMemoryError", "SystemExit")
MESSAGES = (
    "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.15 GiB total capacity)",
    "NCCL error in: ProcessGroupNCCL.cpp:1275, unhandled system error, NCCL version 2.18.1",
    "[Rank 3] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE) ran for "
    "600000 milliseconds before timing out.",
    "CUDA error: an illegal memory access was encountered",
    "Loss is nan, stopping training", "step 12 | loss nan | grad_norm inf | lr 1.0e-04",
    "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 0.0001",
    "torch.distributed.elastic.multiprocessing.api: failed (exitcode: -9) local_rank: 0 (pid: 12) of "
    "binary: /usr/bin/python", "died with <Signals.SIGSEGV: 11>", "Received 15 death signal",
    "Traceback (most recent call last):\n  File \"train.py\", line 3, in <module>\nRuntimeError: boom",
    "", " ", "\x00", "nan", "inf", "💥" * 3, "\u202eevil\u202c", "a" * 300,
)
RUN_IDS = ("run-a", "run-b", "r", "0", "-", "_x_", "ünïcode", "a" * 128)
EVENT_ID_ALPHABET = "0123456789abcdefABCDEF_-"
ODD_TEXT = st.text(st.characters(codec="utf-8"), max_size=40)  # any code point but lone surrogates


def _vocab(words: tuple[str, ...]) -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from(words), ODD_TEXT)


#: string fields whose values steer the engine, by name; every other string is ODD_TEXT or a vocab word
_STRING_FIELDS: Dict[str, st.SearchStrategy[str]] = {
    "name": _vocab(METRIC_NAMES), "type": _vocab(EXCEPTION_TYPES), "message": _vocab(MESSAGES),
    "traceback": _vocab(MESSAGES), "summary": _vocab(MESSAGES), "alert": _vocab(("non_finite:loss", "")),
    "run_id": _vocab(RUN_IDS), "trace_id": _vocab(RUN_IDS), "project": _vocab(("", "p", "q")),
    "event_id": st.one_of(*[st.text(EVENT_ID_ALPHABET, min_size=1, max_size=40)] * 3, ODD_TEXT),
    "level": _vocab(("ERROR", "WARNING", "INFO", "CRITICAL")),
    "source": _vocab(("stderr", "stdout", "logging", "file:/tmp/train.log")),
    "reason": _vocab(("normal", "exception", "signal", "sys.exit")),
    "device": _vocab(("cuda:0", "cpu")), "relation": _vocab(("cause", "context")),
    "mechanism": _vocab(("excepthook", "threading", "capture_exception", "log", "agent")),
}


def doubles() -> st.SearchStrategy[Any]:
    """A double as the JSON mapping writes it: finite numbers, ``"NaN"``, ``"Infinity"``, ``"-Infinity"``;
    any finite value from tiny subnormals to the largest double, and -0.0."""
    def spell(x: float) -> Any:
        if math.isnan(x):
            return "NaN"
        if math.isinf(x):
            return "Infinity" if x > 0 else "-Infinity"
        return x
    special = st.sampled_from([0.0, -0.0, 5e-324, -5e-324, 1e308, -1.7976931348623157e308, 1.0, 1e-8, 65504.0])
    return st.one_of(st.floats(allow_nan=True, allow_infinity=True), special).map(spell)


def _integers(fd: FieldDescriptor) -> st.SearchStrategy[Any]:
    lo, hi = INT64 if fd.type in (FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_SINT64,
                                  FieldDescriptor.TYPE_SFIXED64) else INT32
    edges = st.sampled_from([lo, hi, -1, 0, 1, 2**31 - 1, -(2**31)]).filter(lambda v: lo <= v <= hi)
    number = st.one_of(st.integers(lo, hi), st.integers(-3, 50), edges)
    if hi > INT32[1]:  # the mapping also spells int64 as a decimal string
        return st.one_of(number, number.map(str))
    return number


def _scalar(fd: FieldDescriptor) -> st.SearchStrategy[Any]:
    t = fd.type
    if t == FieldDescriptor.TYPE_STRING:
        return _STRING_FIELDS.get(fd.name, ODD_TEXT)
    if t == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return doubles()
    if t == FieldDescriptor.TYPE_ENUM:
        values = [v.name for v in fd.enum_type.values] + [v.number for v in fd.enum_type.values]
        return st.one_of(st.sampled_from(values), st.integers(INT32[0], INT32[1]))
    if t == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=16).map(lambda b: base64.b64encode(b).decode())
    return _integers(fd)


@functools.cache
def json_values(max_leaves: int = 12, finite: bool = False) -> st.SearchStrategy[Any]:
    """Any JSON value: null, booleans, integers of any size, floats (``finite``: no NaN/Infinity, which
    JSON text spells ``NaN``/``Infinity`` only outside the standard), any unicode (lone surrogates too),
    arrays and objects nested a few levels."""
    leaves = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(-(2**70), 2**70),
                       st.floats(allow_nan=not finite, allow_infinity=not finite), st.text(max_size=20),
                       st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999", "0x10", " 7", ""]))
    return st.recursive(leaves, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                        st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                        max_leaves=max_leaves)


def deep_json_text(min_depth: int = 5000, max_depth: int = 8000) -> st.SearchStrategy[str]:
    """JSON text of an array or object nested ``min_depth``..``max_depth`` levels. Text, not a value:
    ``json.dumps`` itself cannot encode that (and under Hypothesis, which raises the recursion limit by
    about 2,000 while a test runs, the default depths stay beyond what the decoder can recurse to)."""
    def build(args: tuple[int, bool]) -> str:
        depth, objects = args
        if objects:
            return '{"k": ' * depth + "0" + "}" * depth
        return "[" * depth + "0" + "]" * depth
    return st.tuples(st.integers(min_depth, max_depth), st.booleans()).map(build)


def _is_repeated(fd: FieldDescriptor) -> bool:
    flag = getattr(fd, "is_repeated", None)  # protobuf >= 6.31; ``label`` is deprecated there
    return flag if isinstance(flag, bool) else bool(fd.label == FieldDescriptor.LABEL_REPEATED)


def _field_value(fd: FieldDescriptor, depth: int, wild: float) -> st.SearchStrategy[Any]:
    if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
        key_fd = fd.message_type.fields_by_name["key"]
        value_fd = fd.message_type.fields_by_name["value"]
        value: st.SearchStrategy[Any] = st.dictionaries(_scalar(key_fd), _single(value_fd, depth, wild),
                                                        max_size=4)
    elif _is_repeated(fd):
        value = st.lists(_single(fd, depth, wild), max_size=5)
    else:
        value = _single(fd, depth, wild)
    return _maybe_wild(value, wild)


def _single(fd: FieldDescriptor, depth: int, wild: float) -> st.SearchStrategy[Any]:
    if fd.type == FieldDescriptor.TYPE_MESSAGE:
        if depth <= 0:
            return st.just({})
        return message_dicts(fd.message_type, depth - 1, wild)
    return _maybe_wild(_scalar(fd), wild)


def _maybe_wild(value: st.SearchStrategy[Any], wild: float) -> st.SearchStrategy[Any]:
    if wild <= 0:
        return value
    percent = round(wild * 100)

    @st.composite
    def draw_one(draw: Callable[..., Any]) -> Any:
        if draw(st.integers(0, 99)) < percent:  # this field, in this envelope, of the wrong type
            return draw(json_values(4, finite=True))
        return draw(value)
    return draw_one()


@functools.cache
def message_dicts(desc: Descriptor, depth: int = 3, wild: float = 0.0, oneof_choice: Optional[str] = None,
                  always: Tuple[str, ...] = ()) -> st.SearchStrategy[Dict[str, Any]]:
    """Dicts in the JSON mapping for message ``desc``: the fields named in ``always`` and any subset of its
    other fields outside oneofs, and exactly one member of each oneof (``oneof_choice`` fixes the member of
    the first); nested messages down to ``depth`` levels."""
    plain = [(fd.name, _field_value(fd, depth, wild)) for fd in desc.fields if fd.containing_oneof is None]
    oneofs = [[(fd.name, _field_value(fd, depth, wild)) for fd in o.fields] for o in desc.oneofs]
    if oneof_choice is not None:
        oneofs[0] = [member for member in oneofs[0] if member[0] == oneof_choice]

    @st.composite
    def build(draw: Callable[..., Any]) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        for name, value in plain:
            if name in always or draw(st.booleans()):
                out[name] = draw(value)
        for members in oneofs:
            name, value = members[0] if len(members) == 1 else draw(st.sampled_from(members))
            out[name] = draw(value)
        return out
    return build()


PAYLOADS: List[str] = [fd.name for fd in events_pb2.Envelope.DESCRIPTOR.oneofs_by_name["payload"].fields]


def envelope_dicts(wild: float = 0.0) -> st.SearchStrategy[Dict[str, Any]]:
    """Envelope dicts from the wire schema (see the module docstring); metrics payloads are drawn more often
    (what jobs mostly send)."""
    kinds = st.one_of(st.just("metrics"), st.sampled_from(PAYLOADS))
    return kinds.flatmap(lambda kind: message_dicts(events_pb2.Envelope.DESCRIPTOR, 3, wild, kind,
                                                    ("event_id", "run_id")))
