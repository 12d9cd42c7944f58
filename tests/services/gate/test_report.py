"""gate.report: the markdown summary (table, mermaid chart, sparkline) and the JUnit XML of a verdict."""

from __future__ import annotations

import math
import re
import xml.etree.ElementTree as ET
from typing import Any, Dict

from trainguard_server.gate import report
from trainguard_server.gate.compare import evaluate
from trainguard_server.gate.policy import Policy
from trainguard_server.gate.profile import RunData, build_profile


def _run(run_id: str, factor: float = 1.0, status: str = "finished") -> RunData:
    loss = [(float(s), 0.5 * math.exp(-s / 40) * (factor if s > 50 else 1.0) * (1 + 0.1 * math.sin(s)))
            for s in range(150)]
    return RunData(run_id=run_id, status=status, last_step=149, series={"loss": loss},
                   fingerprints={"abc123": "KeyError: <str>"} if status == "failed" else {})


def verdict(factor: float = 1.0, status: str = "finished") -> Dict[str, Any]:
    profile = build_profile([_run("a"), _run("b", 1.02), _run("c", 0.98)], Policy())
    return evaluate(profile, _run("cand", factor, status), Policy(), "main").to_dict()


def test_markdown_of_a_failure() -> None:
    text = report.markdown(verdict(factor=3.0, status="failed"))
    assert text.startswith("## TrainGuard gate: ❌ FAIL (exit 1)\n")
    assert "Candidate run `cand` against baseline `main`." in text
    assert "| loss | ❌ fail |" in text and "| fingerprints | ❌ fail |" in text
    assert "| step_time | ⏭️ skip |" in text  # no step-time metric in these runs
    assert "<details><summary>fingerprints: 1 item(s)</summary>" in text and "- abc123: KeyError" in text
    chart = text[text.index("```mermaid"):text.index("```", text.index("```mermaid") + 3)]
    assert "xychart-beta" in chart and 'y-axis "log10 loss"' in chart
    x_labels = re.search(r'x-axis "step" \[(.*)\]', chart)
    assert x_labels is not None
    n = len(x_labels.group(1).split(","))
    lines = re.findall(r"line \[(.*)\]", chart)
    assert len(lines) == 4 and all(len(line.split(",")) == n for line in lines)  # mermaid needs equal lengths
    assert 2 <= n <= report.MAX_CHART_POINTS + 1
    assert "distance from the baseline in sigmas" in text and "█" in text


def test_markdown_escapes_table_cells() -> None:
    doc = {"verdict": "undecided", "exit_code": 2, "reason": "r", "baseline": "b", "candidate": "c",
           "checks": [{"name": "x", "status": "undecided", "summary": "a | b\nc", "details": []}]}
    assert "| x | ❔ undecided | a \\| b c |" in report.markdown(doc)


def test_junit_one_case_per_check() -> None:
    suite = ET.fromstring(report.junit(verdict(factor=3.0)))
    cases = {c.get("name"): c for c in suite.iter("testcase")}
    assert set(cases) == {"status", "fingerprints", "incidents", "loss", "step_time", "peak_memory"}
    assert cases["loss"].find("failure") is not None
    assert cases["step_time"].find("skipped") is not None
    assert suite.get("failures") == "1" and suite.get("skipped") == "2" and suite.get("errors") == "0"
    props = {p.get("name"): p.get("value") for p in suite.iter("property")}
    assert props["verdict"] == "fail" and props["exit_code"] == "1" and props["candidate"] == "cand"
    passing = ET.fromstring(report.junit(verdict()))
    assert passing.get("failures") == "0" and passing.get("errors") == "0"


def test_junit_of_an_undecided_verdict_without_checks() -> None:
    doc = {"verdict": "undecided", "exit_code": 2, "reason": "no baseline 'x' <here> & there",
           "baseline": "x", "candidate": "c", "checks": []}
    suite = ET.fromstring(report.junit(doc))
    [case] = list(suite.iter("testcase"))
    error = case.find("error")
    assert error is not None and error.get("message") == "no baseline 'x' <here> & there"  # escaped
    assert suite.get("errors") == "1"


def test_sparkline() -> None:
    assert report.sparkline([0.0, 5.0, 10.0, None], 0.0, 10.0) == "▁▅█ "
    assert report.sparkline([-3.0, 99.0], 0.0, 10.0) == "▁█"  # clipped
    assert len(report.sparkline([1.0] * 500, 0.0, 10.0, width=50)) == 50


MERMAID_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d+)?|\.\d+)")  # xychart.jison's NUMBER_WITH_DECIMAL


def test_chart_numbers_are_what_mermaids_grammar_reads() -> None:
    """Tiny linear values (no exponent notation: mermaid's lexer has none) and fractional bucket steps."""
    steps = [0.5 + 2 * i for i in range(30)]
    center = [3e-6 - 1e-7 * i for i in range(30)]
    plot = {"metric": 'my "loss"', "transform": "linear", "k": 5.0, "steps": steps, "center": center,
            "band_low": [c - 2e-7 for c in center], "band_high": [c + 2e-7 for c in center],
            "candidate": [c + 5e-7 for c in center], "z": [12.5] * 30}
    text = report.markdown({"verdict": "fail", "exit_code": 1, "reason": "r", "baseline": "b",
                            "candidate": "c", "checks": [], "plot": plot})
    chart = text[text.index("xychart-beta"):text.index("```", text.index("xychart-beta"))]
    assert 'title "my \'loss\': baseline median' in chart and "e-" not in chart
    lo, hi = re.search(r'y-axis "my \'loss\'" (\S+) --> (\S+)', chart).groups()  # type: ignore[union-attr]
    assert MERMAID_NUMBER.fullmatch(lo) and MERMAID_NUMBER.fullmatch(hi) and float(lo) < float(hi)
    for line in re.findall(r"line \[(.*)\]", chart):
        values = [v.strip() for v in line.split(",")]
        assert len(values) == 30 and all(MERMAID_NUMBER.fullmatch(v) for v in values), values
    assert len({v.strip() for v in re.findall(r"line \[(.*)\]", chart)[0].split(",")}) > 20  # not flattened
    labels = re.search(r'x-axis "step" \[(.*)\]', chart).group(1)  # type: ignore[union-attr]
    assert labels.startswith("0.5, 2.5, 4.5")
