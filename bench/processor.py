#!/usr/bin/env python3
"""Processor-alone throughput: queue → pipeline → stores, this checkout beside a baseline commit, one run.

What ``trainguard serve``'s processor does with a backlog, and nothing else: for each stream *shape* a
fresh data directory gets its SQLite queue filled with the shape's serialized ``IngestRequest`` records
(one record per request, as the gateway publishes them), then the processor is built exactly as
``trainguard serve`` builds it (``open_stores`` + ``EmbeddedProcessor`` with the server's default
settings: SQLite stores, ``synchronous=FULL``) and drains the queue, checkpoint included. Reported:
events/s over the wall time of the drain (one thread; the CPU time beside it), then the ratio to the
baseline measured the same way in the same run, and on a line of its own the machine's 1-minute load
average over the drains each figure comes from (a shared machine: figures are only comparable beside it),
the peak RSS of the measuring process (the stream it built included) and the CPU time the drain spent
inside the cyclic garbage collector's collections, per event, with their count (``gc.callbacks``: what the
processor's GC policy leaves, processor/embedded.py ``GC_GEN0_THRESHOLD``).

Shapes (``--shapes``):

* ``sdk16``   -- a 16-rank run the way the SDK sends it: per rank and step one request of two metric
  envelopes (the hooks' ``time/step_s``, ``grad/global_norm``, ``grad/clip_triggered``, ``opt/lr``;
  the loop's ``loss``, ``lr``), a memory envelope every 10 steps, start and exit lifecycle events;
* ``sdk4096`` -- the same for a 4,096-rank run over a few steps;
* ``env500``  -- bench/ingest.py's load: 500 metric envelopes of 5 points per request.

The baseline (``--baseline REF``, default ``HEAD``: the last commit, i.e. the previous main when the
work is uncommitted) is checked out with ``git worktree`` into a temporary folder and measured by this
same script in a subprocess whose ``PYTHONPATH`` points at that checkout's sources: the same streams,
the same machine, minutes apart at most. ``--baseline none`` measures only this checkout. Each checkout
that has the engine's build script (engine/native_build.py) runs its compiled engine, built first when
missing or stale (as ``make install`` does; ~2.5 min; not with ``--quick``: a current build is used, else
the pure engine); ``--engine-pure`` measures this checkout on its pure-Python engine instead. Each shape's
``_load`` line says which ran: ``engine_native=1/0`` (and the baseline's), beside ``native_reader``.

    python bench/processor.py                      # ~1 minute
    python bench/processor.py --baseline HEAD~3 --shapes sdk16
    python bench/processor.py --quick              # small streams (smoke)
    python bench/processor.py --pipeline           # + the detection pipeline alone (CPU per event)
    python bench/processor.py --repeat 3           # this and the baseline take turns, best of 3 each
    python bench/processor.py --backlog            # with serve's per-project backlog hook (its default)
    python bench/processor.py --engine-pure        # this checkout's engine pure (TRAINGUARD_ENGINE_NATIVE=0)

Nothing is asserted; numbers and ratios are printed, and ``--json`` writes them.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent

SHAPES = ("sdk16", "sdk4096", "env500")
START_NS = 1_800_000_000_000_000_000
STEP_NS = 250_000_000  # 4 steps a second


def _sources(root: Path) -> List[str]:
    """The source folders of a checkout (whatever distributions it has)."""
    return [str(p) for p in sorted(root.glob("*/src")) if p.is_dir()]


# ------------------------------------------------------------------------------------------ streams

def _identity(project: str, run_id: str, rank: int, world: int) -> Dict[str, Any]:
    return {"project": project, "run_id": run_id, "trace_id": run_id, "host": f"node-{rank // 8:04d}",
            "pid": 10_000 + rank, "rank": rank, "local_rank": rank % 8, "world_size": world,
            "group_rank": rank // 8, "run_name": "processor-bench", "sdk": "trainguard-python/bench"}


def _wobble(step: int, rank: int, k: int) -> float:
    """A deterministic noise in [-0.5, 0.5) (no random module: every checkout sees the same values)."""
    return (((step * 2654435761 + rank * 40503 + k * 97) % 1000) / 1000.0) - 0.5


def sdk_requests(project: str, run_id: str, world: int, steps: int) -> Iterator[List[Dict[str, Any]]]:
    """The envelope dicts of one request per rank and step, in the order ranks would send them."""
    from trainguard.core import events as ev

    idents = [_identity(project, run_id, r, world) for r in range(world)]
    for rank, ident in enumerate(idents):
        yield [ev.envelope(ident, "lifecycle", {"phase": "START", "tags": {"model": "bench"}}, step=0,
                           time_unix_nano=START_NS + rank, event_id=f"{run_id}-{rank}-start")]
    for step in range(1, steps + 1):
        t = START_NS + step * STEP_NS
        lr = 3e-4 * min(1.0, step / 20.0)
        for rank, ident in enumerate(idents):
            w = _wobble(step, rank, 0)
            loss = 2.0 + 3.0 * math.exp(-step / 40.0) + 0.05 * w
            hooks = {"time/step_s": 0.25 + 0.01 * _wobble(step, rank, 1),
                     "grad/global_norm": 1.0 + 0.2 * _wobble(step, rank, 2),
                     "grad/clip_triggered": 0.0, "opt/lr": lr}
            batch = [ev.envelope(ident, "metrics", ev.metrics_payload(hooks), step=step,
                                 time_unix_nano=t + rank, event_id=f"{run_id}-{rank}-{step}-h"),
                     ev.envelope(ident, "metrics", ev.metrics_payload({"loss": loss, "lr": lr}), step=step,
                                 time_unix_nano=t + rank + 1, event_id=f"{run_id}-{rank}-{step}-l")]
            if step % 10 == 0:
                allocated = 20e9 + 1e6 * _wobble(step, rank, 3)
                batch.append(ev.envelope(ident, "memory", {
                    "device": f"cuda:{rank % 8}", "rss": 8_000_000_000, "allocated": int(allocated),
                    "reserved": 24_000_000_000, "active": int(allocated), "max_allocated": 22_000_000_000,
                    "total_capacity": 150_000_000_000, "fragmentation": 0.15, "num_alloc_retries": 0,
                    "num_ooms": 0}, step=step, time_unix_nano=t + rank + 2,
                    event_id=f"{run_id}-{rank}-{step}-m"))
            yield batch
    t = START_NS + (steps + 1) * STEP_NS
    for rank, ident in enumerate(idents):
        yield [ev.envelope(ident, "lifecycle", {"phase": "EXIT", "exit_code": 0}, step=steps,
                           time_unix_nano=t + rank, event_id=f"{run_id}-{rank}-exit")]


def env500_requests(project: str, run_id: str, requests: int) -> Iterator[List[Dict[str, Any]]]:
    """bench/ingest.py's load: ``requests`` batches of 500 metric envelopes, 5 points each."""
    from trainguard.core import events as ev

    ident = _identity(project, run_id, 0, 1)
    names = ("loss", "lr", "grad/global_norm", "throughput/samples_per_s", "amp/scale")
    for r in range(requests):
        batch = []
        for i in range(500):
            step = r * 500 + i + 1
            values = dict(zip(names, (2.5 + 0.01 * _wobble(step, 0, 0), 3e-4,
                                      0.5 + 0.05 * _wobble(step, 0, 1), 1200.0 + (step % 17), 65536.0)))
            batch.append(ev.envelope(ident, "metrics", ev.metrics_payload(values), step=step,
                                     time_unix_nano=START_NS + step * 1_000_000, event_id=f"{run_id}-{step}"))
        yield batch


