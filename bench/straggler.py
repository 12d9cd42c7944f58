#!/usr/bin/env python3
"""The straggler and throughput detectors (issue 23) on real 4-rank DDP jobs: prints a table, asserts nothing.

Each run is ``torchrun --standalone --nproc-per-node 4 tests/fixtures/straggler/job.py`` (gloo, CPU; the
job's docstring says how a rank is made slow), its four ranks' SDK streams merged by event time and
replayed through the engine (``Pipeline.process`` one envelope at a time, then ``advance`` a minute after
the last one). Per run: the perf incidents opened, the straggler's lead rank against the one made slow,
and how many steps after the slowdown began the straggler (or the regression) was first emitted.

Scenarios (``--seeds N`` runs of each, seeds 0..N-1; the slow rank is ``seed % 4``):

* ``healthy``     -- nothing slowed: must give neither a straggler nor a regression;
* ``compute``     -- one rank does ``--factor`` x the work from step ``--from-step``;
* ``loader``      -- one rank's batches go through a CPU-bound transform;
* ``affinity``    -- one rank is pinned to one core shared with a spinning process;
* ``affinity_weak`` -- the same with the spinner at nice ``--spin-nice`` (3: the rank keeps ~2/3 of its core,
  ~1.5x slower: a weak contention, inside what a loaded host does to a healthy rank for a stretch);
* ``slow_all``    -- every rank does ``--factor`` x the work from step ``--from-step``: a regression, no
  straggler;
* ``data_all``    -- every rank's batches go through the CPU-bound transform: a data-loader bottleneck,
  no straggler;
* ``timeout``     -- ``compute``, then the slow rank stops: its peers' all-reduce times out; must be one
  incident, the straggler, with the timeout as its consequence.

    python bench/straggler.py                        # every scenario, --seeds 5 (healthy: --healthy 20)
    python bench/straggler.py --only healthy --healthy 20
    python bench/straggler.py --record tests/fixtures/straggler   # also keep each scenario's first run
    python bench/straggler.py --only healthy,affinity,compute --healthy 6 --seeds 3 --first-seed 100 \
        --record /tmp/fresh --record-all                           # a held-out set, judged later: --rejudge

With ``--record``, each kept run's side channel (every rank's run-queue delay and CPU time per step, written
by the job itself, not the SDK) is kept in ``DIR/sched/<scenario>-<seed>.tsv.gz``: bench/straggler_sched.py.

On this repository's 2-core machine one run takes 15-25 s (four torch processes on two cores).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "tests" / "fixtures" / "straggler" / "job.py"
SETTLE_NS = 60 * 10**9
SCENARIOS = ("healthy", "compute", "loader", "affinity", "affinity_weak", "slow_all", "data_all", "timeout")
HEADER = ("scenario   seed slow_rank rc  wall_s  straggler(rank, +steps)  regression(+steps)  verdict  "
          "incidents")


@dataclass
class Outcome:
    scenario: str
    seed: int
    slow_rank: int
    from_step: int
    rc: int
    wall_s: float
    kinds: List[str] = field(default_factory=list)   # open or resolved perf/comm incidents, not explained
    straggler_rank: int = -1
    straggler_after: int = -1     # steps after from_step when it was first emitted
    regression_after: int = -1
    consequences: List[str] = field(default_factory=list)
    unexplained: List[str] = field(default_factory=list)  # every incident not explained by another

    def verdict(self) -> str:
        s = self.scenario
        has_s, has_r = "perf/straggler" in self.kinds, "perf/throughput-regression" in self.kinds
        if s == "healthy":
            return "ok" if not has_s and not has_r else "FALSE ALARM"
        if s == "slow_all":
            return "ok" if has_r and not has_s else "MISSED" if not has_r else "WRONG (straggler)"
        if s == "data_all":
            has_d = "perf/data-bottleneck" in self.kinds
            return "ok" if has_d and not has_s else "MISSED" if not has_d else "WRONG (straggler)"
        ok = has_s and self.straggler_rank == self.slow_rank and 0 <= self.straggler_after <= 30
        if s == "timeout":
            ok = ok and self.unexplained == ["perf/straggler"] and \
                any(c.startswith("comm/timeout") for c in self.consequences)
        return "ok" if ok else "MISSED" if not has_s else "WRONG"


def _free_port() -> int:
    """A TCP port nothing listens on now (the kernel's pick): two benches side by side, or a run right after
    another, must not meet on one rendezvous port (a fixed pid + seed formula did: EADDRINUSE)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_job(out: Path, scenario: str, seed: int, steps: int, factor: float, from_step: int,
            timeout_s: float, spin_nice: int = 3, hidden: int = 0) -> int:
    run_id = f"straggler-{scenario}-{seed}-{os.getpid()}-{int(time.time())}"
    args = ["--out", str(out), "--run-id", run_id, "--steps", str(steps), "--seed", str(seed),
            "--from-step", str(from_step)]
    if hidden:
        args += ["--hidden", str(hidden)]
    slow_rank = seed % 4
    if scenario in ("compute", "loader", "affinity"):
        args += ["--slow", scenario, "--slow-rank", str(slow_rank), "--factor", str(factor)]
    elif scenario == "affinity_weak":
        args += ["--slow", "affinity", "--slow-rank", str(slow_rank), "--spin-nice", str(spin_nice)]
    elif scenario == "slow_all":
        args += ["--slow-all", str(factor)]
    elif scenario == "data_all":
        args += ["--slow-data-all", str(factor)]
    elif scenario == "timeout":
        args += ["--slow", "compute", "--slow-rank", str(slow_rank), "--factor", str(factor),
                 "--hang-at", str(from_step + 25), "--hang-s", "30", "--timeout-s", "8"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "sdk" / "src"), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    port = _free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port",
           str(port), "--nnodes", "1", "--node-rank", "0", str(JOB), *args]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0 and scenario != "timeout":
        sys.stderr.write(proc.stderr[-3000:])
    return proc.returncode


