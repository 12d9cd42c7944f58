#!/usr/bin/env python3
"""Which ranks of recorded straggler runs waited for a core (issue 23): the job's own side channel, not the
SDK. Prints tables, asserts nothing.

``tests/fixtures/straggler/job.py`` appends, after every step, each rank's scheduler counters (main thread's
CPU time and run-queue delay from ``/proc/thread-self/schedstat``, the same over all its threads, the core it
last ran on); ``bench/straggler.py --record DIR`` keeps them in ``DIR/sched/<scenario>-<seed>.tsv.gz``. Per
rank and step: ``delay`` = the main thread's run-queue delay over the step's wall time (the share of the step
it was runnable but had no core: 0 on a core of its own, ~0.3-0.5 for a rank sharing its core with a
spinner), ``cpu`` = its CPU time over the wall time. Per run and rank (steady = steps 10 .. from_step-1,
after = from_step+2 ..; healthy runs: 10-29 and 32 on, the same steps): the medians of ``delay`` and
``cpu`` and of the main thread's CPU ms per step (the same work costing more CPU: a busy hyperthread
sibling or a slower clock, which no run-queue delay shows), the worst 10-step window median of ``delay``
(a stretch of contention), the cores it ran on, and the probe's own cost per step.

    python bench/straggler_sched.py /tmp/rec/recA /tmp/rec/recB          # per run and rank (TUNING sets)
    python bench/straggler_sched.py --aggregate /tmp/ho/recA /tmp/ho/recB # per scenario only (held-out sets)
    python bench/straggler_sched.py --inject DST SRC   # add the SDK's time/runqueue_s to older runs

``--inject DST SRC``: copies SRC's recorded runs (``runs/``, ``misses/``) to DST with each rank's main-thread
run-queue delay per step from SRC's side channel added to its step envelope as ``time/runqueue_s`` -- what
the SDK of baf94d1 on sends (the same schedstat counter, read at the optimizer-step boundary; the side
channel reads it right after the step's log call: on a run with both they agreed to the nanosecond, stop 36),
so runs recorded before it can be judged with it (``bench/straggler.py --rejudge DST``). Prints nothing per
run (held-out sets too).
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

PLANTED = ("compute", "loader", "affinity", "affinity_weak", "timeout")
WINDOW = 10
CONTENDED = 0.05  # a worst-window median delay share above this: the rank waited for a core for a stretch

Steps = Dict[int, Dict[str, float]]


def read(path: Path) -> Tuple[Dict[int, Steps], Dict[int, List[str]], List[int]]:
    """rank -> step -> {wall, exec, delay, all_delay, cpu_core, cost} (per-step differences); rank -> the
    affinity lines; every probe cost (ns)."""
    raw: Dict[int, List[List[int]]] = defaultdict(list)
    notes: Dict[int, List[str]] = defaultdict(list)
    rank = -1
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        for line in fh:
            if line.startswith("# rank "):
                rank = int(line.split()[2])
            elif line.startswith("#"):
                notes[rank].append(line[2:].strip())
            elif line[0].isdigit() or line[0] == "-":
                raw[rank].append([int(v) for v in line.split("\t")])
    out: Dict[int, Steps] = {}
    costs: List[int] = []
    for r, rows in raw.items():
        steps: Steps = {}
        for prev, cur in zip(rows, rows[1:]):
            wall = cur[1] - prev[1]
            if wall <= 0:
                continue
            steps[cur[0]] = {"wall": wall, "exec": cur[2] - prev[2], "delay": cur[3] - prev[3],
                             "all_delay": cur[6] - prev[6], "core": cur[7], "cost": cur[8]}
            costs.append(cur[8])
        out[r] = steps
    return out, notes, costs


def _med(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def rank_figures(steps: Steps, from_step: int) -> Dict[str, float]:
    steady = [s for s in steps if 10 <= s < from_step]
    after = [s for s in steps if s >= from_step + 2]
    share = {s: v["delay"] / v["wall"] for s, v in steps.items()}
    cpu = {s: v["exec"] / v["wall"] for s, v in steps.items()}
    judged = sorted(s for s in steps if s >= 10)
    worst = max((_med([share[s] for s in judged[i:i + WINDOW]]) for i in range(len(judged) - WINDOW + 1)),
                default=float("nan"))
    return {"delay_steady": _med([share[s] for s in steady]), "delay_after": _med([share[s] for s in after]),
            "cpu_steady": _med([cpu[s] for s in steady]), "cpu_after": _med([cpu[s] for s in after]),
            "worst": worst, "exec_steady": _med([steps[s]["exec"] / 1e6 for s in steady]),
            "exec_after": _med([steps[s]["exec"] / 1e6 for s in after]),
            "all_delay_after": _med([steps[s]["all_delay"] / steps[s]["wall"] for s in after]),
            "cores": len({v["core"] for v in steps.values()})}


def inject(src: Path, dst: Path) -> int:
    """``--inject``: SRC's recordings with ``time/runqueue_s`` from SRC's side channel, written to DST; the
    number of runs written."""
    written = 0
    for sub in ("runs", "misses"):
        for path in sorted((src / sub).glob("*.jsonl.gz")):
            sched = src / "sched" / (path.name.split(".")[0] + ".tsv.gz")
            delay: Dict[Tuple[int, int], float] = {}
            if sched.exists():
                per_rank, _notes, _cost = read(sched)
                delay = {(r, s): v["delay"] * 1e-9 for r, steps in per_rank.items() for s, v in steps.items()}
            target = dst / sub / path.name
            target.parent.mkdir(parents=True, exist_ok=True)
            with gzip.open(path, "rt", encoding="utf-8") as fin, \
                    gzip.open(target, "wt", encoding="utf-8") as out:
                for line in fin:
                    event = json.loads(line)
                    points = event.get("metrics", {}).get("points", [])
                    key = (event.get("rank", -1), event.get("step", -1))
                    if key in delay and any(p["name"] == "time/step_s" for p in points) and \
                            not any(p["name"] == "time/runqueue_s" for p in points):
                        points.append({"name": "time/runqueue_s", "value": delay[key]})
                    out.write(json.dumps(event, separators=(",", ":")) + "\n")
            written += 1
    return written


def runs(folders: Sequence[Path]) -> List[Tuple[str, int, Path]]:
    out = []
    for folder in folders:
        for path in sorted(folder.glob("sched/*.tsv.gz")):
            scenario, seed = path.name.split(".")[0].rsplit("-", 1)
            out.append((scenario, int(seed), path))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="+", type=Path, help="folders bench/straggler.py --record wrote")
    parser.add_argument("--aggregate", action="store_true", help="per scenario only: for held-out sets")
    parser.add_argument("--from-step", type=int, default=30, help="the slowdown's first step (the bench's)")
    parser.add_argument("--inject", type=Path, default=None, metavar="DST",
                        help="copy the runs of the one folder given to DST with time/runqueue_s added")
    args = parser.parse_args()
    if args.inject is not None:
        (src,) = args.folders
        print(f"{inject(src, args.inject)} runs written to {args.inject}")
        return 0
    agg: Dict[Tuple[str, str], List[Dict[str, float]]] = defaultdict(list)
    costs: List[int] = []
    if not args.aggregate:
        print(f"{'run':22s} rank planted  delay steady->after  worst10  cpu steady->after  all-threads  "
              "cores  cpu_ms/step steady->after")
    for scenario, seed, path in runs(args.folders):
        per_rank, _notes, cost = read(path)
        costs += cost
        slow: Optional[int] = seed % 4 if scenario in PLANTED else None
        for r in sorted(per_rank):
            f = rank_figures(per_rank[r], args.from_step)
            agg[(scenario, "planted" if r == slow else "other")].append(f)
            if not args.aggregate:
                mark = "*" if r == slow else " "
                print(f"{scenario + '-' + str(seed):22s} r{r}   {mark}       {f['delay_steady']:.3f} -> "
                      f"{f['delay_after']:.3f}    {f['worst']:.3f}    {f['cpu_steady']:.2f} -> "
                      f"{f['cpu_after']:.2f}      {f['all_delay_after']:.3f}     {f['cores']:2.0f}   "
                      f"{f['exec_steady']:6.1f} -> {f['exec_after']:6.1f}")
    print(f"\nper scenario (ranks; delay = run-queue delay / step wall, medians per rank; worst = its worst "
          f"{WINDOW}-step window; contended: worst > {CONTENDED})")
    for (scenario, kind), rows in sorted(agg.items()):
        after = sorted(f["delay_after"] for f in rows)
        worst = sorted(f["worst"] for f in rows)
        hit = sum(w > CONTENDED for w in worst)
        print(f"  {scenario:14s} {kind:8s} ranks {len(rows):3d}  delay after: median {_med(after):.3f} max "
              f"{after[-1]:.3f}  worst window: median {_med(worst):.3f} max {worst[-1]:.3f}  contended {hit}"
              f"  cpu/wall after: median {_med([f['cpu_after'] for f in rows]):.2f}  cpu ms per step "
              f"after/steady: max {max(f['exec_after'] / f['exec_steady'] for f in rows):.2f}")
    if costs:
        costs.sort()
        print(f"\nthe probe's own cost per step: median {costs[len(costs) // 2] / 1000:.0f} us, 99th "
              f"percentile {costs[int(0.99 * (len(costs) - 1))] / 1000:.0f} us ({len(costs)} samples)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
