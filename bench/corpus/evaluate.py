#!/usr/bin/env python3
"""Detection on the varied-training corpus, dev and test halves apart.

Each recorded run (``bench/corpus/record.py``'s ``OUT/<id>.jsonl``, what its SDK sent) goes through the
detection engine as a processor runs it (``Pipeline`` with the default ``DetectionSettings``: envelopes in
event-time order, then the processing-time timers a minute after the last one) and is compared with its
label (``labels.py``: the planted cause checked against the run's ground-truth trace). Envelopes are fed
one at a time, so the step at which an incident first became visible (the highest step seen so far) is
exact.

The run's **verdict** is its top incident: open ones before resolved ones (a condition that cleared is
history), then the highest severity, then the earliest; incidents another one explains (``explained_by``)
are not the verdict. Printed per half:

* per label: runs, right category, right subtype (the verdict's kind), what else was found;
* healthy runs: how many end with a WARNING-or-worse incident open (with its Wilson 95 % interval) and how
  many had one that closed again (transient);
* gradient explosions: the lead -- the first non-finite loss or gradient norm (``labels.py``'s ``nf``)
  minus the step at which the run's explosion incident was first visible, under whatever kind it had then
  (printed beside the lead: an explosion flagged before the NaN, or the loss divergence it grew out of and
  was re-classified from in place, ERROR either way) -- clipping on and off, and the share >= 10 steps;
  beside it the same share among the *gradual* ones (the pre-clip norm climbed >= 3x its reference on the
  ``GRADUAL_STEPS`` steps before ``nf``: ``labels.climb_steps``) and every run's climb length -- a
  growing-LR run without clipping often goes from a calm norm to Inf in under 10 steps;
* the same rows for the HF Trainer and Lightning runs apart;
* ``unmanifested`` runs (their planted cause did not show in their trace): counted, never scored;
* the anomalous runs whose trace also meets the healthy rule (``labels.observed``: the loss fell to <=
  0.85 x its start, nothing non-finite) -- only the planted cause makes them anomalous, and a detector
  that alarmed on their shape would alarm on the healthy runs that share it -- and how many of the runs
  left with no incident at all are such (counts only);
* the right category and subtype under the label rule before stop 31's second decision (``labels.label``'s
  ``shapes_on_learned``: a loss-shape label also on a run that learned), so both can be judged.

    python -m bench.corpus.evaluate                   # both halves of what record.py wrote
    python -m bench.corpus.evaluate --split dev -v    # one half, every miss listed
    python -m bench.corpus.evaluate --json out.json
    python -m bench.corpus.evaluate --ignore perf      # without the step-time (perf/*) incidents

Nothing is asserted; targets (issue 16, on the test half) are printed beside the figures.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parents[2]
for _src in (REPO, REPO / "sdk" / "src", REPO / "engine" / "src"):
    if str(_src) not in sys.path:
        sys.path.insert(0, str(_src))

from bench.corpus import labels as labels_mod  # noqa: E402
from bench.corpus import manifest  # noqa: E402
from bench.corpus.record import DEFAULT_OUT  # noqa: E402
from bench.corpus.trainings import clip_for  # noqa: E402
from tests.scenarios.corpus import load_events  # noqa: E402
from trainguard_engine.catalogue import DetectionSettings  # noqa: E402
from trainguard_engine.pipeline import Pipeline  # noqa: E402
from trainguard_engine.records import INCIDENT_RESOLVED, SEVERITY_ORDER  # noqa: E402

TIMERS_AFTER_NS = 60 * 10**9
GRADUAL_STEPS = 10
"""An explosion whose pre-clip norm climbed (>= 3x its reference, labels.climb_steps) on at least this
many steps before the first non-finite value is 'gradual': one that gave the gradients' own warning
10 steps ahead. Printed beside the all-explosions line, which stays the issue's figure."""