def merged_events(out: Path) -> List[Dict[str, Any]]:
    """The four ranks' streams merged by event time (stable), as a backend roughly receives them."""
    events: List[Dict[str, Any]] = []
    for path in sorted(out.glob("rank*.jsonl")):
        with open(path, encoding="utf-8") as fh:
            events += [json.loads(line) for line in fh if line.strip()]
    events.sort(key=lambda e: int(e["time_unix_nano"]))
    return events


def judge(events: List[Dict[str, Any]], outcome: Outcome) -> None:
    """Replay ``events`` through the engine; fill ``outcome``."""
    from trainguard_engine.catalogue import DetectionSettings
    from trainguard_engine.pipeline import Pipeline

    pipeline = Pipeline(DetectionSettings())
    for event in events:
        for inc in pipeline.process([event]).incidents:
            kind = f"{inc.category}/{inc.subtype}"
            if kind == "perf/straggler" and outcome.straggler_after < 0:
                outcome.straggler_after = inc.last_step - outcome.from_step
            if kind == "perf/throughput-regression" and outcome.regression_after < 0:
                outcome.regression_after = inc.last_step - outcome.from_step
    if events:
        pipeline.advance(int(events[-1]["time_unix_nano"]) + SETTLE_NS)
    for inc in pipeline.incidents():
        kind = f"{inc.category}/{inc.subtype}"
        if inc.explained_by:
            continue
        outcome.unexplained.append(kind)
        if inc.category in ("perf", "comm"):
            outcome.kinds.append(kind)
        if kind == "perf/straggler":
            outcome.straggler_rank = inc.lead_rank
            outcome.consequences = list(inc.consequences)


def one(scenario: str, seed: int, args: argparse.Namespace, record: Optional[Path],
        all_runs: bool = False) -> Outcome:
    from_step = 0 if scenario in ("healthy", "data_all") else args.from_step
    out = Path(tempfile.mkdtemp(prefix=f"straggler-{scenario}-"))
    started = time.perf_counter()
    try:
        rc = run_job(out, scenario, seed, args.steps, args.factor, from_step, args.run_timeout,
                     args.spin_nice, args.hidden)
        slow = seed % 4 if scenario not in ("healthy", "slow_all", "data_all") else -1
        outcome = Outcome(scenario, seed, slow, from_step, rc, time.perf_counter() - started)
        events = merged_events(out)
        judge(events, outcome)
        if record is not None:
            target = record / f"{scenario}.jsonl.gz"
            if outcome.verdict() != "ok" or all_runs:
                folder = "misses" if outcome.verdict() != "ok" else "runs"
                target = record / folder / f"{scenario}-{seed}.jsonl.gz"
                target.parent.mkdir(parents=True, exist_ok=True)
            if not target.exists():
                with gzip.open(target, "wt", encoding="utf-8") as fh:
                    for e in events:
                        fh.write(json.dumps(e, separators=(",", ":")) + "\n")
                keep_sched(out, record / "sched" / f"{scenario}-{seed}.tsv.gz")
        return outcome
    finally:
        shutil.rmtree(out, ignore_errors=True)


