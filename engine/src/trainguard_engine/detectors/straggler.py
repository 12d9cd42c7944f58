"""Performance detectors: a straggler rank, a throughput regression, a data-loader bottleneck, a
throttled GPU (issue 23), from the step phases ``watch()`` reports
(:mod:`trainguard.integrations.step_timing`) and the SDK's NVML samples (:mod:`trainguard.integrations.nvml`).

Signals, per rank and step: ``time/step_s`` (boundary to boundary), its phases ``time/data_s``,
``time/forward_s``, ``time/backward_s``, ``time/optimizer_s``; a throughput the job logs
(``throughput_metrics``); ``gpu/throttle_reasons`` with ``gpu/sm_clock_mhz`` & co. A rank's **own** time
is data + forward + optimizer: the phases without a collective in a data-parallel step. The rest of the
step (backward, where DDP waits for the gradient all-reduce) is where a rank waits for the slowest one.

Pure and streaming. Per-rank state in ``RankState.detectors["perf"]``: the rank's last ``perf_window``
timed steps after its first ``perf_warmup_steps`` (step, event time, step/own/data/forward/optimizer/rest
seconds) with one sorted column per phase kept incrementally (bisection in, bisection out: the window
medians cost no sort), and its last ``straggler_window`` per-step pairs; the run's state (which steps
every rank reported, the steady-state baseline, the confirmation counters) in ``detectors["perf_run"]``
of the run's first rank. A step is **judged** once every timed rank reported it (O(1) per batch to
count, O(ranks log ranks) per judged step):

* ``perf/straggler`` -- a sign test on a per-step paired comparison. At each judged step every rank's own
  time is paired with the median of the other ranks' own times **at that same step** (the same step
  shares the host's load and the job's input, so a loaded host or the whole job slowing moves both
  sides); the rank is *over* at that step when its own time >= ``straggler_ratio`` x theirs. Rank r is
  a candidate when it was over on >= ``straggler_steps`` of its last ``straggler_window`` judged steps
  (a rank slower on most steps, not one preempted for a few: a host's transient load makes a healthy
  rank slower for a stretch, contention or a slower device makes it slower on nearly every step), its
  median excess over the others is >= ``straggler_min_share`` of the job's step time, and the others'
  rest (backward + wait) exceeds r's by >= ``straggler_wait_share`` x that excess (they waited for it).
  A candidate is named at once (the window is the confirmation), with its median per-step ratio, the
  phase where the excess is (data, forward, optimizer), since when (the change point of its window) and
  the job's slowdown against its steady state; when every rank of one host (of several) is named, the
  host is. It resolves after ``straggler_confirm`` judged steps with no rank over on
  ``straggler_clear_steps`` of its window. Where the SDK sends ``time/runqueue_s`` (the training thread's
  run-queue delay: Linux), CPU contention is evidence too (:func:`_contended`): a rank that waited for a
  core >= ``straggler_runqueue_share`` of the step on ``straggler_runqueue_steps`` of its window while its
  peers waited <= ``straggler_runqueue_peers`` (median) is a candidate when the median of its paired
  ratios is >= ``straggler_runqueue_ratio`` (its own work slower too: never from the delay alone), the
  excess and wait tests as above -- all three over the window's steps on which it waited (the steps the
  contention names; the steps before it began are not evidence either way). Without the signal nothing of
  this runs and the state is today's exactly.
* ``perf/throughput-regression`` -- the job's step time (median over ranks of their window medians)
  >= ``regression_ratio`` x its steady state (the median of its first ``regression_baseline_steps``
  judged steps after warm-up), or the median logged throughput <= 1/``regression_ratio`` of its own,
  and slower by at least ``regression_min_delta_s`` and ``regression_noise_k`` x the steady state's
  own noise (the robust spread of the job's per-step time over those steps: a step that jumps about
  on a shared host needs a bigger shift than a steady one), on ``regression_confirm`` judged steps in
  a row with no straggler forming (no rank over on ``straggler_hold_steps`` of its window), no open
  straggler and no open
  memory/fragmentation or memory/leak (which explain a slowing job: :data:`EXPLAINED_BY`), and not while
  the job's training threads waited for a core >= ``regression_runqueue_share`` of their step (where the
  SDK sends ``time/runqueue_s``: the host's CPU oversubscribed, the slowdown the machine's, not the job's;
  an open regression resolves then, as when the step time comes back). Warm-up
  steps are never judged; an evaluation or checkpoint pause (one long step) moves no window median.
* ``perf/data-bottleneck`` -- the median rank's data wait >= ``data_wait_share`` of its step time on
  ``straggler_confirm`` judged steps with no straggler candidate (one rank's slow loader is a straggler
  whose phase is ``data``).
* ``perf/throttling`` -- ``gpu/throttle_reasons`` with a thermal, hardware-slowdown or power-brake bit on
  ``throttle_confirm`` samples of a rank in a row.

Replayed or late steps (not newer than a rank's last) change nothing.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from functools import lru_cache
from typing import AbstractSet, Any, Dict, Final, List, Optional, Sequence, Tuple

from ..catalogue import DetectionSettings
from ..incidents import Finding, resolve
from ..records import Evidence, TimelineEntry
from ..robust import bisect_left_of, bisect_right_of
from ..state import RankState, RunState
from .base import Detector, MetricBatch
from .roles import RoleMemo, remember

STATE_KEY: Final = "perf"
RUN_KEY: Final = "perf_run"
STRAGGLER_KEY = "perf:straggler"
REGRESSION_KEY = "perf:regression"
DATA_KEY = "perf:data"
THROTTLE_KEY = "perf:throttling"

STEP_S: Final = "time/step_s"
DATA_S: Final = "time/data_s"
FORWARD_S: Final = "time/forward_s"
BACKWARD_S: Final = "time/backward_s"
OPTIMIZER_S: Final = "time/optimizer_s"
RUNQUEUE_S: Final = "time/runqueue_s"
PHASE_NAMES = (STEP_S, DATA_S, FORWARD_S, BACKWARD_S, OPTIMIZER_S)
_PHASE_SET = frozenset((*PHASE_NAMES, RUNQUEUE_S))
THROTTLE: Final = "gpu/throttle_reasons"
GPU_CONTEXT = ("gpu/sm_clock_mhz", "gpu/sm_clock_max_mhz", "gpu/temperature_c", "gpu/power_w",
               "gpu/power_limit_w")

# a window entry: [step, time_ns, step_s, own_s, data_s, forward_s, optimizer_s, rest_s] (own/... None
# when the SDK sent no phases), + [runqueue_s] when the SDK sent the training thread's run-queue delay
_STEP: Final = 0
_TIME: Final = 1
_STEP_S: Final = 2
_OWN: Final = 3
_DATA: Final = 4
_FWD: Final = 5
_OPT: Final = 6
_REST: Final = 7
_RQ: Final = 8
# a pair (one judged step): [step, time_ns, own_s, the others' median own_s, rest_s, the others' rest_s],
# + [runqueue_s / step_s] when the rank's entry had it
_P_STEP: Final = 0
_P_TIME: Final = 1
_P_OWN: Final = 2
_P_OTHERS: Final = 3
_P_REST: Final = 4
_P_OTHERS_REST: Final = 5
_P_RQ: Final = 6
_MED_FIELDS = {"step": _STEP_S, "own": _OWN, "data": _DATA, "forward": _FWD, "optimizer": _OPT,
               "rest": _REST}
_MED_ITEMS: Final = tuple(_MED_FIELDS.items())
_STEP_ITEMS: Final = (("step", _STEP_S),)
_NOTHING: Final[List[Any]] = [None] * 8  # the evicted entry when nothing is evicted
PHASES = {"data": "data loading (time/data_s)", "forward": "compute (time/forward_s)",
          "optimizer": "the optimizer step (time/optimizer_s)"}

THROTTLE_BITS = {0x8: "HW slowdown", 0x20: "SW thermal slowdown", 0x40: "HW thermal slowdown",
                 0x80: "HW power brake"}
"""NVML clock-event reasons that mean the GPU is slowed for its health (power capping at the limit,
0x4, and idle, 0x1, are normal)."""
EXPLAINED_BY = (("memory", "fragmentation"), ("memory", "leak"))
"""Open incidents that already explain a job getting slower (the allocator working harder): no
perf/throughput-regression is opened beside them."""
RECENT_STEPS: Final = 8
"""Steps whose report counts are kept while waiting for every rank."""


def _finite(value: Any) -> Optional[float]:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        v = float(value)
        if math.isfinite(v) and v >= 0:
            return v
    return None


def _median(values: Sequence[float]) -> float:
    return _median_sorted(sorted(values))


def _median_sorted(s: Sequence[float]) -> float:
    """Median of the sorted ``s`` (not empty)."""
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def _median_without(ordered: Sequence[float], k: int) -> float:
    """Median of the sorted ``ordered`` without its element at position ``k`` (len >= 2)."""
    n = len(ordered) - 1

    def at(i: int) -> float:
        return ordered[i if i < k else i + 1]

    return at(n // 2) if n % 2 else 0.5 * (at(n // 2 - 1) + at(n // 2))


@lru_cache(maxsize=16)
def _names(names: Tuple[str, ...]) -> AbstractSet[str]:
    return frozenset(names)


def rank_state(rank: RankState) -> Dict[str, Any]:
    state: Dict[str, Any] = rank.detectors.setdefault(STATE_KEY, {})
    return state


def _run_state(run: RunState) -> Dict[str, Any]:
    detectors = run.first_rank().detectors
    state: Optional[Dict[str, Any]] = detectors.get(RUN_KEY)
    if state is None:
        state = detectors[RUN_KEY] = {}
    return state


# ----------------------------------------------------------------------------------------------------
# folding a batch in

def _fold_step(state: Dict[str, Any], step: int, time_ns: int, values: Dict[str, float],
               settings: DetectionSettings) -> bool:
    """Add one timed step to the rank's window; False when it is a replay, late or warm-up.

    The window's medians are kept incrementally: one sorted column per phase (``state["col"]``), the
    new value inserted and the evicted one removed by bisection, and only the columns that changed get
    their median read again: a step costs a few list moves and no sort."""
    if step <= state.get("last", -1):
        return False
    state["last"] = step
    n = state["n"] = state.get("n", 0) + 1
    if n <= settings.perf_warmup_steps:
        return False
    step_s = values[STEP_S]
    data, fwd, opt = values.get(DATA_S), values.get(FORWARD_S), values.get(OPTIMIZER_S)
    own = rest = None
    if fwd is not None:
        own = (data or 0.0) + fwd + (opt or 0.0)
        rest = max(0.0, step_s - own)
    entry: List[Any] = [step, time_ns, step_s, own, data, fwd, opt, rest]
    runqueue = values.get(RUNQUEUE_S)
    if runqueue is not None:  # only then: a stream without it keeps today's state exactly
        entry.append(runqueue)
    window: Optional[List[List[Any]]] = state.get("w")
    if window is None:
        window = state["w"] = []
    columns: Optional[Dict[str, List[float]]] = state.get("col")
    if columns is None:  # a new rank, or state saved before the columns were kept
        columns = state["col"] = {name: sorted(e[i] for e in window if e[i] is not None)
                                  for name, i in _MED_FIELDS.items()}
    window.append(entry)
    most = settings.perf_window  # (read once: see the end)
    gone = window.pop(0) if len(window) > most else _NOTHING
    meds: Optional[Dict[str, float]] = state.get("med")
    if meds is None:
        meds = state["med"] = {}
    least = settings.perf_min_points
    if own is None and data is None and opt is None and gone[_OWN] is None and gone[_DATA] is None and \
            gone[_OPT] is None:
        items: Tuple[Tuple[str, int], ...] = _STEP_ITEMS  # no phases (the usual SDK stream): one column
    else:
        items = _MED_ITEMS
    for name, i in items:
        new = entry[i]
        old = gone[i]
        if new is None and old is None:
            continue
        column = columns[name]
        if new is not None:
            column.insert(bisect_right_of(column, new), new)  # (insort)
        if old is not None:
            del column[bisect_left_of(column, old)]
        k = len(column)
        if k >= least:
            meds[name] = column[k // 2] if k % 2 else 0.5 * (column[k // 2 - 1] + column[k // 2])
        else:
            meds.pop(name, None)
    if len(window) > most:  # perf_window lowered since the state was kept
        _refold(state, settings)
    return True


def _refold(state: Dict[str, Any], settings: DetectionSettings) -> None:
    """Rebuild the columns and medians from the window (after a settings change)."""
    window = state["w"]
    del window[:-settings.perf_window]
    state["col"] = {name: sorted(e[i] for e in window if e[i] is not None) for name, i in _MED_FIELDS.items()}
    state["med"] = {name: _median_sorted(c) for name, c in state["col"].items()
                    if len(c) >= settings.perf_min_points}


def _count_report(run: RunState, run_state: Dict[str, Any], step: int) -> bool:
    """Count that one more rank reported ``step``; True when every timed rank has (judge it now)."""
    if step <= run_state.get("judged", -1):
        return False
    counts: Optional[List[List[int]]] = run_state.get("cnt")
    if counts is None:
        counts = run_state["cnt"] = []
    for entry in counts:
        if entry[0] == step:
            entry[1] += 1
            break
    else:
        counts.append([step, 1])
        counts.sort()
        del counts[:-RECENT_STEPS]
    expected = run_state.get("ranks", 0)
    judged: Optional[int] = None  # the latest step every timed rank reported
    for entry in counts:
        if entry[1] >= expected and (judged is None or entry[0] > judged):
            judged = entry[0]
    if judged is None:
        return False
    run_state["judged"] = judged
    run_state["cnt"] = [e for e in counts if e[0] > run_state["judged"]]
    return True


# ----------------------------------------------------------------------------------------------------
# judging a step across ranks

def _judge(run: RunState, run_state: Dict[str, Any], step: int, time_ns: int,
           settings: DetectionSettings) -> List[Finding]:
    states: List[Tuple[RankState, Dict[str, Any], Dict[str, float]]] = []
    for rank in run.ranks.values():
        st = rank.detectors.get(STATE_KEY)
        if st is not None and "step" in st.get("med", {}) and not rank.exited:
            states.append((rank, st, st["med"]))
    if not states:
        return []
    columns: Dict[str, List[float]] = {}
    for _r, _s, m in states:
        for name, value in m.items():
            columns.setdefault(name, []).append(value)
    job = {name: _median(values) for name, values in columns.items()}
    throughput = [st["tp"] for _r, st, _m in states if st.get("tp") is not None]
    if throughput:
        job["tp"] = _median(throughput)
    if "own" in job:
        _pair(states, step, settings, run_state.get("t2"))
    candidates = _stragglers(states, job, settings, run_state.get("t2"))
    hold = settings.straggler_hold_steps
    forming = bool(candidates) or any(_over(st, settings) >= hold for _r, st, _m in states)
    out: List[Finding] = []
    out += _straggler_findings(run, run_state, states, candidates, job, step, time_ns, settings)
    out += _regression(run, run_state, states, job, forming, step, time_ns, settings)
    out += _data_bottleneck(run, run_state, states, job, bool(candidates), step, time_ns, settings)
    return out


def _entry_at(state: Dict[str, Any], step: int) -> Optional[List[Any]]:
    """The rank's window entry of ``step`` (searched from the newest: it is the last one or close)."""
    for entry in reversed(state.get("w", ())):
        if entry[_STEP] == step:
            return entry
        if entry[_STEP] < step:
            return None
    return None