@dataclass
class Outcome:
    """What the engine said about one run, beside its label."""

    id: str
    split: str
    cause: str
    framework: str
    family: str
    clip: Optional[float]
    label: str
    verdict: str  # the top incident's kind, or "-" for none
    kinds: List[str] = field(default_factory=list)  # every kind found (not explained by another)
    open_alerts: List[str] = field(default_factory=list)  # WARNING+ kinds open at the end
    transient: List[str] = field(default_factory=list)  # WARNING+ kinds that closed again
    visible_step: Dict[str, int] = field(default_factory=dict)  # kind -> step when first visible
    first_nonfinite: Optional[int] = None
    climb_steps: Optional[int] = None  # labels.climb_steps: steps the pre-clip norm climbed before nf
    flagged: Dict[str, Any] = field(default_factory=dict)  # the explosion incident: first visible {step, as}
    learned: bool = False  # the trace also meets the healthy rule (labels.py): only its cause is anomalous
    label_before: str = ""  # the label under the rule before stop 31's second decision (shapes_on_learned)

    @property
    def healthy(self) -> bool:
        return self.label == labels_mod.HEALTHY

    @property
    def right_category(self) -> bool:
        if self.healthy:
            return not self.open_alerts
        return self.verdict.split("/")[0] == self.label.split("/")[0]

    @property
    def right_subtype(self) -> bool:
        return not self.open_alerts if self.healthy else self.verdict == self.label


def judge(
    events: Sequence[Dict[str, Any]], settings: DetectionSettings
) -> Tuple[List[Any], Dict[str, int], Dict[str, Tuple[int, str]]]:
    """Run ``events`` through a fresh pipeline one by one; the final incidents, the step at which each
    kind was first visible, and per incident id the step it was first visible at with its kind then (an
    incident can be re-classified in place: a divergence that ends in an explosion is one incident)."""
    pipeline = Pipeline(settings)
    visible: Dict[str, int] = {}
    by_id: Dict[str, Tuple[int, str]] = {}
    seen_step = -1
    last_ns = 0
    for event in events:
        step = event.get("step")
        if isinstance(step, int) and step > seen_step:
            seen_step = step
        last_ns = max(last_ns, int(event.get("time_unix_nano") or 0))
        out = pipeline.process([event])
        for inc in out.incidents:
            visible.setdefault(f"{inc.category}/{inc.subtype}", seen_step)
            by_id.setdefault(inc.incident_id, (seen_step, f"{inc.category}/{inc.subtype}"))
    pipeline.advance(last_ns + TIMERS_AFTER_NS)
    return pipeline.incidents(), visible, by_id


def read_events(path: Path) -> List[Dict[str, Any]]:
    """The envelopes of one plain or gzipped (``.gz``) stream file in event-time order."""
    return load_events([path])


def outcome(spec: manifest.RunSpec, out: Path, settings: DetectionSettings,
            ignore: Sequence[str] = ()) -> Optional[Outcome]:
    stream, truth_path = out / f"{spec.id}.jsonl", out / f"{spec.id}.truth.json"
    if not stream.exists() or not truth_path.exists():
        return None
    truth = json.loads(truth_path.read_text(encoding="utf-8"))["truth"]
    return outcome_of(spec, truth, read_events(stream), settings, ignore)


def outcome_of(spec: manifest.RunSpec, truth: Dict[str, List[float]], events: Sequence[Dict[str, Any]],
               settings: DetectionSettings, ignore: Sequence[str] = ()) -> Outcome:
    """The engine's verdict on one run's ``events`` beside the label its ``truth`` gives; incidents of the
    categories in ``ignore`` are left out of it (``--ignore``)."""
    label = labels_mod.label(spec, truth, clip_for(spec))
    learned = bool(labels_mod.observed(spec, truth, clip_for(spec)).get(labels_mod.HEALTHY))
    incidents, visible, by_id = judge(events, settings)
    mine = [i for i in incidents if not i.explained_by and i.category not in ignore]
    mine.sort(key=lambda i: (i.status == "resolved", -SEVERITY_ORDER.get(i.severity, 0), i.first_ns))
    nf = labels_mod.first_nonfinite_step(truth)
    alert = SEVERITY_ORDER["warning"]
    return Outcome(
        id=spec.id,
        split=spec.split,
        cause=spec.cause,
        framework=spec.framework,
        family=spec.family,
        clip=clip_for(spec),
        label=label,
        verdict=f"{mine[0].category}/{mine[0].subtype}" if mine else "-",
        kinds=sorted({f"{i.category}/{i.subtype}" for i in mine}),
        open_alerts=sorted(
            {
                f"{i.category}/{i.subtype}"
                for i in mine
                if i.status != INCIDENT_RESOLVED and SEVERITY_ORDER.get(i.severity, 0) >= alert
            }
        ),
        transient=sorted(
            {
                f"{i.category}/{i.subtype}"
                for i in mine
                if i.status == INCIDENT_RESOLVED and SEVERITY_ORDER.get(i.severity, 0) >= alert
            }
        ),
        visible_step=visible,
        first_nonfinite=nf,
        climb_steps=labels_mod.climb_steps(truth),
        flagged=next(
            (
                {"step": by_id[i.incident_id][0], "as": by_id[i.incident_id][1]}
                for i in mine
                if (i.category, i.subtype) == ("gradient", "explosion") and i.incident_id in by_id
            ),
            {},
        ),
        learned=learned,
        label_before=labels_mod.label(spec, truth, clip_for(spec), shapes_on_learned=True),
    )