def shape_requests(shape: str, quick: bool) -> Tuple[str, Iterator[List[Dict[str, Any]]]]:
    run_id = f"bench-{shape}"
    if shape == "sdk16":
        return run_id, sdk_requests("bench", run_id, 16, 60 if quick else 400)
    if shape == "sdk4096":
        return run_id, sdk_requests("bench", run_id, 4096, 1 if quick else 2)
    if shape == "env500":
        return run_id, env500_requests("bench", run_id, 8 if quick else 120)
    raise SystemExit(f"unknown shape {shape!r} (known: {', '.join(SHAPES)})")


# ---------------------------------------------------------------------------------------- measuring

def pipeline_alone(values: Sequence[bytes], batch: int) -> float:
    """CPU microseconds per event of the detection pipeline alone over ``values`` (serialized records):
    decoded beforehand as the processor decodes them (``read_request`` where the checkout has it, else
    ``decode_request``), then ``Pipeline.process`` per ``batch`` records as the processor calls it (no
    stores, no queue); the best of three fresh pipelines. NaN for a checkout without the engine's own
    distribution or the processor's one-pass decoder (the comparison then stays processor-alone)."""
    try:
        from trainguard_engine.catalogue import DetectionSettings
        from trainguard_engine.pipeline import Pipeline
        from trainguard_server.processor import decode
    except ImportError:
        return math.nan
    decode_request = getattr(decode, "read_request", None) or getattr(decode, "decode_request", None)
    if decode_request is None:
        return math.nan
    chunks = []
    for i in range(0, len(values), batch):
        envelopes: List[Any] = []
        points: List[Any] = []
        for value in values[i:i + batch]:
            e, p = decode_request(value)
            envelopes.extend(e)
            points.extend(p)
        chunks.append((envelopes, points))
    events = sum(len(c[0]) for c in chunks)
    best = math.inf
    for _ in range(3):
        pipeline = Pipeline(DetectionSettings())
        cpu0 = time.process_time()
        for envelopes, points in chunks:
            pipeline.process(envelopes, points)
        best = min(best, time.process_time() - cpu0)
    return 1e6 * best / events if events else math.nan