def keep_sched(out: Path, target: Path) -> None:
    """The job's side channel (``sched<R>.tsv``: each rank's scheduler counters per step, written by the
    job, not the SDK) packed beside the recording, the ranks one after the other (each begins ``# rank R``);
    ``bench/straggler_sched.py`` reads it. Nothing when the job wrote none."""
    files = sorted(out.glob("sched*.tsv"))
    if not files:
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(target, "wt", encoding="utf-8") as fh:
        for path in files:
            fh.write(path.read_text(encoding="utf-8"))


def rejudge(folder: Path) -> List[Outcome]:
    """Judge again the runs a ``--record DIR --record-all`` run kept (``DIR/runs``, ``DIR/misses``) with
    this checkout's engine: the same real runs under changed detection settings."""
    outcomes: List[Outcome] = []
    files = sorted(folder.glob("runs/*.jsonl.gz")) + sorted(folder.glob("misses/*.jsonl.gz"))
    def key(path: Path) -> Tuple[int, int]:
        name, seed = path.name.split(".")[0].split("-")
        return SCENARIOS.index(name), int(seed)

    for path in sorted(files, key=key):
        scenario, seed = path.name.split("-")[0], key(path)[1]
        with gzip.open(path, "rt", encoding="utf-8") as fh:
            events = [json.loads(line) for line in fh if line.strip()]
        start = next((e for e in events if e.get("lifecycle", {}).get("phase") == "START"), None)
        if start is None:  # the job never started (a failed rendezvous): nothing to judge
            print(f"# {path.name}: no START event (the job did not start), not judged", flush=True)
            continue
        job = start["lifecycle"]["tags"]
        slow = int(job["slow_rank"]) if scenario not in ("healthy", "slow_all", "data_all") else -1
        outcome = Outcome(scenario, seed, slow, int(job["from_step"]), 0, 0.0)
        judge(events, outcome)
        outcomes.append(outcome)
    return outcomes


