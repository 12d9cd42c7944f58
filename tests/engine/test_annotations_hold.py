"""The compiled engine's contract, checked on the pure one: every attribute of every object of a compiled
module's class (trainguard_engine/_native.py HOT) the pipeline holds or hands out holds what its annotation
says -- a ``float`` a float (never an int: compiled, ``3`` would become ``3.0`` in a record), an ``int`` an int
(never a bool), a ``List[Evidence]`` Evidence objects (the env500 bug of stop 47). Walked after every golden
stream (tests/engine/test_pipeline_golden.py), every 500 envelopes, at the end and restored from its snapshot,
and on each output record; and every argument of every call of a compiled module's function on the way
(a ``sys.setprofile`` hook: ``diagnosis._number(3)`` would be a lie -- compiled, it sees ``3.0``).
It runs on the pure engine (a subprocess under the compiled one: ``ENGINE_PURE``), which keeps the
attributes as they were set -- the compiled one has already converted or refused them."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import sys
import types
import typing
from typing import Any, Dict, List, Optional, Set, Tuple

import pytest

from tests.engine.test_pipeline_golden import STREAMS
from trainguard_engine import _native
from trainguard_engine.pipeline import Pipeline
from trainguard_engine.records import Evidence, Incident

PURE = pytest.mark.engine_pure("checks the pure engine's attributes against the annotations the compiled one enforces")
MODULES = frozenset("trainguard_engine." + m for m in _native.HOT)
_HINTS: Dict[type, Dict[str, Any]] = {}


def _hints(cls: type) -> Dict[str, Any]:
    """The annotations of ``cls`` and its bases from compiled modules, resolved."""
    if cls not in _HINTS:
        found: Dict[str, Any] = {}
        for klass in reversed(cls.__mro__):
            if klass.__module__ in MODULES:
                found.update(typing.get_type_hints(klass, vars(sys.modules[klass.__module__])))
        _HINTS[cls] = {k: t for k, t in found.items() if typing.get_origin(t) is not typing.ClassVar}
    return _HINTS[cls]


def holds(value: Any, kind: Any) -> bool:
    """Whether ``value`` is what the annotation ``kind`` says, as a compiled class checks it (exact float,
    int and str; containers element by element, the first 100)."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if kind is Any or isinstance(kind, typing.TypeVar):
        return True
    if origin is typing.Union:
        return any(holds(value, a) for a in args)
    if kind is type(None):
        return value is None
    if kind in (float, int, str, bool):
        return type(value) is kind
    if origin is list:
        return type(value) is list and (not args or all(holds(v, args[0]) for v in value[:100]))
    if origin is dict:
        return type(value) is dict and (not args or all(holds(k, args[0]) and holds(v, args[1])
                                                        for k, v in list(value.items())[:100]))
    if origin is tuple:
        if type(value) is not tuple:
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(holds(v, args[0]) for v in value[:100])
        return not args or (len(args) == len(value) and all(holds(v, a) for v, a in zip(value, args)))
    if isinstance(kind, type):
        return isinstance(value, kind)
    return True  # (Callable, Protocols, ...: not checked)


def lies(root: Any) -> Set[Tuple[str, str, str, str]]:
    """``(class, attribute, annotation, type found)`` for every attribute below ``root`` that does not hold
    its annotation."""
    found: Set[Tuple[str, str, str, str]] = set()
    seen: Set[int] = set()
    todo: List[Any] = [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, dict):
            todo.extend(list(obj.values())[:200])
        elif isinstance(obj, (list, tuple, set, frozenset)):
            todo.extend(list(obj)[:200])
        elif type(obj).__module__ in MODULES:
            for name, kind in _hints(type(obj)).items():
                value = getattr(obj, name, _hints)
                if value is _hints:
                    continue
                if not holds(value, kind):
                    found.add((type(obj).__name__, name, str(kind), type(value).__name__))
                todo.append(value)
            todo.extend(getattr(obj, "__dict__", {}).values())
    return found


