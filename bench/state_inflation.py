#!/usr/bin/env python3
"""One project inflates its state with metric names, another's incidents: event -> incident latency of a
victim project while a noisy project sends ``--runs`` runs of ``--names`` distinct metric names per step, per
TRAINGUARD_RUN_MAX_METRIC_NAMES setting (``--backlog``: TRAINGUARD_PROJECT_MAX_BACKLOG_EVENTS, serve's default
unless given). Prints numbers and ratios, asserts nothing.

For each setting (``--caps``, default ``5000`` -- serve's default -- and ``0``: off) a fresh ``trainguard
serve`` subprocess (bench/ingest.py's ``start_server``) gets a second project, ``victim`` (bench/tenants.py's
tokens and NaN probes). The victim's probes are measured ``--quiet`` s alone, then for ``--duration`` s while
one gRPC client of the bootstrap project sends, as fast as answered, one request per step holding one
envelope per run of ``--names`` points (``--fresh``: new names at every step, a name flood; else the same
names every step, a wide but steady run). Reported per setting: the victim's event -> incident p50 / p99 /
max quiet and loaded, the noisy client's steps acknowledged, envelopes rejected (``too_many_metric_names``)
and the server's resident memory before and after; then the loaded figures' ratios to the setting ``0``.

    python bench/state_inflation.py                 # same names, ~2 minutes
    python bench/state_inflation.py --fresh         # a flood of new names
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, List

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
for _src in (BENCH, REPO / "sdk" / "src", REPO / "services" / "src"):
    if str(_src) not in sys.path:
        sys.path.insert(0, str(_src))

import ingest  # noqa: E402  (bench/ingest.py)
import tenants  # noqa: E402  (bench/tenants.py)

from trainguard_server.config import Settings  # noqa: E402


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def noisy(server: Any, runs: int, names: int, fresh: bool, stop: threading.Event,
          counts: Dict[str, int]) -> None:
    import grpc

    from trainguard.v1 import ingest_pb2

    channel = ingest._grpc_channel(server.grpc_target)
    send = channel.unary_unary(ingest.SEND_METHOD,
                               request_serializer=ingest_pb2.IngestRequest.SerializeToString,
                               response_deserializer=ingest_pb2.IngestResponse.FromString)
    metadata = (("authorization", f"Bearer {server.ingest_token}"),)
    tag = os.urandom(3).hex()
    step = 0
    while not stop.is_set():
        step += 1
        request = ingest_pb2.IngestRequest()
        now = time.time_ns()
        for r in range(runs):
            env = request.events.add(event_id=f"{tag}-{r}-{step}", run_id=f"wide-{tag}-{r:02d}", step=step,
                                     time_unix_nano=now, project=server.project)
            prefix = f"s{step}/" if fresh else ""
            for i in range(names):
                env.metrics.points.add(name=f"{prefix}layer/{i:05d}/grad_norm", value=1.0 + (i % 7))
        try:
            resp = send(request, metadata=metadata, timeout=60)
        except grpc.RpcError as err:
            counts[err.code().name] = counts.get(err.code().name, 0) + 1
            stop.wait(1.0)
            continue
        counts["steps"] = counts.get("steps", 0) + 1
        counts["accepted"] = counts.get("accepted", 0) + resp.accepted
        for rej in resp.rejected:
            counts[rej.code] = counts.get(rej.code, 0) + 1
    channel.close()


def _lat(results: List[Any]) -> Dict[str, float]:
    lat = sorted(r[0] for r in results)
    return {"p50": ingest._percentile(lat, 0.5), "p99": ingest._percentile(lat, 0.99), "max": lat[-1]}


def one(cap: int, args: argparse.Namespace, root: Path) -> Dict[str, float]:
    data_dir = root / f"cap-{cap}"
    # bench/ingest.py's start_server turns the per-project backlog bound off; this bench keeps serve's own
    server = ingest.start_server(data_dir, server_env=[f"TRAINGUARD_RUN_MAX_METRIC_NAMES={cap}",
                                                       f"TRAINGUARD_PROJECT_MAX_BACKLOG_EVENTS={args.backlog}"])
    try:
        victim_ingest, victim_read = tenants.token(data_dir, "ingest"), tenants.token(data_dir, "read")
        count = max(1, int(args.quiet / args.probe_interval))
        quiet = tenants.probes(server, victim_ingest, victim_read, count, args.probe_interval,
                               args.probe_timeout)
        rss_before = rss_mib(server.pid)
        stop = threading.Event()
        counts: Dict[str, int] = {}
        client = threading.Thread(target=noisy,
                                  args=(server, args.runs, args.names, args.fresh, stop, counts))
        client.start()
        time.sleep(args.warmup)
        count = max(1, int((args.duration - args.warmup) / args.probe_interval))
        loaded = tenants.probes(server, victim_ingest, victim_read, count, args.probe_interval,
                                args.probe_timeout)
        stop.set()
        client.join(120)
        rss_after = rss_mib(server.pid)
    finally:
        server.stop()
    figures: Dict[str, float] = {}
    for phase, results in (("quiet", quiet), ("loaded", loaded)):
        for k, v in _lat(results).items():
            figures[f"victim_{phase}_{k}_s"] = v
    figures.update({f"noisy_{k}": float(v) for k, v in counts.items()})
    figures["rss_before_mib"], figures["rss_after_mib"] = rss_before, rss_after
    print(f"cap={cap} " + " ".join(f"{k}={v:.3f}" for k, v in figures.items()), flush=True)
    return figures


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--caps", default="5000,0", help="TRAINGUARD_RUN_MAX_METRIC_NAMES values; 0: off")
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--names", type=int, default=5000, help="metric names per envelope (one per run and step)")
    p.add_argument("--fresh", action="store_true", help="new names at every step (a name flood)")
    p.add_argument("--backlog", type=int, default=Settings.model_fields["project_max_backlog_events"].default,
                   help="TRAINGUARD_PROJECT_MAX_BACKLOG_EVENTS (default: serve's; 0: off)")
    p.add_argument("--duration", type=float, default=30.0)
    p.add_argument("--warmup", type=float, default=5.0, help="seconds of noise before the first loaded probe")
    p.add_argument("--quiet", type=float, default=8.0, help="seconds of probes before the noise")
    p.add_argument("--probe-interval", type=float, default=1.0)
    p.add_argument("--probe-timeout", type=float, default=60.0)
    args = p.parse_args()
    caps = [int(c) for c in args.caps.split(",")]
    kind = "fresh" if args.fresh else "same"
    print(f"# state_inflation: {args.runs} runs x {args.names} names per step ({kind} names), "
          f"backlog bound {args.backlog}, {args.duration:g} s, {os.cpu_count()} CPUs, "
          f"loadavg {os.getloadavg()[0]:.1f}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        results = {c: one(c, args, Path(tmp)) for c in caps}
    if 0 in results and len(results) > 1:
        for c, figures in results.items():
            if c:
                print(f"ratio cap={c} / off: " + " ".join(
                    f"{k}={v / results[0][k]:.2f}x" for k, v in figures.items()
                    if k.startswith("victim_loaded") and results[0].get(k)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
