#!/usr/bin/env python3
"""The scale-out pipeline side by side with the embedded backend, in one run (issue 5).

Every phase is a real server process on 127.0.0.1 (``trainguard serve`` / its roles, as bench/ingest.py
starts them) and, for Kafka, a real Kafka-protocol broker (Tansu, the tests' broker; memory storage):

1. ``ingest``: pre-built gRPC batches from ``--clients`` processes for ``--duration`` s (bench/ingest.py's
   client: 500 metric envelopes per request, 5 points each) into
   - ``embedded``: ``trainguard serve`` (SQLite queue; its processor runs meanwhile, as it does in use);
   - ``kafka``: ``trainguard gateway`` alone, publishing to the broker (acks=all, idempotent producer).
2. ``processor``: events/s through queue → pipeline → stores with ingest stopped, over at least
   ``--alone`` s of whole processor rounds, read from the server's ``/metrics``:
   - ``embedded``: the same server, working through the backlog phase 1 left;
   - ``kafka``: ``trainguard processor`` (+ the API for its /metrics) started on the backlog phase 1
     left in the topic: consume → pipeline → stores → commit.
3. ``latency``: event → incident p50/p99 (bench/ingest.py's probes: a NaN-loss batch for a fresh run, the
   query API polled every 10 ms) under a paced background load of half the processor's solo rate from
   phase 2, through ``trainguard serve`` on SQLite and through ``trainguard serve`` with
   ``TRAINGUARD_QUEUE=kafka`` (gateway → broker → processor → stores → API in one process). When the
   processor did not keep up (the one-process Kafka server shares 2 cores with the broker), once more at
   half of what it processed under the probes: the figure in the summary is the path's, not a backlog's.
4. ``flink`` (when .venv-flink exists): the Flink job on a local mini-cluster over a bounded input of the
   scenario corpus at two sizes; the marginal rate (difference of events over difference of wall time)
   removes the job's start-up cost.

5. ``processor_alone`` -- bench/processor.py's streams (SDK-shaped: 16 and 4,096 ranks, one request per
   rank and step; the 500-envelope stream of phase 1) through the processor alone, this checkout beside
   ``--processor-baseline`` (a git ref in a temporary worktree), with the speed-up and the ratio to the
   embedded gRPC ingest rate of phase 1.

Nothing is asserted; figures and ratios are printed. The ingest target is 120,000 events/s into Kafka.

    python bench/pipeline.py               # ~3 minutes
    python bench/pipeline.py --quick       # seconds per phase (smoke)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Dict, List, Optional, Tuple

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
for _p in (BENCH, REPO, REPO / "sdk" / "src", REPO / "engine" / "src", REPO / "services" / "src"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import ingest  # noqa: E402  (bench/ingest.py: servers, clients, probes)

TARGET = 120_000


def rate_alone(server: ingest.Server, seconds: float) -> Tuple[float, float]:
    """(events/s, backlog left) of the server's processor over whole rounds spanning ``seconds``."""
    first: Optional[Tuple[float, float]] = None
    last: Optional[Tuple[float, float]] = None
    seen = server.metrics().get("trainguard_processed_events_total", 0.0)
    give_up = time.monotonic() + 4 * seconds + 30
    while time.monotonic() < give_up:
        time.sleep(0.05)
        n = server.metrics().get("trainguard_processed_events_total", 0.0)
        if n == seen:
            continue
        seen = n
        if first is None:
            first = (time.monotonic(), n)
        else:
            last = (time.monotonic(), n)
            if last[0] - first[0] >= seconds:
                break
    if first is None or last is None:
        return float("nan"), float("nan")
    depth = server.metrics().get("trainguard_queue_depth", float("nan"))
    return (last[1] - first[1]) / (last[0] - first[0]), depth


def warm_up(server: ingest.Server, timeout: float = 90.0) -> float:
    """Seconds until the server turns one probe into a queryable incident (a Kafka processor first joins
    its consumer group: Tansu answers a JoinGroup after half the session timeout). The latency probes start
    after this, so they measure the path, not the start."""
    from trainguard.v1 import ingest_pb2

    channel = ingest._grpc_channel(server.grpc_target)
    send = channel.unary_unary(ingest.SEND_METHOD, request_serializer=None,
                               response_deserializer=ingest_pb2.IngestResponse.FromString)
    run_id = f"warm-up-{uuid.uuid4().hex[:6]}"
    started = time.monotonic()
    try:
        send(ingest.probe_request(server.project, run_id, time.time_ns()),
             metadata=(("authorization", f"Bearer {server.ingest_token}"),), timeout=30)
        while time.monotonic() - started < timeout:
            status, data = ingest.http_get(server.http_port, f"/api/v1/runs/{run_id}/incidents",
                                           server.read_token)
            if status == 200 and json.loads(data)["items"]:
                return time.monotonic() - started
            time.sleep(0.05)
    finally:
        channel.close()
    return float("inf")


