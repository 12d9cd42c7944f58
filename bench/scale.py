#!/usr/bin/env python3
"""Scale-out (issue 20): 1, 2 and 3 embedded processors in one Kafka consumer group, the Flink job at
parallelism 1 and 2 beside one embedded processor on the same stream, and a 4,096-rank run's checkpoint
(the run in one part, and below the run in rank parts).

**Group drain.** A Tansu broker (the tests' Kafka-protocol broker, memory storage) is started; for each N
in ``--processors`` (default 1,2,3) a fresh topic of 12 partitions (and a fresh consumer group) gets a
backlog of SDK-shaped records of many runs (default 48 runs x 16 ranks x 100 steps, bench/processor.py's
``sdk_requests``: one record per rank and step, key = run id, so runs spread over the partitions). Then
N worker processes (this script with ``--worker``, each a separate OS process with its own KafkaQueue,
its own SQLite stores in its own data directory, an ``EmbeddedProcessor`` built as ``trainguard serve``
builds it: server default settings, ``tune_gc``, the dead-letter validator) subscribe together and drain
it. Each worker notes when it first got a record and when it last committed (it checkpoints -- saves
its partitions' pipelines and commits their offsets -- as soon as a round finds nothing new); the parent
watches the group's lag (end offsets of its own acknowledged publishes minus the group's committed
offsets) until it is 0. Reported per N: total events/s = all events / (last commit - first consume over
all workers), each worker's events/s over its own first-record-to-last-commit span, the ratio to N=1,
CPU seconds of the workers and of the broker during the drain, events per worker CPU second (what one
core gives when it is free: the figure a loaded machine disturbs least), and how often a worker's
partitions changed (rebalances after the first assignment). Runs are not spread evenly by their keys
over 12 partitions: ``balance_bound`` = all events / the busiest processor's events is the most the
ratio can be with that split, however many cores.

**Checkpoint of a 4,096-rank run.** One processor over Kafka, one 4,096-rank run (bench/processor.py's
``sdk4096`` shape, kept live: no EXIT), no periodic snapshot; after step 2 (the ``sdk4096`` shape) and
step 20 (``--checkpoint-steps``), and one step after each, the time of ``processor.checkpoint()`` (the
changed parts of the run's partition's pipeline saved in one transaction, offsets committed) and the
parts and bytes it saved; last, the next step of 1/16 of the ranks only (``changed_ranks``). Three times in
one process (``--checkpoint-modes``): ``mode=whole`` (the run one part, every rank encoded at each
checkpoint, as before processor/rank_parts.py), ``mode=rank_parts_full`` (stop 28: a run above 1 MiB as a
head and rank parts of 128 ranks, only changed ones written, but every rank encoded and the 28 MB part
scanned) and ``mode=rank_parts`` (the processor's default now: the pipeline encodes only the ranks touched
since the run's last encode and hands rank_parts each rank's bytes); ``largest_stored_bytes`` is the
biggest value under one state key; ``checkpoint_split`` lines are the ratios of each mode to whole.

**Flink.** ``--flink-runs`` runs of the backlog (default all 48, as the group drain: runs hash onto slots as
onto partitions, and a uniform hash splits 16 runs 10/6 or worse over 2 slots with probability ~0.45 --
stop 32 measured 9/7 and 10/6 -- where 48 runs measured 25/23) through the Flink job
(processor/flink_main.py ``--records``: a local mini-cluster of .venv-flink, bounded source read by a
reader per slot, file sink) at each ``--flink-parallelism`` (1,2), and through one embedded processor over
Kafka (one process, one core). The job's stream is in ``--flink-order``: ``live`` (default: the runs'
records in turn, as concurrent jobs send them) or ``backlog`` (run after run: a job keyed by run then has
one run, so one slot, busy at a time -- what stop 31 measured; :func:`flink_stream`).
``events_per_s`` = the stream's events / the job's busy span: from the first record any run-stage
subtask took to the last record or timer any of them finished (each subtask writes its span when it
closes: flink_job.SPANS_ENV) -- the embedded processor's figure is likewise from its first record to its
last commit, so neither counts its process's start-up; ``events_per_s_per_slot`` = that / parallelism;
``slot_vs_embedded_core`` is the issue's ratio (target >= 0.5). Also printed, as before: a one-run,
two-step stream is run at each parallelism and subtracted (the mini-cluster's start-up, 10-30 s here)
for ``marginal_events_per_s`` -- on a loaded machine the difference of two noisy walls of ~30 s each is
mostly noise -- and ``events_per_cpu_s``, the marginal events per CPU second of the job's whole process
tree (JVM + Python workers, sampled from /proc), against the embedded processor's events per CPU second.
``flink_busy`` lines: the records each run-stage subtask took (``balance_bound`` = all records / the
busiest subtask's: runs hash onto slots as onto partitions), and each process's CPU seconds inside the busy
span (the JVM, each Python worker -- one per slot --, the rest) with ``cores_used`` (their sum / the span)
and ``events_per_busy_cpu_s``: where the cores went, and whether two slots kept two cores busy.

On a 2-core machine N processors cannot go beyond ~2x one processor -- less, since the broker and the
publisher share the same cores: the script prints ``os.cpu_count()`` and the load average beside every
figure; parallelism 2 of the Flink job likewise.

    python bench/scale.py            # ~10 minutes (Flink ~5 of them)
    python bench/scale.py --quick    # a smoke run (~30 s; no Flink part)

Nothing is asserted; numbers and ratios are printed, the last line is the figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
for _p in (BENCH, REPO, REPO / "sdk" / "src", REPO / "engine" / "src", REPO / "services" / "src"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

PARTITIONS = 12
SESSION_TIMEOUT_MS = 6000  # Tansu answers a JoinGroup after ~half of it: every worker joins the same round
# Tansu answers a Fetch only after fetch.wait.max.ms even when records are there (Kafka answers at once)
CONSUMER_CONFIG: Dict[str, Any] = {"fetch.wait.max.ms": 10}
DRAIN_TIMEOUT_S = 600.0
FLINK_TIMEOUT_S = 600.0  # a Flink job still running after this is killed and reported as failed


def _loadavg() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f}/{five:.2f}/{fifteen:.2f}"


def _proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------------------------------ streams

def backlog(runs: int, ranks: int, steps: int) -> Tuple[List[Tuple[str, List[bytes]]], int]:
    """``runs`` SDK-shaped runs as serialized IngestRequest records per run id, and their event count."""
    from processor import sdk_requests  # bench/processor.py

    from trainguard import wire

    out: List[Tuple[str, List[bytes]]] = []
    events = 0
    for r in range(runs):
        run_id = f"scale-{r:03d}-{uuid.uuid4().hex[:6]}"
        values = []
        for batch in sdk_requests("bench", run_id, ranks, steps):
            request = wire.prepare_batch(batch).request
            events += len(request.events)
            values.append(request.SerializeToString())
        out.append((run_id, values))
    return out, events


def publisher(bootstrap: str, topic: str) -> Any:
    """A publish-only KafkaQueue on ``topic`` (created with 12 partitions) reading ``topic``'s group lag."""
    from trainguard_server.queue.kafka import KafkaQueue

    return KafkaQueue(bootstrap, topic, group_id=topic, partitions=PARTITIONS, consume=False,
                      max_depth=10**9, delivery_timeout_s=60.0)