def _over(state: Dict[str, Any], settings: DetectionSettings) -> int:
    """How many of the rank's window pairs are over its bar: ``straggler_ratio``, or the steady host's
    lower bar (``pc2``) once the job has one -- unless its peers' own time moved since the steady state
    (:func:`_peers_moved`: that bar no longer holds, for holding a regression or a named straggler too)."""
    high, low = state.get("pc", 0), state.get("pc2", 0)
    if low <= high or _peers_moved(state, settings):
        return high
    return int(low)


def _pair(states: Sequence[Tuple[RankState, Dict[str, Any], Dict[str, float]]], step: int,
          settings: DetectionSettings, low: Optional[float] = None) -> None:
    """The per-step paired comparison: each rank's own time at the judged ``step`` against the median of
    the other ranks' own times at that same step (the same step shares the host's load and the job's
    input), appended to the rank's last ``straggler_window`` pairs (``state["px"]``: [step, time_ns,
    own, others, rest, others' rest]) with the count of pairs over ``straggler_ratio`` kept
    incrementally (``state["pc"]``; ``state["pc2"]`` over the steady host's lower bar ``low``, when the
    job has one: :func:`_steady_bar`). O(ranks log ranks) per judged step."""
    timed = [(st, e) for _r, st, _m in states
             if (e := _entry_at(st, step)) is not None and e[_OWN] is not None]
    if len(timed) < 2:
        return
    own_sorted = sorted(e[_OWN] for _st, e in timed)
    rest_sorted = sorted(e[_REST] for _st, e in timed)
    ratio = settings.straggler_ratio
    busy = settings.straggler_runqueue_share
    for st, e in timed:
        others = _median_without(own_sorted, bisect_left(own_sorted, e[_OWN]))
        others_rest = _median_without(rest_sorted, bisect_left(rest_sorted, e[_REST]))
        pairs: List[List[Any]] = st.setdefault("px", [])
        pair = [e[_STEP], e[_TIME], e[_OWN], others, e[_REST], others_rest]
        if len(e) > _RQ:  # the run-queue share of the step, and the count of pairs at >= busy (rc)
            pair.append(e[_RQ] / max(e[_STEP_S], 1e-12))
            st["rc"] = st.get("rc", 0) + (1 if pair[_P_RQ] >= busy else 0)
        pairs.append(pair)
        count = st.get("pc", 0) + (1 if e[_OWN] >= ratio * others else 0)
        count2 = st.get("pc2", 0) + (1 if low is not None and e[_OWN] >= low * others else 0)
        while len(pairs) > settings.straggler_window:
            gone = pairs.pop(0)
            count -= 1 if gone[_P_OWN] >= ratio * gone[_P_OTHERS] else 0
            count2 -= 1 if low is not None and gone[_P_OWN] >= low * gone[_P_OTHERS] else 0
            if len(gone) > _P_RQ and gone[_P_RQ] >= busy:
                st["rc"] -= 1
        st["pc"] = count
        if low is not None:
            st["pc2"] = count2