def kafka_env(bootstrap: str, topic: str, roles: str) -> List[str]:
    return ["TRAINGUARD_QUEUE=kafka", f"TRAINGUARD_KAFKA_BOOTSTRAP_SERVERS={bootstrap}",
            f"TRAINGUARD_KAFKA_TOPIC={topic}", "TRAINGUARD_KAFKA_PARTITIONS=4",
            "TRAINGUARD_KAFKA_SESSION_TIMEOUT_MS=6000", f"TRAINGUARD_ROLES={roles}",
            # Tansu answers a Fetch only after fetch.wait.max.ms even when records are there (Apache Kafka
            # answers at once): the default 500 ms would be the latency figure, not the pipeline
            'TRAINGUARD_KAFKA_CLIENT_CONFIG={"fetch.wait.max.ms": 10}']


def flink_phase(root: Path, sizes: Tuple[int, int]) -> Optional[Dict[str, float]]:
    python = REPO / ".venv-flink" / "bin" / "python"
    if not python.exists():
        print("flink skipped: no .venv-flink (make install builds it)", flush=True)
        return None
    from tests.scenarios.corpus import SCENARIOS, retimed
    from trainguard import wire
    from trainguard_server.processor.flink_main import write_records

    base = [s.events() for s in SCENARIOS]
    walls: List[Tuple[int, float]] = []
    for copies in sizes:
        values: List[bytes] = []
        events = 0
        for c in range(copies):
            for run in base:
                moved = retimed(run, 1_800_000_000_000_000_000)
                for e in moved:
                    e["run_id"] = f"{e['run_id']}~{c}"
                events += len(moved)
                values += [wire.ingest_request_from_dicts(moved[i:i + 50]).SerializeToString()
                           for i in range(0, len(moved), 50)]
        path = root / f"flink-{copies}.bin"
        write_records(path, values)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(REPO / "sdk" / "src"), str(REPO / "engine" / "src"), str(REPO / "services" / "src")]))
        started = time.monotonic()
        proc = subprocess.run([str(python), "-m", "trainguard_server.processor.flink_main", "--records",
                               str(path), "--out", str(root / f"flink-out-{copies}"), "--parallelism", "2"],
                              env=env, capture_output=True, text=True, timeout=1800)
        wall = time.monotonic() - started
        if proc.returncode != 0:
            print(f"flink job failed:\n{proc.stderr[-2000:]}", flush=True)
            return None
        walls.append((events, wall))
        print(f"flink bounded_job events={events} runs={copies * len(base)} wall_s={wall:.1f} "
              f"events_per_s_incl_startup={events / wall:.0f}", flush=True)
    (n0, t0), (n1, t1) = walls
    marginal = (n1 - n0) / (t1 - t0) if t1 > t0 else float("nan")
    print(f"flink marginal events_per_s={marginal:.0f} (parallelism 2; start-up ~{t0 - n0 / marginal:.1f} s)"
          if marginal > 0 else "flink marginal events_per_s=nan", flush=True)
    return {"marginal": marginal}


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=None, help="seconds of ingest per path (10)")
    p.add_argument("--alone", type=float, default=None, help="seconds of processor rounds measured (8)")
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--probes", type=int, default=None, help="event → incident probes per path (40)")
    p.add_argument("--skip", default="", help="comma list of: embedded,kafka,latency,flink,processor")
    p.add_argument("--processor-baseline", default="HEAD",
                   help="git ref whose processor is measured beside this checkout's ('none': skip)")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    quick = args.quick
    duration = args.duration or (1.5 if quick else 10.0)
    alone = args.alone or (1.0 if quick else 8.0)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    load = argparse.Namespace(batch=500, points=5, inflight=2, max_rate=150_000 if quick else 250_000,
                              probes=args.probes or (6 if quick else 40), probe_interval=0.1, poll_ms=10.0,
                              probe_timeout=15.0 if quick else 60.0)
    n_batches = max(2, math.ceil(duration * load.max_rate / args.clients / load.batch))
    print(f"env cpus={os.cpu_count()} duration_s={duration:g} clients={args.clients} batch={load.batch} "
          f"points={load.points} loadavg_1m={os.getloadavg()[0]:.2f}", flush=True)
    root = Path(tempfile.mkdtemp(prefix="trainguard-pipeline-bench-"))
    results: Dict[str, Dict[str, float]] = {}
    broker = None
    try:
        if "embedded" not in skip:
            server = ingest.start_server(root / "embedded")
            try:
                r = ingest.run_load("embedded_ingest", ingest.grpc_client, server, load, "prebuilt",
                                    args.clients, duration, n_batches)
                ingest.print_load(r, load.batch)
                rate, depth = rate_alone(server, alone)
                print(f"embedded processor_alone events_per_s={rate:.0f} backlog_left={depth:.0f}",
                      flush=True)
                results["embedded"] = {"ingest": r.events_per_s, "processor": rate}
            finally:
                server.stop()
        if "kafka" not in skip:
            from tests.support.kafka import Tansu

            broker = Tansu(root / "tansu.log").start()
            topic = f"bench-{uuid.uuid4().hex[:8]}"
            gateway = ingest.start_server(root / "kafka",
                                          server_env=kafka_env(broker.bootstrap, topic, "gateway"))
            try:
                r = ingest.run_load("kafka_ingest", ingest.grpc_client, gateway, load, "prebuilt",
                                    args.clients, duration, n_batches)
                ingest.print_load(r, load.batch)
            finally:
                gateway.stop()
            processor = ingest.start_server(root / "kafka",
                                            server_env=kafka_env(broker.bootstrap, topic, "processor,api"))
            try:
                rate, depth = rate_alone(processor, alone)
                print(f"kafka processor_alone events_per_s={rate:.0f} backlog_left={depth:.0f}", flush=True)
            finally:
                processor.stop()
            results["kafka"] = {"ingest": r.events_per_s, "processor": rate}
        if "latency" not in skip:
            for path in ("embedded", "kafka"):
                if path not in results:
                    continue
                bg = 0.5 * results[path]["processor"] if results[path]["processor"] > 0 else 1000.0
                bg = min(bg, 1000.0) if quick else bg
                for attempt in range(2):  # past the processor's capacity the backlog sets the latency
                    env: List[str] = []
                    if path == "kafka":  # a fresh topic: no backlog of the attempt before
                        assert broker is not None
                        env = kafka_env(broker.bootstrap, f"lat-{uuid.uuid4().hex[:8]}",
                                        "gateway,processor,api")
                    server = ingest.start_server(root / f"{path}-latency-{attempt}", server_env=env)
                    try:
                        print(f"{path}_latency warm_up_s={warm_up(server):.2f}", flush=True)
                        lat = ingest.latency_phase(server, load, bg, f"{path}_latency")
                    finally:
                        server.stop()
                    results[path].update(p50=lat["p50"], p99=lat["p99"], bg=lat["bg"],
                                         kept_up=float(lat["kept_up"]))
                    if lat["kept_up"] or quick or not lat["processed"] > 0:
                        break
                    bg = 0.5 * lat["processed"]  # what this server processed under the probes, halved
                    print(f"{path}_latency did not keep up: again at {bg:.0f} events/s", flush=True)
        if "processor" not in skip:
            shapes = ["sdk16", "env500"] if quick else list(ingest.processor_bench.SHAPES)
            compared = ingest.processor_bench.compare(shapes, args.processor_baseline, quick)
            ingest.processor_bench.print_table(compared, shapes, args.processor_baseline)
            alone = compared["this"].get("env500", {}).get("events_per_s", float("nan"))
            results["processor"] = {"env500": alone,
                                    "sdk16": compared["this"].get("sdk16", {}).get("events_per_s", math.nan)}
        if "flink" not in skip:
            flink = flink_phase(root, (1, 2) if quick else (2, 10))
            if flink is not None:
                results["flink"] = flink
    finally:
        if broker is not None:
            broker.stop(kill=True)
        shutil.rmtree(root, ignore_errors=True)

    print("summary", flush=True)
    print(f"summary {'path':<9} {'ingest_ev_s':>12} {'processor_ev_s':>15} {'p50_ms':>8} {'p99_ms':>8} "
          f"{'background_ev_s':>16}", flush=True)
    for path in ("embedded", "kafka"):
        if path in results:
            r2 = results[path]
            print(f"summary {path:<9} {r2['ingest']:>12.0f} {r2['processor']:>15.0f} "
                  f"{r2.get('p50', float('nan')) * 1000:>8.0f} {r2.get('p99', float('nan')) * 1000:>8.0f} "
                  f"{r2.get('bg', float('nan')):>16.0f}", flush=True)
    if "kafka" in results:
        k = results["kafka"]["ingest"]
        print(f"summary gateway_to_kafka_events_per_s={k:.0f} target={TARGET} ratio={k / TARGET:.2f} "
              f"{'OK' if k >= TARGET else 'BELOW'}", flush=True)
        if "embedded" in results:
            e = results["embedded"]
            print(f"summary ratios kafka/embedded: ingest={k / e['ingest']:.2f} "
                  f"processor={results['kafka']['processor'] / e['processor']:.2f}", flush=True)
    if "processor" in results and "embedded" in results:
        ratio = results["processor"]["env500"] / results["embedded"]["ingest"]
        print(f"summary processor_alone_env500_over_embedded_grpc_ingest={ratio:.3f} target=0.5 "
              f"{'OK' if ratio >= 0.5 else 'BELOW'}", flush=True)
    if "flink" in results:
        print(f"summary flink_marginal_events_per_s={results['flink']['marginal']:.0f}", flush=True)
    print(json.dumps({k: {kk: round(vv, 4) for kk, vv in v.items()} for k, v in results.items()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
