#!/usr/bin/env python3
"""One project floods, another's incidents: the per-project backlog bound
(TRAINGUARD_PROJECT_MAX_BACKLOG_EVENTS) against no bound, in one run. Prints numbers and ratios, asserts
nothing.

For each setting (``--bounds``, default ``100000`` -- serve's default -- and ``0``: off, as before) a fresh
``trainguard serve`` subprocess (bench/ingest.py's ``start_server``) gets a second project, ``victim``, with
its own ingest and read tokens. Then, for ``--duration`` s, ``--clients`` processes of the bootstrap project
send pre-built 500-envelope gRPC batches as fast as the server answers (``--inflight`` calls outstanding each;
a refused batch is counted and the next one sent: the flood never waits), while the victim sends, every
``--probe-interval`` s, one metric batch with ``loss = NaN`` for a fresh run (bench/ingest.py's probe, what
the SDK sends) and polls its incidents with its read token every 20 ms. Reported per setting: the flood's
accepted
and refused (RESOURCE_EXHAUSTED) batches and accepted events/s, the victim's probes acknowledged and refused,
and its event -> incident latency p50 / p99 / max; then each figure's ratio to the unbounded setting.

    python bench/tenants.py                    # ~1.5 minutes
    python bench/tenants.py --duration 30 --clients 3
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, List, Tuple

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
for _src in (BENCH, REPO / "sdk" / "src", REPO / "services" / "src"):
    if str(_src) not in sys.path:
        sys.path.insert(0, str(_src))

import ingest  # noqa: E402  (bench/ingest.py)

VICTIM = "victim"


def flood(target: str, token: str, project: str, client: int, batches: int, inflight: int, end_at: float,
          out: Any) -> None:
    """One flooding client: its pre-built batches sent round and round until ``end_at`` (a batch sent again
    repeats its event ids: the stores keep each once, the processor still reads it)."""
    import collections

    import grpc

    from trainguard.v1 import ingest_pb2

    ident = ingest.identity(project, f"flood-{os.getpid()}-{client}", client, 1)
    factory = ingest.BatchFactory(ident, 5, f"{client:04x}{os.getpid() & 0xFFFFFFFF:08x}", time.time_ns())
    requests = [factory.request(i * 500, 500) for i in range(batches)]
    channel = ingest._grpc_channel(target)
    send = channel.unary_unary(ingest.SEND_METHOD, request_serializer=None,
                               response_deserializer=ingest_pb2.IngestResponse.FromString)
    metadata = (("authorization", f"Bearer {token}"),)
    counts = {"accepted_events": 0, "accepted": 0, "refused": 0, "other": 0}
    pending: collections.deque = collections.deque()
    nxt = 0
    while time.time() < end_at:
        while len(pending) < inflight:
            pending.append(send.future(requests[nxt % len(requests)], metadata=metadata, timeout=60))
            nxt += 1
        try:
            resp = pending.popleft().result()
            counts["accepted"] += 1
            counts["accepted_events"] += resp.accepted
        except grpc.RpcError as err:
            counts["refused" if err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED else "other"] += 1
    for fut in pending:
        try:
            fut.result()
        except grpc.RpcError:
            pass
    channel.close()
    out.put(counts)


def token(data_dir: Path, kind: str) -> str:
    path = os.pathsep.join(str(REPO / d / "src") for d in ("sdk", "engine", "services"))
    proc = subprocess.run([sys.executable, "-m", "trainguard_server", "token", "create", "--data-dir",
                           str(data_dir), "--project", VICTIM, "--kind", kind], capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=path), check=True)
    return proc.stdout.strip().splitlines()[-1].split()[-1]


def probes(server: Any, ingest_token: str, read_token: str, count: int, interval: float,
           timeout: float) -> List[Tuple[float, str]]:
    """The victim's NaN probes: (event -> incident seconds, or inf; how its batch was answered)."""
    import grpc

    from trainguard.v1 import ingest_pb2

    channel = ingest._grpc_channel(server.grpc_target)
    send = channel.unary_unary(ingest.SEND_METHOD, request_serializer=None,
                               response_deserializer=ingest_pb2.IngestResponse.FromString)
    metadata = (("authorization", f"Bearer {ingest_token}"),)
    tag = os.urandom(3).hex()

    def probe(i: int, at: float) -> Tuple[float, str]:
        time.sleep(max(0.0, at - time.monotonic()))
        run_id = f"probe-{tag}-{i:03d}"
        t_sent = time.monotonic()
        try:
            resp = send(ingest.probe_request(VICTIM, run_id, time.time_ns()), metadata=metadata, timeout=30)
        except grpc.RpcError as err:
            return float("inf"), err.code().name
        if resp.accepted != 1:
            return float("inf"), "not accepted"
        path = f"/api/v1/runs/{run_id}/incidents"
        while time.monotonic() - t_sent < timeout:
            status, data = ingest.http_get(server.http_port, path, read_token)
            if status == 200 and json.loads(data)["items"]:
                return time.monotonic() - t_sent, "OK"
            time.sleep(0.02)
        return float("inf"), "OK"

    begin = time.monotonic() + 0.1
    with ThreadPoolExecutor(max_workers=16) as pool:
        out = list(pool.map(lambda i: probe(i, begin + i * interval), range(count)))
    channel.close()
    return out


