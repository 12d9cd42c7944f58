#!/usr/bin/env python3
"""Run the unseen training shapes (:mod:`bench.unseen.sets`: none of them in bench/corpus) and judge each.

Each shape runs as its own process, configured only through ``TRAINGUARD_*`` variables (a ``file://``
endpoint); its stream is then fed, event by event, through a fresh engine pipeline with the default
``DetectionSettings`` (``bench.corpus.evaluate.judge``). A healthy shape is right when no WARNING+ incident
is open at its end; a failing shape when one of its expected kinds (``a|b``) is among its incidents (open
or resolved).

    python -m bench.unseen.probe                    # stop 34's set, 2 at a time (~8 min on 2 cores)
    python -m bench.unseen.probe --set tuning36     # stop 36's tuning set
    python -m bench.unseen.probe --only plain_mlp_nan_input,hf_gpt2_default_logging_ok
    python -m bench.unseen.probe --set tuning36 --rejudge  # judge the streams in --out again (engine changes)
    python -m bench.unseen.probe --set heldout36    # stop 36's held-out set: run ONCE, with the engine kept
    python -m bench.unseen.probe --set tuning44 --rejudge --setting oscillation_min_serial=0.4  # a setting

Trace rules (the sets marked so in ``sets.SETS``: the held-out sets and stop 36's tuning set; decided with
stop 35's held-out list, before any of it ran): from the loss the run reported, its initial level is the
median of its first 5 values (or the first value when lower: stop 36, after its tuning set's first run
showed blow-ups inside the first 5 values taken as the level, before its held-out set ran); a failing
shape is scored only when its cause manifested (a value after the first >= 2x the initial level, or a
non-finite one) -- for a stalling fault (every expected kind in ``STALL_KINDS``: stop
36, before its sets ran) when its loss did NOT learn; any shape whose loss ended learned (the median of its
last 20 values <= 0.85x the initial level, the last one finite) must also end with no WARNING+ incident open
-- a run that blew up and recovered must not be left with a stale alarm.

No set here was used to tune a detector threshold except the tuning sets (stop34, tuning36); held-out sets
are an outside check, run once.
"""

from __future__ import annotations

import argparse
import json
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
from bench.unseen import sets  # noqa: E402
from bench.unseen.sets import HEALTHY, UNMANIFESTED  # noqa: E402
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


def trace_facts(losses: Sequence[float], jump: bool = False) -> Dict[str, Optional[bool]]:
    """``manifested`` (a loss after the first >= 2x the initial level, or a non-finite one; with ``jump``
    (the sets of ``sets.JUMP_RULE``) also a value >= ``sets.JUMP_FACTOR`` x the median of the
    ``sets.JUMP_POINTS`` values before it) and ``learned``
    (the last 20 values' median <= 0.85x the initial level, the last one finite); the initial level: the
    first 5 values' median, or the first value when that is lower (stop 36: a blow-up inside the first 5
    values must not become the level the run is measured from; nor does a first value far above a loss
    that fell at once count as a rise)."""
    if len(losses) < 5:
        return {"manifested": None, "learned": None}
    start = statistics.median(losses[:5])
    if math.isfinite(losses[0]) and 0 < losses[0] < start:
        start = losses[0]
    finite = [v for v in losses[1:] if math.isfinite(v)]
    manifested = len(finite) < len(losses) - 1 or max(finite) >= 2 * start
    if jump and not manifested:
        k = sets.JUMP_POINTS
        manifested = any(
            losses[i] >= sets.JUMP_FACTOR * statistics.median(losses[i - k : i])
            for i in range(k, len(losses))
        )
    learned = math.isfinite(losses[-1]) and statistics.median(losses[-20:]) <= 0.85 * start
    return {"manifested": manifested, "learned": learned}


STALL_KINDS = ("loss/plateau", "adapter/lora-grad-break")
"""Expected kinds of a fault that stalls learning (frozen weights, an LR schedule that vanishes)."""


def manifested(expected: str, facts: Dict[str, Optional[bool]], set_name: str = "") -> Optional[bool]:
    """Whether a failing shape's planted cause showed in its loss: for a stalling fault (every expected kind
    in ``STALL_KINDS``, plus ``gradient/vanishing`` in the sets of ``sets.VANISH_STALL``) the loss did not
    learn; for any other, ``facts["manifested"]``."""
    stall = STALL_KINDS + (("gradient/vanishing",) if set_name in sets.VANISH_STALL else ())
    if all(kind in stall for kind in expected.split("|")):
        return None if facts["learned"] is None else not facts["learned"]
    return facts["manifested"]


def verdict(
    name: str, out: Path, set_name: str = "", settings: Optional[DetectionSettings] = None
) -> Dict[str, object]:
    """The engine's incidents on one recorded shape and whether they are what the shape expects (``right``
    None: not scored); ``right_but_perf``: the same with ``perf/*`` incidents left out (on a shared machine
    a neighbour's load slows a job for real: the throughput detector is right to say so, but it says
    nothing of the training). A set scored with the trace rules (module docstring) also gets ``manifested``
    and ``learned``. ``settings``: the engine's (default: ``DetectionSettings()``)."""
    set_name = set_name or sets.set_of(name)
    expected = sets.shapes(set_name)[name][0]
    events = read_events(out / f"{name}.jsonl")
    traced = sets.trace_rules(set_name)
    facts = trace_facts(loss_trace(events), set_name in sets.JUMP_RULE) if traced else {}
    incidents, visible, _ = judge(events, settings or DetectionSettings())
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
        still_open = [k for k in open_alerts if not (skip_perf and k.startswith("perf/"))]
        if expected == UNMANIFESTED:
            return None
        if expected == HEALTHY:
            return not still_open
        if traced and not manifested(expected, facts, set_name):
            return None
        found = any(k.split(":")[0] in expected.split("|") for k in kinds)
        return found and not (traced and facts["learned"] and still_open)

    return {
        "name": name,
        "expected": expected,
        "right": right(False),
        "right_but_perf": right(True),
        "incidents": kinds,
        "open_alerts": open_alerts,
        **facts,
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated shape names (default: all)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--rejudge", action="store_true", help="judge the recorded streams, record nothing")
    parser.add_argument(
        "--set",
        default="stop34",
        choices=sorted(sets.SETS),
        help="which set (held-out sets: run them ONCE, at the end)",
    )
    parser.add_argument(
        "--heldout", action="store_true", help="the same as --set heldout35 (stop 35's; SPENT)"
    )
    parser.add_argument(
        "--setting",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="judge with this detection setting overridden (VALUE read as JSON, else text); repeatable",
    )
    args = parser.parse_args(argv)
    overrides: Dict[str, Any] = {}
    for item in args.setting:
        key, _, text = item.partition("=")
        try:
            overrides[key.strip()] = json.loads(text)
        except ValueError:
            overrides[key.strip()] = text
    settings = DetectionSettings.from_overrides(overrides)
    set_name = "heldout35" if args.heldout else args.set
    names: List[str] = [n for n in args.only.split(",") if n] or list(sets.shapes(set_name))
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
        v = verdict(name, args.out, set_name, settings)
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
