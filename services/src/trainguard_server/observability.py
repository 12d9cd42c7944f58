"""The server's own health in Prometheus text format: ingest rate, queue depth, rejected/dropped events,
processing lag."""

from __future__ import annotations

from typing import Any, Iterable, List, Tuple

Sample = Tuple[str, str, str, Iterable[Tuple[str, float]]]  # name, type, help, [(labels, value)]


def _lines(samples: Iterable[Sample]) -> List[str]:
    out: List[str] = []
    for name, kind, help_text, values in samples:
        out.append(f"# HELP {name} {help_text}")
        out.append(f"# TYPE {name} {kind}")
        for labels, value in values:
            out.append(f"{name}{labels} {float(value)!r}")
    return out


def _label(value: str) -> str:
    """A Prometheus label value, escaped (backslash, double quote, newline)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render_prometheus(services: Any) -> str:
    """Text exposition of the gateway's, queue's and processor's counters."""
    samples: List[Sample] = []
    gateway = getattr(services, "gateway", None)
    stats = getattr(gateway, "stats", None)
    if stats is not None:
        samples.append(("trainguard_ingest_events_total", "counter", "events accepted by the gateway",
                        [("", getattr(stats, "accepted", 0))]))
        samples.append(("trainguard_ingest_duplicates_total", "counter",
                        "events already seen in the same request", [("", getattr(stats, "duplicates", 0))]))
        rejected = getattr(stats, "rejected", {}) or {}
        samples.append(("trainguard_ingest_rejected_total", "counter", "events rejected, by reason",
                        [(f'{{code="{code}"}}', n) for code, n in sorted(rejected.items())] or [("", 0)]))
        samples.append(("trainguard_ingest_backpressure_total", "counter",
                        "requests answered 429/RESOURCE_EXHAUSTED",
                        [("", getattr(stats, "backpressure", 0))]))
        samples.append(("trainguard_ingest_new_run_limited_total", "counter",
                        "requests answered 429: their project started new runs faster than "
                        "TRAINGUARD_PROJECT_NEW_RUNS_PER_S", [("", getattr(stats, "new_run_limited", 0))]))
        samples.append(("trainguard_ingest_backlog_limited_total", "counter",
                        "requests answered 429: their project had TRAINGUARD_PROJECT_MAX_BACKLOG_EVENTS "
                        "events waiting for the processor", [("", getattr(stats, "backlog_limited", 0))]))
        samples.append(("trainguard_ingest_bytes_total", "counter", "request bytes received",
                        [("", getattr(stats, "bytes", 0))]))
    queue = getattr(services, "queue", None)
    if queue is not None:
        samples.append(("trainguard_queue_depth", "gauge", "batches queued and not yet committed",
                        [("", queue.depth())]))
    processor = getattr(services, "processor", None)
    if processor is not None:
        pstats = processor.stats
        samples.append(("trainguard_processed_events_total", "counter", "events run through the pipeline",
                        [("", pstats.events)]))
        samples.append(("trainguard_processed_metric_points_total", "counter", "metric points stored",
                        [("", pstats.metric_points)]))
        samples.append(("trainguard_processor_undecodable_total", "counter",
                        "queue records that could not be decoded (dropped)", [("", pstats.undecodable)]))
        samples.append(("trainguard_processor_errors_total", "counter", "processing rounds that failed",
                        [("", pstats.errors)]))
        samples.append(("trainguard_processing_lag_seconds", "gauge",
                        "publish-to-processed time of the oldest record processed in the last second "
                        "(how far behind the most-behind run is)", [("", pstats.last_lag_s)]))
        samples.append(("trainguard_checkpoint_failures", "gauge",
                        "processor checkpoints failed in a row (0 once one succeeds; /readyz: 503 meanwhile)",
                        [("", getattr(processor, "checkpoint_failures", 0))]))
        samples.append(("trainguard_processor_uncommitted_bytes", "gauge",
                        "record bytes the processor holds taken and not yet committed (until the next "
                        "checkpoint); over TRAINGUARD_PROCESSOR_UNCOMMITTED_MAX_MB it checkpoints before "
                        "taking more, and takes none while that fails",
                        [("", getattr(processor, "uncommitted_bytes", 0))]))
        samples.append(("trainguard_processor_early_checkpoints_total", "counter",
                        "checkpoints tried before a round because the uncommitted records were over "
                        "TRAINGUARD_PROCESSOR_UNCOMMITTED_MAX_MB (each failed one takes no records)",
                        [("", getattr(pstats, "early_checkpoints", 0))]))
        samples.append(("trainguard_processor_rejected_records_total", "counter",
                        "run, incident and cluster records the incident store refused for good (a value "
                        "outside its types): dropped, the others written; each is logged",
                        [("", getattr(pstats, "rejected_records", 0))]))
        counters = getattr(processor, "counters", None) or {}
        samples.append(("trainguard_runs_quarantined_total", "counter",
                        "runs whose state was dropped because it could not go on (not serialisable, a "
                        "processing error): the others went on; each is logged",
                        [("", counters.get("runs_quarantined", 0))]))
        left_out = getattr(processor, "poisoned_runs", None)
        if left_out is not None and hasattr(left_out, "by_project"):
            samples.append(("trainguard_processor_runs_left_out_total", "counter",
                            "runs left out of detection because their records ended the pipeline worker "
                            "(alone, after a fresh rebuild, every time); each is logged and on /readyz",
                            [("", left_out.total)]))
            samples.append(("trainguard_processor_runs_left_out", "gauge",
                            "runs left out of detection now, by project (tried again at the first "
                            "checkpoint after TRAINGUARD_PROCESSOR_POOL_LEFT_OUT_S)",
                            [(f'{{project="{_label(p)}"}}', n)
                             for p, n in sorted(left_out.by_project().items())] or [("", 0)]))
        quota = getattr(processor, "quota_evictions", None) or {}
        samples.append(("trainguard_project_quota_evictions_total", "counter",
                        "runs or clusters a project lost because it hit a per-project quota (or held the "
                        "most when the state was full), by project and quota; never another project's",
                        [(f'{{project="{_label(p)}",quota="{_label(q)}"}}', n)
                         for (p, q), n in sorted(quota.items())] or [("", 0)]))
    return "\n".join(_lines(samples)) + "\n"
