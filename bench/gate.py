#!/usr/bin/env python3
"""The CI gate (``trainguard gate``) on real canary trainings: false fails and detections.

A real ``trainguard serve`` gets real canary trainings with the SDK (``python -m
trainguard_server.demo.trainings canary``: the demo MLP, 200 steps, deterministic by seed):

* the baseline: 3 healthy runs, seeds 0-2, defined through the API from their tag;
* 20 healthy candidates, seeds 100-119: every verdict should be pass (exit 0) -- the false-fail rate;
* regressions, 2 seeds each: the LR divided by 2, 3.3 and 10 (the loss envelope), a code change raising a
  new exception at step 120 (the fingerprint), 64 MiB and 256 MiB more memory kept alive (peak memory:
  +21% warns, +84% fails under the default policy), a data pipeline 0.1 ms and 0.5 ms slower per batch (step
  time: warns above +25% under the default policy, which never fails on step time).

Each candidate is gated through ``POST /api/v1/gate`` (timed: the gate's latency as a CI job sees it).
Then, with the pure functions on the same fetched runs, the false-fail rate over many baselines: every
healthy run (23) against baselines of 2, 3 and 5 other healthy runs drawn at random (``--resample`` draws
each), and the LR regressions' detection rate over the same baselines.

    python bench/gate.py --markdown bench/results/gate_summary_lr.md | tee bench/results/gate.txt  # ~4 min
    python bench/gate.py --quick                           # 5 healthy candidates, 1 seed per regression
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, List, Tuple

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
for _p in (BENCH, REPO, REPO / "sdk" / "src", REPO / "engine" / "src", REPO / "services" / "src"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import ingest  # noqa: E402

from trainguard_server.gate.client import GateClient  # noqa: E402

TAG = "gate=bench"
REGRESSIONS: Dict[str, Tuple[str, ...]] = {
    "lr/2": ("--lr", "0.025"),
    "lr/3.3": ("--lr", "0.015"),
    "lr/10": ("--lr", "0.005"),
    "new exception": ("--raise-at", "120"),
    "memory +64 MiB": ("--extra-memory-mb", "64"),
    "memory +256 MiB": ("--extra-memory-mb", "256"),
    "data +0.1 ms/step": ("--data-delay-ms", "0.1"),
    "data +0.5 ms/step": ("--data-delay-ms", "0.5"),
}


def train(server: ingest.Server, run_id: str, flags: Tuple[str, ...]) -> int:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    env.update(PYTHONPATH=os.pathsep.join([str(REPO / d / "src") for d in ("sdk", "engine", "services")]),
               TRAINGUARD_ENDPOINT=server.http_url, TRAINGUARD_TOKEN=server.ingest_token,
               TRAINGUARD_RUN_ID=run_id, TRAINGUARD_FLUSH_INTERVAL="0.2",
               TRAINGUARD_SPOOL_DIR=str(server.data_dir.parent / f"spool-{run_id}"))
    done = subprocess.run([sys.executable, "-m", "trainguard_server.demo.trainings", "canary", "--steps",
                           "200", *flags], env=env, capture_output=True, text=True, timeout=300)
    return done.returncode


def wait_ended(client: GateClient, run_id: str, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = client.run_status(run_id)
        if status not in (None, "running"):
            return str(status)
        time.sleep(0.2)
    raise RuntimeError(f"run {run_id} did not end")


def failing(verdict: Dict[str, Any]) -> str:
    bad = [f"{c['name']}={c['status']}" for c in verdict["checks"]
           if c["status"] in ("fail", "warn", "undecided")]
    return ", ".join(bad) or "-"


def step_change(verdict: Dict[str, Any]) -> str:
    for c in verdict["checks"]:
        if c["name"] == "step_time" and "change_pct" in c["figures"]:
            return f"{c['figures']['change_pct']:+.0f}%"
    return "-"


def loss_z(verdict: Dict[str, Any]) -> str:
    for c in verdict["checks"]:
        if c["name"] == "loss" and "max_z" in c["figures"]:
            z = c["figures"]["max_z"]
            return f"{z:.1f}" if isinstance(z, (int, float)) else str(z)
    return "-"


def resampled(data: Dict[str, Any], healthy: List[str], lr_runs: Dict[str, List[str]], draws: int,
              seed: int = 0) -> None:
    """False-fail and LR detection rates over random baselines, with the pure profile/compare functions."""
    from trainguard_server.gate.compare import evaluate
    from trainguard_server.gate.policy import Policy
    from trainguard_server.gate.profile import build_profile

    policy = Policy()
    rng = random.Random(seed)
    for n in (2, 3, 5):
        fails = total = 0
        detected = {name: 0 for name in lr_runs}
        tried = {name: 0 for name in lr_runs}
        for _ in range(draws):
            base = rng.sample(healthy, n)
            profile = build_profile([data[r] for r in base], policy)
            for run in healthy:
                if run in base:
                    continue
                total += 1
                fails += evaluate(profile, data[run], policy).verdict == "fail"
            for name, runs in lr_runs.items():
                for run in runs:
                    tried[name] += 1
                    loss = {c.name: c for c in evaluate(profile, data[run], policy).checks}["loss"]
                    detected[name] += loss.status == "fail"
        rates = "  ".join(f"{name} {detected[name] / tried[name]:.0%}" for name in lr_runs)
        print(f"resampled n={n}: false-fail {fails}/{total} = {fails / total:.2%} (healthy runs vs {draws} "
              f"random baselines of {n}); loss check detects {rates}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--healthy", type=int, default=20, help="healthy candidate seeds (20)")
    parser.add_argument("--resample", type=int, default=200, help="random baselines per size (200)")
    parser.add_argument("--workers", type=int, default=1,
                        help="trainings at once (1, as a CI job runs its canary; more share the cores)")
    parser.add_argument("--markdown", help="write the LR regression's markdown summary here")
    args = parser.parse_args()
    healthy_n = 5 if args.quick else args.healthy
    seeds_per_regression = 1 if args.quick else 2
    tmp = Path(tempfile.mkdtemp(prefix="tg-bench-gate-"))
    server = ingest.start_server(tmp / "data")
    client = GateClient(server.http_url, server.read_token)
    try:
        jobs: List[Tuple[str, Tuple[str, ...]]] = [(f"base-{s}", ("--seed", str(s), "--tag", TAG))
                                                    for s in range(3)]
        jobs += [(f"healthy-{s}", ("--seed", str(s))) for s in range(100, 100 + healthy_n)]
        regression_runs: Dict[str, List[str]] = {}
        for i, (name, flags) in enumerate(REGRESSIONS.items()):
            for j in range(seeds_per_regression):
                run_id = f"reg-{i}-{j}"
                regression_runs.setdefault(name, []).append(run_id)
                jobs.append((run_id, ("--seed", str(200 + 10 * i + j), *flags)))
        started = time.monotonic()
        with ThreadPoolExecutor(max_workers=args.workers) as pool:
            codes = dict(zip([j[0] for j in jobs], pool.map(lambda j: train(server, *j), jobs)))
        for run_id, _ in jobs:
            wait_ended(client, run_id)
        print(f"{len(jobs)} canary trainings (200 steps each, {args.workers} at a time; step time below: "
              f"the change of a run's 10th-percentile step against the baseline's) in "
              f"{time.monotonic() - started:.1f} s; exit codes: "
              f"{json.dumps({k: v for k, v in codes.items() if v})} non-zero, the rest 0", flush=True)
        t0 = time.perf_counter()
        baseline = client.define_baseline("bench", {"tag": TAG})
        print(f"baseline 'bench' defined from {TAG}: runs {sorted(baseline['profile']['runs'])} in "
              f"{(time.perf_counter() - t0) * 1e3:.0f} ms", flush=True)

        latencies: List[float] = []

        def gate(run_id: str) -> Dict[str, Any]:
            t = time.perf_counter()
            verdict = client.gate("bench", run_id, None)
            latencies.append((time.perf_counter() - t) * 1e3)
            return verdict

        print("\nhealthy candidates (default policy):")
        verdicts = {}
        for s in range(100, 100 + healthy_n):
            v = verdicts[f"healthy-{s}"] = gate(f"healthy-{s}")
            print(f"  seed {s}: {v['verdict']:<5} exit {v['exit_code']}  loss max z {loss_z(v):>5}  "
                  f"step time {step_change(v):>5}  flagged: {failing(v)}", flush=True)
        fails = sum(v["exit_code"] == 1 for v in verdicts.values())
        undecided = sum(v["exit_code"] == 2 for v in verdicts.values())
        warns = sum(v["verdict"] == "warn" for v in verdicts.values())
        print(f"false-fail rate: {fails}/{healthy_n} = {fails / healthy_n:.0%} (undecided {undecided}, "
              f"passed with a warning {warns})")

        print("\nregressions (default policy):")
        lr_verdict: Dict[str, Any] = {}
        for name, runs in regression_runs.items():
            for run_id in runs:
                v = gate(run_id)
                if name == "lr/10" and not lr_verdict:
                    lr_verdict = v
                caught = ("DETECTED" if v["exit_code"] == 1 else
                          "warned" if v["verdict"] == "warn" else "missed")
                print(f"  {name:<17} {run_id}: {caught:<8} {v['verdict']:<5} exit {v['exit_code']}  "
                      f"loss max z {loss_z(v):>5}  step time {step_change(v):>5}  flagged: {failing(v)}",
                      flush=True)
        print(f"\ngate latency (POST /api/v1/gate, {len(latencies)} calls): p50 "
              f"{statistics.median(latencies):.0f} ms, max {max(latencies):.0f} ms")
        if args.markdown and lr_verdict:
            from trainguard_server.gate.report import markdown

            Path(args.markdown).write_text(markdown(lr_verdict), encoding="utf-8")

        # the same runs through the pure functions, against many baselines
        from trainguard_server.gate.fetch import StoreReader
        from trainguard_server.storage.sqlite import open_sqlite_stores

        stores = open_sqlite_stores(server.data_dir)
        try:
            reader = StoreReader(stores.incidents, stores.metrics, stores.events, server.project)
            metrics = ["loss", "time/step_s", "mem/rss"]
            healthy = [f"base-{s}" for s in range(3)]
            healthy += [f"healthy-{s}" for s in range(100, 100 + healthy_n)]
            lr_runs = {k: v for k, v in regression_runs.items() if k.startswith("lr/")}
            wanted = healthy + [x for v in lr_runs.values() for x in v]
            data = {r: reader.run_data(r, metrics) for r in wanted}
            print()
            t = time.perf_counter()
            resampled(data, healthy, lr_runs, 20 if args.quick else args.resample)
            print(f"(resampling took {time.perf_counter() - t:.1f} s)")
        finally:
            stores.close()
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
