"""The detector contract (detectors/base.py), run against every detector in the registry: valid
registration, findings only of the kinds it declares (observed on every recorded stream), thresholds read
only from its settings section (plus ``common`` and ``state``), and no exception on odd input."""

from __future__ import annotations

import math
import re
from collections import defaultdict
from pathlib import Path
from typing import Any, Dict, List, Sequence, Set

import pytest

from tests.engine.test_pipeline_golden import STREAMS, run_stream
from trainguard_engine import pipeline as pipeline_mod
from trainguard_engine.catalogue import KINDS, SECTION_OF, DetectionSettings
from trainguard_engine.detectors import registry
from trainguard_engine.detectors.base import Detector, EventInfo, MetricBatch
from trainguard_engine.state import RunState

PURE = pytest.mark.engine_pure("subclasses the registered detectors to record their findings")
"""Why the tests marked with it run on the pure engine when the compiled one is loaded
(tests/support/engine_pure.py): they watch or replace engine internals, which compiled callers do not see;
the module's other tests run compiled."""

ENGINE = Path(pipeline_mod.__file__).resolve().parent
SHARED_SECTIONS = ("common", "state")


class Recording(Detector):
    """A registered detector, recording the kinds of the findings it returns."""

    def __init__(self, inner: Detector, seen: Dict[str, Set[str]]) -> None:
        self.inner, self.seen = inner, seen
        self.name, self.kinds, self.section = inner.name, inner.kinds, inner.section

    def wants(self, rank: Any, names: Any, settings: DetectionSettings) -> bool:
        return self.inner.wants(rank, names, settings)

    def on_metrics(self, run: Any, rank: Any, batch: MetricBatch, settings: DetectionSettings) -> Sequence[Any]:
        return self._seen(self.inner.on_metrics(run, rank, batch, settings))

    def on_memory(self, run: Any, rank: Any, payload: Any, batch: MetricBatch,
                  settings: DetectionSettings) -> Sequence[Any]:
        return self._seen(self.inner.on_memory(run, rank, payload, batch, settings))

    def on_exception(self, run: Any, rank: Any, event: EventInfo, fingerprint: str,
                     settings: DetectionSettings) -> Sequence[Any]:
        return self._seen(self.inner.on_exception(run, rank, event, fingerprint, settings))

    def on_log(self, run: Any, rank: Any, event: EventInfo, settings: DetectionSettings) -> Sequence[Any]:
        return self._seen(self.inner.on_log(run, rank, event, settings))

    def on_heartbeat(self, run: Any, rank: Any, event: EventInfo, settings: DetectionSettings) -> Sequence[Any]:
        return self._seen(self.inner.on_heartbeat(run, rank, event, settings))

    def on_exit(self, run: Any, rank: Any, event: EventInfo, settings: DetectionSettings) -> Sequence[Any]:
        return self._seen(self.inner.on_exit(run, rank, event, settings))

    def _seen(self, found: Sequence[Any]) -> Sequence[Any]:
        self.seen[self.name].update(f"{f.category}/{f.subtype}" for f in found)
        return found


@pytest.fixture(scope="module")
def observed() -> Dict[str, Set[str]]:
    """The kinds each detector returned over every recorded stream (the golden test's set)."""
    seen: Dict[str, Set[str]] = defaultdict(set)
    wrapped = tuple(Recording(d, seen) for d in registry.DETECTORS)
    original = pipeline_mod.DETECTORS
    pipeline_mod.DETECTORS = wrapped  # type: ignore[misc]
    try:
        for load_events, settings in STREAMS.values():
            run_stream(load_events(), settings, 50)
    finally:
        pipeline_mod.DETECTORS = original  # type: ignore[misc]
    return seen


@PURE
@pytest.mark.parametrize("detector", registry.DETECTORS, ids=lambda d: d.name)
def test_findings_are_of_the_declared_kinds(detector: Detector, observed: Dict[str, Set[str]]) -> None:
    assert observed[detector.name] <= set(detector.kinds), detector.name
    assert set(detector.kinds) <= set(KINDS)