def backlog_hook(settings: Any, queue: Any) -> Dict[str, Any]:
    """The ``processed`` keyword ``trainguard serve`` gives its processor by default (the gateway's
    per-project backlog count, ``project_max_backlog_events`` > 0: gateway/backlog.py), for a checkout
    whose processor and gateway have it; ``{}`` for one without (measured as before)."""
    import inspect

    from trainguard_server.processor.embedded import EmbeddedProcessor
    try:
        from trainguard_server.gateway.backlog import ProjectBacklog
    except ImportError:
        return {}
    if "processed" not in inspect.signature(EmbeddedProcessor).parameters:
        return {}
    limit = getattr(settings, "project_max_backlog_events", 0) or 100_000
    return {"processed": ProjectBacklog(limit, 1.0, queue.depth).processed}


def measure(shape: str, quick: bool, root: Path, pipeline: bool = False,
            backlog: bool = False) -> Dict[str, float]:
    """Fill a fresh queue with ``shape``'s records, drain it with the server's processor (with ``backlog``,
    also its per-project backlog hook, as serve runs it: :func:`backlog_hook`); the figures (with
    ``pipeline``, also :func:`pipeline_alone`'s, measured after the drain)."""
    from trainguard import wire
    from trainguard_server.config import Settings
    from trainguard_server.processor.embedded import EmbeddedProcessor
    from trainguard_server.queue.sqlite import QUEUE_DB, SqliteQueue
    from trainguard_server.storage.select import open_stores

    try:
        from trainguard_engine.catalogue import DetectionSettings
    except ImportError:  # a baseline from before the engine had its own distribution
        from trainguard.core.catalogue import DetectionSettings  # type: ignore[import-not-found,no-redef]

    data_dir = root / shape
    data_dir.mkdir(parents=True)
    run_id, requests = shape_requests(shape, quick)
    prepared = [wire.prepare_batch(batch).request for batch in requests]
    values = [request.SerializeToString() for request in prepared]
    events = sum(len(request.events) for request in prepared)
    queue = SqliteQueue(data_dir / QUEUE_DB, max_depth=len(values) + 1)
    for i in range(0, len(values), 1000):
        queue.publish(run_id, values[i:i + 1000])
    settings = Settings()
    try:  # what trainguard serve does to the interpreter of a process with a processor, where it does
        from trainguard_server.processor.embedded import tune_gc  # type: ignore[attr-defined]
        tune_gc()
    except ImportError:
        pass
    stores = open_stores(settings, data_dir)
    hook = backlog_hook(settings, queue) if backlog else {}
    processor = EmbeddedProcessor(queue, stores.events, stores.metrics, stores.incidents, DetectionSettings(),
                                  batch=settings.processor_batch, snapshot_every_s=settings.snapshot_every_s,
                                  tick_interval_s=settings.tick_interval_s, **hook)
    load0 = os.getloadavg()[0]
    in_gc = _GcClock()
    gc.callbacks.append(in_gc)
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    try:
        processor.drain(timeout=3600)
        processor.checkpoint()
    finally:
        gc.callbacks.remove(in_gc)
    wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    load1 = os.getloadavg()[0]
    processed = processor.stats.events
    record = stores.incidents.get_run("bench", run_id)
    incidents = stores.incidents.list_incidents("bench", run_id=run_id)
    queue.close()
    stores.close()
    out = {"events": float(events), "processed": float(processed), "records": float(len(values)),
           "wall_s": wall, "cpu_s": cpu, "events_per_s": processed / wall if wall > 0 else math.nan,
           "us_per_event_cpu": 1e6 * cpu / processed if processed else math.nan,
           "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
           "finished": float(record is not None and record.status == "finished"),
           "incidents": float(len(incidents.items)),
           "loadavg_min": min(load0, load1), "loadavg_max": max(load0, load1),
           "backlog_hook": float(bool(hook)), "native_reader": float(_native_reader()),
           "engine_native": float(_engine_native()),
           "gc_us_per_event": 1e6 * in_gc.seconds / processed if processed else math.nan,
           "gc_collections": float(in_gc.collections)}
    if pipeline:
        out["pipeline_us_per_event_cpu"] = pipeline_alone(values, settings.processor_batch)
    return out


