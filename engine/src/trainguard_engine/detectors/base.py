"""The one interface every detector implements, and what it is handed.

A detector is stateless code over the run's state: what it remembers lives in ``RankState.detectors``
(plain JSON-able dicts, so the pipeline's snapshot carries it) under its own key. It declares:

* ``name``     -- unique, ``family.what`` (``"loss.curve"``);
* ``kinds``    -- every ``category/subtype`` it can open (checked against the catalogue at import, and on
  the recorded corpus by tests/engine/test_detector_contract.py);
* ``section``  -- its family of :class:`~trainguard_engine.catalogue.DetectionSettings`
  (:data:`~trainguard_engine.catalogue.SECTIONS`): the thresholds it reads are that section's, plus the
  shared ``common`` and ``state`` ones;

and implements any of the hooks, each returning the findings it made (never raising on odd input):

* :meth:`Detector.on_metrics` -- one metric batch of a rank (:class:`MetricBatch`), after its points are
  in the rank's history; :meth:`Detector.wants` tells from the batch's metric names whether the call can
  matter (most batches concern one or two families: the others are not called) -- remembered per list of
  names when the detector declares ``names_only``, or where :meth:`Detector.wants_names` says the names
  alone decide;
* :meth:`Detector.on_metric_run` -- the *column hook*, for a detector that declares ``independent``: one
  call for a run of one rank's consecutive metric envelopes (:class:`MetricRun`), returning each
  envelope's findings apart; the pipeline applies them at each envelope's place in the registry's order,
  so the outputs are those of calling :meth:`Detector.on_metrics` envelope by envelope (see below);
* :meth:`Detector.on_memory`  -- one ``memory`` event (a MemorySnapshot payload) of a rank;
* :meth:`Detector.on_exception`, :meth:`Detector.on_log`, :meth:`Detector.on_heartbeat`,
  :meth:`Detector.on_exit` -- the other events of a rank (:class:`EventInfo`).

**Independent detectors and the column hook.** A detector may declare ``independent = True`` (with
``names_only``) when its :meth:`~Detector.on_metrics` reads nothing but the batch, the settings, the
rank's ``rank`` and ``host`` and its own state under its own key -- no other detector's state, no
incident, no metric history, no other rank -- and nobody else reads its state; and when the findings it
returns hold no reference into that state (copies only). Then what it finds on an envelope depends only on
the envelopes of that rank it was given before, so the pipeline may hand it, at the first envelope of a
run of one rank's consecutive metric envelopes that route to it (same run, rank and host; none with a
non-finite value or an alert -- those are remembered by id and may be dropped as replays; none carrying a
shard's norm), the whole run at once (:meth:`~Detector.on_metric_run`), keep each envelope's findings, and
apply them when it reaches that envelope's place in the registry order: the state, records and snapshots
are those of the envelope-by-envelope walk. The run never spans two ``process`` calls (a snapshot sees a
detector's state as of the envelopes processed). A hook that raises at an envelope of the run is
re-raised at that envelope's place (the run is quarantined there, as before).

The pipeline walks :data:`~trainguard_engine.detectors.registry.DETECTORS` in order, so a later detector
sees what an earlier one decided about the same event (the numeric detectors first, the loss curve,
which defers to them, after; a stall closed by an exit before the exit's own verdict). The
processing-time timers (stalled and lost runs, correlation's waits) stay the pipeline's
(:meth:`~trainguard_engine.pipeline.Pipeline.advance`): they act on whole runs, not on an event.

What a hook may write (the snapshot depends on it): the state of the event's own rank and of the run's
first rank (run-wide detector state lives there). The pipeline re-encodes at a checkpoint only the ranks it
saw touched and reuses the bytes of the others (issue 20); it marks every rank of the run when a finding is
applied, the run has incidents, gradient shards were combined or the straggler detector judged a step
across ranks. A hook that writes another rank's state any other way must make the pipeline mark the run
(``Pipeline`` in pipeline.py), or a restore brings that rank back stale --
tests/services/processor/test_rank_parts.py compares the incremental encode with the whole one on recorded
4-rank jobs after every event.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import AbstractSet, Any, Final, List, Mapping, NamedTuple, Optional, Sequence, Tuple

from ..catalogue import DetectionSettings
from ..incidents import Finding
from ..state import RankState, RunState

Point = Tuple[str, int, float]


@dataclass(frozen=True)
class EventInfo:
    """One non-metric event of a rank as the detectors see it: the envelope, its payload, the step it
    belongs to (an error read from a log without a step: the rank's last), its event time and id."""

    envelope: Mapping[str, Any]
    body: Mapping[str, Any]
    step: int
    time_ns: int
    event_id: str


class MetricBatch(NamedTuple):
    """One metric envelope of one rank as the detectors see it: its points ``(name, step, value)`` (a
    point's own step, else the envelope's; NaN and ±Inf as floats), the envelope's step, event time and
    id. Immutable; a named tuple (built for every metric envelope: half a frozen dataclass's cost)."""

    points: Sequence[Point]
    step: int
    time_ns: int
    event_id: str


_TUPLE_NEW: Final[Any] = tuple.__new__
_BATCH_CLASS: Final[Any] = MetricBatch
"""The class :func:`new_batch` makes (compiled: a static, not a read of the module's globals per call)."""


def new_batch(points: Sequence[Point], step: Any, time_ns: Any, event_id: str) -> MetricBatch:
    """``MetricBatch(points, step, time_ns, event_id)``, the same object, built as the named tuple's own
    ``__new__`` builds it (``tuple.__new__``) without calling that Python-level function (the compiled
    pipeline builds one per metric envelope). ``step`` and ``time_ns`` are ints, taken as objects: the
    envelope's own, stored as they are (compiled: not unboxed and boxed again)."""
    batch: MetricBatch = _TUPLE_NEW(_BATCH_CLASS, (points, step, time_ns, event_id))
    return batch


class MetricRun(NamedTuple):
    """One rank's consecutive metric envelopes handed to :meth:`Detector.on_metric_run` at once: their
    batches in arrival order (each as :meth:`Detector.on_metrics` would get it)."""

    batches: Sequence[MetricBatch]


class RunFindings(NamedTuple):
    """What :meth:`Detector.on_metric_run` found: ``findings[i]`` for ``run.batches[i]``; ``error``: the
    exception raised on batch ``len(findings)`` (None: every batch was judged). Nothing after the batch that
    raised was looked at."""

    findings: List[Sequence[Finding]]
    error: Optional[Exception]


class Detector:
    """Base class: the hooks find nothing unless overridden (see the module docstring)."""

    name: str = ""
    kinds: Tuple[str, ...] = ()
    section: str = ""
    names_only: bool = False
    """True when :meth:`wants` reads nothing but ``names`` and ``settings`` (never the rank): the pipeline
    then asks once per settings object and distinct list of point names and remembers the answer (most
    envelopes of a run carry the same few lists). False (the default): asked for every batch."""

    independent: bool = False
    """True when :meth:`on_metrics` reads only the batch, the settings, the rank's number and host and the
    detector's own state, nobody else reads that state and its findings hold copies only (see the module
    docstring): the pipeline may then call :meth:`on_metric_run` once for a run of envelopes. Requires
    ``names_only``."""

    def wants(self, rank: RankState, names: AbstractSet[str], settings: DetectionSettings) -> bool:
        """Whether :meth:`on_metrics` can find or remember anything in a batch whose point names are
        ``names`` (the pipeline skips the call otherwise). Must be exact: False only when the call would
        return nothing and change nothing that matters. Default: always."""
        return True

    def wants_names(self, names: AbstractSet[str], settings: DetectionSettings) -> Optional[bool]:
        """For a detector that is not ``names_only``: what :meth:`wants` answers for every rank on a batch
        whose point names are ``names``, when the names and ``settings`` alone decide it (True or False),
        remembered per list of names like a ``names_only`` answer; None when the rank's state decides (then
        :meth:`wants` is asked per batch). Must agree with :meth:`wants` wherever it is not None. Default:
        None."""
        return None

    def wants_rank(self, rank: RankState, names: AbstractSet[str], settings: DetectionSettings) -> bool:
        """:meth:`wants` on a batch whose ``names`` :meth:`wants_names` answered None for under ``settings``
        (the pipeline asks this per batch then: the names' part of the answer is known already, so an
        override reads only the rank's state). Must agree with :meth:`wants` there. Default: :meth:`wants`."""
        return self.wants(rank, names, settings)

    def on_metrics(self, run: RunState, rank: RankState, batch: MetricBatch,
                   settings: DetectionSettings) -> Sequence[Finding]:
        return ()

    def on_metric_run(self, run: RunState, rank: RankState, batches: MetricRun,
                      settings: DetectionSettings) -> RunFindings:
        """The findings of :meth:`on_metrics` on each batch of ``batches`` in turn (an independent
        detector may override it with a cheaper equivalent); stops at the first batch that raises."""
        out: List[Sequence[Finding]] = []
        on_metrics = self.on_metrics
        for batch in batches.batches:
            try:
                out.append(on_metrics(run, rank, batch, settings))
            except Exception as exc:  # re-raised by the pipeline at that envelope's place
                return RunFindings(out, exc)
        return RunFindings(out, None)

    def on_memory(self, run: RunState, rank: RankState, payload: Mapping[str, Any], batch: MetricBatch,
                  settings: DetectionSettings) -> Sequence[Finding]:
        """``batch`` carries the event's step, time and id (no points)."""
        return ()

    def on_exception(self, run: RunState, rank: RankState, event: EventInfo, fingerprint: str,
                     settings: DetectionSettings) -> Sequence[Finding]:
        """An ``exception`` event (``fingerprint``: its stack fingerprint, as the clusters know it)."""
        return ()

    def on_log(self, run: RunState, rank: RankState, event: EventInfo,
               settings: DetectionSettings) -> Sequence[Finding]:
        """A ``log`` event (the job's own error text, or an agent's report)."""
        return ()

    def on_heartbeat(self, run: RunState, rank: RankState, event: EventInfo,
                     settings: DetectionSettings) -> Sequence[Finding]:
        """A heartbeat newer than the rank's last (already folded into the rank's state)."""
        return ()

    def on_exit(self, run: RunState, rank: RankState, event: EventInfo,
                settings: DetectionSettings) -> Sequence[Finding]:
        """A lifecycle EXIT (already recorded on the rank: exited, code, signal, reason)."""
        return ()

    def __repr__(self) -> str:
        return f"<detector {self.name}>"
