"""The gradient detectors' per-batch path (issue 15, stop 43) must change nothing:

* ``numeric.read_batch`` reads a point's role from its name once (remembered per settings object and name,
  ``numeric._role``) instead of testing every point against the family's name sets;
* ``gradient.on_metrics`` skips ``numeric_final`` on a run without incidents, tests note_nonfinite's "nothing
  to note" inline, reads the loss level from the family state it holds (``numeric.diverged_state``) and hands
  that state to ``check_clip``;
* ``check_clip`` answers early on a step that is not clipped while no streak runs (``gradient._clip_quiet``,
  stop 47: the reference path below turns it off), and the pipeline asks ``Detector.wants_rank`` where the
  names alone left the answer open;
* a route (pipeline.py) asks ``Detector.wants_names`` once per list of point names: the gradient and adapter
  detectors are then called without asking ``wants`` per batch (or left out of the route) where the names
  alone decide.

Checked against the code before, kept here verbatim ON PURPOSE as the pre-change reference (the fast path is
inline code: there is no switch that gives the old path back by patching): outputs and snapshots piece by piece
with restores (tests/engine/fast_slow.py) on every corpus scenario and on synthetic gradient streams (grad
norms climbing, NaN/inf norms and layers, clip flags and thresholds, GradScaler overflow flags, losses, other
names), under the default settings and settings where ``amp/overflow`` is a clip threshold name too; the role
reader batch by batch against the reference (with its memo starting afresh); ``wants_names`` against
``wants`` on every name set."""

from __future__ import annotations

import itertools
import math
import random
from contextlib import ExitStack, contextmanager
from typing import AbstractSet, Any, Dict, Iterator, List, Optional, Sequence, Tuple
from unittest.mock import patch

import pytest

from tests.engine.fast_slow import run_fast_and_slow
from tests.scenarios.corpus import SCENARIOS
from trainguard_engine.catalogue import DetectionSettings
from trainguard_engine.detectors import adapter, gradient, numeric, roles
from trainguard_engine.detectors.adapter import Adapters
from trainguard_engine.detectors.base import Detector
from trainguard_engine.detectors.gradient import Gradients
from trainguard_engine.incidents import Finding
from trainguard_engine.state import RankState, RunState

PURE = pytest.mark.engine_pure("counts gradient._clip_quiet calls")
"""Why the tests marked with it run on the pure engine when the compiled one is loaded
(tests/support/engine_pure.py): they watch or replace engine internals, which compiled callers do not see;
the module's other tests run compiled."""

SETTINGS = DetectionSettings()
AMP_CLIP = DetectionSettings.from_overrides({"clip_threshold_metrics": ["grad/clip_threshold", "amp/overflow"]})
Event = Dict[str, Any]
Point = Tuple[str, int, float]


# --- the code before (a11e7e4), verbatim ------------------------------------------------------------------

def _read_batch_before(rank: RankState, state: Dict[str, Any], points: Sequence[Point],
                       settings: DetectionSettings) -> Tuple[Optional[Point], List[Point], Optional[Point], bool]:
    layers: List[Point] = []
    grad_point: Optional[Point] = None
    loss_point: Optional[Point] = None
    overflow = False
    grad_names, loss_names, clip_names = numeric.family_names(settings)
    for name, step, value in points:
        if name in grad_names:
            grad_point = (name, step, value)
        elif name.startswith(numeric.LAYER_PREFIX):
            layers.append((name, step, value))
        elif name in loss_names:
            loss_point = loss_point or (name, step, value)
        elif name == "amp/overflow" and value == 1.0:
            overflow = True
        elif name in clip_names and math.isfinite(value) and value > 0:
            state.setdefault("clip", {})["tau"] = value
    overflow_history = rank.history.get("amp/overflow") if not overflow else None
    if overflow_history:
        steps = {p[1] for p in layers} | ({grad_point[1]} if grad_point is not None else set())
        overflow = any(overflow_history.get(s, (0.0, 0))[0] >= 0.5 for s in steps)
    return grad_point, layers, loss_point, overflow