def _pair_ratio(p: Sequence[Any]) -> float:
    return float(p[_P_OWN]) / max(float(p[_P_OTHERS]), 1e-12)


def _steady_bar(run_state: Dict[str, Any],
                states: Sequence[Tuple[RankState, Dict[str, Any], Dict[str, float]]],
                settings: DetectionSettings) -> None:
    """When the job's steady state is set: the steady host's lower bar (``run_state["t2"]``, see
    ``straggler_noise_k``) from the spread of every rank's paired ratios so far (all after warm-up), each
    rank's own steady-state ratio (``pr``), its peers' steady own time (``po``: the median of the others'
    own time in its pairs) and its count over the bar (``pc2``). No bar when it would not
    be below ``straggler_ratio`` (an oversubscribed host) or there are too few pairs."""
    ratios = [_pair_ratio(p) for _r, st, _m in states for p in st.get("px", ())]
    if len(ratios) < settings.perf_min_points * 2 or len(states) < 2:
        return
    spread = _spread(ratios)
    bar = max(settings.straggler_shift_ratio, 1.0 + settings.straggler_noise_k * spread)
    run_state["spread"] = round(spread, 4)
    if bar >= settings.straggler_ratio:
        return
    run_state["t2"] = bar
    for _r, st, _m in states:
        pairs = st.get("px", [])
        if pairs:
            st["pr"] = _median([_pair_ratio(p) for p in pairs])
            st["po"] = _median([p[_P_OTHERS] for p in pairs])
        st["pc2"] = sum(1 for p in pairs if p[_P_OWN] >= bar * p[_P_OTHERS])