def wilson(k: int, n: int, z: float = 1.96) -> Tuple[float, float]:
    """The Wilson score interval of the proportion k/n."""
    if n == 0:
        return (math.nan, math.nan)
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def _pct(k: int, n: int) -> str:
    return f"{k}/{n} = {100 * k / n:.1f} %" if n else "0/0"


def report(outcomes: Sequence[Outcome], title: str, verbose: bool = False) -> Dict[str, Any]:
    """Print one half's figures; return them."""
    scored = [o for o in outcomes if o.label != labels_mod.UNMANIFESTED]
    anomalous = [o for o in scored if not o.healthy]
    healthy = [o for o in scored if o.healthy]
    print(
        f"\n== {title}: {len(outcomes)} runs, {len(scored)} scored ({len(anomalous)} anomalous, "
        f"{len(healthy)} healthy), {len(outcomes) - len(scored)} unmanifested"
    )
    by_label: Dict[str, List[Outcome]] = defaultdict(list)
    for o in anomalous:
        by_label[o.label].append(o)
    print(f"  {'label':26s} {'runs':>4s} {'category':>9s} {'subtype':>8s}  verdicts")
    for lab in sorted(by_label):
        rows = by_label[lab]
        verdicts = Counter(o.verdict for o in rows)
        print(
            f"  {lab:26s} {len(rows):4d} {sum(o.right_category for o in rows):9d} "
            f"{sum(o.right_subtype for o in rows):8d}  "
            + ", ".join(f"{k} {v}" for k, v in verdicts.most_common())
        )
    cat = sum(o.right_category for o in anomalous)
    learned = [o for o in anomalous if o.learned]
    silent = [o for o in anomalous if o.verdict == "-"]
    print(
        f"  anomalous runs whose trace also meets the healthy rule (it learned: only the planted cause "
        f"makes them anomalous): {len(learned)}, right category {sum(o.right_category for o in learned)}; "
        f"runs with no incident at all: {len(silent)}, of which such: {sum(o.learned for o in silent)}"
    )
    sub = sum(o.right_subtype for o in anomalous)
    before = [o for o in outcomes if o.label_before not in (labels_mod.UNMANIFESTED, labels_mod.HEALTHY)]
    cat_before = sum(o.verdict.split("/")[0] == o.label_before.split("/")[0] for o in before)
    sub_before = sum(o.verdict == o.label_before for o in before)
    print(
        f"  under the label rule before stop 31's second decision (a loss-shape label also on a run that "
        f"learned): right category {_pct(cat_before, len(before))}, right subtype "
        f"{_pct(sub_before, len(before))}; loss-shape labels now unmanifested because the run learned: "
        f"{sum(1 for o in before if o.label == labels_mod.UNMANIFESTED)}"
    )
    alerts = sum(1 for o in healthy if o.open_alerts)
    transient = sum(1 for o in healthy if o.transient and not o.open_alerts)
    lo, hi = wilson(alerts, len(healthy))
    print(
        f"  right category {_pct(cat, len(anomalous))} (target >= 95 %); right subtype "
        f"{_pct(sub, len(anomalous))} (target >= 90 %)"
    )
    print(
        f"  healthy runs with a WARNING+ incident open at the end: {_pct(alerts, len(healthy))} "
        f"[95 % CI {100 * lo:.1f}-{100 * hi:.1f} %] (target <= 1 %); transient only: {transient}"
    )
    if alerts:
        print(
            "    "
            + ", ".join(
                f"{k} {v}" for k, v in Counter(k for o in healthy for k in o.open_alerts).most_common()
            )
        )
    explosions = [o for o in anomalous if o.label == "gradient/explosion" and o.first_nonfinite is not None]
    leads: Dict[str, List[Optional[int]]] = {"clip on": [], "clip off": []}
    first_kinds: Dict[str, List[str]] = {"clip on": [], "clip off": []}
    for o in explosions:
        step = o.flagged.get("step")
        lead = None if step is None else o.first_nonfinite - step  # type: ignore[operator]
        leads["clip on" if o.clip else "clip off"].append(lead)
        first_kinds["clip on" if o.clip else "clip off"].append(str(o.flagged.get("as", "-")).split("/")[-1])
    for name, values in leads.items():
        ahead = sum(1 for v in values if v is not None and v >= 10)
        shown = ", ".join(
            ("-" if v is None else str(v)) + f" ({k})" for v, k in zip(values, first_kinds[name])
        )
        print(
            f"  explosions, {name}: flagged >= 10 steps before the first non-finite value "
            f"{_pct(ahead, len(values))} (target >= 90 %); leads [{shown}]"
        )
        spans = [o.climb_steps for o in explosions if bool(o.clip) == (name == "clip on")]
        gradual = [v for v, c in zip(values, spans) if c is not None and c >= GRADUAL_STEPS]
        print(
            f"    of which gradual (the pre-clip norm >= 3x its reference on the {GRADUAL_STEPS}+ steps "
            f"before nf): {_pct(sum(1 for v in gradual if v is not None and v >= 10), len(gradual))}; "
            f"climb lengths [{', '.join('-' if c is None else str(c) for c in spans)}]"
        )
    frameworks: Dict[str, Dict[str, Any]] = {}
    for fw in ("plain", "hf", "lightning"):
        rows_a = [o for o in anomalous if o.framework == fw]
        rows_h = [o for o in healthy if o.framework == fw]
        frameworks[fw] = {
            "anomalous": len(rows_a),
            "category": sum(o.right_category for o in rows_a),
            "subtype": sum(o.right_subtype for o in rows_a),
            "healthy": len(rows_h),
            "healthy_alerts": sum(1 for o in rows_h if o.open_alerts),
        }
        f = frameworks[fw]
        print(
            f"  {fw:9s}: category {_pct(f['category'], f['anomalous'])}, subtype "
            f"{_pct(f['subtype'], f['anomalous'])}, healthy alerted {_pct(f['healthy_alerts'], f['healthy'])}"
        )
    unmanifested = Counter(o.cause for o in outcomes if o.label == labels_mod.UNMANIFESTED)
    if unmanifested:
        print("  unmanifested by cause: " + ", ".join(f"{k} {v}" for k, v in sorted(unmanifested.items())))
    if verbose:
        for o in scored:
            if not o.right_subtype:
                print(
                    f"    MISS {o.id} {o.cause}/{o.framework}/{o.family} label={o.label} verdict={o.verdict} "
                    f"kinds={o.kinds} open={o.open_alerts} transient={o.transient}"
                )
    return {
        "runs": len(outcomes),
        "scored": len(scored),
        "anomalous": len(anomalous),
        "right_category": cat,
        "learned": len(learned),
        "no_incident": len(silent),
        "no_incident_learned": sum(o.learned for o in silent),
        "right_subtype": sub,
        "before_stop31_rule": {"anomalous": len(before), "right_category": cat_before,
                               "right_subtype": sub_before},
        "healthy": len(healthy),
        "healthy_alerts": alerts,
        "healthy_alert_ci": [lo, hi],
        "healthy_transient": transient,
        "explosion_leads": leads,
        "frameworks": frameworks,
        "unmanifested": dict(unmanifested),
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--split", choices=("dev", "test", "both"), default="both")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where record.py wrote the runs")
    parser.add_argument("--only", default="", help="comma-separated run ids")
    parser.add_argument("--json", type=Path)
    parser.add_argument("-v", "--verbose", action="store_true", help="list every miss")
    parser.add_argument("--ignore", default="",
                        help="comma-separated incident categories left out of every verdict (e.g. perf: "
                             "step-time incidents of a recording host shared with other work); printed")
    args = parser.parse_args(argv)
    ignore = tuple(c for c in args.ignore.split(",") if c)
    if ignore:
        print(f"incidents of the categories {', '.join(ignore)} are left out of every verdict (--ignore)")
    settings = DetectionSettings()
    specs = manifest.load()
    if args.only:
        specs = [s for s in specs if s.id in set(args.only.split(","))]
    outcomes = [o for o in (outcome(s, args.out, settings, ignore) for s in specs) if o is not None]
    missing = len(specs) - len(outcomes)
    if missing:
        print(
            f"{missing} runs of the manifest have no recording in {args.out} (python -m bench.corpus.record)"
        )
    figures: Dict[str, Any] = {}
    for split in ("dev", "test") if args.split == "both" else (args.split,):
        figures[split] = report([o for o in outcomes if o.split == split], f"{split} half", args.verbose)
    if args.json:
        args.json.write_text(
            json.dumps({"figures": figures, "runs": [asdict(o) for o in outcomes]}, indent=1),
            encoding="utf-8",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