def _loss_diverged_before(rank: RankState, settings: DetectionSettings) -> bool:
    state = numeric.rank_state(rank).get("loss", {})
    level, init = state.get("level"), state.get("init")
    if level is None or not init:
        return False
    lowest = min(init)
    if lowest > 0 and settings.divergence_factor > 0 and level < settings.divergence_factor * lowest:
        return False
    base = numeric.divergence_base(numeric.robust.median(list(init)), init[0], settings)
    return base > 0 and level >= settings.divergence_factor * base


def _on_metrics_before(run: RunState, rank: RankState, points: Sequence[Point], time_ns: int,
                       event_id: str, settings: DetectionSettings) -> List[Finding]:
    g = gradient
    tuned = settings
    state = numeric.rank_state(rank)
    out: List[Finding] = []
    grad_point, layers, loss_point, overflow = _read_batch_before(rank, state, points, settings)
    numeric_open = numeric.numeric_final(run, rank)
    if not numeric_open and not overflow:
        numeric.note_nonfinite(state, grad_point, layers, time_ns)
    if layers:
        out.extend(g.check_layers(run, rank, layers, time_ns, event_id, settings, tuned))
    pending = state.get("nonfinite")
    if pending is not None and pending.get("waiting"):
        if numeric_open:
            pending["waiting"] = False
        else:
            loss_seen = loss_point is not None and loss_point[1] >= pending["step"] and \
                math.isfinite(loss_point[2])
            if loss_seen or (grad_point is not None and grad_point[1] > pending["step"]):
                pending["waiting"] = False
                out.append(g._pending_finding(run, rank, pending, loss_seen, time_ns, event_id, settings))
                numeric_open = True
    if grad_point is not None and math.isfinite(grad_point[2]) and not numeric_open and \
            not _loss_diverged_before(rank, settings) and \
            not ("gave_way" in state.get("grad", {}) and numeric.rank_has_open(run, rank, "loss:plateau")):
        grad_state = state.setdefault("grad", {})
        if grad_point[1] > grad_state.get("last", -1):
            grad_state["last"] = grad_point[1]
            gate = grad_state.get("gate")
            far_below = (gate is not None and grad_point[1] - gate[1] < g.CLIMB_GATE_STEPS
                         and grad_point[2] < 0.5 * settings.explosion_jump_factor * gate[0])
            found = None if far_below else g.check_climb(run, rank, grad_point[0], grad_point[1], time_ns,
                                                         event_id, settings, tuned, memo=grad_state)
            if found is not None:
                out.append(found)
                numeric_open = True
                grad_state["climb"] = [grad_state["gate"][0], grad_point[1], 0]
    elif grad_point is not None and math.isfinite(grad_point[2]) and numeric_open:
        g._climb_settled(run, rank, state, grad_point, time_ns, settings)
    if loss_point is not None and math.isfinite(loss_point[2]) and not numeric_open:
        found = g.check_clip(run, rank, loss_point[0], loss_point[1], time_ns, event_id, settings, tuned)
        if found is not None:
            out.append(found)
    return out


def _gradient_wants_before(self: Gradients, rank: RankState, names: AbstractSet[str],
                           settings: DetectionSettings) -> bool:
    if not (names.isdisjoint(settings.grad_norm_metrics) and names.isdisjoint(settings.loss_metrics)
            and names.isdisjoint(settings.clip_threshold_metrics) and "amp/overflow" not in names):
        return True
    if any(n.startswith(numeric.LAYER_PREFIX) for n in names):
        return True
    pending = rank.detectors.get(numeric.STATE_KEY, {}).get("nonfinite")
    return pending is not None and bool(pending.get("waiting"))


def _adapter_wants_before(self: Adapters, rank: RankState, names: AbstractSet[str],
                          settings: DetectionSettings) -> bool:
    if not names.isdisjoint((adapter.GRAD_MEAN_A, adapter.GRAD_MEAN_B, adapter.NO_GRAD, adapter.PARAMS)):
        return True
    return adapter.STATE_KEY in rank.detectors and not names.isdisjoint(settings.loss_metrics)