def _stragglers(states: Sequence[Tuple[RankState, Dict[str, Any], Dict[str, float]]],
                job: Dict[str, float], settings: DetectionSettings,
                low: Optional[float] = None) -> Dict[int, Dict[str, float]]:
    """rank -> {own, others, rest, others_rest, ratio} (window medians of its pairs) of every straggler
    candidate: over ``straggler_ratio`` on >= ``straggler_steps`` of its last ``straggler_window``
    judged steps (a sign test on the paired per-step ratio) -- or over the steady host's lower bar ``low``
    on as many while its window's median ratio is >= ``straggler_shift_growth`` x its steady-state one and
    its peers' own time has not itself grown ``straggler_shift_peers_growth`` x (:func:`_peers_moved`) --,
    its median excess >= ``straggler_min_share`` of the job's step time, the others' median extra wait >=
    ``straggler_wait_share`` x that excess. A candidate on CPU contention (:func:`_contended`) is judged
    on the pairs of the steps it waited (:func:`_waited_pairs`) and has ``runqueue`` and
    ``peers_runqueue``. ``bar`` in each: the bar it was over."""
    out: Dict[int, Dict[str, float]] = {}
    for rank, st, _m in states:
        bar = settings.straggler_ratio
        busy: Optional[Tuple[float, float, List[List[Any]]]] = None
        if st.get("pc", 0) < settings.straggler_steps:
            if low is not None and _shifted(st, settings, low):
                bar = low
            else:
                busy = _contended(rank, st, states, settings)
                if busy is None:
                    continue
                bar = settings.straggler_runqueue_ratio
        pairs = st["px"] if busy is None else busy[2]
        excess = _median([p[_P_OWN] - p[_P_OTHERS] for p in pairs])
        if excess < settings.straggler_min_share * job["step"]:
            continue
        wait = _median([p[_P_OTHERS_REST] - p[_P_REST] for p in pairs])
        if wait < settings.straggler_wait_share * excess:
            continue
        out[rank.rank] = {"own": _median([p[_P_OWN] for p in pairs]),
                          "others": _median([p[_P_OTHERS] for p in pairs]),
                          "rest": _median([p[_P_REST] for p in pairs]),
                          "others_rest": _median([p[_P_OTHERS_REST] for p in pairs]),
                          "ratio": _median([_pair_ratio(p) for p in pairs]), "bar": bar}
        if busy is not None:
            out[rank.rank]["runqueue"], out[rank.rank]["peers_runqueue"] = busy[0], busy[1]
    return out


def _shifted(state: Dict[str, Any], settings: DetectionSettings, low: float) -> bool:
    """The steady host's lower bar holds the rank: over ``low`` on >= ``straggler_steps`` of its window,
    its median ratio >= ``straggler_shift_growth`` x its steady one, its peers not moved."""
    if state.get("pc2", 0) < settings.straggler_steps or "pr" not in state:
        return False
    if _median([_pair_ratio(p) for p in state["px"]]) < settings.straggler_shift_growth * state["pr"]:
        return False
    return not _peers_moved(state, settings)


def _runqueue_share(state: Dict[str, Any]) -> Optional[float]:
    """The median run-queue share of the step over the rank's window pairs that carry one."""
    shares = [p[_P_RQ] for p in state.get("px", ()) if len(p) > _P_RQ]
    return _median(shares) if shares else None


def _waited_pairs(state: Dict[str, Any], settings: DetectionSettings) -> List[List[Any]]:
    """The rank's window pairs on whose step its training thread waited for a core >=
    ``straggler_runqueue_share`` of the step (``rc`` counts them)."""
    busy = settings.straggler_runqueue_share
    return [p for p in state.get("px", ()) if len(p) > _P_RQ and p[_P_RQ] >= busy]


def _contended(rank: RankState, state: Dict[str, Any],
               states: Sequence[Tuple[RankState, Dict[str, Any], Dict[str, float]]],
               settings: DetectionSettings) -> Optional[Tuple[float, float, List[List[Any]]]]:
    """CPU contention: (its median run-queue share, its peers' median, the pairs of the steps it waited)
    when the rank's training thread waited for a core (``time/runqueue_s``) >= ``straggler_runqueue_share``
    of the step on >= ``straggler_runqueue_steps`` of its window's steps, the other ranks' median share is <=
    ``straggler_runqueue_peers`` (they had cores: not a whole oversubscribed host), and its own work is
    slower -- the median of the paired ratios of the steps it waited (:func:`_waited_pairs`) >=
    ``straggler_runqueue_ratio`` (never a straggler from the delay alone; the steps before the contention
    began do not dilute it). None otherwise, and always when the SDK sent no run-queue delay (``rc`` is kept
    only when it did)."""
    if state.get("rc", 0) < settings.straggler_runqueue_steps:
        return None
    waited = _waited_pairs(state, settings)
    if _median([_pair_ratio(p) for p in waited]) < settings.straggler_runqueue_ratio:
        return None
    peers = [share for r, st, _m in states if r is not rank and (share := _runqueue_share(st)) is not None]
    if not peers:
        return None
    peers_share = _median(peers)
    if peers_share > settings.straggler_runqueue_peers:
        return None
    return _runqueue_share(state) or 0.0, peers_share, waited