def cost(baseline: str, world: int, steps: int, repeats: int) -> None:
    """The perf detector's share of the pipeline's CPU time on bench/processor.py's SDK-shaped stream
    (``world`` ranks, ``steps`` steps: time/step_s and the hooks' metrics, no phases), in one process:
    the pipeline with this checkout's detector, with ``baseline``'s detector module (``git show``) in its
    place, and with a detector that does nothing (the floor). Medians of ``repeats`` interleaved runs."""
    import importlib.util

    sys.path.insert(0, str(REPO / "bench"))
    import processor as shapes  # bench/processor.py's stream generator

    from trainguard_engine.catalogue import DetectionSettings
    from trainguard_engine.detectors import straggler as current
    from trainguard_engine.pipeline import Pipeline

    path = "engine/src/trainguard_engine/detectors/straggler.py"
    source = subprocess.run(["git", "show", f"{baseline}:{path}"], cwd=REPO, capture_output=True, text=True,
                            check=True).stdout
    spec = importlib.util.spec_from_loader("trainguard_engine.detectors._perf_baseline", loader=None)
    assert spec is not None
    base = importlib.util.module_from_spec(spec)
    base.__package__ = "trainguard_engine.detectors"
    exec(compile(source, f"{baseline}:straggler.py", "exec"), base.__dict__)
    requests = list(shapes.sdk_requests("bench", "perf-cost", world, steps))
    mine = current.Performance.on_metrics
    variants = {"this checkout": lambda self, run, rank, batch, settings: current.on_metrics(
                    run, rank, batch, settings),
                f"baseline {baseline}": lambda self, run, rank, batch, settings: base.on_metrics(
                    run, rank, batch, settings),
                "no-op detector": lambda self, run, rank, batch, settings: []}
    spent: Dict[str, List[float]] = {name: [] for name in variants}
    try:
        for _ in range(repeats):
            for name, fn in variants.items():
                current.Performance.on_metrics = fn  # type: ignore[method-assign]
                pipeline = Pipeline(DetectionSettings())
                started = time.process_time()
                for request in requests:
                    pipeline.process(request)
                spent[name].append(time.process_time() - started)
    finally:
        current.Performance.on_metrics = mine  # type: ignore[method-assign]
    med = {name: sorted(v)[len(v) // 2] for name, v in spent.items()}
    floor = med["no-op detector"]
    events = sum(len(r) for r in requests)
    print(f"# {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; {world} ranks x {steps} steps, "
          f"{events} events; CPU seconds, median of {repeats}")
    print(f"{'detector':28s} {'pipeline_s':>10s} {'detector_s':>10s} {'share':>6s} {'us/event':>9s}")
    for name, value in med.items():
        print(f"{name:28s} {value:10.3f} {value - floor:10.3f} {100 * (value - floor) / value:5.1f}% "
              f"{1e6 * (value - floor) / events:9.2f}")
    ratio = (med["this checkout"] - floor) / max(med[f"baseline {baseline}"] - floor, 1e-9)
    print(f"detector cost, this checkout / baseline: {ratio:.2f}")


def print_row(o: Outcome) -> None:
    strag = f"{o.straggler_rank}, +{o.straggler_after}" if "perf/straggler" in o.kinds else "-"
    reg = f"+{o.regression_after}" if "perf/throughput-regression" in o.kinds else "-"
    extra = f" consequences={o.consequences}" if o.consequences else ""
    print(f"{o.scenario:10s} {o.seed:4d} {o.slow_rank:9d} {o.rc:3d} {o.wall_s:7.1f}  {strag:23s}  "
          f"{reg:18s}  {o.verdict():7s}  {','.join(o.unexplained) or '-'}{extra}", flush=True)


def summary(outcomes: List[Outcome], scenarios: List[str]) -> None:
    print("\nsummary")
    for scenario in scenarios:
        mine = [o for o in outcomes if o.scenario == scenario]
        if not mine:
            continue
        good = sum(o.verdict() == "ok" for o in mine)
        lat = sorted(o.straggler_after for o in mine if o.straggler_after >= 0) or \
            sorted(o.regression_after for o in mine if o.regression_after >= 0)
        lat_text = f" steps to detection: median {lat[len(lat) // 2]}, max {lat[-1]}" if lat else ""
        print(f"  {scenario:10s} {good}/{len(mine)} ok{lat_text}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="comma-separated scenarios")
    parser.add_argument("--seeds", type=int, default=5, help="runs of each slowed scenario")
    parser.add_argument("--healthy", type=int, default=20, help="healthy runs")
    parser.add_argument("--first-seed", type=int, default=0,
                        help="seeds first-seed..first-seed+N-1 (a held-out set: seeds not tuned on)")
    parser.add_argument("--steps", type=int, default=70)
    parser.add_argument("--from-step", type=int, default=30)
    parser.add_argument("--factor", type=float, default=2.5)
    parser.add_argument("--spin-nice", type=int, default=3, help="affinity_weak: the spinner's nice value")
    parser.add_argument("--hidden", type=int, default=0,
                        help="the job's MLP width (0: the job's default, 256). On a quiet many-core host "
                             "a step of the default model is mostly fixed per-step cost, so --factor x the "
                             "compute is only ~1.1-1.8x the rank's own time; 1024 makes it mostly compute")
    parser.add_argument("--run-timeout", type=float, default=240.0)
    parser.add_argument("--record", default="", help="folder: keep each scenario's first run (gzip JSONL)")
    parser.add_argument("--record-all", action="store_true", help="with --record: keep every run (runs/)")
    parser.add_argument("--rejudge", default="", help="judge again the runs kept by --record-all")
    parser.add_argument("--json", default="", help="also write the outcomes as JSON here")
    parser.add_argument("--cost", default="", metavar="REF",
                        help="print the detector's CPU share on an SDK-shaped stream, beside REF's detector")
    parser.add_argument("--cost-ranks", type=int, default=16)
    parser.add_argument("--cost-steps", type=int, default=300)
    parser.add_argument("--cost-repeats", type=int, default=7)
    args = parser.parse_args()
    if args.cost:
        cost(args.cost, args.cost_ranks, args.cost_steps, args.cost_repeats)
        return 0
    scenarios = list(SCENARIOS)
    if args.rejudge:
        print(f"# re-judged with this checkout's engine: the runs kept in {args.rejudge}")
        print(HEADER)
        outcomes = rejudge(Path(args.rejudge))
        for o in outcomes:
            print_row(o)
        summary(outcomes, scenarios)
        if args.json:
            Path(args.json).write_text(json.dumps([o.__dict__ for o in outcomes], indent=1))
        return 0
    if args.only:
        scenarios = [s for s in scenarios if s in args.only.split(",")]
    record = Path(args.record) if args.record else None
    outcomes: List[Outcome] = []
    print(f"# {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start; 4 ranks, gloo, "
          f"{args.steps} steps, slowdown x{args.factor} from step {args.from_step}", flush=True)
    print(HEADER, flush=True)
    for scenario in scenarios:
        runs = args.healthy if scenario == "healthy" else (min(2, args.seeds) if scenario == "timeout"
                                                           else args.seeds)
        for seed in range(args.first_seed, args.first_seed + runs):
            o = one(scenario, seed, args, record, args.record_all)
            outcomes.append(o)
            print_row(o)
    summary(outcomes, scenarios)
    if args.json:
        Path(args.json).write_text(json.dumps([o.__dict__ for o in outcomes], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