@contextmanager
def _before() -> Iterator[None]:
    """The code before in place: every batch read point by point, ``wants`` asked per batch."""
    with ExitStack() as stack:
        stack.enter_context(patch.object(gradient, "on_metrics", _on_metrics_before))
        stack.enter_context(patch.object(numeric, "read_batch", _read_batch_before))
        stack.enter_context(patch.object(gradient, "read_batch", _read_batch_before))
        stack.enter_context(patch.object(Gradients, "wants", _gradient_wants_before))
        stack.enter_context(patch.object(Gradients, "wants_names", lambda self, names, settings: None))
        stack.enter_context(patch.object(Adapters, "wants", _adapter_wants_before))
        stack.enter_context(patch.object(Adapters, "wants_names", lambda self, names, settings: None))
        stack.enter_context(patch.object(gradient, "_clip_quiet", lambda state, history, step: False))
        # every batch asked through ``wants`` (the base class's wants_rank: the names' part not known)
        stack.enter_context(patch.object(Gradients, "wants_rank", Detector.wants_rank))
        stack.enter_context(patch.object(Adapters, "wants_rank", Detector.wants_rank))
        yield


class _Asked:
    """Counts the fast pipeline's ``wants`` / ``wants_rank`` calls of the two detectors (re-entered for every
    piece)."""

    def __init__(self) -> None:
        self.calls = 0
        self.saved = (Gradients.wants, Adapters.wants, Gradients.wants_rank, Adapters.wants_rank)

    def __enter__(self) -> _Asked:
        def counted(asked: Any) -> Any:
            def ask(det: Any, rank: RankState, names: AbstractSet[str], s: DetectionSettings) -> bool:
                self.calls += 1
                return bool(asked(det, rank, names, s))
            return ask

        g_wants, a_wants, g_rank, a_rank = self.saved
        Gradients.wants, Adapters.wants = counted(g_wants), counted(a_wants)  # type: ignore[method-assign]
        Gradients.wants_rank, Adapters.wants_rank = counted(g_rank), counted(a_rank)  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: Any) -> None:
        Gradients.wants, Adapters.wants, Gradients.wants_rank, Adapters.wants_rank = \
            self.saved  # type: ignore[method-assign]


def _compare(events: List[Event], settings: DetectionSettings = SETTINGS, piece: int = 37,
             restore_every: int = 3) -> _Asked:
    asked = _Asked()
    run_fast_and_slow(events, settings, asked, _before, piece, restore_every)
    return asked


# --- streams ------------------------------------------------------------------------------------------------

NAMES = ("loss", "lr", "opt/lr", "time/step_s", "grad/global_norm", "grad/norm", "grad/clip_triggered",
         "grad/clip_threshold", "grad/max_norm", "amp/overflow", "amp/scale", "grad/layer/embed",
         "grad/layer/block.0", "grad/layer/head", "throughput/samples_per_s", "mem/allocated",
         "lora/grad_mean_a")


def _value(rng: random.Random, name: str, step: int, blow: int) -> float:
    if rng.random() < 0.02:
        return rng.choice([math.nan, math.inf, -math.inf, 0.0, -1.0, 1.0])
    if name == "loss":
        return 2.0 / (1 + step / 40) if step < blow else 2.0 * (1.3 ** (step - blow))
    if name.startswith("grad/layer/"):
        return rng.choice([1e-9, 1e-3, 0.5, 1.0]) * (1.0 + rng.random())
    if name in ("grad/global_norm", "grad/norm"):
        return (1.0 + 0.1 * rng.random()) * (1.0 if step < blow else 1.6 ** (step - blow))
    if name == "grad/clip_triggered":
        return rng.choice([0.0, 1.0, 1.0])
    if name in ("grad/clip_threshold", "grad/max_norm"):
        return rng.choice([1.0, 0.5, 0.0])
    if name == "amp/overflow":
        return rng.choice([0.0, 0.0, 1.0, 2.0])
    return 0.1 + rng.random()


