#!/usr/bin/env python3
"""Run the training shapes of :mod:`bench.unseen.shapes` (none of them in bench/corpus) and judge each.

Each shape runs as its own process, configured only through ``TRAINGUARD_*`` variables (a ``file://``
endpoint); its stream is then fed, event by event, through a fresh engine pipeline with the default
``DetectionSettings`` (``bench.corpus.evaluate.judge``). A healthy shape is right when no WARNING+ incident
is open at its end; a failing shape when its expected kind is among its incidents (open or resolved).

    python -m bench.unseen.probe                 # every shape, 2 at a time (~8 min on 2 cores)
    python -m bench.unseen.probe --only plain_mlp_nan_input,hf_gpt2_default_logging_ok
    python -m bench.unseen.probe --rejudge       # judge the streams already in --out again (engine changes)
    python -m bench.unseen.probe --heldout       # stop 35's held-out shapes (HELDOUT_SHAPES), scored with
                                                 # the trace rules below; run ONCE, with the engine kept

Held-out scoring (``HELDOUT_SHAPES``, rules decided with that list, before any of it ran): from the loss
the run reported, its initial level is the median of its first 5 values; a failing shape is scored only
when its cause manifested (a value >= 2x the initial level, or a non-finite one), and is right when one of
its expected kinds (``a|b``) is among its incidents; any shape whose loss ended learned (the median of its
last 20 values <= 0.85x the initial level, the last one finite) must also end with no WARNING+ incident
open -- a run that blew up and recovered must not be left with a stale alarm.

This set was never used to tune a detector threshold: keep it that way (it is an outside check; what it
finds is fixed in the SDK/integrations or becomes new corpus material).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.corpus.evaluate import judge, read_events  # noqa: E402
from bench.unseen.shapes import HEALTHY, HELDOUT_SHAPES, SHAPES, UNMANIFESTED  # noqa: E402
from trainguard_engine.catalogue import DetectionSettings  # noqa: E402
from trainguard_engine.records import INCIDENT_RESOLVED, SEVERITY_ORDER  # noqa: E402

DEFAULT_OUT = REPO / "bench" / "unseen" / "out"


def record(name: str, out: Path) -> Optional[str]:
    """Run one shape into ``out/<name>.jsonl``; an error text or None."""
    stream = out / f"{name}.jsonl"
    stream.unlink(missing_ok=True)
    env = dict(
        os.environ,
        TRAINGUARD_ENDPOINT=stream.resolve().as_uri(),
        TRAINGUARD_PROJECT="unseen",
        TRAINGUARD_SPOOL_DIR=str(out / "spool" / name),
        TRAINGUARD_FLUSH_INTERVAL="0.5",
        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    )
    done = subprocess.run(
        [sys.executable, "-m", "bench.unseen.shapes", name], env=env, cwd=REPO, capture_output=True, text=True
    )
    (out / f"{name}.log").write_text(done.stdout + done.stderr, encoding="utf-8")
    return None if done.returncode == 0 else f"exit {done.returncode}: {done.stderr.strip()[-300:]}"


def loss_trace(events: Sequence[Dict[str, Any]]) -> List[float]:
    """The run's reported ``loss`` values, one per step (the last one sent for a step), in step order."""
    by_step: Dict[int, float] = {}
    for event in events:
        for point in (event.get("metrics") or {}).get("points") or ():
            if point.get("name") == "loss" and isinstance(event.get("step"), int):
                by_step[event["step"]] = float(point.get("value"))
    return [by_step[k] for k in sorted(by_step)]


def trace_facts(losses: Sequence[float]) -> Dict[str, Optional[bool]]:
    """``manifested`` (a loss >= 2x the initial level or non-finite) and ``learned`` (the last 20 values'
    median <= 0.85x the initial level, the last one finite); the initial level: the first 5 values' median."""
    if len(losses) < 5:
        return {"manifested": None, "learned": None}
    start = statistics.median(losses[:5])
    finite = [v for v in losses if math.isfinite(v)]
    manifested = len(finite) < len(losses) or max(finite) >= 2 * start
    learned = math.isfinite(losses[-1]) and statistics.median(losses[-20:]) <= 0.85 * start
    return {"manifested": manifested, "learned": learned}