@PURE
def test_the_corpus_exercises_the_detectors(observed: Dict[str, Set[str]]) -> None:
    found = set().union(*observed.values())
    for kind in ("loss/plateau", "gradient/explosion", "gradient/clip-stale", "memory/leak",
                 "memory/fragmentation", "sequence/truncation", "adapter/lora-grad-break", "process/exception",
                 "comm/timeout", "memory/oom", "progress/stalled"):
        assert kind in found, f"no recorded stream made a {kind} finding"


def _settings_read(detector: Detector) -> Set[str]:
    """DetectionSettings fields the detector's module names (``settings.x``, ``tuned.x``,
    ``_cfg(settings, "x", ...)``)."""
    source = Path(__import__(type(detector).__module__, fromlist=["_"]).__file__).read_text()
    names = set(re.findall(r"\b(?:settings|tuned)\.([a-z_0-9]+)\b", source))
    names |= set(re.findall(r"\(settings, \"([a-z_0-9]+)\"", source))
    return {n for n in names if n in SECTION_OF}


@PURE
@pytest.mark.parametrize("detector", registry.DETECTORS, ids=lambda d: d.name)
def test_a_detector_reads_its_own_section_and_the_shared_ones(detector: Detector) -> None:
    read = _settings_read(detector)
    assert read, f"{detector.name}: no setting read: the scan is broken"
    foreign = sorted(n for n in read if SECTION_OF[n] not in (detector.section, *SHARED_SECTIONS))
    assert foreign == [], f"{detector.name} ({detector.section}) reads {[(n, SECTION_OF[n]) for n in foreign]}"


ODD: List[List[Any]] = [
    [],
    [("loss", 1, math.nan)],
    [("loss", -3, math.inf), ("grad/global_norm", -3, -math.inf)],
    [("grad/global_norm", 0, -1.0), ("grad/layer/0", 0, math.nan)],
    [("mem/allocated", 5, 1e300), ("mem/reserved", 5, 0.0), ("amp/scale", 5, 0.0), ("amp/overflow", 5, 1.0)],
    [("seq/pad_attended_frac", 2, 2.0), ("lora/grad_mean_a", 2, math.nan), ("x" * 300, 2, 1.0)],
]


@pytest.mark.parametrize("detector", registry.DETECTORS, ids=lambda d: d.name)
def test_odd_input_gives_findings_not_exceptions(detector: Detector) -> None:
    settings = DetectionSettings()
    run = RunState(project="p", run_id="odd")
    rank = run.rank_state(0, settings)
    assert rank is not None
    for i, points in enumerate(ODD * 3):  # repeated: detectors that need several samples get them
        for name, step, value in points:
            rank.observe_point(name, step, value, 1_000 + i, settings)
        batch = MetricBatch(points, i, 1_000 + i, f"odd-{i}")
        assert isinstance(list(detector.on_metrics(run, rank, batch, settings)), list)
        payload = {"device": "cuda:0", "allocated": math.nan, "reserved": -1, "total_capacity": 0}
        assert isinstance(list(detector.on_memory(run, rank, payload, batch, settings)), list)


ODD_EVENTS: List[Dict[str, Any]] = [  # odd, but what the wire schema lets through (ints are ints)
    {}, {"type": None, "message": 12, "frames": "not a list"}, {"source": "agent:hang", "message": None},
    {"phase": "EXIT", "exit_code": 2**40, "signal": -3}, {"message": "\x00" * 1000, "level": "ERROR"},
]


@pytest.mark.parametrize("detector", registry.DETECTORS, ids=lambda d: d.name)
def test_odd_events_give_findings_not_exceptions(detector: Detector) -> None:
    settings = DetectionSettings()
    run = RunState(project="p", run_id="odd")
    rank = run.rank_state(0, settings)
    assert rank is not None
    for i, body in enumerate(ODD_EVENTS):
        event = EventInfo({"run_id": "odd", "exception": body}, body, i, 1_000 + i, f"odd-{i}")
        for found in (detector.on_exception(run, rank, event, "", settings), detector.on_log(run, rank, event, settings),
                      detector.on_heartbeat(run, rank, event, settings), detector.on_exit(run, rank, event, settings)):
            assert isinstance(list(found), list)