def _gradient_stream(seed: int) -> List[Event]:
    """Two ranks sending per step an SDK-like hooks envelope (step time, grad norm, clip flag, LR, at times a
    clip threshold, an overflow flag, layer norms) and a loop envelope (loss, LR), or random envelopes of the
    family's names and others; a norm that climbs (and a loss that blows up) late in some streams; replays
    and late envelopes."""
    rng = random.Random(seed)
    blow = rng.choice([10 ** 9, 120, 200])
    base_ns = 1_700_000_000_000_000_000
    out: List[Event] = []
    for step in range(rng.choice([160, 260])):
        for rank in (0, 1):
            batches: List[List[str]]
            if rng.random() < 0.8:
                hooks = ["time/step_s", "grad/global_norm", "grad/clip_triggered", "opt/lr"]
                if rng.random() < 0.1:
                    hooks.append(rng.choice(["grad/clip_threshold", "amp/overflow", "grad/layer/embed"]))
                if seed % 3 == 0 and step % 10 == 0:
                    hooks += ["grad/layer/embed", "grad/layer/block.0", "grad/layer/head"]
                batches = [hooks, ["loss", "lr"]]
            else:
                batches = [rng.sample(NAMES, rng.randint(1, 5)) for _ in range(rng.randint(1, 3))]
            for k, names in enumerate(batches):
                points = [{"name": n, "value": _value(rng, n, step, blow)} for n in names]
                out.append({"project": "p", "run_id": f"g-{seed}", "host": f"h{rank}", "pid": 1 + rank,
                            "rank": rank, "world_size": 2, "event_id": f"g{seed}-{step}-{rank}-{k}", "step": step,
                            "time_unix_nano": base_ns + step * 10 ** 8 + rank * 10 ** 6 + k,
                            "severity": "INFO", "metrics": {"points": points}})
    for i in range(30, len(out) - 3, rng.choice([23, 57])):  # late envelopes
        out[i], out[i + 2] = out[i + 2], out[i]
    for i in range(41, len(out), 89):  # replays
        out.insert(i, dict(out[i - 7]))
    return out


@pytest.mark.parametrize("seed", range(12))
def test_synthetic_gradient_streams_are_unchanged(seed: int) -> None:
    events = _gradient_stream(seed)
    asked = _compare(events, piece=29 + seed % 5)
    # asked before: both detectors on every envelope (~2 per event); now the adapter detector on loss batches
    assert asked.calls < 0.6 * len(events), asked.calls
    _compare(events, AMP_CLIP, piece=64 + seed, restore_every=2)


@pytest.mark.parametrize("scenario", [s.name for s in SCENARIOS])
def test_corpus_scenarios_are_unchanged(scenario: str) -> None:
    events = next(s for s in SCENARIOS if s.name == scenario).events()
    _compare(events, piece=41)


def test_the_synthetic_streams_reach_the_rules() -> None:
    """The streams above exercise what the fast path skips or reorders: incidents of the gradient family
    (a climb, a NaN's source, vanishing layers, clip-stale) open on some of them."""
    from trainguard_engine.pipeline import Pipeline
    kinds = set()
    for seed in range(12):
        pipe = Pipeline(SETTINGS)
        pipe.process(_gradient_stream(seed))
        kinds |= {f"{i.category}/{i.subtype}" for i in pipe.incidents()}
    assert {"gradient/explosion", "gradient/nan-source"} & kinds, kinds
    assert len(kinds) >= 3, kinds


@PURE
def test_the_quiet_clip_path_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    """check_clip's early answer (gradient._clip_quiet, off in the reference path above) is taken on loss batches
    of the synthetic streams, and not on all (a streak, a threshold, a clipped step): both paths are compared."""
    from trainguard_engine.pipeline import Pipeline
    answers: List[bool] = []
    quiet = gradient._clip_quiet

    def counted(state: Dict[str, Any], history: Dict[str, Dict[int, Any]], step: int) -> bool:
        answers.append(quiet(state, history, step))
        return answers[-1]

    monkeypatch.setattr(gradient, "_clip_quiet", counted)
    for seed in range(12):
        Pipeline(SETTINGS).process(_gradient_stream(seed))
    assert 0 < answers.count(True) < len(answers), (answers.count(True), len(answers))


