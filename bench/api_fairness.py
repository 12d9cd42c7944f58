#!/usr/bin/env python3
"""One project's many readers, another project's latency: the per-project bound on query-API requests in
flight (TRAINGUARD_API_MAX_REQUESTS_PER_PROJECT) against no bound, in one run. Prints numbers and ratios,
asserts nothing.

For each setting (``--bounds``, default ``8`` -- serve's default -- and ``0``: off, as before) a fresh
``trainguard serve`` subprocess (bench/ingest.py's ``start_server``) gets a second project, ``noisy``, with
its own tokens and ``--runs`` runs of log and exception events. The bootstrap project (the victim) then
measures, every ``--interval`` s, one HTTP ingest of a metric batch and one ``GET /api/v1/runs``: first
``--quiet`` s alone, then ``--duration`` s while ``--clients`` threads of ``noisy`` list runs, clusters,
incidents and a run's events and search, as fast as answered (a 429 is counted and the client sleeps its
Retry-After, as a client should; ``--ignore-retry-after`` retries at once instead). Reported per setting: the
victim's read and ingest latency p50 / p95 / max, quiet and loaded, the loaded/quiet ratio, the noisy
clients' answers by status and rate; then each loaded figure's ratio to the unbounded setting.

    python bench/api_fairness.py                   # ~1 minute
    python bench/api_fairness.py --clients 80 --duration 20
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any, Dict, List

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
for _src in (BENCH, REPO / "sdk" / "src", REPO / "services" / "src"):
    if str(_src) not in sys.path:
        sys.path.insert(0, str(_src))

import httpx  # noqa: E402
import ingest  # noqa: E402  (bench/ingest.py)

NOISY = "noisy"


def token(data_dir: Path, project: str, kind: str) -> str:
    path = os.pathsep.join(str(REPO / d / "src") for d in ("sdk", "engine", "services"))
    proc = subprocess.run([sys.executable, "-m", "trainguard_server", "token", "create", "--data-dir",
                           str(data_dir), "--project", project, "--kind", kind], capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=path), check=True)
    return proc.stdout.strip().splitlines()[-1].split()[-1]


def _envelope(run_id: str, step: int, **payload: Any) -> Dict[str, Any]:
    return {"event_id": uuid.uuid4().hex, "run_id": run_id, "step": step, "time_unix_nano": time.time_ns(),
            "severity": "ERROR" if "exception" in payload else "INFO", **payload}


def post(client: httpx.Client, token: str, events: List[Dict[str, Any]]) -> httpx.Response:
    return client.post("/v1/ingest", content=json.dumps({"events": events}).encode(),
                       headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})


def seed_noisy(client: httpx.Client, ingest_token: str, runs: int) -> None:
    """``runs`` runs of the noisy project, each with 40 log lines, an exception and a few metrics."""
    for r in range(runs):
        run_id = f"noisy-{r:03d}"
        events = [_envelope(run_id, s, log={"message": f"step {s} loss {1.0 / (s + 1):.4f} error budget ok",
                                            "source": "stdout"}) for s in range(40)]
        events.append(_envelope(run_id, 40, exception={"type": "RuntimeError",
                                                       "message": f"CUDA error: device-side assert {r % 7}",
                                                       "frames": [{"filename": "train.py", "function": "step",
                                                                   "lineno": 10 + r % 5}]}))
        events.append(_envelope(run_id, 41, metrics={"points": [{"name": "loss", "value": 0.5}]}))
        answer = post(client, ingest_token, events)
        answer.raise_for_status()
        if answer.json()["rejected"]:
            raise RuntimeError(f"seed events rejected: {answer.json()['rejected'][:2]}")


def noisy_reader(url: str, read_token: str, runs: int, stop: threading.Event, honour_retry: bool,
                 counts: Counter) -> None:  # type: ignore[type-arg]
    paths = ["/api/v1/runs?limit=50", "/api/v1/clusters", "/api/v1/search?q=error", "/api/v1/incidents"]
    with httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {read_token}"}) as client:
        i = 0
        while not stop.is_set():
            path = paths[i % len(paths)] if i % 5 else f"/api/v1/runs/noisy-{i % runs:03d}/events?limit=100"
            i += 1
            try:
                r = client.get(path)
            except httpx.HTTPError:
                counts["error"] += 1
                continue
            counts[str(r.status_code)] += 1
            if r.status_code == 429 and honour_retry:
                stop.wait(float(r.headers.get("retry-after", "1")))


def victim_probes(url: str, ingest_token: str, read_token: str, seconds: float,
                  interval: float) -> Dict[str, List[float]]:
    out: Dict[str, List[float]] = {"read": [], "ingest": [], "read_status": [], "ingest_status": []}
    with httpx.Client(base_url=url, timeout=60) as client:
        end = time.monotonic() + seconds
        step = 0
        while time.monotonic() < end:
            t0 = time.perf_counter()
            r = post(client, ingest_token, [_envelope("victim-run", step,
                                                      metrics={"points": [{"name": "loss", "value": 0.3}]})])
            out["ingest"].append(time.perf_counter() - t0)
            out["ingest_status"].append(r.status_code)
            t0 = time.perf_counter()
            r = client.get("/api/v1/runs", headers={"Authorization": f"Bearer {read_token}"})
            out["read"].append(time.perf_counter() - t0)
            out["read_status"].append(r.status_code)
            step += 1
            time.sleep(interval)
    return out


def _stats(values: List[float]) -> Dict[str, float]:
    v = sorted(values)
    return {"p50": ingest._percentile(v, 0.5), "p95": ingest._percentile(v, 0.95), "max": v[-1]}


def one(bound: int, args: argparse.Namespace, root: Path) -> Dict[str, float]:
    data_dir = root / f"bound-{bound}"
    server = ingest.start_server(data_dir, server_env=[f"TRAINGUARD_API_MAX_REQUESTS_PER_PROJECT={bound}"])
    url = f"http://127.0.0.1:{server.http_port}"
    try:
        noisy_ingest, noisy_read = token(data_dir, NOISY, "ingest"), token(data_dir, NOISY, "read")
        with httpx.Client(base_url=url, timeout=60) as client:
            seed_noisy(client, noisy_ingest, args.runs)
        time.sleep(2.0)  # the processor stores the seed
        quiet = victim_probes(url, server.ingest_token, server.read_token, args.quiet, args.interval)
        stop = threading.Event()
        counts: Counter = Counter()  # type: ignore[type-arg]
        honour = not args.ignore_retry_after
        readers = [threading.Thread(target=noisy_reader, daemon=True,
                                    args=(url, noisy_read, args.runs, stop, honour, counts))
                   for _ in range(args.clients)]
        for t in readers:
            t.start()
        time.sleep(1.0)
        loaded = victim_probes(url, server.ingest_token, server.read_token, args.duration, args.interval)
        stop.set()
        for t in readers:
            t.join(60)
    finally:
        server.stop()
    figures: Dict[str, float] = {}
    for what in ("read", "ingest"):
        for phase, data in (("quiet", quiet), ("loaded", loaded)):
            for k, v in _stats(data[what]).items():
                figures[f"victim_{what}_{phase}_{k}_s"] = v
        figures[f"victim_{what}_loaded_over_quiet_p50"] = (figures[f"victim_{what}_loaded_p50_s"]
                                                           / max(1e-9, figures[f"victim_{what}_quiet_p50_s"]))
        figures[f"victim_{what}_not_ok"] = sum(1 for s in loaded[f"{what}_status"] if s != 200)
    total = sum(counts.values())
    figures["noisy_requests_per_s"] = total / args.duration
    for status, n in sorted(counts.items()):
        figures[f"noisy_{status}"] = n
    print(f"bound={bound} " + " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                                       for k, v in figures.items()), flush=True)
    return figures


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bounds", default="8,0", help="TRAINGUARD_API_MAX_REQUESTS_PER_PROJECT values; 0: off")
    p.add_argument("--clients", type=int, default=80, help="reader threads of the noisy project")
    p.add_argument("--runs", type=int, default=60, help="runs of the noisy project")
    p.add_argument("--quiet", type=float, default=5.0, help="seconds the victim is measured alone")
    p.add_argument("--duration", type=float, default=15.0, help="seconds measured under the noisy readers")
    p.add_argument("--interval", type=float, default=0.1, help="seconds between the victim's probes")
    p.add_argument("--ignore-retry-after", action="store_true", help="noisy clients retry a 429 at once")
    args = p.parse_args()
    bounds = [int(b) for b in args.bounds.split(",")]
    print(f"# api_fairness: {args.clients} noisy readers, {args.runs} runs, {args.duration:g} s loaded, "
          f"{os.cpu_count()} CPUs, loadavg {os.getloadavg()[0]:.1f}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        results = {b: one(b, args, Path(tmp)) for b in bounds}
    if 0 in results and len(results) > 1:
        base = results[0]
        for b, figures in results.items():
            if b == 0:
                continue
            ratios = {k: v / base[k] for k, v in figures.items()
                      if k.startswith("victim_") and "loaded" in k and k.endswith("_s") and base.get(k)}
            print(f"ratio bound={b} / off: " + " ".join(f"{k}={v:.2f}x" for k, v in ratios.items()),
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