class _GcClock:
    """A ``gc.callbacks`` entry that adds up the CPU time spent inside the cyclic collector's collections
    (and counts them): what the processor's GC policy (processor/embedded.py GC_GEN0_THRESHOLD) leaves."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.collections = 0
        self._started = 0.0

    def __call__(self, phase: str, _info: Dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.process_time()
        else:
            self.seconds += time.process_time() - self._started
            self.collections += 1


def _native_reader() -> bool:
    """Whether the measured processor reads records with the native reader (processor/_fastread.c)."""
    try:
        from trainguard_server.processor import decode
    except ImportError:
        return False
    return getattr(decode, "NATIVE", None) is not None


def _engine_native() -> bool:
    """Whether the measured processor runs the engine's compiled hot modules (engine/native_build.py)."""
    native = sys.modules.get("trainguard_engine._native")
    return bool(native is not None and native.compiled_modules().get("pipeline"))


def worker(shapes: Sequence[str], quick: bool, pipeline: bool = False,
           backlog: bool = False) -> Dict[str, Dict[str, float]]:
    """Measure every shape in a fresh temporary folder (each shape in its own data directory)."""
    root = Path(tempfile.mkdtemp(prefix="trainguard-processor-bench-"))
    try:
        return {shape: measure(shape, quick, root, pipeline, backlog) for shape in shapes}
    finally:
        shutil.rmtree(root, ignore_errors=True)


NATIVE_BUILDER = Path("services/src/trainguard_server/processor/native.py")
"""A checkout with the processor's optional native reader builds it with this (as its package build does)."""


def build_native(checkout: Path) -> bool:
    """Build ``checkout``'s native reader in place, as installing the package does (services/hatch_build.py),
    where it has one and it is not built yet; False where it has none or it did not build (the protobuf
    path then runs: the figures say which, ``native_reader``)."""
    builder = checkout / NATIVE_BUILDER
    if not builder.is_file():
        return False
    source = builder.with_name("_fastread.c")
    built = list(builder.parent.glob("_fastread*.so"))
    if built and source.is_file() and all(b.stat().st_mtime >= source.stat().st_mtime for b in built):
        return True  # built from this source already
    return subprocess.run([sys.executable, str(builder)], capture_output=True, check=False).returncode == 0


ENGINE_BUILDER = Path("engine/native_build.py")
"""A checkout with the engine's compiled build builds it with this (as ``make install`` does)."""


def build_engine(checkout: Path) -> bool:
    """Build ``checkout``'s compiled engine (out of its source tree; nothing to do when current), where it
    has the build script; False where it has none or it did not build (its pure engine then runs: the
    figures say which, ``engine_native``)."""
    builder = checkout / ENGINE_BUILDER
    if not builder.is_file():
        return False
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(_sources(checkout)))
    return subprocess.run([sys.executable, str(builder)], capture_output=True, env=env,
                          check=False).returncode == 0


def run_checkout(checkout: Path, shapes: Sequence[str], quick: bool, pipeline: bool = False,
                 backlog: bool = False, engine_pure: bool = False) -> Dict[str, Dict[str, float]]:
    """This script, one shape per subprocess (a fresh interpreter and peak RSS), on ``checkout``'s code
    (with ``engine_pure``, its pure-Python engine: ``TRAINGUARD_ENGINE_NATIVE=0``)."""
    build_native(checkout)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(_sources(checkout)))
    if engine_pure:
        env["TRAINGUARD_ENGINE_NATIVE"] = "0"
    elif not quick:  # (a smoke run builds nothing: a current build is used, else the pure engine)
        build_engine(checkout)
    out: Dict[str, Dict[str, float]] = {}
    for shape in shapes:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--shapes", shape]
        if quick:
            cmd.append("--quick")
        if pipeline:
            cmd.append("--pipeline")
        if backlog:
            cmd.append("--backlog")
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0:
            print(f"{checkout}: {shape} failed:\n{proc.stderr[-3000:]}", file=sys.stderr, flush=True)
            continue
        out.update(json.loads(proc.stdout.strip().splitlines()[-1]))
    return out