# --- the role reader and the names-decided wants, batch by batch ---------------------------------------------

def _random_points(rng: random.Random) -> List[Point]:
    step = rng.randint(0, 9)
    return [(n, step + rng.choice([0, 0, 1, -1]), rng.choice([0.0, 1.0, 2.0, 0.5, -1.0, math.nan, math.inf]))
            for n in rng.sample(NAMES, rng.randint(0, 7))]


@PURE
@pytest.mark.parametrize("settings", [SETTINGS, AMP_CLIP], ids=["default", "amp-clip"])
def test_read_batch_reads_what_it_read_before(settings: DetectionSettings, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(43)
    monkeypatch.setattr(roles, "ROLES_MAX", 5)  # the memo starts afresh every few names too
    monkeypatch.setattr(numeric, "_ROLES", roles.RoleMemo())
    for _ in range(3000):
        rank, before_rank = RankState(rank=0), RankState(rank=0)
        if rng.random() < 0.5:
            flags = {s: (rng.choice([0.0, 1.0]), 0) for s in range(-1, 11)}
            rank.history["amp/overflow"] = dict(flags)
            before_rank.history["amp/overflow"] = dict(flags)
        state: Dict[str, Any] = {}
        before_state: Dict[str, Any] = {}
        points = _random_points(rng)
        assert numeric.read_batch(rank, state, points, settings) == \
            _read_batch_before(before_rank, before_state, points, settings)
        assert state == before_state
    assert len(numeric._ROLES.of(settings)) <= 5


def test_wants_names_agrees_with_wants() -> None:
    ranks = []
    for waiting, adapters in itertools.product((None, False, True), (False, True)):
        rank = RankState(rank=0)
        if waiting is not None:
            rank.detectors[numeric.STATE_KEY] = {"nonfinite": {"waiting": waiting}}
        if adapters:
            rank.detectors[adapter.STATE_KEY] = {}
        ranks.append(rank)
    decided = asked = 0
    for settings in (SETTINGS, AMP_CLIP):
        for k in range(0, 4):
            for combo in itertools.combinations(NAMES, k):
                names = frozenset(combo)
                for det, before in ((Gradients(), _gradient_wants_before), (Adapters(), _adapter_wants_before)):
                    said = det.wants_names(names, settings)
                    for rank in ranks:
                        want = before(det, rank, names, settings)  # type: ignore[arg-type]
                        assert det.wants(rank, names, settings) == want, (det, names)
                        if said is not None:
                            decided += 1
                            assert said == want, (det, names, said)
                        else:
                            asked += 1
                            assert det.wants_rank(rank, names, settings) == want, (det, names)
    assert decided > 10000 and asked > 1000, (decided, asked)


def test_two_settings_objects_alternating_keep_their_roles() -> None:
    """The role memo (detectors/roles.py) is per settings object: projects with their own settings, alternating,
    each keep theirs (a name that is a clip threshold under one is nothing under the other)."""
    memo = roles.RoleMemo()
    for _ in range(3):
        for settings, want in ((SETTINGS, numeric._AMP), (AMP_CLIP, numeric._AMP_CLIP)):
            held = memo.of(settings)
            role = held.get("amp/overflow")
            if role is None:
                role = roles.remember(held, "amp/overflow", numeric._role("amp/overflow", settings))
            assert role == want
    assert len(memo.held) == 2 and memo.of(SETTINGS) is memo.of(SETTINGS)
    for k in range(roles.SETTINGS_MAX + 1):
        memo.of(DetectionSettings.from_overrides({"history_len": 100 + k}))
    assert len(memo.held) <= roles.SETTINGS_MAX
