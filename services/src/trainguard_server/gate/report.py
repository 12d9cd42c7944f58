"""The verdict as a markdown summary (with a small plot) and as JUnit XML: pure string building from the
verdict's JSON mapping (``Verdict.to_dict()`` or the API's answer); the CLI writes the files.

The plot is a mermaid ``xychart-beta`` line chart: GitHub renders mermaid blocks in markdown, job summaries
included, and GitLab renders them in markdown it displays; an inline SVG (data URI or raw) is stripped or
not rendered by GitHub's sanitiser in step summaries, and images would need a host. Mermaid's xychart has no
log axis and no legend, so a log-transformed loss is plotted as log10 and the series' colours are fixed
(grey: baseline median, light grey: the k-sigma band, red: the candidate) and named under the chart. Below
it, a Unicode sparkline of the candidate's distance from the baseline in sigmas reads in any viewer,
including a terminal.
"""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET
from typing import Any, Dict, List, Optional, Sequence

ICONS = {"pass": "✅", "warn": "⚠️", "fail": "❌", "undecided": "❔", "skip": "⏭️"}
SPARK = "▁▂▃▄▅▆▇█"
MAX_CHART_POINTS = 60


def _num(value: Any) -> Optional[float]:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    if value == "Infinity":
        return math.inf
    return None


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def sparkline(values: Sequence[Optional[float]], lo: float, hi: float, width: int = 60) -> str:
    """``values`` (None: no data, shown as a space) clipped to [lo, hi] as block characters, at most
    ``width`` of them (each the maximum of its slice)."""
    if not values:
        return ""
    size = max(1, math.ceil(len(values) / width))
    out = []
    for i in range(0, len(values), size):
        chunk = [v for v in values[i:i + size] if v is not None]
        if not chunk:
            out.append(" ")
            continue
        v = min(max(max(chunk), lo), hi)
        out.append(SPARK[min(len(SPARK) - 1, int((v - lo) / (hi - lo) * len(SPARK))) if hi > lo else 0])
    return "".join(out)


def _plain(value: float, decimals: int) -> str:
    """A number as mermaid's xychart grammar reads it: no exponent (``[+-]?\\d+(\\.\\d+)?``)."""
    text = f"{value:.{decimals}f}"
    text = text.rstrip("0").rstrip(".") if "." in text else text
    return "0" if text in ("-0", "") else text


def _step_label(step: float) -> str:
    return str(int(step)) if float(step).is_integer() else f"{step:.1f}"


def _chart(plot: Dict[str, Any]) -> List[str]:
    steps = plot.get("steps") or []
    cand = [_num(v) for v in plot.get("candidate") or []]
    idx = [i for i, v in enumerate(cand) if v is not None]
    if len(idx) < 2:
        idx = list(range(len(steps)))
    if len(idx) < 2:
        return []
    every = max(1, math.ceil(len(idx) / MAX_CHART_POINTS))
    picked = idx[::every]
    if picked[-1] != idx[-1]:
        picked.append(idx[-1])
    log = plot.get("transform") == "log"

    def y(series: str, i: int) -> Optional[float]:
        values = plot.get(series) or []
        v = _num(values[i]) if i < len(values) else None
        if v is None or math.isinf(v):
            return None
        if log:
            return math.log10(v) if v > 0 else None
        return v

    rows = {name: [y(name, i) for i in picked] for name in ("center", "band_high", "band_low", "candidate")}
    finite = [v for vs in rows.values() for v in vs if v is not None]
    if not finite:
        return []
    lo, hi = min(finite), max(finite)
    pad = (hi - lo) * 0.05 or max(abs(hi) * 0.05, 1e-12)
    top = hi + pad
    # enough decimals for ~4 significant digits of the plotted range, never an exponent
    decimals = max(2, min(15, 4 - math.floor(math.log10(top - (lo - pad)))))
    metric = str(plot.get("metric", "loss")).replace('"', "'")
    label = f"log10 {metric}" if log else metric
    lines = ["```mermaid",
             '%%{init: {"themeVariables": {"xyChart": {"plotColorPalette": '
             '"#7f7f7f, #c7c7c7, #c7c7c7, #d62728"}}}}%%',
             "xychart-beta",
             f'    title "{metric}: baseline median ± {plot.get("k", "k")} sigma band vs candidate"',
             "    x-axis \"step\" [" + ", ".join(_step_label(steps[i]) for i in picked) + "]",
             f'    y-axis "{label}" {_plain(lo - pad, decimals)} --> {_plain(top, decimals)}']
    for name in ("center", "band_high", "band_low", "candidate"):
        # a point above the band (or non-finite) is drawn at the top of the chart
        values = [v if v is not None else top for v in rows[name]]
        lines.append("    line [" + ", ".join(_plain(v, decimals) for v in values) + "]")
    lines += ["```", "", "grey: baseline median · light grey: the band (outside it counts) · red: the "
              "candidate (smoothed)" + (" · log10 scale" if log else ""), ""]
    return lines