def one(bound: int, args: argparse.Namespace, root: Path) -> Dict[str, float]:
    data_dir = root / f"bound-{bound}"
    server = ingest.start_server(data_dir, server_env=[f"TRAINGUARD_PROJECT_MAX_BACKLOG_EVENTS={bound}"])
    try:
        victim_ingest, victim_read = token(data_dir, "ingest"), token(data_dir, "read")
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        end_at = time.time() + args.duration + 8.0  # the clients build their batches first (a few s)
        clients = [ctx.Process(target=flood, args=(server.grpc_target, server.ingest_token, server.project,
                                                   c, args.batches, args.inflight, end_at, out), daemon=True)
                   for c in range(args.clients)]
        for c in clients:
            c.start()
        time.sleep(8.0 + args.warmup)
        count = max(1, int((args.duration - args.warmup) / args.probe_interval))
        results = probes(server, victim_ingest, victim_read, count, args.probe_interval, args.probe_timeout)
        counts: Dict[str, int] = {}
        for _ in clients:
            for k, v in out.get(timeout=120).items():
                counts[k] = counts.get(k, 0) + v
        for c in clients:
            c.join(30)
    finally:
        server.stop()
    lat = sorted(r[0] for r in results)
    acked = sum(1 for r in results if r[1] == "OK")
    figures = {"flood_accepted_events_per_s": counts["accepted_events"] / args.duration,
               "flood_accepted_batches": counts["accepted"], "flood_refused_batches": counts["refused"],
               "flood_other_errors": counts["other"], "victim_probes": len(results), "victim_acked": acked,
               "victim_p50_s": ingest._percentile(lat, 0.5), "victim_p99_s": ingest._percentile(lat, 0.99),
               "victim_max_s": lat[-1]}
    print(f"bound={bound} " + " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                                         for k, v in figures.items()), flush=True)
    return figures


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bounds", default="100000,0",
                   help="TRAINGUARD_PROJECT_MAX_BACKLOG_EVENTS values; 0: off")
    p.add_argument("--duration", type=float, default=30.0)
    p.add_argument("--warmup", type=float, default=5.0, help="seconds of flood before the first probe")
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--inflight", type=int, default=4)
    p.add_argument("--batches", type=int, default=200, help="distinct pre-built batches per flooding client")
    p.add_argument("--probe-interval", type=float, default=1.0)
    p.add_argument("--probe-timeout", type=float, default=120.0)
    args = p.parse_args()
    print(f"# bench/tenants.py cpus={os.cpu_count()} loadavg_1m={os.getloadavg()[0]:.1f} "
          f"duration={args.duration:g}s clients={args.clients} inflight={args.inflight}", flush=True)
    figures: Dict[int, Dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="tg-tenants-") as tmp:
        for bound in [int(b) for b in args.bounds.split(",")]:
            figures[bound] = one(bound, args, Path(tmp))
    if 0 in figures:
        base = figures[0]
        for bound, f in figures.items():
            if bound:
                p99 = f["victim_p99_s"] / base["victim_p99_s"] if base["victim_p99_s"] else float("nan")
                rate = f["flood_accepted_events_per_s"] / max(1e-9, base["flood_accepted_events_per_s"])
                print(f"ratio bound={bound} / off: victim p99 {p99:.3f}x, "
                      f"flood accepted events/s {rate:.3f}x", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