@PURE
def test_a_bad_registration_fails_at_import(monkeypatch: pytest.MonkeyPatch) -> None:
    class Stray(Detector):
        name, kinds, section = "stray", ("loss/imaginary",), "loss_gradient"

    monkeypatch.setattr(registry, "DETECTORS", (*registry.DETECTORS, Stray()))
    monkeypatch.setattr(registry, "BY_NAME", {d.name: d for d in registry.DETECTORS})
    with pytest.raises(AssertionError, match="loss/imaginary"):
        registry._check()


def _without_empty(value: Any) -> Any:
    """``value`` without empty dicts (a detector's state created empty by a call that found nothing)."""
    if isinstance(value, dict):
        return {k: _without_empty(v) for k, v in value.items() if v != {}}
    if isinstance(value, list):
        return [_without_empty(v) for v in value]
    return value


class Checking(Detector):
    """A registered detector whose ``wants`` is checked: where it says False, the call it would skip is
    made anyway on a copy-free basis and must find nothing and change nothing (but an empty state)."""

    def __init__(self, inner: Detector, skipped: Dict[str, int]) -> None:
        self.inner, self.skipped = inner, skipped
        self.name, self.kinds, self.section = inner.name, inner.kinds, inner.section

    def wants(self, rank: Any, names: Any, settings: DetectionSettings) -> bool:
        return True  # the pipeline calls on_metrics every time; on_metrics asks the inner detector

    def on_metrics(self, run: Any, rank: Any, batch: MetricBatch, settings: DetectionSettings) -> Sequence[Any]:
        names = {n for n, _s, _v in batch.points}
        if self.inner.wants(rank, names, settings):
            return self.inner.on_metrics(run, rank, batch, settings)
        before = _without_empty(run.to_json())
        found = self.inner.on_metrics(run, rank, batch, settings)
        assert list(found) == [], f"{self.name} said it did not want {sorted(names)} but found {found}"
        assert _without_empty(run.to_json()) == before, f"{self.name} changed state on {sorted(names)}"
        self.skipped[self.name] += 1
        return found

    def on_memory(self, run: Any, rank: Any, payload: Any, batch: MetricBatch,
                  settings: DetectionSettings) -> Sequence[Any]:
        return self.inner.on_memory(run, rank, payload, batch, settings)

    def on_exception(self, run: Any, rank: Any, event: EventInfo, fingerprint: str,
                     settings: DetectionSettings) -> Sequence[Any]:
        return self.inner.on_exception(run, rank, event, fingerprint, settings)

    def on_log(self, run: Any, rank: Any, event: EventInfo, settings: DetectionSettings) -> Sequence[Any]:
        return self.inner.on_log(run, rank, event, settings)

    def on_heartbeat(self, run: Any, rank: Any, event: EventInfo, settings: DetectionSettings) -> Sequence[Any]:
        return self.inner.on_heartbeat(run, rank, event, settings)

    def on_exit(self, run: Any, rank: Any, event: EventInfo, settings: DetectionSettings) -> Sequence[Any]:
        return self.inner.on_exit(run, rank, event, settings)


@PURE
def test_wants_is_exact_on_every_recorded_stream() -> None:
    skipped: Dict[str, int] = defaultdict(int)
    original = pipeline_mod.DETECTORS
    pipeline_mod.DETECTORS = tuple(Checking(d, skipped) for d in registry.DETECTORS)  # type: ignore[misc]
    try:
        for name in sorted(STREAMS)[::3]:  # a third of the streams: each call is checked on a state copy
            load_events, settings = STREAMS[name]
            run_stream(load_events(), settings, 50)
    finally:
        pipeline_mod.DETECTORS = original  # type: ignore[misc]
    assert all(skipped[d.name] > 0 for d in registry.DETECTORS), dict(skipped)  # every gate was exercised
