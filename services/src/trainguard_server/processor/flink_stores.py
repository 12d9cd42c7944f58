"""The stores' side of the Flink runtime (``TRAINGUARD_PROCESSOR_RUNTIME=flink``): what the processor does
when the Flink job (flink_job.py, run by ``flink_main --kafka``) runs the pipeline.

* From the **ingest topic** (the processors' consumer group, as the embedded processor reads it): raw
  context to the event store and metric points to the metric store -- exactly what the embedded processor
  stores (the same code) -- and nothing else: no pipeline.
* From the **results topic** (the job's JSON upserts, :mod:`.flink_stages`): runs, incidents and clusters
  into the incident store (:func:`apply_results`). Upserts are idempotent, so at-least-once delivery (the
  job's sink, a restart here) is harmless; one partition keeps each record's updates in order.

Each record is committed only after what it carries is stored (a store unavailable: the round is retried,
as in the embedded processor).
"""

from __future__ import annotations

import json
import logging
from typing import Any, Dict, Optional, Sequence

from trainguard_engine.pipeline import PipelineOutput
from trainguard_engine.records import Cluster, Incident, RunRecord

from ..queue.base import Queue
from ..queue.common import PARTITION
from ..storage.base import EventStore, IncidentStore, MetricStore
from .decode import Envelope, Points
from .embedded import EmbeddedProcessor

log = logging.getLogger("trainguard.processor.flink")


def parse_results(values: Sequence[bytes]) -> PipelineOutput:
    """The job's result lines as records (the latest of each id wins); undecodable lines are skipped."""
    runs: Dict[str, RunRecord] = {}
    incidents: Dict[str, Incident] = {}
    clusters: Dict[str, Cluster] = {}
    for value in values:
        try:
            line = json.loads(value)
            kind, record = line["kind"], line["record"]
            if kind == "run":
                runs[json.dumps([record["project"], record["run_id"]])] = RunRecord.from_dict(record)
            elif kind == "incident":
                incidents[record["incident_id"]] = Incident.from_dict(record)
            elif kind == "cluster":
                clusters[json.dumps([record["project"], record["fingerprint"]])] = Cluster.from_dict(record)
        except (ValueError, KeyError, TypeError) as exc:
            log.error("undecodable result record: %s", exc)
    return PipelineOutput(runs=list(runs.values()), incidents=list(incidents.values()),
                          clusters=list(clusters.values()))


class FlinkStoresProcessor(EmbeddedProcessor):
    """The embedded processor's loop without its pipeline, plus the Flink job's results (module doc)."""

    def __init__(self, queue: Queue, results: Queue, events: EventStore, metrics: MetricStore,
                 incidents: IncidentStore, *, batch: int = 256, snapshot_every_s: float = 5.0) -> None:
        super().__init__(queue, events, metrics, incidents, batch=batch, snapshot_every_s=snapshot_every_s,
                         tick_interval_s=1e15)  # no timers: the job decides
        self.results = results
        self.results_applied = 0

    per_partition_state = False  # the Flink job keeps the detection state

    def _run_pipeline(self, partition: int, envelopes: Sequence[Envelope],
                      points: Sequence[Points]) -> None:
        """Nothing: the Flink job runs the pipeline; this stores raw context and metrics only."""

    def _checkpoint_locked(self) -> None:  # no pipeline state to save: commit what was stored
        if self._uncommitted:
            self._commit_held()  # durable before the offsets that cover them
        self.stats.snapshots += 1

    def run_once(self, timeout: float) -> int:
        done = super().run_once(timeout=min(timeout, 0.05))
        results = self.results.consume(self.batch, 0.0 if done else timeout)
        if results:
            out = parse_results([r.value for r in results])
            with self._lock:
                self._apply(PARTITION, out)  # the job's records: already one view per run and cluster
                self.incidents.sync()  # durable before the results' offsets are committed
            self.results.commit(results)
            self.results_applied += len(results)
        return done + len(results)

    def stop(self, drain: bool = True, timeout: float = 30.0) -> None:
        super().stop(drain=drain, timeout=timeout)
        self.results.close()


def open_results_queue(bootstrap: str, topic: str, group_id: str, client_config: Optional[Dict[str, Any]],
                       session_timeout_ms: int, create_topics: bool) -> Queue:
    """The results topic as a queue this processor consumes (values are JSON lines: no validation)."""
    from ..queue.kafka import KafkaQueue

    return KafkaQueue(bootstrap, topic, group_id=f"{group_id}.results", partitions=1,
                      session_timeout_ms=session_timeout_ms, client_config=client_config or {},
                      create_topics=create_topics, consume=True)
