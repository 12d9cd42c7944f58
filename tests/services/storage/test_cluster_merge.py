"""``merge_views`` (storage/cluster_merge.py), the pure merge behind ``IncidentStore.merge_clusters``, on
the views real pipelines build from a recorded job replayed over three partitions (see
test_postgres_stores.py): order-free, idempotent, and equal to one pipeline over every event."""

from __future__ import annotations

import itertools

from tests.services.storage.test_postgres_stores import assert_same_cluster, per_source_outputs, replayed_runs
from trainguard_engine.pipeline import Pipeline
from trainguard_server.storage.cluster_merge import merge_views


def test_merged_views_are_order_free_idempotent_and_equal_one_pipeline() -> None:
    events = replayed_runs()
    reference = Pipeline()
    reference.process(events)
    (want,) = reference.clusters()
    outputs = per_source_outputs(events)
    # each source: all its views joined (a later view already counts what an earlier one did)
    latest = []
    for views in outputs.values():
        seen = [clusters[0] for clusters in views]
        joined = merge_views(seen, same_source=True, max_members=100)
        assert joined == seen[-1]  # joining a source's history is its last view
        assert merge_views([seen[0], seen[-1], seen[0]], same_source=True, max_members=100) == seen[-1]
        latest.append(joined)
    results = {repr(merge_views(list(order), same_source=False, max_members=100))
               for order in itertools.permutations(latest)}
    assert len(results) == 1
    merged = merge_views(latest, same_source=False, max_members=100)
    assert_same_cluster(merged, want)
    capped = merge_views(latest, same_source=False, max_members=2)
    assert capped.count == want.count and len(capped.runs) == 2  # members capped, counts not
