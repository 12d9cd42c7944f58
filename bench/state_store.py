#!/usr/bin/env python3
"""The processor's writes to the transactional state store: SQLite (the embedded default) beside
PostgreSQL (``TRAINGUARD_STATE_STORE=postgres``), in one run (issue 20).

The workload is what the embedded processor writes per batch: the real pipeline is run over the recorded
scenario corpus (every CPU scenario, replayed ``--copies`` times under new run ids, events in time order,
``--batch`` events per call) and each call's output -- changed runs, incidents and clusters, and the
pipeline's changed snapshot parts -- is recorded. Those writes are then replayed into

- ``sqlite``: ``SqliteIncidentStore`` (synchronous=FULL, as shipped);
- ``postgres``: ``PostgresIncidentStore`` on a real PostgreSQL (Debian's, started here on loopback with
  ``fsync=on``, ``synchronous_commit=on``: durable like SQLite FULL), clusters by ``merge_clusters``;
- ``postgres x2``: two stores (two pools, as two processors), each writing half of the batches (its
  partitions' runs) at once.

Printed: batches/s, records/s and ms per batch, and the ratio of each to SQLite. Nothing is asserted.

    python bench/state_store.py              # ~1 minute
    python bench/state_store.py --copies 2   # smoke
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path
from typing import Any, Dict, List, Optional

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
for _p in (REPO, REPO / "sdk" / "src", REPO / "engine" / "src", REPO / "services" / "src"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from tests.scenarios.corpus import SCENARIOS  # noqa: E402
from tests.support.postgres import PostgresServer  # noqa: E402
from trainguard_engine.pipeline import Pipeline, PipelineOutput  # noqa: E402
from trainguard_server.storage.base import IncidentStore  # noqa: E402
from trainguard_server.storage.postgres import PostgresIncidentStore  # noqa: E402
from trainguard_server.storage.sqlite import SqliteIncidentStore  # noqa: E402

Batch = Dict[str, Any]


def workload(copies: int, batch: int) -> List[Batch]:
    """Each pipeline call's writes: {"output", "parts", "source"} (source: the run's partition of 2)."""
    events: List[Dict[str, Any]] = []
    for scenario in SCENARIOS:
        if scenario.source != "cpu":
            continue
        recorded = scenario.events()
        for i in range(copies):
            for e in recorded:
                copy = dict(e)
                copy["run_id"] = f"{e['run_id']}-c{i}"
                copy["event_id"] = f"{e['event_id']}-c{i}"
                events.append(copy)
    events.sort(key=lambda e: int(e.get("time_unix_nano") or 0))
    pipelines = {0: Pipeline(), 1: Pipeline()}  # one per partition, runs hashed to one of two
    out: List[Batch] = []
    by_part: Dict[int, List[Dict[str, Any]]] = {0: [], 1: []}
    for e in events:
        by_part[zlib.crc32(e["run_id"].encode()) % 2].append(e)
    for part, mine in by_part.items():
        pipeline = pipelines[part]
        for start in range(0, len(mine), batch):
            output: PipelineOutput = pipeline.process(mine[start:start + batch])
            parts = {f"pipeline/p{part}/{k}": v for k, v in pipeline.changed_parts().items()}
            pipeline.parts_saved()
            out.append({"output": output, "parts": parts, "source": f"p{part}"})
    return out


def apply(store: IncidentStore, batches: List[Batch], merge: bool) -> None:
    for b in batches:
        output: PipelineOutput = b["output"]
        if output.runs:
            store.upsert_runs(output.runs)
        if output.incidents:
            store.upsert_incidents(output.incidents)
        if output.clusters:
            if merge:
                store.merge_clusters(b["source"], output.clusters)
            else:
                store.upsert_clusters(output.clusters)
        store.save_states(b["parts"])


def records(batches: List[Batch]) -> int:
    return sum(len(b["output"].runs) + len(b["output"].incidents) + len(b["output"].clusters) +
               len(b["parts"]) for b in batches)


def timed(label: str, fn: Any, batches: List[Batch], base: Optional[float]) -> float:
    start = time.perf_counter()
    fn()
    wall = time.perf_counter() - start
    rate = len(batches) / wall
    ratio = f"  x{rate / base:.2f} of sqlite" if base else ""
    print(f"{label:14s} {rate:8.0f} batches/s  {records(batches) / wall:9.0f} records/s  "
          f"{1000 * wall / len(batches):6.2f} ms/batch{ratio}")
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--copies", type=int, default=6, help="times each CPU scenario is replayed")
    parser.add_argument("--batch", type=int, default=200, help="events per pipeline call")
    args = parser.parse_args()
    batches = workload(args.copies, args.batch)
    size = sum(len(v or b"") for b in batches for v in b["parts"].values())
    print(f"workload: {len(batches)} batches, {records(batches)} records "
          f"({size / 1e6:.1f} MB of snapshot parts), from {args.copies} copies of the CPU scenarios")
    server = PostgresServer(settings=["fsync=on", "synchronous_commit=on", "full_page_writes=on"]).start()
    try:
        dsn = server.create_database("bench")
        with tempfile.TemporaryDirectory() as tmp:
            sqlite = SqliteIncidentStore(Path(tmp) / "incidents.db")
            base = timed("sqlite", lambda: apply(sqlite, batches, merge=False), batches, None)
            sqlite.close()
        pg = PostgresIncidentStore(dsn, schema="one")
        timed("postgres", lambda: apply(pg, batches, merge=True), batches, base)
        pg.close()
        stores = {src: PostgresIncidentStore(dsn, schema="two") for src in ("p0", "p1")}

        def both() -> None:
            threads = [threading.Thread(target=apply, args=(store, [b for b in batches if b["source"] == src],
                                                            True)) for src, store in stores.items()]
            for t in threads:
                t.start()
            for t in threads:
                t.join()

        timed("postgres x2", both, batches, base)
        for store in stores.values():
            store.close()
    finally:
        server.stop()


if __name__ == "__main__":
    main()
