"""The Flink runtime: the pure pipeline as a PyFlink DataStream job (DESIGN §2, §5).

:func:`build_job` wires the graph between a source stream of queue record values and a sink; it is the one
place the graph is defined:

    records (bytes: IngestRequest) ─flat_map(decode)→ (run key, bytes of the run's envelopes)
      ─key_by(project, run)→ RunStage (keyed state: the run's pipeline + pending records; timers)
      ├─ run / incident upserts (main output) ──────────────────────────────────────────────┐
      └─ observations (side output) ─key_by(project, fingerprint)→ ClusterStage (keyed state) ─┴→ sink

Both stages are :mod:`.flink_stages` (plain functions of state and input). Between the stages records are
bytes (the IngestRequest's own, not re-encoded) and the results JSON lines: no Python object is pickled
per record. A run's records are folded into its pipeline in batches (flink_stages.FLUSH_EVENTS), kept in
its keyed state until then, so a checkpoint holds them.

Timers: a run has one event-time timer at or after (its last event + ``settle_s``), moved only when that
passes it (to the next multiple of the settle time: one timer move per settle time of event time, not one
per record); when it fires, the pending records are folded in and the pipeline ``advance``-s to exactly
the run's last event + ``settle_s`` -- or, if the watermark has not reached that yet, the timer moves
there. The job assigns no watermarks (PyFlink 2.3's Python timestamp assigner reordered a key's elements
when we tried it), so these fire only at the final watermark of a bounded input: the decisions the
embedded runtime makes on its clock after the last event. A live deployment (``processing_time_s`` > 0)
ticks each run with state on the processing-time clock every that many seconds, as the embedded
processor does: the tick folds the pending records in, then advances.

In production the source is to be Flink's Kafka connector reading the gateway's topic (``KafkaSource``,
value-only byte-array deserializer) and the sink a ``KafkaSink`` to a results topic that a store writer
applies (processor/flink_main.py ``--kafka``). The tests run this very graph on a local mini-cluster
(``apache-flink``, its own venv: requirements/flink.txt) from a bounded collection of recorded records to a
``FileSink`` (tests/services/processor/test_flink_conformance.py).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Iterable, Optional

from pyflink.common import Types
from pyflink.datastream import DataStream, KeyedProcessFunction, OutputTag, RuntimeContext, TimeDomain
from pyflink.datastream.state import ValueStateDescriptor

from trainguard_engine.catalogue import DetectionSettings

from .embedded import GC_GEN0_THRESHOLD, tune_gc
from .flink_stages import (
    FLUSH_EVENTS,
    ClusterStage,
    Flushed,
    Keyed,
    PipelineBox,
    RunStage,
    decode_record,
    observation_key,
    run_key_of,
)

SETTLE_S = 60.0
"""After a run's last event, how long (event time) until its pipeline advances: past
``rank_lost_grace_s`` and a few heartbeats, as tests/engine/test_comm_scenarios.py judges recordings."""

SPANS_ENV = "TRAINGUARD_FLINK_SPANS"
"""For bench/scale.py: when set (in the environment the job's Python workers inherit), a file each run-stage
subtask appends one JSON line to when it closes: ``{"first_ns", "last_ns", "records"}`` -- the wall-clock
times its first record arrived and its last record or timer was done, and how many records it took. The
job's throughput is then records' events over its busy span, without its start-up or end."""

OBSERVATIONS = OutputTag("observations", Types.STRING())
"""Stage 1's side output: the exceptions a run counted, to stage 2."""


def _emit(out: Flushed) -> Iterable[Any]:
    yield from out.lines
    for line in out.observations:
        yield OBSERVATIONS, line


class _RunFunction(KeyedProcessFunction):  # type: ignore[misc]
    def __init__(self, overrides: str, settle_s: float, processing_time_s: float, flush_events: int,
                 gc_gen0_threshold: int = GC_GEN0_THRESHOLD) -> None:
        self.overrides = overrides
        self.settle_ms = int(settle_s * 1000)
        self.grid_ms = max(1000, self.settle_ms)
        self.tick_ms = int(processing_time_s * 1000)
        self.flush_events = flush_events
        self.gc_gen0_threshold = gc_gen0_threshold

    def open(self, runtime_context: RuntimeContext) -> None:
        # this Python worker runs pipelines, as a processor does: the operator's threshold (serve's
        # processor_gc_gen0_threshold, flink_main.py --gc-gen0-threshold; embedded.GC_GEN0_THRESHOLD)
        tune_gc(self.gc_gen0_threshold)
        self.stage = RunStage(self.overrides, self.settle_ms, self.flush_events)
        self.state = runtime_context.get_state(ValueStateDescriptor("run", Types.PICKLED_BYTE_ARRAY()))
        self.spans = os.environ.get(SPANS_ENV) or None
        self.first_ns = self.last_ns = self.records = 0

    def close(self) -> None:
        if self.spans and self.records:
            with open(self.spans, "a", encoding="utf-8") as fh:
                fh.write(json.dumps({"first_ns": self.first_ns, "last_ns": self.last_ns,
                                     "records": self.records}) + "\n")

    def _busy(self, records: int) -> None:
        now = time.time_ns()
        self.first_ns = self.first_ns or now
        self.last_ns = now
        self.records += records

    def process_element(self, value: Keyed, ctx: KeyedProcessFunction.Context) -> Iterable[Any]:
        box: PipelineBox = self.stage.box(self.state.value())
        out, latest_ms = self.stage.on_record(box, value[1])
        due = max(box.due_ms, latest_ms + self.settle_ms)
        if due > box.timer_ms:  # the wake-up moves past the run's settle time: to the next grid point
            self._move_timer(box, ctx, due)
        if self.tick_ms and not box.tick_ms:
            box.tick_ms = ctx.timer_service().current_processing_time() + self.tick_ms
            ctx.timer_service().register_processing_time_timer(box.tick_ms)
        self.state.update(box)
        if self.spans:
            self._busy(1)
        yield from _emit(out)

    def _move_timer(self, box: PipelineBox, ctx: Any, due: int) -> None:
        if box.timer_ms:
            ctx.timer_service().delete_event_time_timer(box.timer_ms)
        box.timer_ms = -(-due // self.grid_ms) * self.grid_ms
        ctx.timer_service().register_event_time_timer(box.timer_ms)

    def on_timer(self, timestamp: int, ctx: KeyedProcessFunction.OnTimerContext) -> Iterable[Any]:
        stored: Optional[PipelineBox] = self.state.value()
        if stored is None:
            return
        box = stored
        if ctx.time_domain() == TimeDomain.PROCESSING_TIME:  # the tick of a live deployment
            if timestamp != box.tick_ms:
                return
            out = self.stage.on_timer(box, time.time_ns())
            if box.pipeline.runs():
                box.tick_ms = ctx.timer_service().current_processing_time() + self.tick_ms
                ctx.timer_service().register_processing_time_timer(box.tick_ms)
                self.state.update(box)
            else:  # the run was evicted (past its TTL; its records stay in the stores): forget the key
                if box.timer_ms:
                    ctx.timer_service().delete_event_time_timer(box.timer_ms)
                self.state.clear()
            yield from _emit(out)
        elif timestamp == box.timer_ms:  # the wake-up at or after the run's settle time
            out = self.stage.flush(box)
            box.timer_ms = 0
            watermark = ctx.timer_service().current_watermark() or timestamp
            due = box.due_ms or timestamp  # 0: no event of the run had a time
            if due <= max(timestamp, watermark):
                out.lines += self.stage.on_timer(box, due * 1_000_000).lines
            else:  # events since moved the settle time past the watermark
                self._move_timer(box, ctx, box.due_ms)
            self.state.update(box)
            if self.spans:
                self._busy(0)
            yield from _emit(out)


class _ClusterFunction(KeyedProcessFunction):  # type: ignore[misc]
    def __init__(self, overrides: str) -> None:
        self.overrides = overrides

    def open(self, runtime_context: RuntimeContext) -> None:
        self.stage = ClusterStage(self.overrides)
        self.cluster = runtime_context.get_state(ValueStateDescriptor("cluster", Types.STRING()))

    def process_element(self, value: str, ctx: KeyedProcessFunction.Context) -> Iterable[str]:
        state, lines = self.stage.on_observation(self.cluster.value(), value)
        self.cluster.update(state)
        yield from lines


def build_job(records: DataStream, sink: Any, *, source_parallelism: int, overrides: Optional[dict] = None,
              settle_s: float = SETTLE_S, processing_time_s: float = 0.0,
              flush_events: int = FLUSH_EVENTS, gc_gen0_threshold: int = GC_GEN0_THRESHOLD) -> DataStream:
    """Wire the job from ``records`` (a stream of IngestRequest values: bytes, or base64 text) to ``sink``
    (a Flink ``Sink`` of strings); returns the output stream. ``source_parallelism`` must be the source's:
    decoding runs chained to it, so a run's records reach its key in the order the source read them (one
    Kafka partition per run; a rebalance in between would reorder them). ``overrides``: detection setting
    overrides (as ``TRAINGUARD_DETECTION_OVERRIDES``); ``flush_events``: see flink_stages.FLUSH_EVENTS;
    ``gc_gen0_threshold``: the run stage's workers' young-generation threshold (:func:`.embedded.tune_gc`: 0
    or below the interpreter's keeps that one), as ``trainguard serve``'s processor_gc_gen0_threshold."""
    settings = json.dumps(overrides or {})
    DetectionSettings.from_overrides(json.loads(settings))  # a bad override fails here, not in a worker
    keyed: Any = Types.TUPLE([Types.STRING(), Types.PRIMITIVE_ARRAY(Types.BYTE())])
    inputs = (records.flat_map(decode_record, output_type=keyed).name("decode")
              .set_parallelism(source_parallelism))
    staged = (inputs.key_by(run_key_of, key_type=Types.STRING())
              .process(_RunFunction(settings, settle_s, processing_time_s, flush_events, gc_gen0_threshold),
                       output_type=Types.STRING())
              .name("runs"))
    clusters = (staged.get_side_output(OBSERVATIONS)
                .key_by(observation_key, key_type=Types.STRING())
                .process(_ClusterFunction(settings), output_type=Types.STRING())
                .name("clusters"))
    out = staged.union(clusters)
    out.sink_to(sink).name("results")
    return out