def baseline_checkout(ref: str, root: Path) -> Path:
    """``ref`` checked out (detached, no submodules) under ``root``."""
    path = root / "baseline"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(path), ref], check=True)
    return path


TARGETS = {"sdk16": 25.0, "sdk4096": 20.0, "env500": 5.0}
"""Issue 15's speed-up targets over the previous main, per shape."""


def _best(runs: Sequence[Dict[str, float]]) -> Dict[str, float]:
    """The best of repeated measurements of one shape: the highest events/s, the lowest CPU per event (each
    on its own: on a loaded machine the least disturbed run of each figure), the rest from the last run."""
    out = dict(runs[-1])
    out["events_per_s"] = max(r.get("events_per_s", math.nan) for r in runs)
    for key in ("us_per_event_cpu", "pipeline_us_per_event_cpu"):
        if key in out:
            out[key] = min(r.get(key, math.nan) for r in runs)
    out["peak_rss_mb"] = max(r.get("peak_rss_mb", math.nan) for r in runs)
    out["loadavg_min"] = min(r.get("loadavg_min", math.nan) for r in runs)  # the machine's 1-minute load
    out["loadavg_max"] = max(r.get("loadavg_max", math.nan) for r in runs)  # over the drains measured
    out["repeats"] = float(len(runs))
    return out


def _alternate(checkouts: Dict[str, Path], shapes: Sequence[str], quick: bool, pipeline: bool,
               repeat: int, backlog: bool = False,
               engine_pure: bool = False) -> Dict[str, Dict[str, Dict[str, float]]]:
    """Each shape ``repeat`` times, the checkouts taking turns (this, baseline, this, ...), best of each:
    load that comes and goes on a shared machine then falls on both alike (``engine_pure``: this checkout
    on its pure-Python engine)."""
    runs: Dict[str, Dict[str, List[Dict[str, float]]]] = {label: {} for label in checkouts}
    for shape in shapes:
        for _ in range(max(1, repeat)):
            for label, checkout in checkouts.items():
                got = run_checkout(checkout, [shape], quick, pipeline, backlog,
                                   engine_pure and label == "this").get(shape)
                if got is not None:
                    runs[label].setdefault(shape, []).append(got)
    return {label: {shape: _best(figures) for shape, figures in by_shape.items()}
            for label, by_shape in runs.items()}


def compare(shapes: Sequence[str], baseline: str, quick: bool, baseline_path: Optional[Path] = None,
            pipeline: bool = False, repeat: int = 1, backlog: bool = False,
            engine_pure: bool = False) -> Dict[str, Dict[str, Dict[str, float]]]:
    """``{"this": {shape: figures}, "baseline": {...}}``: this checkout and ``baseline`` (a git ref, or
    ``"none"``) checked out in a temporary worktree -- or the checkout already at ``baseline_path`` (a
    machine without the git history, e.g. a device machine given ``git archive REF``) -- measured the same
    way, taking turns shape by shape, ``repeat`` times each (best of them)."""
    if baseline_path is not None:
        checkouts = {"this": REPO, "baseline": baseline_path.resolve()}
        return _alternate(checkouts, shapes, quick, pipeline, repeat, backlog, engine_pure)
    if baseline == "none":
        return _alternate({"this": REPO}, shapes, quick, pipeline, repeat, backlog, engine_pure)
    tmp = Path(tempfile.mkdtemp(prefix="trainguard-processor-baseline-"))
    try:
        base = baseline_checkout(baseline, tmp)
        try:
            return _alternate({"this": REPO, "baseline": base}, shapes, quick, pipeline, repeat, backlog,
                              engine_pure)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base)], check=False)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _load(figures: Dict[str, float]) -> str:
    """``"2.1-4.3"``: the 1-minute load average over a shape's drains (``nan`` when not measured)."""
    return f"{figures.get('loadavg_min', math.nan):.1f}-{figures.get('loadavg_max', math.nan):.1f}"


