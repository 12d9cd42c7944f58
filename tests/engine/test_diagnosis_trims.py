"""The diagnosis' per-refresh trims (issue 15, stop 42): ``enrich`` runs on every finding applied to an
incident (env500's open plateau: every 10 loss values), and renders the same few numbers each time.
``_number`` remembers its answer for a finite non-zero float; ``lr_phase`` finds the last LR record at or
before the step from the end of the log instead of listing every one; ``cuda_in_use`` reads the rank's
diagnosis state once. Each must answer what it answered before, for any input: oracles against the
earlier code on crafted and random inputs, and pipelines with the earlier code in place give the same
outputs and snapshots piece by piece (tests/engine/fast_slow.py) on every corpus scenario and on runs with
LR schedules, plateaus and CPU-only / CUDA ranks."""

from __future__ import annotations

import math
import random
import struct
from contextlib import ExitStack
from typing import Any, ContextManager, Dict, List, Optional
from unittest.mock import patch

import pytest

from tests.engine.fast_slow import run_fast_and_slow
from tests.scenarios.corpus import SCENARIOS
from trainguard.core.events import wire_float
from trainguard_engine import diagnosis
from trainguard_engine.catalogue import DetectionSettings
from trainguard_engine.state import RankState

PURE = pytest.mark.engine_pure("feeds ints and bools to diagnosis._number, outside its float annotation (compiled: converted)")
"""Why the tests marked with it run on the pure engine when the compiled one is loaded
(tests/support/engine_pure.py): they watch or replace engine internals, which compiled callers do not see;
the module's other tests run compiled."""

SETTINGS = DetectionSettings()
Event = Dict[str, Any]


# --- the earlier code (the reference) ------------------------------------------------------------------
def _number_before(value: float) -> Any:
    out = wire_float(value)
    return float(f"{out:.7g}") if isinstance(out, float) else out


def _lr_phase_before(rank: RankState, step: int) -> Dict[str, Any]:
    log = rank.detectors.get(diagnosis.STATE_KEY, {}).get("lr") or []
    below = [i for i, (s, _v) in enumerate(log) if s <= step]
    if not below:
        return {}
    i = below[-1]
    s_i, lr = log[i]
    out: Dict[str, Any] = {"lr": _number_before(lr)}
    if lr == 0:
        out["lr_phase"] = "zero"
    elif i > 0 and step - s_i <= diagnosis.LR_RECENT_STEPS:
        out["lr_phase"] = "rising" if lr > log[i - 1][1] else "decaying"
    elif i + 1 < len(log) and log[i + 1][0] - step <= diagnosis.LR_RECENT_STEPS:
        out["lr_phase"] = "rising" if log[i + 1][1] > lr else "decaying"
    else:
        out["lr_phase"] = "constant"
    if log[0][1] > 0:
        out["lr_growth"] = wire_float(round(lr / log[0][1], 4))
    return out


def _cuda_in_use_before(rank: RankState) -> Optional[bool]:
    peak = rank.detectors.get(diagnosis.STATE_KEY, {}).get("peak", {})
    if any(name in peak for name in diagnosis.CUDA_MEMORY_METRICS) or any(
            name in rank.history for name in diagnosis.CUDA_MEMORY_METRICS):
        return True
    torch_version = str(rank.detectors.get(diagnosis.STATE_KEY, {}).get("torch", ""))
    return False if torch_version.endswith("+cpu") else None


class _Before:
    """The earlier code in place of the three trims."""

    def __enter__(self) -> None:
        self.stack = ExitStack()
        self.stack.enter_context(patch.object(diagnosis, "_number", _number_before))
        self.stack.enter_context(patch.object(diagnosis, "lr_phase", _lr_phase_before))
        self.stack.enter_context(patch.object(diagnosis, "cuda_in_use", _cuda_in_use_before))

    def __exit__(self, *exc: Any) -> None:
        self.stack.close()


# --- oracles -----------------------------------------------------------------------------------------------
def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and repr(a) == repr(b)


def _values(rng: random.Random) -> List[Any]:
    out: List[Any] = [0.0, -0.0, 0, 1, True, False, math.nan, -math.nan, math.inf, -math.inf, 5e-324, -5e-324,
                      1.7976931348623157e308, 2.5, 2.5000001, 2.50000005, 1e-7, 123456789.0, 3, -7]
    for _ in range(3000):
        kind = rng.random()
        if kind < 0.5:
            out.append(rng.uniform(-10, 10) * 10 ** rng.randint(-30, 30))
        elif kind < 0.8:
            out.append(struct.unpack("<d", struct.pack("<Q", rng.getrandbits(64)))[0])  # any bit pattern
        else:
            out.append(round(rng.uniform(0, 3), rng.randint(0, 9)))
    return out


