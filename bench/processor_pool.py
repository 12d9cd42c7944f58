#!/usr/bin/env python3
"""Processor alone over a partitioned SQLite queue, the pipelines in the processor's thread (``--workers 0``)
or in worker processes (processor/pool.py): a multi-run stream (``--runs`` runs of bench/processor.py's
sdk16 or env500 shape, each run its own key, so its own lane and partition) is drained with the server's
processor defaults, every worker count in turn in one process, alternating, ``--repeat`` times.

    python bench/processor_pool.py --shapes env500,sdk16 --runs 8 --workers 0,1,2 --repeat 2

Per drain: events/s of wall clock and CPU us/event -- the processor process's (``time.process_time``) plus
its workers' (``/proc/<pid>/stat`` utime + stime over the drain; spawning and imports before it, waited for
with ``PipelinePool.ready``, are left out) -- and the 1-minute load average before and after (the machine is
shared: read figures against it).

``--digest``: instead, drain each shape (``--runs`` runs; 1: bench/processor.py's own stream, full length)
with every worker count over the same partitioned queue, chunks of ``round_events`` (no time bound: chunk
borders independent of the machine's speed), and print bench/processor_digest.py's digests of every store
table and of the emitted records, then whether every worker count left the same as the first:

    python bench/processor_pool.py --digest --shapes sdk16,env500 --runs 1 --workers 0,1,2
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import processor as bench  # noqa: E402  (bench/processor.py: the streams)
from processor_digest import STORE_FILES, table_digests  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")


def stream(shape: str, runs: int, steps: int) -> List[Tuple[str, List[bytes]]]:
    """``runs`` runs of ``shape``: (run id, its serialized requests)."""
    from trainguard import wire

    if runs == 1:  # bench/processor.py's own stream
        run_id, requests = bench.shape_requests(shape, False)
        return [(run_id, [wire.prepare_batch(b).request.SerializeToString() for b in requests])]
    out = []
    for r in range(runs):
        run_id = f"pool-{shape}-{r}"
        batches = (bench.sdk_requests("bench", run_id, 16, steps) if shape == "sdk16"
                   else bench.env500_requests("bench", run_id, steps))
        out.append((run_id, [wire.prepare_batch(b).request.SerializeToString() for b in batches]))
    return out


def _cpu_s(pids: Sequence[int]) -> float:
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    return total / TICKS


def drain(runs: Sequence[Tuple[str, List[bytes]]], workers: int, partitions: int, root: Path,
          digest: bool = False) -> Dict[str, Any]:
    from trainguard_engine.catalogue import DetectionSettings
    from trainguard_server.config import Settings
    from trainguard_server.processor.embedded import EmbeddedProcessor, tune_gc
    from trainguard_server.queue.sqlite import QUEUE_DB, SqliteQueue
    from trainguard_server.storage.select import open_stores

    root.mkdir(parents=True)
    records = sum(len(values) for _key, values in runs)
    queue = SqliteQueue(root / QUEUE_DB, max_depth=records + 1, partitions=partitions)
    for key, values in runs:
        queue.publish(key, values)
    settings = Settings()
    tune_gc()
    stores = open_stores(settings, root)
    processor = EmbeddedProcessor(queue, stores.events, stores.metrics, stores.incidents, DetectionSettings(),
                                  batch=settings.processor_batch, snapshot_every_s=settings.snapshot_every_s,
                                  tick_interval_s=3600.0 if digest else settings.tick_interval_s,
                                  round_target_s=0.0 if digest else settings.processor_round_target_s,
                                  processor_workers=workers)
    emitted = hashlib.sha256()

    def listener(output: Any) -> None:
        for record in (*output.runs, *output.incidents, *output.clusters):
            emitted.update(repr(record).encode())

    processor.listeners.append(listener)
    pids: List[int] = []
    if processor.pool is not None:
        processor.pool.ready()
        pids = [w.process.pid or 0 for w in processor.pool.workers]
    load0 = os.getloadavg()[0]
    cpu0, child0, t0 = time.process_time(), _cpu_s(pids), time.perf_counter()
    processor.drain(timeout=3600)
    processor.checkpoint()
    wall = time.perf_counter() - t0
    cpu, child = time.process_time() - cpu0, _cpu_s(pids) - child0
    load1 = os.getloadavg()[0]
    events = processor.stats.events
    processor.stop(drain=False)
    queue.close()
    stores.close()
    if digest:
        out = {"emitted": emitted.hexdigest()[:16], "events": str(events)}
        for name in STORE_FILES:
            if (root / name).exists():
                out.update((f"{name}:{table}", d) for table, d in table_digests(root / name).items())
        return out
    return {"events": events, "wall_s": wall, "events_per_s": events / wall, "main_us": 1e6 * cpu / events,
            "workers_us": 1e6 * child / events, "cpu_us": 1e6 * (cpu + child) / events,
            "load0": load0, "load1": load1}


def digests(args: Any, counts: Sequence[int]) -> int:
    """``--digest``: every shape drained with every worker count; 1 when one left something else."""
    root = Path(tempfile.mkdtemp(prefix="trainguard-pool-digest-"))
    differ = 0
    try:
        for shape in [s.strip() for s in args.shapes.split(",") if s.strip()]:
            steps = args.sdk16_steps if shape == "sdk16" else args.env500_requests
            runs = stream(shape, args.runs, steps)
            first: Dict[str, str] = {}
            for workers in counts:
                got = drain(runs, workers, args.partitions, root / f"{shape}-{workers}", digest=True)
                for key, value in got.items():
                    print(f"digest shape={shape} runs={args.runs} workers={workers} {key} {value}")
                first = first or got
                same = got == first
                differ += not same
                print(f"digest shape={shape} runs={args.runs} workers={workers} same_as_workers={counts[0]} "
                      f"{'yes' if same else 'NO'}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 1 if differ else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="env500,sdk16")
    p.add_argument("--runs", type=int, default=8)
    p.add_argument("--env500-requests", type=int, default=30, help="requests (500 envelopes each) per run")
    p.add_argument("--sdk16-steps", type=int, default=100, help="steps per run (16 ranks)")
    p.add_argument("--workers", default="0,1,2")
    p.add_argument("--partitions", type=int, default=16)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--digest", action="store_true", help="compare what each worker count leaves (module doc)")
    args = p.parse_args()
    counts = [int(w) for w in args.workers.split(",")]
    if args.digest:
        return digests(args, counts)
    print(f"env cpus={os.cpu_count()} python={sys.version.split()[0]} loadavg_1m={os.getloadavg()[0]:.2f} "
          f"partitions={args.partitions} runs={args.runs}", flush=True)
    root = Path(tempfile.mkdtemp(prefix="trainguard-pool-bench-"))
    try:
        for shape in [s.strip() for s in args.shapes.split(",") if s.strip()]:
            steps = args.sdk16_steps if shape == "sdk16" else args.env500_requests
            runs = stream(shape, args.runs, steps)
            for rep in range(args.repeat):
                for workers in counts:
                    f = drain(runs, workers, args.partitions, root / f"{shape}-{rep}-{workers}")
                    print(f"pool shape={shape} runs={args.runs} workers={workers} repeat={rep} "
                          f"events={f['events']} wall_s={f['wall_s']:.2f} "
                          f"events_per_s={f['events_per_s']:.0f} "
                          f"cpu_us_per_event={f['cpu_us']:.1f} main_us={f['main_us']:.1f} "
                          f"workers_us={f['workers_us']:.1f} loadavg_1m={f['load0']:.2f}-{f['load1']:.2f}",
                          flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
