#!/usr/bin/env python3
"""Per-rank step phases of recorded straggler runs (issue 23): where a slowed rank's time goes, and whether
its peers' collective wait tells it from a host's own scatter. Prints tables, asserts nothing.

Reads runs kept by ``bench/straggler.py --record DIR --record-all`` (gzip JSONL, the four ranks' SDK
events). For each run and rank, medians of each phase over the steady state (steps 10 .. from_step-1) and
after the slowdown (from_step+2 ..), then three per-step signals, each against the same step's other ranks:

* ``own``    -- data + forward + optimizer (the detector's own time) over the others' median;
* ``nowait`` -- step - backward_wait (everything but the all-reduce wait) over the others' median;
* ``gap``    -- the others' median ``time/backward_wait_s`` minus the rank's, as a share of the job's step
  (> 0: they waited for it);

and, with ``--rule RATIO GAP GROWTH``, a candidate rule counted the detector's way: a rank is over at a step
when its own ratio >= RATIO and its gap >= GAP; named when over on >= 18 of its last 28 steps while its
window's median own ratio >= GROWTH x its steady-state median (the step it would be named, and the most
steps over any window reached, per rank). Only for tuning sets: never run it on held-out recordings.

    python bench/straggler_phases.py /tmp/rec/pair5/misses/compute-1500.jsonl.gz
    python bench/straggler_phases.py --rule 1.35 0.1 1.25 /tmp/rec/pair*/*/*.jsonl.gz
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from collections import defaultdict
from typing import Dict, List, Optional, Sequence, Tuple

PHASES = ("time/data_s", "time/forward_s", "time/backward_s", "time/backward_wait_s", "time/optimizer_s",
          "time/step_s")
SHORT = {"time/data_s": "data", "time/forward_s": "fwd", "time/backward_s": "bwd",
         "time/backward_wait_s": "wait", "time/optimizer_s": "opt", "time/step_s": "step"}
WINDOW, STEPS, STEADY_FROM = 28, 18, 10

Phases = Dict[Tuple[int, int], Dict[str, float]]


def load(path: str) -> Tuple[Phases, Dict[str, str]]:
    """(rank, step) -> phase seconds, and the job's START tags."""
    phases: Phases = defaultdict(dict)
    tags: Dict[str, str] = {}
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        for line in fh:
            event = json.loads(line)
            life = event.get("lifecycle") or {}
            if life.get("phase") == "START":
                tags = dict(life.get("tags") or {})
            for point in (event.get("metrics") or {}).get("points", []):
                if point["name"] in PHASES:
                    phases[(int(event["rank"]), int(event["step"]))][point["name"]] = float(point["value"])
    return phases, tags


def own(x: Dict[str, float]) -> float:
    return x["time/data_s"] + x["time/forward_s"] + x["time/optimizer_s"]


def signals(phases: Phases, ranks: Sequence[int], rank: int, step: int) -> Tuple[float, float, float]:
    """(own ratio, no-wait ratio, wait gap share) of ``rank`` at ``step`` against the other ranks."""
    x, others = phases[(rank, step)], [phases[(q, step)] for q in ranks if q != rank]
    job_step = statistics.median(phases[(q, step)]["time/step_s"] for q in ranks)
    own_r = own(x) / statistics.median(own(y) for y in others)
    nowait = (x["time/step_s"] - x["time/backward_wait_s"]) / statistics.median(
        y["time/step_s"] - y["time/backward_wait_s"] for y in others)
    waits = statistics.median(y["time/backward_wait_s"] for y in others)
    gap = (waits - x["time/backward_wait_s"]) / job_step
    return own_r, nowait, gap


def candidate(ratios: List[float], gaps: List[float], steps: List[int], rule: Sequence[float]
              ) -> Tuple[int, Optional[int]]:
    """(most steps over in any window after the steady state, the step it would be named or None)."""
    bar, gap_bar, growth = rule
    over = [r >= bar and g >= gap_bar for r, g in zip(ratios, gaps)]
    steady = statistics.median(ratios[:20])
    best, named = 0, None
    for i in range(20, len(steps)):
        window = slice(max(0, i - WINDOW + 1), i + 1)
        if statistics.median(ratios[window]) < growth * steady:
            continue
        best = max(best, sum(over[window]))
        if named is None and sum(over[window]) >= STEPS:
            named = steps[i]
    return best, named


def report(path: str, rule: Optional[Sequence[float]]) -> None:
    phases, tags = load(path)
    slow = int(tags.get("slow_rank", -1)) if tags.get("slow", "none") != "none" else -1
    start = int(tags.get("from_step") or 0) or 30  # a healthy run: the same split as a slowed one
    ranks = sorted({r for r, _ in phases})
    steps = [s for s in sorted({s for _, s in phases}) if s >= STEADY_FROM
             and all(all(k in phases.get((r, s), {}) for k in PHASES) for r in ranks)]
    before = [s for s in steps if s < start]
    after = [s for s in steps if s >= start + 2]
    print(f"{path.rsplit('/', 1)[-1]}  slow={tags.get('slow', 'none')} rank {slow}  split at step {start}")
    if not before or not after or len(ranks) < 2:
        print("   (too few complete steps)")
        return
    for r in ranks:
        cols = []
        for name in PHASES:
            b = statistics.median(phases[(r, s)][name] for s in before)
            a = statistics.median(phases[(r, s)][name] for s in after)
            cols.append(f"{SHORT[name]} {b * 1e3:5.1f}->{a * 1e3:5.1f}")
        sig = [signals(phases, ranks, r, s) for s in steps]
        n_before = len(before)
        meds = [(statistics.median(v[k] for v in sig[:n_before]),
                 statistics.median(v[k] for v in sig[n_before:])) for k in range(3)]
        text = "  ".join(f"{name} {b:5.2f}->{a:5.2f}" for name, (b, a) in zip(("own", "nowait", "gap"), meds))
        mark = "*" if r == slow else " "
        line = f"   r{r}{mark} ms: {' | '.join(cols)}\n        {text}"
        if rule is not None:
            best, named = candidate([v[0] for v in sig], [v[2] for v in sig], steps, rule)
            when = "-" if named is None else f"+{named - start}"
            line += f"  rule: most over {best}/{WINDOW}, named {when}"
        print(line)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="recorded runs (.jsonl.gz)")
    parser.add_argument("--rule", nargs=3, type=float, metavar=("RATIO", "GAP", "GROWTH"),
                        help="count a candidate rule (tuning sets only)")
    args = parser.parse_args()
    for path in args.runs:
        report(path, args.rule)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