@PURE
def test_number_answers_as_before_for_any_value() -> None:
    values = _values(random.Random(7))
    for _ in range(2):  # (the second pass from what was remembered)
        for value in values:
            assert _same(diagnosis._number(value), _number_before(value)), value


@PURE
def test_number_remembers_only_finite_non_zero_floats_and_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(diagnosis, "_NUMBERS", {})
    for value in (0.0, -0.0, math.nan, math.inf, 3, True):
        diagnosis._number(value)
    assert diagnosis._NUMBERS == {}
    assert _same(diagnosis._number(-0.0), -0.0) and _same(diagnosis._number(0.0), 0.0)
    monkeypatch.setattr(diagnosis, "NUMBERS_MAX", 10)
    for i in range(25):
        assert diagnosis._number(1.0 + i / 3) == _number_before(1.0 + i / 3)
        assert len(diagnosis._NUMBERS) <= 10


def _rank_with(rng: random.Random) -> RankState:
    rank = RankState(rank=0)
    held: Dict[str, Any] = {}
    if rng.random() < 0.9:
        log: List[List[float]] = []
        step = rng.randint(-5, 20)
        for _ in range(rng.choice([0, 1, 2, 5, 64])):
            step += rng.choice([1, 1, 3, 17, 40]) if rng.random() > 0.05 else -rng.randint(1, 30)  # unsorted too
            log.append([step, rng.choice([0.0, 1e-4, 3e-4, 1e-3, 0.1, 5e-324, rng.random()])])
        if log or rng.random() < 0.5:
            held["lr"] = log
    if rng.random() < 0.5:
        held["peak"] = {name: 1e9 for name in rng.sample(diagnosis.MEMORY_METRICS, rng.randint(0, 3))}
    if rng.random() < 0.5:
        held["torch"] = rng.choice(["2.3.0+cpu", "2.3.0+cu121", "", "+cpu"])
    if held or rng.random() < 0.5:
        rank.detectors[diagnosis.STATE_KEY] = held
    for name in rng.sample(["mem/allocated", "mem/rss", "loss", "mem/reserved"], rng.randint(0, 2)):
        rank.history[name] = {1: (1.0, 0)}
    return rank


def test_lr_phase_and_cuda_in_use_answer_as_before() -> None:
    rng = random.Random(11)
    for _ in range(3000):
        rank = _rank_with(rng)
        for step in (-10, 0, 1, rng.randint(0, 400), 10 ** 6):
            assert diagnosis.lr_phase(rank, step) == _lr_phase_before(rank, step)
            assert repr(diagnosis.lr_phase(rank, step)) == repr(_lr_phase_before(rank, step))
        assert diagnosis.cuda_in_use(rank) is _cuda_in_use_before(rank)


# --- pipelines ---------------------------------------------------------------------------------------------
def _compare(events: List[Event], piece: int = 37) -> None:
    def before() -> ContextManager[object]:
        return _Before()  # type: ignore[return-value]
    run_fast_and_slow(events, SETTINGS, _Nothing(), before, piece)


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


@pytest.mark.parametrize("scenario", [s.name for s in SCENARIOS])
def test_corpus_scenarios_are_unchanged(scenario: str) -> None:
    _compare(next(s for s in SCENARIOS if s.name == scenario).events())


def _schedule_run(seed: int) -> List[Event]:
    """A run whose loss flattens (plateau refreshes), then explodes, with an LR schedule (warmup, steps,
    zero), memory metrics on some seeds and a CPU-only START on others."""
    rng = random.Random(seed)
    base_ns = 1_700_000_000_000_000_000
    out: List[Event] = [{"project": "p", "run_id": f"s{seed}", "rank": 0, "world_size": 1, "event_id": f"s{seed}-0",
                         "step": 0, "time_unix_nano": base_ns, "lifecycle": {
                             "phase": "START", "torch": rng.choice(["2.3.0+cpu", "2.3.0+cu121"])}}]
    blow = rng.randint(300, 500)
    for step in range(1, 560):
        lr = 3e-4 * min(1.0, step / rng.choice([20, 80])) * (0.1 if step > 250 else 1.0) * (step < 540)
        loss = 2.0 + 0.001 * rng.random() if step < blow else 2.0 * 1.3 ** (step - blow)
        points = [{"name": "loss", "value": loss}, {"name": "lr", "value": lr},
                  {"name": "grad/global_norm", "value": 1.0 + 0.1 * rng.random()}]
        if seed % 2:
            points.append({"name": "mem/allocated", "value": 1e9 + step})
        out.append({"project": "p", "run_id": f"s{seed}", "rank": 0, "world_size": 1, "event_id": f"s{seed}-{step}",
                    "step": step, "time_unix_nano": base_ns + step * 10 ** 8, "metrics": {"points": points}})
    return out


@pytest.mark.parametrize("seed", range(8))
def test_schedule_runs_are_unchanged(seed: int) -> None:
    _compare(_schedule_run(seed), piece=29 + seed)
