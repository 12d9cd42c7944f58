"""A one-partition pipeline snapshot handed to the partitions of a queue that became partitioned.

A data directory's embedded queue turns partitioned when ``processor_workers`` or ``queue_partitions`` is set
on it (queue/sqlite.py keeps the count from then on). Its processor then keeps one pipeline per partition
(``PARTITION_PREFIX``), and the one pipeline saved before (``PARTS_PREFIX``, or the older whole
``STATE_KEY``) would be ignored: every run in flight would start again from an empty state and report its
incidents a second time. :func:`split_single_state` hands it over once, before anything is restored:

* each run to the partition of its run id (``lane_of(run_id, lanes) % partitions``: where the queue puts the
  run's records from now on), its evicted-run memory likewise;
* each cluster whole to one partition (its first run's), and the store's view of that partition seeded with
  the cluster as the snapshot holds it (``merge_clusters``): the partitions' views are summed, so the merged
  count goes on from there whichever partition meets the fingerprint next (records after the snapshot are
  delivered again and counted in their runs' partitions -- once: not also through the seed);
* the counters to partition 0 (/metrics sums the partitions);
* the offsets the snapshot covers (``OFFSETS_PREFIX``), lane by lane to each lane's partition, so records
  redelivered after it are not handed to a pipeline twice;

then, in one transaction, every partition's parts written and the one-partition keys deleted (a crash before
it: the next start does it again -- the cluster views' seeding is idempotent).
"""

from __future__ import annotations

import json
import logging
from typing import Any, Callable, Dict, List, Optional

from trainguard_engine.catalogue import DetectionSettings
from trainguard_engine.pipeline import Pipeline
from trainguard_engine.records import Cluster

from ..queue.common import lane_of
from ..storage.base import IncidentStore
from .rank_parts import RankParts

log = logging.getLogger("trainguard.processor")


def split_single_state(incidents: IncidentStore, detection: DetectionSettings, *, lanes: int,
                       partitions: int, single_prefix: str, whole_key: str, single_offsets: str,
                       prefix_of: Callable[[int], str], offsets_of: Callable[[int], str]) -> bool:
    """Hand the one-partition snapshot (parts under ``single_prefix`` or the whole one at ``whole_key``, its
    cover at ``single_offsets``) to ``partitions`` pipelines stored under ``prefix_of(p)`` (covers at
    ``offsets_of(p)``); True when there was one to hand over. An unreadable one is left as it is (logged:
    the partitions start empty, as before)."""
    keys = incidents.state_keys(single_prefix)
    stored = {key[len(single_prefix):]: incidents.load_state(key) for key in keys}
    whole = None if stored else incidents.load_state(whole_key)
    if not stored and whole is None:
        return False
    try:
        if stored:
            present = {k: v for k, v in stored.items() if v is not None}
            old = Pipeline.restore_parts(RankParts().from_store(present), detection)
        else:
            assert whole is not None
            old = Pipeline.restore(whole, detection)
        doc = json.loads(old.snapshot())
    except Exception as exc:
        log.error("the one-partition pipeline snapshot cannot be read (%s); the partitions start from an "
                  "empty state (every record stays in the stores)", exc)
        return False

    def partition_of(run_id: str) -> int:
        return lane_of(run_id, lanes) % partitions

    docs: List[Dict[str, Any]] = [{"format": doc["format"], "version": doc["version"], "runs": [],
                                   "clusters": [], "evicted": [], "counters": {}} for _ in range(partitions)]
    docs[0]["counters"] = doc.get("counters", {})
    for run in doc.get("runs", []):
        docs[partition_of(str(run.get("run_id", "")))]["runs"].append(run)
    for key, when in doc.get("evicted", []):
        docs[partition_of(str(key).partition("\x00")[2])]["evicted"].append([key, when])
    seeds: Dict[int, List[Cluster]] = {}
    for cluster in doc.get("clusters", []):
        runs = cluster.get("record", {}).get("runs") or [""]
        partition = partition_of(str(runs[0])) if runs[0] else 0
        docs[partition]["clusters"].append(cluster)
        # the partition's view is seeded with the cluster AS SNAPSHOTTED (what that partition's pipeline
        # holds), not as stored: after a crash the stored one also counts records the snapshot does not
        # cover, which come again -- in their runs' partitions, whose views are summed with this one (stop
        # 46's G6: a cluster of two runs in two partitions was counted 3 times for 2 occurrences)
        seeds.setdefault(partition, []).append(Cluster.from_dict(cluster["record"]))
    items: Dict[str, Optional[bytes]] = {key: None for key in keys}
    items[whole_key] = None
    items[single_offsets] = None
    for partition, part_doc in enumerate(docs):
        if not part_doc["runs"] and not part_doc["clusters"] and not part_doc["evicted"] and partition:
            continue
        pipeline = Pipeline.restore(json.dumps(part_doc).encode(), detection)
        prefix = prefix_of(partition)
        parts = RankParts().to_store(pipeline.changed_parts())
        items.update((prefix + name, blob) for name, blob in parts.items())
    items.update(_covers(incidents.load_state(single_offsets), lanes, partitions, offsets_of))
    for partition, clusters in sorted(seeds.items()):
        incidents.merge_clusters(f"partition/{partition}", clusters)
    incidents.save_states(items)
    log.warning("the one-partition pipeline snapshot (%d run(s), %d cluster(s)) was handed to the %d "
                "partitions of the queue, each run to its partition", len(doc.get("runs", [])),
                len(doc.get("clusters", [])), partitions)
    return True


def _covers(blob: Optional[bytes], lanes: int, partitions: int,
            offsets_of: Callable[[int], str]) -> Dict[str, Optional[bytes]]:
    """The one-partition cover split by lane into each lane's partition (embedded.OFFSETS_PREFIX's form);
    none when it is absent, unreadable or of another lane count (as embedded._load_offsets ignores it)."""
    if blob is None:
        return {}
    try:
        saved = json.loads(blob)
        if not isinstance(saved, dict) or int(saved["lanes"]) != lanes:
            return {}
        tops = [(int(lane), int(offset)) for lane, offset in saved["tops"]]
    except (ValueError, TypeError, KeyError):
        return {}
    per: Dict[int, List[List[int]]] = {}
    for lane, offset in sorted(tops):
        per.setdefault(lane % partitions, []).append([lane, offset])
    head = {k: saved[k] for k in ("lanes", "queue") if k in saved}  # the queue it was saved for goes along
    return {offsets_of(p): json.dumps({**head, "tops": mine}).encode() for p, mine in per.items()}