def _functions() -> Dict[types.CodeType, Tuple[str, Dict[str, Any], Optional[str]]]:
    """Every function and method of the compiled modules (dataclasses' generated ``__init__``s left out: their
    fields are the attributes :func:`lies` checks) by code object: its name, its parameters' annotations
    and the name of its ``*args`` parameter (annotated per element)."""
    out: Dict[types.CodeType, Tuple[str, Dict[str, Any], Optional[str]]] = {}
    for name in sorted(MODULES):
        module = importlib.import_module(name)
        candidates: List[Any] = []
        for value in vars(module).values():
            if isinstance(value, type) and value.__module__ == name:
                generated = dataclasses.is_dataclass(value)
                candidates += [v for k, v in vars(value).items() if not (generated and k == "__init__")]
            else:
                candidates.append(value)
        for fn in candidates:
            fn = fn.__func__ if isinstance(fn, (staticmethod, classmethod)) else fn
            if isinstance(fn, types.FunctionType) and fn.__module__ == name:
                hints = typing.get_type_hints(fn, vars(module))
                hints.pop("return", None)
                star = inspect.getfullargspec(fn).varargs
                if hints:
                    out[fn.__code__] = (fn.__qualname__, hints, star)
    return out


@PURE
def test_the_walk_finds_a_lie() -> None:
    """The check has teeth: an int in a float field, a dict in the evidence list, a bool in an int field."""
    incident = Incident("i", "p", "r", "loss", "non_finite", "error")
    incident.evidence = [Evidence("loss.non_finite", "d", threshold=3)]  # type: ignore[arg-type]
    incident.duration_s = 2  # type: ignore[assignment]
    incident.count = True
    got = {(cls, name) for cls, name, _k, _t in lies([incident])}
    assert got == {("Evidence", "threshold"), ("Incident", "duration_s"), ("Incident", "count")}
    incident.evidence = [{"rule": "x"}]  # type: ignore[list-item]
    assert ("Incident", "evidence") in {(cls, name) for cls, name, _k, _t in lies([incident])}


class _Arguments:
    """A ``sys.setprofile`` hook: every call of a compiled module's function, its arguments checked against
    its parameters' annotations (what a compiled function converts or refuses on the way in)."""

    def __init__(self) -> None:
        self.functions = _functions()
        self.found: Set[Tuple[str, str, str, str]] = set()

    def __call__(self, frame: Any, event: str, _arg: Any) -> None:
        if event != "call":
            return
        known = self.functions.get(frame.f_code)
        if known is None:
            return
        name, hints, star = known
        local = frame.f_locals
        for param, kind in hints.items():
            if param in local:
                values = local[param] if param == star else (local[param],)
                for value in values:
                    if not holds(value, kind):
                        self.found.add((name, param, str(kind), type(value).__name__))


@PURE
def test_the_argument_check_finds_a_lie() -> None:
    from trainguard_engine import diagnosis

    check = _Arguments()
    sys.setprofile(check)
    try:
        diagnosis._number(3)  # an int where a float is annotated (compiled: 3.0)
    finally:
        sys.setprofile(None)
    assert check.found == {("_number", "value", "<class 'float'>", "int"),
                           ("_render", "value", "<class 'float'>", "int")}


@PURE
@pytest.mark.parametrize("name", sorted(STREAMS))
def test_every_annotation_holds_on_a_golden_stream(name: str) -> None:
    load_events, settings = STREAMS[name]
    events = load_events()
    pipeline = Pipeline(settings)
    found: Set[Tuple[str, str, str, str]] = set()
    arguments = _Arguments()
    sys.setprofile(arguments)
    try:
        for i in range(0, len(events), 50):
            pipeline.process(events[i:i + 50])
        pipeline.advance(max(int(e.get("time_unix_nano") or 0) for e in events) + 60 * 10**9)
        Pipeline.restore(pipeline.snapshot(), settings)
    finally:
        sys.setprofile(None)
    assert not arguments.found, sorted(arguments.found)
    pipeline = Pipeline(settings)
    last: Optional[int] = None
    for i in range(0, len(events), 50):
        out = pipeline.process(events[i:i + 50])
        found |= lies([*out.runs, *out.incidents, *out.clusters])
        if i % 500 == 0:
            found |= lies(vars(pipeline) if hasattr(pipeline, "__dict__") else pipeline)
    last = max(int(e.get("time_unix_nano") or 0) for e in events)
    out = pipeline.advance(last + 60 * 10**9)
    found |= lies([*out.runs, *out.incidents, *out.clusters])
    found |= lies(vars(pipeline) if hasattr(pipeline, "__dict__") else pipeline)
    restored = Pipeline.restore(pipeline.snapshot(), settings)  # the state as a snapshot gives it back
    found |= lies(vars(restored) if hasattr(restored, "__dict__") else restored)
    assert not found, sorted(found)