def heldout_verdict(name: str, out: Path) -> Dict[str, object]:
    """:func:`verdict` for a held-out shape, scored with the trace rules of the module's docstring."""
    expected = HELDOUT_SHAPES[name][0]
    events = read_events(out / f"{name}.jsonl")
    facts = trace_facts(loss_trace(events))
    v = _judged(name, events, expected)
    kinds, open_alerts = v["incidents"], v["open_alerts"]

    def right(skip_perf: bool) -> Optional[bool]:
        still_open = [k for k in open_alerts if not (skip_perf and k.startswith("perf/"))]  # type: ignore[attr-defined]
        if expected == HEALTHY:
            return not still_open
        if not facts["manifested"]:
            return None
        found = any(k.split(":")[0] in expected.split("|") for k in kinds)  # type: ignore[attr-defined]
        return found and not (facts["learned"] and still_open)

    v.update(right=right(False), right_but_perf=right(True), **facts)
    return v


def _judged(name: str, events: Sequence[Dict[str, Any]], expected: str) -> Dict[str, object]:
    incidents, visible, _ = judge(events, DetectionSettings())
    mine = [i for i in incidents if not i.explained_by]
    alert = SEVERITY_ORDER["warning"]
    open_alerts = sorted(
        {
            f"{i.category}/{i.subtype}"
            for i in mine
            if i.status != INCIDENT_RESOLVED and SEVERITY_ORDER.get(i.severity, 0) >= alert
        }
    )
    kinds = [
        f"{i.category}/{i.subtype}:{i.status}@{visible.get(f'{i.category}/{i.subtype}', '?')}" for i in mine
    ]
    return {"name": name, "expected": expected, "incidents": kinds, "open_alerts": open_alerts}


def verdict(name: str, out: Path) -> Dict[str, object]:
    """The engine's incidents on one recorded shape and whether they are what the shape expects
    (``right`` None: not scored); ``right_but_perf``: the same with ``perf/*`` incidents left out (on a
    shared machine a neighbour's load slows a job for real: the throughput detector is right to say so,
    but it says nothing of the training)."""
    expected = SHAPES[name][0]
    incidents, visible, _ = judge(read_events(out / f"{name}.jsonl"), DetectionSettings())
    mine = [i for i in incidents if not i.explained_by]
    alert = SEVERITY_ORDER["warning"]
    open_alerts = sorted(
        {
            f"{i.category}/{i.subtype}"
            for i in mine
            if i.status != INCIDENT_RESOLVED and SEVERITY_ORDER.get(i.severity, 0) >= alert
        }
    )
    kinds = [
        f"{i.category}/{i.subtype}:{i.status}@{visible.get(f'{i.category}/{i.subtype}', '?')}" for i in mine
    ]

    def right(skip_perf: bool) -> Optional[bool]:
        if expected == UNMANIFESTED:
            return None
        if expected == HEALTHY:
            return not [k for k in open_alerts if not (skip_perf and k.startswith("perf/"))]
        return any(k.split(":")[0] in expected.split("|") for k in kinds)

    return {
        "name": name,
        "expected": expected,
        "right": right(False),
        "right_but_perf": right(True),
        "incidents": kinds,
        "open_alerts": open_alerts,
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated shape names (default: all)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--rejudge", action="store_true", help="judge the recorded streams, record nothing")
    parser.add_argument("--heldout", action="store_true", help="stop 35's held-out shapes (run them ONCE)")
    args = parser.parse_args(argv)
    names: List[str] = [n for n in args.only.split(",") if n] or list(
        HELDOUT_SHAPES if args.heldout else SHAPES
    )
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.rejudge:
        started = time.monotonic()
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            errors = dict(zip(names, pool.map(lambda n: record(n, args.out), names)))
        for name, error in errors.items():
            if error:
                print(f"{name}: FAILED to run ({error})")
        print(f"recorded {len(names)} shapes in {time.monotonic() - started:.0f} s (--jobs {args.jobs})")
    tally = {(group, perf): [0, 0] for group in ("healthy", "failing") for perf in (True, False)}
    for name in names:
        if not (args.out / f"{name}.jsonl").exists():
            continue
        v = heldout_verdict(name, args.out) if name in HELDOUT_SHAPES else verdict(name, args.out)
        mark = {True: "ok  ", False: "MISS", None: "n/a "}[v["right"]]  # type: ignore[index]
        trace = f" [manifested {v['manifested']}, learned {v['learned']}]" if "learned" in v else ""
        print(f"{mark} {name:34s} expected {v['expected']:22s} got {', '.join(v['incidents']) or '-'}{trace}")  # type: ignore[arg-type]
        if v["right"] is None:
            continue
        group = "healthy" if v["expected"] == HEALTHY else "failing"
        for perf, key in ((True, "right"), (False, "right_but_perf")):
            tally[(group, perf)][0] += bool(v[key])
            tally[(group, perf)][1] += 1
    for (group, perf), (k, n) in tally.items():
        print(f"summary {group}{'' if perf else ' (perf/* left out)'}: {k}/{n} right")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
