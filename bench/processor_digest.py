#!/usr/bin/env python3
"""Digest of what the processor writes: drain a shape (bench/processor.py's streams) into a fresh data
directory with the server's processor, then print the sha256 of every table of every SQLite store (rows in
primary-key order; the queue's file left out: its rows carry publish times) and of the records the processor
emitted to its listeners (``repr`` of each output's runs, incidents and clusters, in emission order).

Two checkouts give the same lines when their processors leave identical stores and emit identical records:

    python bench/processor_digest.py --shapes sdk16,env500          # this checkout
    PYTHONPATH=<other>/sdk/src:<other>/engine/src:<other>/services/src python bench/processor_digest.py

The processor runs with the server's defaults except ``round_target_s=0`` (``--round-target-s``): chunks of
``round_events`` envelopes, not sized by the measured rate -- the time bound makes chunk borders (and so the
emission order of records within a drain) depend on the machine's speed, the tables do not.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import shutil
import sqlite3
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import processor as bench  # noqa: E402  (bench/processor.py: the streams)

STORE_FILES = ("events.db", "metrics.db", "incidents.db", "projects.db")
WALL_CLOCK = frozenset({"updated_ns"})
"""Columns left out of the digests: when a row was written (the state table's), not what it holds."""
BOOKKEEPING = frozenset({"store_syncs"})
"""Tables left out: storage/sqlite.py's SYNC_TABLE (how many checkpoint syncs a store had, not data)."""
QUEUE_ID = re.compile(rb'"queue": "[0-9a-f]+"')
"""The queue file's random id inside a saved offsets cover (processor/embedded.py OFFSETS_PREFIX): a fresh
queue file has a new one each drain, so it is masked (else two drains of the same stream never digest
alike)."""


def _masked(row: Any) -> Any:
    return tuple(QUEUE_ID.sub(b'"queue": "-"', v) if isinstance(v, bytes) else
                 QUEUE_ID.sub(b'"queue": "-"', v.encode()).decode() if isinstance(v, str) else v for v in row)


def table_digests(path: Path) -> Dict[str, str]:
    """``{table: sha256}`` of every table of one SQLite file (FTS shadow tables included; the columns of
    :data:`WALL_CLOCK` left out, the queue id masked: :data:`QUEUE_ID`), rows ordered by every column (a
    total order that needs no knowledge of the keys)."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' "
                                             "ORDER BY name") if r[0] not in BOOKKEEPING]
        out = {}
        for table in tables:
            cols = [r[1] for r in conn.execute(f'PRAGMA table_info("{table}")') if r[1] not in WALL_CLOCK]
            order = ", ".join(f'"{c}"' for c in cols)
            h = hashlib.sha256()
            n = 0
            for row in conn.execute(f'SELECT {order} FROM "{table}" ORDER BY {order}'):
                h.update(repr(_masked(row)).encode())
                n += 1
            out[table] = f"{h.hexdigest()[:16]} rows={n}"
        return out
    finally:
        conn.close()


def drain(shape: str, root: Path, round_target_s: float) -> Dict[str, str]:
    from trainguard import wire
    from trainguard_engine.catalogue import DetectionSettings
    from trainguard_server.config import Settings
    from trainguard_server.processor.embedded import EmbeddedProcessor
    from trainguard_server.queue.sqlite import QUEUE_DB, SqliteQueue
    from trainguard_server.storage.select import open_stores

    data_dir = root / shape
    data_dir.mkdir(parents=True)
    run_id, requests = bench.shape_requests(shape, False)
    values = [wire.prepare_batch(batch).request.SerializeToString() for batch in requests]
    queue = SqliteQueue(data_dir / QUEUE_DB, max_depth=len(values) + 1)
    for i in range(0, len(values), 1000):
        queue.publish(run_id, values[i:i + 1000])
    settings = Settings()
    stores = open_stores(settings, data_dir)
    processor = EmbeddedProcessor(queue, stores.events, stores.metrics, stores.incidents, DetectionSettings(),
                                  batch=settings.processor_batch, snapshot_every_s=settings.snapshot_every_s,
                                  tick_interval_s=3600.0, round_target_s=round_target_s)
    emitted = hashlib.sha256()
    count: List[int] = [0]

    def listener(output: Any) -> None:
        for record in (*output.runs, *output.incidents, *output.clusters):
            emitted.update(repr(record).encode())
            count[0] += 1

    processor.listeners.append(listener)
    processor.drain(timeout=3600)
    processor.checkpoint()
    left = queue.consume(10, 0.0)
    queue.close()
    stores.close()
    out = {"emitted": f"{emitted.hexdigest()[:16]} records={count[0]}",
           "processed": f"events={processor.stats.events} records={processor.stats.records} left={len(left)}"}
    for name in STORE_FILES:
        if (data_dir / name).exists():
            for table, digest in table_digests(data_dir / name).items():
                out[f"{name}:{table}"] = digest
    return out


def engine_native() -> int:
    """1 when this process runs the engine's compiled build (trainguard_engine/_native.py), else 0 (a pure
    run, or a checkout without the build)."""
    import trainguard_engine.pipeline  # noqa: F401  (the package decides when it is imported)

    native = sys.modules.get("trainguard_engine._native")
    return int(bool(native is not None and native.compiled_modules().get("pipeline")))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="sdk16,env500")
    p.add_argument("--round-target-s", type=float, default=0.0)
    p.add_argument("--keep", type=Path,
                   help="drain into this (new) folder and keep it (to diff two checkouts' stores)")
    args = p.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="trainguard-processor-digest-"))
    # on stderr: the digest lines of a compiled and a pure run compare as they are
    print(f"engine_native={engine_native()}", file=sys.stderr, flush=True)
    try:
        for shape in [s.strip() for s in args.shapes.split(",") if s.strip()]:
            for key, value in drain(shape, root, args.round_target_s).items():
                print(f"{shape} {key} {value}", flush=True)
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