def _peers_moved(state: Dict[str, Any], settings: DetectionSettings) -> bool:
    """True when the other ranks' own time at the rank's window steps (its pairs' median) is >=
    ``straggler_shift_peers_growth`` x theirs in the steady state (``state["po"]``): the job's own work
    moved as a whole, so the steady host's lower bar -- measured on that steady state -- no longer holds
    (``straggler_ratio`` still does). False when the setting is 0 or the steady value is unknown."""
    limit = settings.straggler_shift_peers_growth
    steady = state.get("po")
    if not limit or not steady:
        return False
    return _median([p[_P_OTHERS] for p in state["px"]]) >= limit * steady


def _phase_of(rank: RankState, states: Sequence[Tuple[RankState, Dict[str, Any], Dict[str, float]]],
              ) -> Tuple[str, float, float]:
    """The own phase where ``rank`` exceeds the others most: (phase, its median, the others' median)."""
    mine = rank.detectors[STATE_KEY]["med"]
    best = ("forward", mine.get("forward", 0.0), 0.0)
    gap = -math.inf
    for phase in PHASES:
        if phase not in mine:
            continue
        others = [m[phase] for r, _s, m in states if r is not rank and phase in m]
        if not others:
            continue
        o = _median(others)
        if mine[phase] - o > gap:
            gap, best = mine[phase] - o, (phase, mine[phase], o)
    return best


def _onset(rank: RankState, settings: DetectionSettings, bar: float) -> Tuple[int, int]:
    """(step, time_ns) where the rank's run of pairs over ``bar`` began: the change point of its window,
    the pair from which on (over - straggler_steps/straggler_window per pair) sums highest."""
    pairs = rank.detectors[STATE_KEY]["px"]
    share = settings.straggler_steps / settings.straggler_window
    best, total, at = -math.inf, 0.0, pairs[-1]
    for p in reversed(pairs):
        total += (1.0 if p[_P_OWN] >= bar * p[_P_OTHERS] else 0.0) - share
        if total > best:
            best, at = total, p
    return int(at[_P_STEP]), int(at[_P_TIME])


def _straggler_findings(run: RunState, run_state: Dict[str, Any],
                        states: Sequence[Tuple[RankState, Dict[str, Any], Dict[str, float]]],
                        candidates: Dict[int, Dict[str, float]], job: Dict[str, float], step: int,
                        time_ns: int, settings: DetectionSettings) -> List[Finding]:
    confirm = settings.straggler_confirm
    named = sorted((r for r, _st, _m in states if r.rank in candidates),
                   key=lambda r: -candidates[r.rank]["ratio"])
    open_st = run.incidents.get(STRAGGLER_KEY)
    if not named:
        if open_st is not None and open_st.is_open:
            forming = any(_over(st, settings) >= settings.straggler_clear_steps for _r, st, _m in states)
            run_state["clear"] = run_state.get("clear", 0) + (0 if forming else 1)
            if run_state["clear"] >= confirm:
                resolve(open_st, time_ns, step, open_st.record.lead_rank,
                        f"no rank held the others back for {confirm} judged steps (no rank's own time "
                        f"over {settings.straggler_ratio:g}x the others' on {settings.straggler_clear_steps} "
                        f"of its last {settings.straggler_window} steps)", settings)
                run_state["clear"] = 0
        return []
    run_state["clear"] = 0
    fresh = [r for r in named if r.rank not in (open_st.rank_first if open_st is not None and open_st.is_open
                                                else ())]
    if open_st is not None and open_st.is_open and not fresh and \
            step - run_state.get("named_at", step) < settings.perf_window:
        return []  # named already: the evidence is refreshed every perf_window judged steps
    run_state["named_at"] = step
    lead = named[0]
    ratio = candidates[lead.rank]["ratio"]
    phase, mine, others_phase = _phase_of(lead, states)
    who = _who(run, [r.rank for r in named])
    slowdown = ""
    base = run_state.get("base")
    if base and base.get("step"):
        slowdown = f"; the job's step time is {job['step'] / base['step']:.2f}x its earlier steady state"
    throttled = ""
    if lead.detectors[STATE_KEY].get("thr", 0) >= settings.throttle_confirm:
        throttled = " NVML reports its GPU throttled (see perf/throttling)."
    contention = (f", its training thread waiting for a core {candidates[lead.rank]['runqueue']:.0%} of "
                  f"each step (CPU contention)" if "runqueue" in candidates[lead.rank] else "")
    detail = (f"Straggler: {who} -- its own work per step takes {ratio:.1f}x the other ranks' "
              f"(in {phase}){contention}; they wait for it in every collective")
    out: List[Finding] = []
    for r in named:
        cr = candidates[r.rank]
        ratio_r = cr["ratio"]
        bar = cr["bar"]
        began_step, began_ns = _onset(r, settings, bar)
        ph, mine_r, oth_r = _phase_of(r, states) if r is not lead else (phase, mine, others_phase)
        mine_st = r.detectors[STATE_KEY]
        pairs = mine_st["px"]
        over = mine_st.get("pc", 0) if bar >= settings.straggler_ratio else mine_st.get("pc2", 0)
        why = "" if bar >= settings.straggler_ratio else (
            f" (the steady host's bar: 1 + {settings.straggler_noise_k:g} x the steady state's spread of "
            f"paired ratios {run_state.get('spread', 0.0):.2f}, at least {settings.straggler_shift_ratio:g}; "
            f"its own steady-state ratio was {mine_st.get('pr', 1.0):.2f})")
        lead_in = (f"rank {r.rank}: own time (data + forward + optimizer) >= {bar:.2f}x the other ranks' "
                   f"median at the same step on {over} of its last {len(pairs)} judged steps (threshold "
                   f"{settings.straggler_steps}){why}")
        if "runqueue" in cr:  # named on CPU contention: judged on the steps it waited
            pairs = _waited_pairs(mine_st, settings)
            over = sum(1 for p in pairs if p[_P_OWN] >= bar * p[_P_OTHERS])
            lead_in = (f"rank {r.rank}: CPU contention -- its training thread waited for a core (run-queue "
                       f"delay, time/runqueue_s) >= {settings.straggler_runqueue_share:.0%} of the step on "
                       f"{len(pairs)} of its last {len(mine_st['px'])} judged steps (threshold "
                       f"{settings.straggler_runqueue_steps}; median {cr['runqueue']:.0%}, the other ranks' "
                       f"{cr['peers_runqueue']:.0%}) while its own time (data + forward + optimizer) on "
                       f"those steps ran at a median {ratio_r:.2f}x the other ranks' (threshold "
                       f"{bar:.2f}; over it on {over})")
        description = (
            f"{lead_in}; medians over them: {cr['own'] * 1000:.1f} ms vs "
            f"{cr['others'] * 1000:.1f} ms, a per-step ratio of {ratio_r:.2f}x, mostly in {ph} "
            f"({mine_r * 1000:.1f} ms vs {oth_r * 1000:.1f} ms); the others' backward + wait "
            f"{cr['others_rest'] * 1000:.1f} ms vs its {cr['rest'] * 1000:.1f} ms: they wait for it; "
            f"over the ratio since step {began_step}{slowdown}")
        evidence = Evidence(rule="perf.straggler", description=description, step=began_step,
                            time_ns=began_ns, rank=r.rank, metric="own_time_ratio",
                            threshold=round(bar, 4), value=round(ratio_r, 4),
                            window=[{"step": int(p[_P_STEP]), "own_s": p[_P_OWN],
                                     "others_own_s": p[_P_OTHERS]} for p in pairs])
        timeline = [TimelineEntry(time_ns=began_ns, step=began_step, rank=r.rank,
                                  what=f"rank {r.rank}: own time over {bar:.2f}x its peers'")]
        out.append(Finding(
            "perf", "straggler", STRAGGLER_KEY, r.rank, began_step, began_ns, host=r.host, seen_ns=time_ns,
            seen_step=step, evidence=[evidence], timeline=timeline if r in fresh else [],
            replace_evidence=True, update_values=True, counts=r in fresh,
            values={"detail": detail, "rank": lead.rank, "ratio": round(ratio, 2), "phase": phase},
            summary=(f"{detail}. The whole job runs at {who}'s pace{slowdown}.{throttled} A collective "
                     f"that times out later is this straggler's consequence, whichever rank reports it.")))
    return out


