"""``SqliteIncidentStore.merge_clusters``: one processor over a partitioned queue runs one pipeline per
partition, each with its own view of a cluster; the SQLite store must merge them exactly as PostgreSQL
does (the same recorded job replayed over three partitions, the views written in two orders, then again)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.services.storage.test_postgres_stores import (
    RUNS,
    assert_same_cluster,
    interleaved,
    per_source_outputs,
    replayed_runs,
)
from trainguard_engine.pipeline import Pipeline
from trainguard_server.storage.sqlite import SqliteIncidentStore


def test_partition_views_merge_to_one_pipeline_over_everything(tmp_path: Path) -> None:
    events = replayed_runs()
    reference = Pipeline()
    reference.process(events)
    (want,) = reference.clusters()
    outputs = per_source_outputs(events)
    assert want.count == 2 * RUNS and len(outputs) > 1
    docs = []
    for seed in (1, 2):
        store = SqliteIncidentStore(tmp_path / f"incidents-{seed}.db")
        try:
            for source, clusters in interleaved(outputs, seed):
                store.merge_clusters(source, clusters)
            got = store.get_cluster(want.project, want.fingerprint)
            assert got is not None
            assert_same_cluster(got, want)
            for source, views in outputs.items():  # a replay after a restore: older views, then the latest
                store.merge_clusters(source, views[0])
                store.merge_clusters(source, views[-1])
            assert store.get_cluster(want.project, want.fingerprint) == got
            docs.append(json.dumps(got.to_dict(), sort_keys=True))
            # a plain upsert (one processor, one partition) replaces the record and forgets the views
            store.upsert_clusters([want])
            assert store.get_cluster(want.project, want.fingerprint) == want
        finally:
            store.close()
    assert docs[0] == docs[1]