def print_table(results: Dict[str, Dict[str, Dict[str, float]]], shapes: Sequence[str], baseline: str,
                label: str = "processor_alone") -> None:
    """One line per shape: this checkout's events/s and CPU per event, the baseline's, the speed-up."""
    for shape in shapes:
        this = results["this"].get(shape, {})
        base = results.get("baseline", {}).get(shape, {})
        speedup = (this.get("events_per_s", math.nan) / base["events_per_s"]) if base else math.nan
        print(f"{label} shape={shape} events={this.get('events', math.nan):.0f} "
              f"records={this.get('records', math.nan):.0f} "
              f"events_per_s={this.get('events_per_s', math.nan):.0f} "
              f"cpu_us_per_event={this.get('us_per_event_cpu', math.nan):.1f} baseline={baseline} "
              f"baseline_events_per_s={base.get('events_per_s', math.nan):.0f} "
              f"baseline_cpu_us_per_event={base.get('us_per_event_cpu', math.nan):.1f} "
              f"speedup={speedup:.2f} target={TARGETS.get(shape, math.nan):g}", flush=True)
        print(f"{label}_load shape={shape} loadavg_1m={_load(this)} baseline_loadavg_1m={_load(base)} "
              f"peak_rss_mb={this.get('peak_rss_mb', math.nan):.0f} "
              f"baseline_peak_rss_mb={base.get('peak_rss_mb', math.nan):.0f} "
              f"backlog_hook={this.get('backlog_hook', 0):.0f} "
              f"baseline_backlog_hook={base.get('backlog_hook', math.nan):.0f} "
              f"native_reader={this.get('native_reader', 0):.0f} "
              f"baseline_native_reader={base.get('native_reader', 0):.0f} "
              f"engine_native={this.get('engine_native', 0):.0f} "
              f"baseline_engine_native={base.get('engine_native', 0):.0f} "
              f"gc_us_per_event={this.get('gc_us_per_event', math.nan):.2f} "
              f"gc_collections={this.get('gc_collections', math.nan):.0f} "
              f"baseline_gc_us_per_event={base.get('gc_us_per_event', math.nan):.2f} "
              f"baseline_gc_collections={base.get('gc_collections', math.nan):.0f}", flush=True)
        if "pipeline_us_per_event_cpu" in this:
            mine, theirs = this["pipeline_us_per_event_cpu"], base.get("pipeline_us_per_event_cpu", math.nan)
            print(f"pipeline_alone shape={shape} cpu_us_per_event={mine:.1f} baseline={baseline} "
                  f"baseline_cpu_us_per_event={theirs:.1f} speedup={theirs / mine:.2f} "
                  f"engine_native={this.get('engine_native', 0):.0f} "
                  f"baseline_engine_native={base.get('engine_native', 0):.0f}", flush=True)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--baseline", default="HEAD", help="git ref to compare with ('none': skip)")
    p.add_argument("--baseline-path", type=Path,
                   help="a baseline checkout already on disk (e.g. `git archive REF | tar -x -C DIR`); "
                        "--baseline then only names it in the output")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--pipeline", action="store_true",
                   help="also the detection pipeline alone (decoded records, no stores): CPU per event, best "
                        "of three, after each drain -- steadier than wall time on a loaded machine")
    p.add_argument("--repeat", type=int, default=1,
                   help="measure each shape this many times, this checkout and the baseline taking turns; "
                        "the best of each figure is printed (a shared, loaded machine)")
    p.add_argument("--backlog", action="store_true",
                   help="give the processor serve's default per-project backlog hook (gateway/backlog.py) "
                        "where the checkout has it, as trainguard serve runs it (off: the processor alone)")
    p.add_argument("--engine-pure", action="store_true",
                   help="measure this checkout on its pure-Python engine (TRAINGUARD_ENGINE_NATIVE=0); by "
                        "default each checkout with engine/native_build.py runs its compiled build")
    p.add_argument("--json", type=Path, help="write the figures here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    if args.worker:
        print(json.dumps(worker(shapes, args.quick, args.pipeline, args.backlog)), flush=True)
        return 0
    print(f"env cpus={os.cpu_count()} python={sys.version.split()[0]} quick={args.quick} "
          f"backlog={args.backlog} engine_pure={args.engine_pure} loadavg_1m={os.getloadavg()[0]:.2f}",
          flush=True)
    results = compare(shapes, args.baseline, args.quick, args.baseline_path, args.pipeline, args.repeat,
                      args.backlog, args.engine_pure)
    print_table(results, shapes, args.baseline)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