def markdown(verdict: Dict[str, Any]) -> str:
    """The job summary: verdict, reason, one row per check, details, the loss plot and a sparkline."""
    status = verdict.get("verdict", "undecided")
    code = verdict.get("exit_code", 2)
    out = [f"## TrainGuard gate: {ICONS.get(status, '')} {status.upper()} (exit {code})", "",
           f"Candidate run `{verdict.get('candidate', '')}` against baseline "
           f"`{verdict.get('baseline', '')}`.",
           "", f"> {verdict.get('reason', '')}", ""]
    checks = verdict.get("checks") or []
    if checks:
        out += ["| check | status | result |", "|---|---|---|"]
        for c in checks:
            icon = ICONS.get(c["status"], "")
            out.append(f"| {c['name']} | {icon} {c['status']} | {_cell(c['summary'])} |")
        out.append("")
    for c in checks:
        if c.get("details"):
            out += [f"<details><summary>{c['name']}: {len(c['details'])} item(s)</summary>", ""]
            out += [f"- {_cell(d)}" for d in c["details"]]
            out += ["", "</details>", ""]
    plot = verdict.get("plot") or {}
    if plot.get("steps"):
        out += ["### Loss against the baseline envelope", ""]
        out += _chart(plot)
        zs = [_num(z) for z in plot.get("z") or []]
        if any(z is not None for z in zs):
            k = float(plot.get("k", 5))
            out += [f"distance from the baseline in sigmas (▁ ≤ 0, █ ≥ {2 * k:g}; outside beyond {k:g}): "
                    f"`{sparkline(zs, 0.0, 2 * k)}`", ""]
    for note in verdict.get("notes") or []:
        out.append(f"- note: {note}")
    return "\n".join(out).rstrip() + "\n"


def junit(verdict: Dict[str, Any]) -> str:
    """JUnit XML: one test case per check (fail -> failure, undecided -> error, skip -> skipped, warn ->
    passed with the warning in system-out); a precondition that stopped the gate is one erroring case."""
    baseline = verdict.get("baseline", "")
    checks = verdict.get("checks") or []
    suite = ET.Element("testsuite", name="trainguard-gate", tests=str(max(1, len(checks))))
    props = ET.SubElement(suite, "properties")
    for key in ("verdict", "exit_code", "baseline", "candidate", "reason"):
        ET.SubElement(props, "property", name=key, value=str(verdict.get(key, "")))
    failures = errors = skipped = 0
    classname = f"trainguard.gate.{baseline}"
    if not checks:
        case = ET.SubElement(suite, "testcase", classname=classname, name="gate")
        if verdict.get("verdict") == "undecided":
            ET.SubElement(case, "error", message=verdict.get("reason", ""), type="undecided").text = \
                verdict.get("reason", "")
            errors += 1
    for c in checks:
        case = ET.SubElement(suite, "testcase", classname=classname, name=c["name"])
        text = "\n".join([c["summary"], *c.get("details", [])])
        if c["status"] == "fail":
            ET.SubElement(case, "failure", message=c["summary"], type="regression").text = text
            failures += 1
        elif c["status"] == "undecided":
            ET.SubElement(case, "error", message=c["summary"], type="undecided").text = text
            errors += 1
        elif c["status"] == "skip":
            ET.SubElement(case, "skipped", message=c["summary"])
            skipped += 1
        else:
            ET.SubElement(case, "system-out").text = ("WARNING: " if c["status"] == "warn" else "") + text
    suite.set("failures", str(failures))
    suite.set("errors", str(errors))
    suite.set("skipped", str(skipped))
    ET.indent(suite)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(suite, encoding="unicode") + "\n"


def text(verdict: Dict[str, Any]) -> str:
    """A few lines for the terminal / CI log."""
    lines = [f"gate {verdict.get('verdict', '').upper()} (exit {verdict.get('exit_code')}): candidate "
             f"{verdict.get('candidate')} vs baseline {verdict.get('baseline')}",
             f"  {verdict.get('reason')}"]
    for c in verdict.get("checks") or []:
        lines.append(f"  {c['status']:<9} {c['name']:<12} {c['summary']}")
    return "\n".join(lines) + "\n"
