"""The Flink runtime: the pure pipeline as a PyFlink DataStream job (DESIGN §2, §5).

:func:`build_job` wires the graph between a source stream of queue record values and a sink; it is the one
place the graph is defined:

    records (bytes: IngestRequest) ─flat_map(decode)→ envelopes (JSON lines, event-time timestamps)
      ─key_by(project, run)→ RunStage (keyed state: the run's pipeline; timers: advance)
      ├─ run / incident upserts ────────────────────────────────────────────────┐
      └─ observations ─key_by(project, fingerprint)→ ClusterStage (keyed state) ─┴→ sink (JSON lines)

Both stages are :mod:`.flink_stages` (plain functions of state and input). Timers: every event moves the
run's event-time timer to (its last event + ``settle_s``); the job assigns no watermarks (PyFlink 2.3's
Python timestamp assigner reordered a key's elements when we tried it), so these fire
only at the final watermark of a bounded input, where the run's pipeline ``advance``-s to that time -- the
decisions the embedded runtime makes on its clock after the last event. A live deployment
(``processing_time_s`` > 0) ticks each run with state on the processing-time clock every that many
seconds, as the embedded processor does.

In production the source is to be Flink's Kafka connector reading the gateway's topic (``KafkaSource``,
value-only byte-array deserializer) and the sink a ``KafkaSink`` to a results topic that a store writer
applies; that wiring is not built yet (the connector jar is on no registry these machines reach). The
tests run this very graph on a local mini-cluster (``apache-flink``, its own venv: requirements/flink.txt)
from a bounded collection of recorded records to a ``FileSink``
(tests/services/processor/test_flink_conformance.py).
"""

from __future__ import annotations

import json
import time
from typing import Any, Iterable, Optional

from pyflink.common import Types
from pyflink.datastream import DataStream, KeyedProcessFunction, RuntimeContext
from pyflink.datastream.state import ValueStateDescriptor

from trainguard_engine.catalogue import DetectionSettings

from .flink_stages import ClusterStage, RunStage, decode_record, is_observation, observation_key, run_key_of

SETTLE_S = 60.0
"""After a run's last event, how long (event time) until its pipeline advances: past
``rank_lost_grace_s`` and a few heartbeats, as tests/engine/test_comm_scenarios.py judges recordings."""


class _RunFunction(KeyedProcessFunction):  # type: ignore[misc]
    def __init__(self, overrides: str, settle_s: float, processing_time_s: float) -> None:
        self.overrides = overrides
        self.settle_ms = int(settle_s * 1000)
        self.tick_ms = int(processing_time_s * 1000)

    def open(self, runtime_context: RuntimeContext) -> None:
        self.stage = RunStage(self.overrides)
        self.pipeline = runtime_context.get_state(
            ValueStateDescriptor("pipeline", Types.PICKLED_BYTE_ARRAY()))
        self.timer = runtime_context.get_state(ValueStateDescriptor("timer", Types.LONG()))
        self.tick = runtime_context.get_state(ValueStateDescriptor("tick", Types.LONG()))

    def process_element(self, value: str, ctx: KeyedProcessFunction.Context) -> Iterable[str]:
        state, lines, last_ns = self.stage.on_event(self.pipeline.value(), value)
        self.pipeline.update(state)
        due = last_ns // 1_000_000 + self.settle_ms
        previous = self.timer.value()
        if previous is None or due > previous:
            if previous is not None:
                ctx.timer_service().delete_event_time_timer(previous)
            ctx.timer_service().register_event_time_timer(due)
            self.timer.update(due)
        if self.tick_ms and self.tick.value() is None:
            tick = ctx.timer_service().current_processing_time() + self.tick_ms
            ctx.timer_service().register_processing_time_timer(tick)
            self.tick.update(tick)
        yield from lines

    def on_timer(self, timestamp: int, ctx: KeyedProcessFunction.OnTimerContext) -> Iterable[str]:
        if timestamp == self.tick.value():  # the processing-time tick of a live deployment
            state, lines = self.stage.on_timer(self.pipeline.value(), time.time_ns())
            if state.pipeline.runs():
                next_tick = ctx.timer_service().current_processing_time() + self.tick_ms
                ctx.timer_service().register_processing_time_timer(next_tick)
                self.tick.update(next_tick)
                self.pipeline.update(state)
            else:  # the run was evicted (past its TTL; its records stay in the stores): forget the key
                self.pipeline.clear()
                self.tick.clear()
                if self.timer.value() is not None:
                    ctx.timer_service().delete_event_time_timer(self.timer.value())
                    self.timer.clear()
            yield from lines
        elif timestamp == self.timer.value():  # the settle time after the run's last event
            self.timer.clear()
            state, lines = self.stage.on_timer(self.pipeline.value(), timestamp * 1_000_000)
            self.pipeline.update(state)
            yield from lines


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
              settle_s: float = SETTLE_S, processing_time_s: float = 0.0) -> DataStream:
    """Wire the job from ``records`` (a stream of IngestRequest values: bytes, or base64 text) to ``sink``
    (a Flink ``Sink`` of strings); returns the output stream. ``source_parallelism`` must be the source's:
    decoding runs chained to it, so a run's records reach its key in the order the source read them (one
    Kafka partition per run; a rebalance in between would reorder them). ``overrides``: detection setting
    overrides (as ``TRAINGUARD_DETECTION_OVERRIDES``)."""
    settings = json.dumps(overrides or {})
    DetectionSettings.from_overrides(json.loads(settings))  # a bad override fails here, not in a worker
    envelopes = (records.flat_map(decode_record, output_type=Types.STRING()).name("decode")
                 .set_parallelism(source_parallelism))
    staged = (envelopes.key_by(run_key_of, key_type=Types.STRING())
              .process(_RunFunction(settings, settle_s, processing_time_s), output_type=Types.STRING())
              .name("runs"))
    clusters = (staged.filter(is_observation)
                .key_by(observation_key, key_type=Types.STRING())
                .process(_ClusterFunction(settings), output_type=Types.STRING())
                .name("clusters"))
    out = staged.filter(lambda line: not is_observation(line)).union(clusters)
    out.sink_to(sink).name("results")
    return out
