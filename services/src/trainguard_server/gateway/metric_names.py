"""How many distinct metric names one run may have, enforced at the gateway so the client is told.

Every distinct name of a run is a series in the metric store (one per rank), a row of its summary and
state in the pipeline's detectors; without a bound, 10 requests of 20,000 new names made 200,000 series in
one run. Contract of :class:`MetricNameCap` (thread-safe):

* :meth:`refusals` ``(project, items)`` takes the metric-batch envelopes a request would queue, as
  ``(key, run_id, names)`` in request order (``names``: the envelope's point names in order, as
  :class:`.point_names.Shape` has them), and returns
  ``{key: (code, message)}`` for those refused. An
  envelope whose point names would take its run past ``cap`` distinct names is refused *whole* (the wire's
  unit; the caller reports it per event with code :data:`CODE` and queues the rest of the request); an
  envelope of names the run already has is always admitted -- a run at its cap keeps logging them. The
  names of an admitted envelope are the run's from then on. Points without a name are not counted (they
  are not stored either); an alert's ``recent`` context is not counted (past values, not new series).
* Counted per gateway process, since its start. A run seen for the first time (or again after being
  forgotten) starts from the names ``seed(project, run_id)`` returns -- the metric store's, where the
  gateway shares it (``trainguard serve``), so a restart does not reset the count -- else from none.
* A point name longer than ``max_length`` characters refuses its envelope too (code ``too_large``, naming
  the point): a name is an identifier (``grad/layer/<module>``), and 5,000 names of 60,000 characters would
  be 300 MB of one run's series names, here and in the stores.
* A point name holding a control character (C0, DEL, C1) or a Unicode bidirectional control refuses its
  envelope too (code ``invalid_field``, naming the point, the code point and its position): a metric name is
  printed as is -- the dashboard, the CLI, notifications, log lines -- where an ESC sequence clears a
  terminal, a newline forges a log line and a bidi control reorders the text around it (the rule of
  ``run_id``, :mod:`.validate`). Names the metric store already holds with one (stored before this rule)
  are not seeded as known, so they are refused as new ones are. Always on.
* Memory: the names remembered over all runs weigh at most ``budget`` (each name its length plus
  :data:`NAME_OVERHEAD`); beyond it the project whose remembered names weigh the most forgets its least
  recently active run (a forgotten run is seeded again when it comes back) -- never a lighter project's
  (security.md H50: before, the least recently active run of any project went, so one tenant sending new
  runs of many names made every other tenant's runs be read again from the metric store, request after
  request).
* ``cap <= 0`` turns the count off, ``max_length <= 0`` the length rule (the character rule stays).
* A seed that fails (a store that cannot answer: too many open files during a connection burst, H46) is
  logged at most once per :data:`SEED_FAILURE_LOG_EVERY_S` seconds, with how many runs failed since the last
  line (security.md H49): one line (and its traceback, unless it is the known ``OutOfFiles``) per window,
  not one traceback per request of every run a burst touches.
* :meth:`admits_known` ``(project, runs)`` is the steady state's shortcut: True when :meth:`refusals` of
  those runs' envelopes would refuse nothing and admit no new name (every run remembered and naming only
  names it has, none too long); the runs are then marked active as :meth:`refusals` would. False changes
  nothing (the caller then calls :meth:`refusals`).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from ..storage.base import OutOfFiles
from .log_window import LogWindow
from .validate import BIDI_CONTROL, CONTROL, show

__all__ = ["CODE", "MetricNameCap"]

log = logging.getLogger(__name__)

#: the rejection code of an envelope refused for its run's distinct metric names
CODE = "too_many_metric_names"
SETTING = "TRAINGUARD_RUN_MAX_METRIC_NAMES"
#: characters of a new name a rejection's message shows (then "...")
NAME_SHOWN = 80
#: what remembering one name costs beside its characters (a str object and a set slot), for the budget
NAME_OVERHEAD = 80
LENGTH_CODE = "too_large"
#: a failing seed is logged at most once per this many seconds, with the count of failures since
SEED_FAILURE_LOG_EVERY_S = 10.0
CHARACTER_CODE = "invalid_field"

Seed = Callable[[str, str], Iterable[str]]


class MetricNameCap:
    """Distinct metric names per run (see the module doc)."""

    def __init__(self, cap: int, budget: int, seed: Optional[Seed] = None, max_length: int = 0) -> None:
        self.cap = cap
        self.budget = budget
        self.seed = seed
        self.max_length = max_length
        self._runs: Dict[Tuple[str, str], Set[str]] = {}
        #: per project: its remembered runs, least recently active first, and what their names weigh
        self._order: Dict[str, OrderedDict[str, None]] = {}
        self._weights: Dict[str, int] = {}
        self._tracked = 0
        self._lock = threading.Lock()
        #: failed seeds: one log line per SEED_FAILURE_LOG_EVERY_S (its clock may be replaced: tests)
        self.seed_log = LogWindow(SEED_FAILURE_LOG_EVERY_S)

    @property
    def enabled(self) -> bool:
        return True  # the character rule is always on

    def names(self, project: str, run_id: str) -> int:
        """Distinct names counted for the run now (0 when not remembered)."""
        with self._lock:
            return len(self._runs.get((project, run_id), ()))

    def admits_known(self, project: str, runs: Dict[str, Set[str]]) -> bool:
        """True when :meth:`refusals` of envelopes of ``runs`` (run id -> the names they carry, in the
        order the runs first appear) would refuse nothing and admit no name; those runs are then marked
        active as it would mark them. False: nothing changed."""
        if self.max_length > 0:
            for names in runs.values():
                if names and max(map(len, names)) > self.max_length:
                    return False
        if self.cap <= 0:  # names a run knows were checked when admitted; without the count, check them here
            return not any(CONTROL.search("".join(names)) for names in runs.values())
        with self._lock:
            for run_id, names in runs.items():
                known = self._runs.get((project, run_id))
                if known is None or not names <= known:
                    return False
            if runs:  # (every one remembered, so its project has an order)
                order = self._order[project]
                for run_id in runs:
                    order.move_to_end(run_id)
        return True

    def refusals(self, project: str,
                 items: Iterable[Tuple[int, str, Sequence[str]]]) -> Dict[int, Tuple[str, str]]:
        """``{key: (code, message)}`` of the envelopes refused (see the module doc); the others' names are
        admitted. ``items``: ``(key, run_id, names)`` of metric-batch envelopes (``names``: their points'
        names in order); a message starts with the field (``metrics...``), the caller puts ``events[i].``
        before it."""
        by_run: Dict[str, List[Tuple[int, Sequence[str]]]] = {}
        for key, run_id, names_of in items:
            by_run.setdefault(run_id, []).append((key, names_of))
        out: Dict[int, Tuple[str, str]] = {}
        for run_id, envelopes in by_run.items():
            every: Set[str] = set()
            for _, points in envelopes:
                every.update(points)
            every.discard("")
            if self.max_length > 0 and every and max(map(len, every)) > self.max_length:
                envelopes = self._long_names(envelopes, out)
                every = {n for _, points in envelopes for n in points} - {""}
            if CONTROL.search("".join(every)):
                envelopes = self._control_names(envelopes, out)
                every = {n for _, points in envelopes for n in points} - {""}
            if self.cap <= 0:
                continue
            self._ensure(project, run_id)
            with self._lock:
                known = self._run(project, run_id)
                if every <= known:  # the steady state: a run logging the names it has
                    continue
                before = len(known)
                for key, points in envelopes:
                    names = set(points)
                    names.discard("")
                    if names <= known:
                        continue
                    new = names - known
                    if len(known) + len(new) > self.cap:
                        out[key] = (CODE, self._message(run_id, len(known), new))
                        continue
                    known |= new
                    self._add_weight(project, _weight(new))
                if len(known) > before:
                    self._forget_beyond_budget(keep=(project, run_id))
        return out

    def _long_names(self, envelopes: List[Tuple[int, Sequence[str]]],
                    out: Dict[int, Tuple[str, str]]) -> List[Tuple[int, Sequence[str]]]:
        """``envelopes`` less those with a point name over ``max_length``, each refused into ``out``."""
        kept = []
        for key, points in envelopes:
            for j, name in enumerate(points):
                if len(name) > self.max_length:
                    out[key] = (LENGTH_CODE, f"metrics.points[{j}].name: {len(name)} characters exceeds "
                                             f"max_metric_name_length={self.max_length} "
                                             f"(TRAINGUARD_MAX_METRIC_NAME_LENGTH)")
                    break
            else:
                kept.append((key, points))
        return kept

    def _control_names(self, envelopes: List[Tuple[int, Sequence[str]]],
                       out: Dict[int, Tuple[str, str]]) -> List[Tuple[int, Sequence[str]]]:
        """``envelopes`` less those with a point name holding a control character, each refused into
        ``out``."""
        kept = []
        for key, points in envelopes:
            for j, name in enumerate(points):
                found = CONTROL.search(name)
                if found:
                    at = found.start()
                    kind = "the bidirectional control character" if BIDI_CONTROL.match(name[at]) else \
                        "the control character"
                    out[key] = (CHARACTER_CODE, f"metrics.points[{j}].name: {show(name)} has {kind} "
                                                f"U+{ord(name[at]):04X} at position {at}; a metric name is "
                                                f"printed as is (dashboard, CLI, notifications, logs), so "
                                                f"control and bidirectional control characters are refused")
                    break
            else:
                kept.append((key, points))
        return kept

    # --- internals --------------------------------------------------------------------------------
    def _message(self, run_id: str, has: int, new: Set[str]) -> str:
        first = min(new)
        if len(first) > NAME_SHOWN:  # a rejection's message stays small whatever the names
            first = first[:NAME_SHOWN] + "..."
        more = f" and {len(new) - 1} more" if len(new) > 1 else ""
        noun = "name" if len(new) == 1 else "names"
        return (f"metrics: run {run_id!r} has {has} distinct metric names and this event adds {len(new)} "
                f"new {noun} ({first!r}{more}), past the {self.cap} a run may have ({SETTING}); nothing of "
                f"this event was queued. Events naming only the run's metrics so far are accepted")

    def _run(self, project: str, run_id: str) -> Set[str]:
        """(Under the lock.) The run's names, marked most recently active."""
        key = (project, run_id)
        known = self._runs.get(key)
        if known is None:
            known = self._remember(project, run_id, set())
        else:
            self._order[project].move_to_end(run_id)
        return known

    def _remember(self, project: str, run_id: str, names: Set[str]) -> Set[str]:
        """(Under the lock.) Remember a run not remembered, as its project's most recently active."""
        self._runs[(project, run_id)] = names
        self._order.setdefault(project, OrderedDict())[run_id] = None
        self._add_weight(project, _weight(names))
        return names

    def _add_weight(self, project: str, weight: int) -> None:
        self._tracked += weight
        self._weights[project] = self._weights.get(project, 0) + weight

    def _ensure(self, project: str, run_id: str) -> None:
        """Seed a run this process does not remember from ``seed`` (outside the lock: it may read a store)."""
        with self._lock:
            if (project, run_id) in self._runs:
                return
        seeded: Set[str] = set()
        if self.seed is not None:
            try:
                seeded = set(self.seed(project, run_id))
            except Exception as exc:  # a store that cannot answer: count from the names seen from now on
                self._seed_failed(project, run_id, exc)
        seeded.discard("")
        if CONTROL.search("".join(seeded)):  # stored before the character rule: not known, so refused
            seeded = {name for name in seeded if not CONTROL.search(name)}
        with self._lock:
            if (project, run_id) not in self._runs:
                self._remember(project, run_id, seeded)

    def _seed_failed(self, project: str, run_id: str, exc: Exception) -> None:
        """Log a failed seed: at most one line per SEED_FAILURE_LOG_EVERY_S, counting those left out."""
        count = self.seed_log.due()
        if not count:
            return
        log.warning("cannot read the metric names of run %r of project %r (%s: %s); counting its names from "
                    "now (%d run(s) since the last such line, one line per %g s)", run_id, project,
                    type(exc).__name__, exc, count, SEED_FAILURE_LOG_EVERY_S,
                    exc_info=not isinstance(exc, OutOfFiles))

    def _forget_beyond_budget(self, keep: Tuple[str, str]) -> None:
        """(Under the lock.) While over budget, the project whose names weigh the most (ties: the greater
        name) forgets its least recently active run (never ``keep``)."""
        weights = self._weights
        while self._tracked > self.budget and len(self._runs) > 1:
            project = max(weights, key=lambda p: (weights[p], p))
            order = self._order[project]
            run_id = next(iter(order))
            if (project, run_id) == keep:
                if len(order) > 1:
                    order.move_to_end(run_id)
                    run_id = next(iter(order))
                else:  # keep is its project's only run: the next heaviest project's
                    project = max((p for p in weights if p != project), key=lambda p: (weights[p], p))
                    order = self._order[project]
                    run_id = next(iter(order))
            del order[run_id]
            names = self._runs.pop((project, run_id))
            self._add_weight(project, -_weight(names))
            if not order:
                del self._order[project]
                del self._weights[project]


def _weight(names: Set[str]) -> int:
    """What remembering ``names`` costs against the budget (about their bytes)."""
    return sum(map(len, names)) + NAME_OVERHEAD * len(names)