def _who(run: RunState, ranks: List[int]) -> str:
    """``rank 2``, ``ranks 2, 5`` or ``host h's ranks 4-7`` (every rank of one host of several)."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    hosts = {run.ranks[r].host for r in ranks}
    if len(hosts) == 1:
        host = next(iter(hosts))
        on_host = sorted(r.rank for r in run.ranks.values() if r.host == host)
        all_hosts = {r.host for r in run.ranks.values()}
        if host and len(all_hosts) > 1 and sorted(ranks) == on_host:
            return f"host {host}'s ranks {', '.join(str(r) for r in on_host[:16])}"
    return "ranks " + ", ".join(str(r) for r in sorted(ranks)[:16])


def _regression(run: RunState, run_state: Dict[str, Any],
                states: Sequence[Tuple[RankState, Dict[str, Any], Dict[str, float]]], job: Dict[str, float],
                has_candidates: bool, step: int, time_ns: int, settings: DetectionSettings) -> List[Finding]:
    if len(states) < run_state.get("ranks", 0):
        return []
    base = run_state.get("base")
    if base is None:
        samples: List[Dict[str, float]] = run_state.setdefault("bl", [])
        samples.append(dict(job))
        now = _step_now(states, step)
        if now is not None:
            run_state.setdefault("bls", []).append(now)
        if len(samples) >= settings.regression_baseline_steps:
            run_state["base"] = {name: _median([s[name] for s in samples if name in s])
                                 for name in samples[-1]}
            run_state["base_step"] = step
            run_state["base_noise"] = _spread(run_state.pop("bls", []))
            del run_state["bl"]
            for _r, st, m in states:  # each rank's own steady state, for the every-rank test
                if "own" in m:
                    st["ob"] = m["own"]
            _steady_bar(run_state, states, settings)
        return []
    ratio = job["step"] / max(base["step"], 1e-12)
    tp_ratio = (base["tp"] / job["tp"] if job.get("tp") and base.get("tp") else 0.0)
    straggling = has_candidates or (STRAGGLER_KEY in run.incidents and run.incidents[STRAGGLER_KEY].is_open)
    straggling = straggling or any(st.is_open and (st.record.category, st.record.subtype) in EXPLAINED_BY
                                   for st in run.incidents.values())
    slower = ratio >= settings.regression_ratio or tp_ratio >= settings.regression_ratio
    if slower:  # by more than the floors (the every-rank test only when the ratio already holds)
        delta = job["step"] - base["step"]
        slower = delta >= settings.regression_noise_k * run_state.get("base_noise", 0.0) and (
            delta >= settings.regression_min_delta_s or _every_rank_slower(states, settings))
    open_st = run.incidents.get(REGRESSION_KEY)
    is_open = open_st is not None and open_st.is_open
    waited = _host_contended(states, settings) if slower or is_open else None
    holds = slower and not straggling and waited is None
    run_state["reg"] = run_state.get("reg", 0) + 1 if holds else 0
    if not holds:
        if open_st is not None and is_open and not straggling:
            run_state["reg_clear"] = run_state.get("reg_clear", 0) + 1
            if run_state["reg_clear"] >= settings.regression_confirm:
                why = (f"the job's step time is back within {settings.regression_ratio:g}x its steady state"
                       if waited is None else
                       f"the training thread waits for a core {waited:.0%} of its step (median; >= "
                       f"regression_runqueue_share {settings.regression_runqueue_share:g}): the host's CPU "
                       f"is oversubscribed, the slower step is the machine's, not the job's")
                resolve(open_st, time_ns, step, open_st.record.lead_rank, why, settings)
        return []
    run_state["reg_clear"] = 0
    if run_state["reg"] != settings.regression_confirm:
        return []
    grown = max((p for p in ("data", "forward", "optimizer", "rest") if p in job and p in base),
                key=lambda p: job[p] - base[p], default="")
    where = {"rest": "backward + all-reduce (time/backward_s)", **PHASES}.get(grown, "")
    lead = min(r.rank for r, _s, _m in states)
    lead_state = run.ranks[lead]
    what = f"{ratio:.2f}x" if ratio >= settings.regression_ratio else f"throughput 1/{tp_ratio:.2f}"
    detail = (f"Throughput regression: the job's step time is {ratio:.2f}x its steady state "
              f"({base['step'] * 1000:.1f} -> {job['step'] * 1000:.1f} ms)"
              + (f", tokens/samples per second {job['tp']:.4g} vs {base['tp']:.4g}" if tp_ratio else "")
              + " on every rank together")
    began = step - settings.regression_confirm - settings.perf_window // 2
    description = (f"the job's step time (median over {len(states)} ranks of their last "
                   f"{settings.perf_window} steps) {job['step'] * 1000:.1f} ms against "
                   f"{base['step'] * 1000:.1f} ms in its steady state (from step "
                   f"{run_state.get('base_step', -1)}): {what} (threshold "
                   f"{settings.regression_ratio:g}x) on {settings.regression_confirm} judged steps in a row, "
                   f"with no rank slower than its peers"
                   + (f"; the phase that grew most: {where} ({base[grown] * 1000:.1f} -> "
                      f"{job[grown] * 1000:.1f} ms)" if grown else ""))
    evidence = Evidence(rule="perf.throughput_regression", description=description, step=step,
                        time_ns=time_ns, rank=lead, metric=STEP_S, threshold=settings.regression_ratio,
                        value=round(ratio, 4))
    return [Finding(
        "perf", "throughput-regression", REGRESSION_KEY, lead, max(0, began), time_ns, host=lead_state.host,
        seen_step=step, evidence=[evidence], values={"detail": detail}, update_values=True,
        timeline=[TimelineEntry(time_ns=time_ns, step=step, rank=lead, what=detail)],
        summary=(f"{detail}. Every rank slowed together (no straggler): look for what changed for the whole "
                 f"job at about step {max(0, began)} -- the nodes' clocks, power and temperatures, the "
                 f"interconnect, the input sizes."))]


def _host_contended(states: Sequence[Tuple[RankState, Dict[str, Any], Dict[str, float]]],
                    settings: DetectionSettings) -> Optional[float]:
    """The job's run-queue share -- the median over ranks of each rank's median of ``time/runqueue_s`` /
    ``time/step_s`` over its window's steps that carry it -- when it is >= ``regression_runqueue_share``
    (the training threads waited for a core most of their step: the host's CPU is oversubscribed); None
    otherwise, when the setting is 0, and always when the SDK sent no run-queue delay."""
    limit = settings.regression_runqueue_share
    if not limit > 0:
        return None
    shares = []
    for _r, st, _m in states:
        own = [e[_RQ] / e[_STEP_S] for e in st.get("w", ()) if len(e) > _RQ and e[_STEP_S] > 0]
        if own:
            shares.append(_median(own))
    if not shares:
        return None
    share = _median(shares)
    return share if share >= limit else None


def _every_rank_slower(states: Sequence[Tuple[RankState, Dict[str, Any], Dict[str, float]]],
                       settings: DetectionSettings) -> bool:
    """True when the job has >= 2 ranks and every one's own time (data + forward + optimizer, window
    median) is >= ``regression_ratio`` x its own steady state: the job slowed together in its own work,
    not one process a co-tenant's burst of load slowed (which hits processes unevenly) nor ranks waiting
    for one slow rank."""
    if len(states) < 2:
        return False
    ratio = settings.regression_ratio
    for _r, st, m in states:
        base = st.get("ob")
        if not base or "own" not in m or m["own"] < ratio * base:
            return False
    return True


def _step_now(states: Sequence[Tuple[RankState, Dict[str, Any], Dict[str, float]]], step: int
              ) -> Optional[float]:
    """The job's step time at ``step`` alone: the median over ranks of their time/step_s there."""
    values = [e[_STEP_S] for _r, st, _m in states if (e := _entry_at(st, step)) is not None]
    return _median(values) if values else None


