#!/usr/bin/env python3
"""Dashboard and query API on a run with 1M metric points, against a small run in the same process.

A real ``trainguard serve`` (bench/ingest.py starts it) gets two runs over gRPC, built as the SDK builds
metric envelopes (5 points per step): ``big`` with 200,000 steps (1,000,000 points) and ``small`` with 200
steps (1,000 points). Once the processor has stored every point:

* ``api_metrics``: ``GET /api/v1/runs/<run>/metrics?names=<the 5>&max_points=600`` (what a run page asks:
  server-side downsampling to min/max/mean buckets), ``--requests`` times per run: p50/p99 ms;
* ``page_load``: the dashboard's run page in headless Chromium (Debian's, through its chromedriver), from
  navigation until every chart has drawn its points (read from the charts themselves), ``--loads`` times
  per run: p50/max ms.

Printed with the big/small ratio. Nothing is asserted.

    python bench/dashboard.py            # ~1 min
    python bench/dashboard.py --quick    # 20,000 steps (100k points): a smoke run
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path
from typing import Dict, List

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
for _p in (BENCH, REPO, REPO / "sdk" / "src", REPO / "engine" / "src", REPO / "services" / "src"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import ingest  # noqa: E402

POINTS = 5
NAMES = ",".join(ingest.METRIC_NAMES[:POINTS])
CHARTS_DRAWN_JS = """
const els = Array.from(document.querySelectorAll('[data-metric]'));
if (!els.length || !window.echarts) return false;
return els.every(el => { const c = echarts.getInstanceByDom(el);
  return c && c.getOption().series.some(s => s.data.length > 0); });
"""


def feed(server: ingest.Server, run_id: str, steps: int) -> None:
    from trainguard.v1 import ingest_pb2

    factory = ingest.BatchFactory(ingest.identity(server.project, run_id, 0, 1), POINTS, f"{run_id}-",
                                  time.time_ns())
    channel = ingest._grpc_channel(server.grpc_target)
    send = channel.unary_unary(ingest.SEND_METHOD, request_serializer=None,
                               response_deserializer=ingest_pb2.IngestResponse.FromString)
    metadata = (("authorization", f"Bearer {server.ingest_token}"),)
    try:
        for first in range(0, steps, 500):
            while True:
                try:
                    send(factory.request(first, min(500, steps - first)), metadata=metadata, timeout=30)
                    break
                except Exception as exc:  # backpressure (429): the processor is behind; wait
                    if "RESOURCE_EXHAUSTED" not in str(exc):
                        raise
                    time.sleep(0.2)
    finally:
        channel.close()


def stored_points(server: ingest.Server, run_id: str) -> int:
    status, body = ingest.http_get(server.http_port, f"/api/v1/runs/{run_id}/metrics/summary",
                                   server.read_token)
    return sum(s["count"] for s in json.loads(body)) if status == 200 else 0


def api_latency(server: ingest.Server, run_id: str, n: int) -> List[float]:
    path = f"/api/v1/runs/{run_id}/metrics?names={urllib.parse.quote(NAMES)}&max_points=600"
    out = []
    for _ in range(n):
        started = time.perf_counter()
        status, body = ingest.http_get(server.http_port, path, server.read_token)
        out.append(time.perf_counter() - started)
        assert status == 200 and json.loads(body)["series"], body[:200]
    return out


def page_loads(server: ingest.Server, run_id: str, n: int) -> List[float]:
    from tests.support.browser import chrome

    driver = chrome()
    out = []
    try:
        driver.get(server.http_url + "/ui/")
        token = json.dumps(server.read_token)
        driver.execute_script(f"localStorage.setItem('trainguard.readToken', {token})")
        for _ in range(n):
            driver.get("about:blank")
            started = time.perf_counter()
            driver.get(f"{server.http_url}/ui/#/runs/{run_id}")
            while not driver.execute_script(CHARTS_DRAWN_JS):
                if time.perf_counter() - started > 60:
                    raise RuntimeError("charts not drawn within 60 s")
                time.sleep(0.005)
            out.append(time.perf_counter() - started)
    finally:
        driver.quit()
    return out


def main(argv: List[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=None, help="steps of the big run (200,000 = 1M points)")
    p.add_argument("--requests", type=int, default=30)
    p.add_argument("--loads", type=int, default=5)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    big_steps = args.steps or (20_000 if args.quick else 200_000)
    root = Path(tempfile.mkdtemp(prefix="trainguard-dashboard-bench-"))
    server = ingest.start_server(root / "serve")
    results: Dict[str, Dict[str, float]] = {}
    try:
        runs = {"small": ("bench-small", 200), "big": ("bench-big", big_steps)}
        started = time.monotonic()
        for run_id, steps in runs.values():
            feed(server, run_id, steps)
        for run_id, steps in runs.values():
            deadline = time.monotonic() + 600
            while stored_points(server, run_id) < steps * POINTS:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{run_id}: only {stored_points(server, run_id)} points stored")
                time.sleep(0.5)
        total = sum(s for _r, s in runs.values()) * POINTS
        print(f"fed {total:,} points in {time.monotonic() - started:.1f} s", flush=True)
        for label, (run_id, steps) in runs.items():
            api = [x * 1000 for x in api_latency(server, run_id, args.requests)]
            page = [x * 1000 for x in page_loads(server, run_id, args.loads)]
            results[label] = {"points": steps * POINTS, "api_p50": statistics.median(api),
                              "api_p99": sorted(api)[max(0, int(0.99 * len(api)) - 1)],
                              "page_p50": statistics.median(page), "page_max": max(page)}
            r = results[label]
            print(f"dashboard run={label} points={r['points']:,.0f} api_metrics p50_ms={r['api_p50']:.1f} "
                  f"p99_ms={r['api_p99']:.1f} page_load p50_ms={r['page_p50']:.0f} "
                  f"max_ms={r['page_max']:.0f}", flush=True)
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
    b, s = results["big"], results["small"]
    print(f"summary points big/small={b['points'] / s['points']:.0f}x "
          f"api_p50 ratio={b['api_p50'] / s['api_p50']:.2f} "
          f"page_load_p50 ratio={b['page_p50'] / s['page_p50']:.2f}", flush=True)
    print(json.dumps(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