# ------------------------------------------------------------------------------------------- worker

def worker(bootstrap: str, topic: str, data_dir: Path, control: Path, index: int) -> int:
    """One processor of the group: wait for ``control/go``, subscribe, process until ``control/stop``,
    then write ``control/result-<index>.json``."""
    from trainguard_engine.catalogue import DetectionSettings
    from trainguard_server.config import Settings
    from trainguard_server.processor.embedded import EmbeddedProcessor, tune_gc
    from trainguard_server.queue.kafka import KafkaQueue, ingest_request_problem
    from trainguard_server.storage.select import open_stores

    settings = Settings()
    tune_gc()
    stores = open_stores(settings, data_dir)
    (control / f"ready-{index}").touch()
    go, stop = control / "go", control / "stop"
    while not go.exists():
        time.sleep(0.005)
    queue = KafkaQueue(bootstrap, topic, group_id=topic, partitions=PARTITIONS,
                       validate=ingest_request_problem, session_timeout_ms=SESSION_TIMEOUT_MS,
                       consumer_config=dict(CONSUMER_CONFIG))
    processor = EmbeddedProcessor(queue, stores.events, stores.metrics, stores.incidents, DetectionSettings(),
                                  batch=settings.processor_batch, snapshot_every_s=settings.snapshot_every_s,
                                  tick_interval_s=settings.tick_interval_s)
    first = last_work = last_commit = 0.0
    cpu_first = cpu_end = 0.0
    owned: Tuple[int, ...] = ()
    changes = -1  # the first assignment is not a rebalance
    while not stop.exists():
        started, cpu = time.time(), time.process_time()
        n = processor.run_once(timeout=0.05)
        now = tuple(sorted(processor.pipelines))
        if now != owned:
            owned, changes = now, changes + 1
        if n:
            if not first:
                first, cpu_first = started, cpu
            last_work = time.time()
        elif last_work > last_commit:  # idle: save what is owned and commit it now
            processor.checkpoint()
            last_commit, cpu_end = time.time(), time.process_time()
    result = {"index": index, "first": first, "last_commit": last_commit, "events": processor.stats.events,
              "records": processor.stats.records, "cpu_s": cpu_end - cpu_first, "partitions": list(owned),
              "rebalances": max(0, changes), "snapshots": processor.stats.snapshots,
              "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0}
    queue.close()
    stores.close()
    (control / f"result-{index}.json").write_text(json.dumps(result))
    return 0


# ------------------------------------------------------------------------------------------ parent

def drain_group(bootstrap: str, broker_pid: int, n: int, runs: Sequence[Tuple[str, List[bytes]]],
                events: int, root: Path) -> Dict[str, Any]:
    """Publish ``runs`` to a fresh topic, drain it with ``n`` worker processes in one group; the figures."""
    topic = f"scale-n{n}-{uuid.uuid4().hex[:8]}"
    control = root / f"n{n}-{topic[-8:]}"
    control.mkdir()
    pub = publisher(bootstrap, topic)
    records = 0
    for run_id, values in runs:
        pub.publish(run_id, values)
        records += len(values)
    procs = []
    try:
        for i in range(n):
            cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--bootstrap", bootstrap,
                   "--topic", topic, "--data-dir", str(control / f"data-{i}"), "--control", str(control),
                   "--index", str(i)]
            with open(control / f"w{i}.log", "w") as log:
                procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log))
        deadline = time.monotonic() + 120
        while not all((control / f"ready-{i}").exists() for i in range(n)):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError(f"workers did not start: {(control / 'w0.log').read_text()[-2000:]}")
            time.sleep(0.02)
        broker_cpu0 = _proc_cpu_s(broker_pid)
        (control / "go").touch()
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while pub.depth() > 0:
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError(f"the group did not drain {topic} (lag {pub.depth()}): "
                                   f"{(control / 'w0.log').read_text()[-2000:]}")
            time.sleep(0.1)
        broker_cpu = _proc_cpu_s(broker_pid) - broker_cpu0
        load = _loadavg()
        (control / "stop").touch()
        for p in procs:
            p.wait(60)
        results = [json.loads((control / f"result-{i}.json").read_text()) for i in range(n)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        pub.close()
    working = [r for r in results if r["events"]]
    wall = max(r["last_commit"] for r in working) - min(r["first"] for r in working)
    processed = sum(r["events"] for r in results)
    return {"processors": n, "events": events, "events_processed": processed, "records": records,
            "records_processed": sum(r["records"] for r in results), "wall_s": wall,
            "events_per_s": processed / wall,
            "events_per_worker_cpu_s": processed / max(1e-9, sum(r["cpu_s"] for r in results)),
            "per_processor_events_per_s": [
                r["events"] / (r["last_commit"] - r["first"]) if r["events"] else 0.0 for r in results],
            "partitions": [len(r["partitions"]) for r in results],
            "events_per_processor": [r["events"] for r in results],
            # what the partitions' share of the runs allows: the busiest processor's events bound the wall
            "balance_bound": processed / max(1, max(r["events"] for r in results)),
            "worker_cpu_s": [r["cpu_s"] for r in results], "broker_cpu_s": broker_cpu,
            "rebalances": sum(r["rebalances"] for r in results),
            "start_skew_s": max(r["first"] for r in working) - min(r["first"] for r in working),
            "end_skew_s": max(r["last_commit"] for r in working) - min(r["last_commit"] for r in working),
            "peak_rss_mb": max(r["peak_rss_mb"] for r in results), "loadavg": load}


def checkpoint_figures(bootstrap: str, ranks: int, stops: Sequence[int], root: Path,
                       mode: str = "rank_parts", split_above: Optional[int] = None) -> List[Dict[str, Any]]:
    """One processor, one ``ranks``-rank run (no EXIT: it stays live): after the run's start and each step
    in ``stops`` a timed ``checkpoint()`` with the parts and bytes it saved (the first saves everything),
    and one more step later another (what one step changed); last, the next step of 1/16 of the ranks
    only (``changed_ranks``: what a checkpoint writes when most ranks were quiet). Each stop is a line of
    figures. ``mode``: ``rank_parts`` (the processor's default: a big run in rank parts,
    processor/rank_parts.py; ``split_above``: its threshold, default the processor's; the pipeline encodes
    only the ranks touched since the run's last encode), ``rank_parts_full`` (the same, every rank encoded
    at each checkpoint and the part scanned into rank parts, as at stop 28) or ``whole`` (the run in one
    part, every rank encoded, as before the split)."""
    from processor import sdk_requests  # bench/processor.py

    from trainguard import wire
    from trainguard_engine import pipeline as pipeline_mod
    from trainguard_engine.catalogue import DetectionSettings
    from trainguard_server.config import Settings
    from trainguard_server.processor import rank_parts
    from trainguard_server.processor.embedded import PARTITION_PREFIX, EmbeddedProcessor, tune_gc
    from trainguard_server.queue.kafka import KafkaQueue
    from trainguard_server.storage.select import open_stores

    tune_gc()
    run_id = f"scale-ckpt-{uuid.uuid4().hex[:6]}"
    last = max(stops) + 2
    requests = list(sdk_requests("bench", run_id, ranks, last))[:-ranks]  # no EXIT: the run stays live
    values = [wire.prepare_batch(batch).request.SerializeToString() for batch in requests]
    # records [0, ranks) are the starts, then step k's are [k * ranks, (k + 1) * ranks)
    marks = sorted({s for s in stops} | {s + 1 for s in stops})
    partial = max(1, ranks // 16)
    topic = f"scale-ckpt-{uuid.uuid4().hex[:8]}"
    pub = publisher(bootstrap, topic)
    settings = Settings()
    stores = open_stores(settings, root / f"ckpt-{mode}")
    default_split = rank_parts.SPLIT_ABOVE_BYTES
    touched_only = pipeline_mod.Pipeline._encode_run
    if mode in ("whole", "rank_parts_full"):  # every rank encoded afresh into plain bytes (stop 28's code)
        def encode_all(self: Any, key: str, run: Any) -> bytes:
            return pipeline_mod._json_bytes({"seq": self._run_seq.get(key, 0), "run": run.to_json()})
        setattr(pipeline_mod.Pipeline, "_encode_run", encode_all)
    if mode == "whole":
        rank_parts.SPLIT_ABOVE_BYTES = 1 << 62  # read when the processor makes a partition's RankParts
    elif split_above is not None:
        rank_parts.SPLIT_ABOVE_BYTES = split_above
    queue = KafkaQueue(bootstrap, topic, group_id=topic, partitions=PARTITIONS,
                       session_timeout_ms=SESSION_TIMEOUT_MS, consumer_config=dict(CONSUMER_CONFIG))
    processor = EmbeddedProcessor(queue, stores.events, stores.metrics, stores.incidents, DetectionSettings(),
                                  batch=settings.processor_batch, snapshot_every_s=1e9,  # only ours
                                  tick_interval_s=settings.tick_interval_s)
    saved: List[Tuple[int, int, int]] = []  # (parts, bytes, largest part's bytes) per save_states call
    original = stores.incidents.save_states

    def counting(items: Dict[str, Optional[bytes]]) -> None:
        sizes = [len(v) for v in items.values() if v is not None]
        saved.append((len(items), sum(sizes), max(sizes, default=0)))
        original(items)
    setattr(stores.incidents, "save_states", counting)
    out: List[Dict[str, Any]] = []
    try:
        if not queue.wait_ready(60):
            raise RuntimeError("the checkpoint processor got no partition")
        processor.checkpoint()  # the empty pipelines of the 12 partitions: saved once, not part of a figure
        done = 0
        for step, changed in [(m, ranks) for m in marks] + [(marks[-1] + 1, partial)]:
            end = step * ranks + changed if changed < ranks else (step + 1) * ranks
            batch = values[done:end]
            done += len(batch)
            pub.publish(run_id, batch)
            target = processor.stats.records + len(batch)
            deadline = time.monotonic() + DRAIN_TIMEOUT_S
            t0 = time.perf_counter()
            while processor.stats.records < target:
                if time.monotonic() > deadline:
                    raise RuntimeError("the checkpoint run was not processed in time")
                processor.run_once(timeout=0.1)
            processed_s = time.perf_counter() - t0
            saved.clear()
            t0 = time.perf_counter()
            processor.checkpoint()
            took = time.perf_counter() - t0
            keys = stores.incidents.state_keys(PARTITION_PREFIX)
            out.append({"ranks": ranks, "after_step": step, "changed_ranks": changed, "mode": mode,
                        "records": len(batch), "process_s": processed_s,
                        "checkpoint_s": took, "parts": sum(p for p, _, _ in saved),
                        "bytes": sum(b for _, b, _ in saved),
                        "largest_part_bytes": max(m for _, _, m in saved),
                        "run_parts_stored": sum(1 for k in keys if "/run/" in k),
                        "rank_parts_stored": sum(1 for k in keys if f"/{rank_parts.RANK_PART_PREFIX}" in k),
                        "largest_stored_bytes": max(len(stores.incidents.load_state(k) or b"") for k in keys),
                        "loadavg": _loadavg()})
    finally:
        rank_parts.SPLIT_ABOVE_BYTES = default_split
        setattr(pipeline_mod.Pipeline, "_encode_run", touched_only)
        queue.close()
        pub.close()
        stores.close()
    return out


# ------------------------------------------------------------------------------------------- Flink

def _process_kind(pid: int) -> str:
    """``jvm``, ``python-worker`` (a PyFlink worker: one per slot), ``client`` or ``other``."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "other"
    if argv and argv[0].endswith(b"java"):
        return "jvm"
    if b"pyflink.fn_execution.beam.beam_boot" in argv:
        return "python-worker"
    if b"trainguard_server.processor.flink_main" in argv:
        return "client"
    return "other"


def _tree_cpu(root_pid: int, seen: Dict[int, float],
              samples: Optional[List[Tuple[float, Dict[int, float]]]] = None) -> None:
    """Note the CPU seconds so far of ``root_pid`` and every process below it (Linux /proc) in ``seen``;
    with ``samples``, append (wall-clock time, CPU seconds per process) too."""
    parents: Dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    tree, frontier = {root_pid}, [root_pid]
    while frontier:
        pid = frontier.pop()
        for child, parent in parents.items():
            if parent == pid and child not in tree:
                tree.add(child)
                frontier.append(child)
    now: Dict[int, float] = {}
    for pid in tree:
        try:
            now[pid] = seen[pid] = max(seen.get(pid, 0.0), _proc_cpu_s(pid))
        except (OSError, IndexError, ValueError):
            continue
    if samples is not None:
        samples.append((time.time(), now))


def busy_cpu(samples: Sequence[Tuple[float, Dict[int, float]]], kinds: Dict[int, str], start: float,
             end: float) -> Dict[str, Any]:
    """CPU seconds each process of the job used between the samples nearest ``start`` and ``end`` (its busy
    span): ``jvm``, ``python_workers`` (busiest first), ``other``, ``cores`` (all of them / the samples'
    span) and ``window_s``."""
    first = min(samples, key=lambda x: abs(x[0] - start))
    last = min(samples, key=lambda x: abs(x[0] - end))
    window = max(1e-9, last[0] - first[0])
    used = {pid: cpu - first[1].get(pid, 0.0) for pid, cpu in last[1].items()}
    workers = sorted((c for pid, c in used.items() if kinds.get(pid) == "python-worker"), reverse=True)
    jvm = sum(c for pid, c in used.items() if kinds.get(pid) == "jvm")
    other = sum(used.values()) - jvm - sum(workers)
    return {"window_s": window, "jvm": jvm, "python_workers": workers, "other": other,
            "cores": sum(used.values()) / window}


def _last_error(log: str) -> str:
    lines = [line.strip() for line in log.splitlines() if "Error" in line or "Exception" in line]
    return lines[-1][:300] if lines else "none in its log"


def flink_job(python: Path, values: Sequence[bytes], parallelism: int, root: Path) -> Dict[str, Any]:
    """The Flink job (processor/flink_main.py ``--records``: a local mini-cluster, bounded input, results
    to files) over ``values`` at ``parallelism``: ``wall`` seconds, ``cpu`` seconds of the job's process
    tree (the JVM and its Python workers, sampled every 0.2 s), ``busy`` seconds (from the first record any
    run-stage subtask took to the last record or timer any finished, as they wrote them to ``SPANS_ENV``'s
    file), ``subtask_records`` (records each run-stage subtask took, most first) and ``busy_cpu`` (each
    process's CPU seconds in the busy span: :func:`busy_cpu`)."""
    from trainguard_server.processor.flink_main import write_records

    tag = uuid.uuid4().hex[:8]
    path = root / f"flink-{tag}.bin"
    spans = root / f"flink-spans-{tag}.jsonl"
    write_records(path, values)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO / "sdk" / "src"), str(REPO / "engine" / "src"), str(REPO / "services" / "src")]),
        TRAINGUARD_FLINK_SPANS=str(spans))  # flink_job.SPANS_ENV (PyFlink is not importable here)
    seen: Dict[int, float] = {}
    samples: List[Tuple[float, Dict[int, float]]] = []
    kinds: Dict[int, str] = {}
    with open(root / f"flink-{tag}.log", "w") as log:
        started = time.monotonic()
        proc = subprocess.Popen([str(python), "-m", "trainguard_server.processor.flink_main", "--records",
                                 str(path), "--out", str(root / f"flink-out-{tag}"), "--parallelism",
                                 str(parallelism)], env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        killed = False
        while proc.poll() is None:
            _tree_cpu(proc.pid, seen, samples)
            for pid in samples[-1][1]:
                kinds[pid] = kinds.get(pid) or _process_kind(pid)
            time.sleep(0.2)
            if time.monotonic() - started > FLINK_TIMEOUT_S:
                os.killpg(proc.pid, 9)  # its whole session: the JVM and its Python workers too
                killed = True
        wall = time.monotonic() - started
    if killed:
        raise RuntimeError(f"the Flink job did not end within {FLINK_TIMEOUT_S:.0f} s (killed); its last "
                           f"Error/Exception line: "
                           f"{_last_error((root / f'flink-{tag}.log').read_text())}")
    if proc.returncode != 0:
        raise RuntimeError(f"the Flink job failed: {(root / f'flink-{tag}.log').read_text()[-3000:]}")
    out = list((root / f"flink-out-{tag}").rglob("*.jsonl"))
    if not any(f.stat().st_size for f in out):
        raise RuntimeError("the Flink job wrote no results")
    busy = [json.loads(line) for line in spans.read_text().splitlines()] if spans.exists() else []
    if sum(b["records"] for b in busy) != len(values):
        raise RuntimeError(f"the run stage's subtasks reported {busy}, not {len(values)} records")
    start, end = min(b["first_ns"] for b in busy) / 1e9, max(b["last_ns"] for b in busy) / 1e9
    return {"wall": wall, "cpu": sum(seen.values()), "busy": end - start,
            "subtask_records": sorted((b["records"] for b in busy), reverse=True),
            "busy_cpu": busy_cpu(samples, kinds, start, end)}


FLINK_ORDERS = ("live", "backlog")


def flink_stream(runs: Sequence[Tuple[str, List[bytes]]], order: str) -> List[bytes]:
    """The Flink job's input: ``live`` -- the runs' records in turn (every run's first record, then every
    run's second, ...), each run's in its order, as the records of concurrent jobs reach the gateway -- or
    ``backlog``: run after run (every record of the first run, then of the second, ...), as one file of a
    drained topic would hold them. A job keyed by run can give a run to one slot only: on a backlog a
    bounded reader meets one run, so one slot, at a time (issue 20, stop 32: at parallelism 2 the two
    run-stage subtasks took turns, each idle while the other worked)."""
    if order == "backlog":
        return [v for _, vs in runs for v in vs]
    longest = max((len(vs) for _, vs in runs), default=0)
    return [vs[i] for i in range(longest) for _, vs in runs if i < len(vs)]


def flink_figures(bootstrap: str, broker_pid: int, runs: Sequence[Tuple[str, List[bytes]]], ranks: int,
                  root: Path, parallelisms: Sequence[int], order: str = "live") -> Optional[Dict[str, Any]]:
    """The Flink job at each of ``parallelisms`` on ``runs`` (SDK-shaped records, the same as the group
    drain's), beside one embedded processor over Kafka draining the same records (one process: one core).
    Start-up is taken out: each parallelism also runs a one-run, two-step stream, and the figures are
    marginal -- (events of the stream - events of the small one) / (difference of wall, or of CPU)."""
    python = REPO / ".venv-flink" / "bin" / "python"
    if not python.exists():
        print("flink: skipped: no .venv-flink (make install-flink builds it)", flush=True)
        return None
    from trainguard.v1 import ingest_pb2

    def events_of(values: Sequence[bytes]) -> int:
        return sum(len(ingest_pb2.IngestRequest.FromString(v).events) for v in values)

    values = flink_stream(runs, order)
    events = events_of(values)
    small = runs[0][1][:ranks * 3]  # the first run's starts and two steps: start-up and little else
    small_events = events_of(small)
    print(f"# flink stream: {len(runs)} runs of the backlog, {len(values)} records, {events} events; "
          f"order={order}; start-up run: {len(small)} records, {small_events} events; mini-cluster "
          f"(apache-flink 2.3, .venv-flink), bounded source (a reader per slot), file sink", flush=True)
    embedded = drain_group(bootstrap, broker_pid, 1, runs, events, root)
    per_core = embedded["events_per_s"]
    per_cpu = embedded["events_per_worker_cpu_s"]
    print(f"flink_baseline embedded_processors=1 events={embedded['events_processed']} "
          f"wall_s={embedded['wall_s']:.2f} events_per_s={per_core:.0f} events_per_cpu_s={per_cpu:.0f} "
          f"loadavg={embedded['loadavg']}", flush=True)
    out: Dict[str, Any] = {"events": events, "embedded_events_per_s": per_core,
                           "embedded_events_per_cpu_s": per_cpu, "jobs": []}
    for p in parallelisms:
        try:
            startup = flink_job(python, small, p, root)
            measured = flink_job(python, values, p, root)
        except RuntimeError as exc:  # the job failed or ran past its time: say so, go on
            text = str(exc)
            out["jobs"].append({"parallelism": p, "failed": text.splitlines()[0][:400]
                                if "did not end" in text else _last_error(text)})
            print(f"flink parallelism={p} events={events} FAILED: {out['jobs'][-1]['failed']} "
                  f"loadavg={_loadavg()}", flush=True)
            continue
        wall0, cpu0 = startup["wall"], startup["cpu"]
        wall1, cpu1, busy = measured["wall"], measured["cpu"], measured["busy"]
        used = measured["busy_cpu"]
        subtasks = measured["subtask_records"]
        rate = (events - small_events) / max(1e-9, wall1 - wall0)
        per_cpu_s = (events - small_events) / (cpu1 - cpu0) if cpu1 > cpu0 else float("nan")
        busy_rate = events / max(1e-9, busy)
        job = {"parallelism": p, "startup_wall_s": wall0, "wall_s": wall1, "busy_s": busy,
               "events_per_s": busy_rate, "events_per_s_per_slot": busy_rate / p,
               "slot_vs_embedded_core": busy_rate / p / per_core,
               "marginal_events_per_s": rate, "marginal_slot_vs_embedded_core": rate / p / per_core,
               "events_per_cpu_s": per_cpu_s, "cpu_vs_embedded_cpu": per_cpu_s / per_cpu,
               "subtask_records": subtasks, "balance_bound": sum(subtasks) / max(1, subtasks[0]),
               "busy_cpu": used,
               "events_per_busy_cpu_s": events / max(1e-9, used["cores"] * used["window_s"]),
               "loadavg": _loadavg()}
        out["jobs"].append(job)
        print(f"flink parallelism={p} events={events} busy_s={busy:.2f} events_per_s={busy_rate:.0f} "
              f"events_per_s_per_slot={busy_rate / p:.0f} "
              f"slot_vs_embedded_core={busy_rate / p / per_core:.2f} (target >= 0.5) | "
              f"wall_s={wall1:.1f} startup_wall_s={wall0:.1f} "
              f"marginal_events_per_s={rate:.0f} marginal_slot_vs_embedded_core={rate / p / per_core:.2f} | "
              f"cpu_s={cpu1:.1f} startup_cpu_s={cpu0:.1f} events_per_cpu_s={per_cpu_s:.0f} "
              f"cpu_vs_embedded_cpu={per_cpu_s / per_cpu:.2f} cpus={os.cpu_count()} loadavg={job['loadavg']}",
              flush=True)
        print(f"flink_busy parallelism={p} subtask_records={','.join(map(str, subtasks))} "
              f"balance_bound={job['balance_bound']:.2f} cores_used={used['cores']:.2f} "
              f"cpu_s_in_busy_span: jvm={used['jvm']:.1f} "
              f"python_workers={','.join(f'{c:.1f}' for c in used['python_workers'])} "
              f"other={used['other']:.1f} window_s={used['window_s']:.1f} "
              f"events_per_busy_cpu_s={job['events_per_busy_cpu_s']:.0f} "
              f"busy_cpu_vs_embedded_cpu={job['events_per_busy_cpu_s'] / per_cpu:.2f} cpus={os.cpu_count()} "
              f"loadavg={job['loadavg']}", flush=True)
    return out


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--processors", default="1,2,3", help="the group sizes to measure")
    p.add_argument("--runs", type=int, default=48)
    p.add_argument("--ranks", type=int, default=16)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--checkpoint-ranks", type=int, default=4096, help="0: no checkpoint part")
    p.add_argument("--checkpoint-steps", default="2,20",
                   help="checkpoint after these steps of the big run, and one step after each")
    p.add_argument("--flink-runs", type=int, default=48,
                   help="the Flink job's stream: the first this many runs of the backlog (0: no Flink part; "
                        "default: the whole default backlog)")
    p.add_argument("--flink-parallelism", default="1,2")
    p.add_argument("--flink-order", choices=FLINK_ORDERS, default="live",
                   help="the Flink stream's order: live (the runs' records in turn) or backlog (run after "
                        "run): flink_stream")
    p.add_argument("--flink-timeout-s", type=float, default=FLINK_TIMEOUT_S,
                   help="a Flink job still running after this is killed and reported as failed")
    p.add_argument("--checkpoint-modes", default="whole,rank_parts_full,rank_parts",
                   help="whole: one part, every rank encoded; rank_parts_full: rank parts, every rank "
                        "encoded (stop 28); rank_parts: rank parts, only touched ranks encoded (the default)")
    p.add_argument("--split-above", type=int, default=None,
                   help="rank_parts mode: split runs above this many bytes (default: the processor's 1 MiB)")
    p.add_argument("--quick", action="store_true", help="a smoke run: small backlog, 512-rank checkpoint")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--bootstrap", help=argparse.SUPPRESS)
    p.add_argument("--topic", help=argparse.SUPPRESS)
    p.add_argument("--data-dir", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--control", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args.bootstrap, args.topic, args.data_dir, args.control, args.index)
    if args.quick:
        args.runs, args.ranks, args.steps, args.checkpoint_ranks = 12, 4, 10, 512
        args.checkpoint_steps = "1"
        args.flink_runs = 0
        args.split_above = 256 * 1024  # the small run is split too
    sizes = [int(s) for s in args.processors.split(",") if s.strip()]
    cpus = os.cpu_count() or 1
    print(f"# bench/scale.py date={time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())} "
          f"host={platform.node()} machine={platform.machine()} cpus={cpus} python={sys.version.split()[0]} "
          f"loadavg={_loadavg()} quick={args.quick}", flush=True)
    print(f"# backlog: {args.runs} runs x {args.ranks} ranks x {args.steps} steps (SDK-shaped, one record "
          f"per rank and step, key = run id), topic of {PARTITIONS} partitions, Tansu broker (memory "
          f"storage); each processor its own OS process and SQLite stores", flush=True)
    from tests.support.kafka import Tansu

    root = Path(tempfile.mkdtemp(prefix="trainguard-scale-"))
    broker = Tansu(root / "tansu.log").start()
    figures: Dict[str, Any] = {"cpus": cpus, "groups": []}
    try:
        assert broker.proc is not None
        t0 = time.perf_counter()
        runs, events = backlog(args.runs, args.ranks, args.steps)
        print(f"# backlog built: {sum(len(v) for _, v in runs)} records, {events} events "
              f"({time.perf_counter() - t0:.1f} s)", flush=True)
        base: Optional[float] = None
        for n in sizes:
            g = drain_group(broker.bootstrap, broker.proc.pid, n, runs, events, root)
            base = base if base is not None else (g["events_per_s"] if n == 1 else None)
            g["ratio_to_1"] = g["events_per_s"] / base if base else float("nan")
            figures["groups"].append(g)
            per = ",".join(f"{x:.0f}" for x in g["per_processor_events_per_s"])
            print(f"scale processors={n} events={g['events_processed']} records={g['records_processed']} "
                  f"wall_s={g['wall_s']:.2f} events_per_s={g['events_per_s']:.0f} "
                  f"per_processor_events_per_s={per} "
                  f"ratio_to_1={g['ratio_to_1']:.2f} partitions={','.join(map(str, g['partitions']))} "
                  f"events_per_processor={','.join(map(str, g['events_per_processor']))} "
                  f"balance_bound={g['balance_bound']:.2f} "
                  f"rebalances={g['rebalances']} start_skew_s={g['start_skew_s']:.2f} "
                  f"end_skew_s={g['end_skew_s']:.2f} "
                  f"worker_cpu_s={','.join(f'{c:.1f}' for c in g['worker_cpu_s'])} "
                  f"events_per_worker_cpu_s={g['events_per_worker_cpu_s']:.0f} "
                  f"broker_cpu_s={g['broker_cpu_s']:.1f} cpus={cpus} loadavg={g['loadavg']}", flush=True)
        print(f"note: {cpus} cores here: N processors cannot exceed ~{cpus}x one processor (and the broker "
              f"shares those cores), so N=3 cannot exceed ~{min(3, cpus)}x; on a loaded machine less.",
              flush=True)
        stops = [int(x) for x in args.checkpoint_steps.split(",") if x.strip()]
        figures["checkpoint"] = []
        modes = [m for m in args.checkpoint_modes.split(",") if m.strip()]
        for mode in modes if args.checkpoint_ranks else ():
            figures["checkpoint"] += checkpoint_figures(broker.bootstrap, args.checkpoint_ranks, stops, root,
                                                        mode, args.split_above)
        for c in figures["checkpoint"]:
            print(f"checkpoint ranks={c['ranks']} after_step={c['after_step']} "
                  f"changed_ranks={c['changed_ranks']} mode={c['mode']} records={c['records']} "
                  f"process_s={c['process_s']:.2f} checkpoint_s={c['checkpoint_s']:.3f} parts={c['parts']} "
                  f"bytes={c['bytes']} bytes_per_rank={c['bytes'] / c['ranks']:.0f} "
                  f"largest_part_bytes={c['largest_part_bytes']} "
                  f"largest_stored_bytes={c['largest_stored_bytes']} "
                  f"run_parts_stored={c['run_parts_stored']} rank_parts_stored={c['rank_parts_stored']} "
                  f"cpus={cpus} loadavg={c['loadavg']}", flush=True)
        whole = {(c["after_step"], c["changed_ranks"]): c
                 for c in figures["checkpoint"] if c["mode"] == "whole"}
        for c in figures["checkpoint"]:
            w = whole.get((c["after_step"], c["changed_ranks"]))
            if c["mode"] != "whole" and w is not None:
                print(f"checkpoint_split mode={c['mode']} after_step={c['after_step']} "
                      f"changed_ranks={c['changed_ranks']} "
                      f"bytes_ratio={c['bytes'] / max(1, w['bytes']):.3f} "
                      f"time_ratio={c['checkpoint_s'] / max(1e-9, w['checkpoint_s']):.2f} "
                      f"largest_stored_ratio="
                      f"{c['largest_stored_bytes'] / max(1, w['largest_stored_bytes']):.3f} "
                      f"({c['mode']} / whole, same process)", flush=True)
        if args.flink_runs:
            globals()["FLINK_TIMEOUT_S"] = args.flink_timeout_s
            figures["flink"] = flink_figures(broker.bootstrap, broker.proc.pid, runs[:args.flink_runs],
                                             args.ranks, root,
                                             [int(x) for x in args.flink_parallelism.split(",") if x.strip()],
                                             args.flink_order)
        else:
            print("flink: not measured (--flink-runs 0)", flush=True)
    finally:
        broker.stop(kill=True)
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(figures), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