def _spread(values: Sequence[float]) -> float:
    """A robust standard deviation: 1.4826 x the median absolute deviation (0 for fewer than 3 values)."""
    if len(values) < 3:
        return 0.0
    middle = _median(values)
    return 1.4826 * _median([abs(v - middle) for v in values])


def _data_bottleneck(run: RunState, run_state: Dict[str, Any],
                     states: Sequence[Tuple[RankState, Dict[str, Any], Dict[str, float]]],
                     job: Dict[str, float], has_candidates: bool, step: int, time_ns: int,
                     settings: DetectionSettings) -> List[Finding]:
    shares = [m["data"] / m["step"] for _r, _s, m in states if "data" in m and m.get("step")]
    if not shares:
        return []
    share = _median(shares)
    holds = (share >= settings.data_wait_share and job.get("data", 0.0) >= settings.data_wait_min_s
             and not has_candidates)
    run_state["data"] = run_state.get("data", 0) + 1 if holds else 0
    open_st = run.incidents.get(DATA_KEY)
    if not holds:
        if open_st is not None and open_st.is_open and share < settings.data_wait_share:
            resolve(open_st, time_ns, step, open_st.record.lead_rank,
                    f"data wait back under {settings.data_wait_share:.0%} of the step", settings)
        return []
    if run_state["data"] != settings.straggler_confirm:
        return []
    lead = min(r.rank for r, _s, _m in states)
    detail = (f"Data-loader bottleneck: {share:.0%} of every step waits for the next batch "
              f"({job.get('data', 0.0) * 1000:.1f} of {job['step'] * 1000:.1f} ms, median rank)")
    evidence = Evidence(rule="perf.data_bottleneck",
                        description=(f"time/data_s / time/step_s, median over {len(shares)} ranks of their "
                                     f"window medians: {share:.2f} (threshold {settings.data_wait_share:g}) "
                                     f"on {settings.straggler_confirm} judged steps in a row"),
                        step=step, time_ns=time_ns, rank=lead, metric=DATA_S,
                        threshold=settings.data_wait_share, value=round(share, 4))
    return [Finding("perf", "data-bottleneck", DATA_KEY, lead, step, time_ns, host=run.ranks[lead].host,
                    evidence=[evidence], values={"detail": detail}, update_values=True,
                    summary=f"{detail}: the accelerators idle while the input pipeline catches up.")]


# ----------------------------------------------------------------------------------------------------
# NVML throttling (one rank's samples)

def _throttle(run: RunState, rank: RankState, state: Dict[str, Any], batch: MetricBatch,
              settings: DetectionSettings) -> List[Finding]:
    values: Dict[str, float] = {}
    for name, _s, v in batch.points:
        if name == THROTTLE or name in GPU_CONTEXT:
            f = _finite(v)
            if f is not None:
                values[name] = f
    if THROTTLE not in values:
        return []
    bits = int(values[THROTTLE])
    reasons = [text for bit, text in THROTTLE_BITS.items() if bits & bit]
    if not reasons:
        state["thr"] = 0
        return []
    state["thr"] = state.get("thr", 0) + 1
    if state["thr"] == 1:
        state["thr_at"] = [batch.step, batch.time_ns]
    if state["thr"] != settings.throttle_confirm:
        return []
    at_step, at_ns = state.get("thr_at", [batch.step, batch.time_ns])
    clock = ""
    if "gpu/sm_clock_mhz" in values:
        clock = f", SM clock {values['gpu/sm_clock_mhz']:.0f} MHz"
        if values.get("gpu/sm_clock_max_mhz"):
            clock += f" of {values['gpu/sm_clock_max_mhz']:.0f}"
    if "gpu/temperature_c" in values:
        clock += f", {values['gpu/temperature_c']:.0f} C"
    if "gpu/power_w" in values:
        clock += f", {values['gpu/power_w']:.0f} W"
        if values.get("gpu/power_limit_w"):
            clock += f" of {values['gpu/power_limit_w']:.0f} W"
    detail = f"GPU of rank {rank.rank} throttled: {', '.join(reasons)}{clock}"
    evidence = Evidence(rule="perf.throttling",
                        description=(f"rank {rank.rank}: NVML clock-event reasons 0x{bits:x} "
                                     f"({', '.join(reasons)}) on {settings.throttle_confirm} samples in a "
                                     f"row{clock}"),
                        step=int(at_step), time_ns=int(at_ns), rank=rank.rank, metric=THROTTLE,
                        value=bits)
    return [Finding("perf", "throttling", THROTTLE_KEY, rank.rank, int(at_step), int(at_ns), host=rank.host,
                    evidence=[evidence], values={"detail": detail}, seen_ns=batch.time_ns,
                    summary=f"{detail}. A throttled GPU makes its rank a straggler the whole job waits for.")]


# ----------------------------------------------------------------------------------------------------

_PHASE: Final = 1
_THROUGHPUT: Final = 2
_THROTTLE: Final = 3
"""The role of a point name in :func:`on_metrics` (0: none)."""
_ROLES = RoleMemo()
"""The roles :func:`on_metrics` decided (:func:`_role`), per settings object and name."""


def _role(name: str, settings: DetectionSettings) -> int:
    """What :func:`on_metrics` reads a point of ``name`` as (the first that applies, its tests' order)."""
    if name in _PHASE_SET:
        return _PHASE
    if name in _names(settings.throughput_metrics):
        return _THROUGHPUT
    return _THROTTLE if name == THROTTLE else 0


def on_metrics(run: RunState, rank: RankState, batch: MetricBatch,
               settings: DetectionSettings) -> List[Finding]:
    """Findings for one metric batch of ``rank``. A point's role is decided by its name alone (:func:`_role`,
    remembered per name): most points of a batch are none of the family's, one lookup each."""
    timed: Optional[Dict[int, Dict[str, float]]] = None
    tp: Optional[float] = None
    throttle = False
    last = _ROLES.last  # (RoleMemo.of, inline for the settings asked for last)
    roles = last[1] if last[0] is settings else _ROLES.of(settings)
    for point in batch.points:
        role = roles.get(point[0])
        if role is None:
            role = remember(roles, point[0], _role(point[0], settings))
        if not role:
            continue
        name, s, value = point
        if role == _PHASE:
            v = value if value.__class__ is float and 0.0 <= value < math.inf else _finite(value)
            if v is not None:
                if timed is None:
                    timed = {}
                values = timed.get(s)
                if values is None:
                    values = timed[int(s)] = {}
                values[name] = v
        elif role == _THROUGHPUT:
            v = value if value.__class__ is float and 0.0 <= value < math.inf else _finite(value)
            if v is not None and v > 0:
                tp = v
        else:
            throttle = True
    out: List[Finding] = []
    detectors = rank.detectors
    state: Optional[Dict[str, Any]] = detectors.get(STATE_KEY)  # (rank_state, inline)
    if state is None:
        state = detectors[STATE_KEY] = {}
    if tp is not None:
        tps: Optional[List[float]] = state.get("tpw")
        if tps is None:
            tps = state["tpw"] = []
        tps.append(tp)
        most = settings.perf_window  # (read once)
        if len(tps) > most:
            del tps[:-most]
        if len(tps) >= settings.perf_min_points:
            state["tp"] = _median_sorted(sorted(tps))
    if throttle:
        out += _throttle(run, rank, state, batch, settings)
    if timed is None:
        return out
    for step in sorted(timed) if len(timed) > 1 else timed:
        values = timed[step]
        if STEP_S not in values:
            continue
        new_rank = "w" not in state
        if not _fold_step(state, step, batch.time_ns, values, settings):
            continue
        run_state = _run_state(run)
        if new_rank:
            run_state["ranks"] = run_state.get("ranks", 0) + 1
        if "med" in state and "step" in state["med"] and _count_report(run, run_state, step):
            out += _judge(run, run_state, run_state["judged"], batch.time_ns, settings)
    return out


class Performance(Detector):
    """Straggler, throughput regression, data-loader bottleneck, GPU throttling (:func:`on_metrics`)."""

    name = "perf"
    kinds: Tuple[str, ...] = ("perf/straggler", "perf/throughput-regression", "perf/data-bottleneck",
                              "perf/throttling")
    section = "perf"
    names_only = True  # wants() reads the batch's names and the settings only

    def wants(self, rank: RankState, names: AbstractSet[str], settings: DetectionSettings) -> bool:
        return STEP_S in names or THROTTLE in names or not names.isdisjoint(settings.throughput_metrics)

    def on_metrics(self, run: RunState, rank: RankState, batch: MetricBatch,
                   settings: DetectionSettings) -> List[Finding]:
        return on_metrics(run, rank, batch, settings)

