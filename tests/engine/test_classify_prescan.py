"""The classifier's shared needle pre-scan (``classify.GATES``/``SCAN``, ``_Text.present``) is an
optimisation only: skipping the rules none of whose needles occur changes no result. Checked on every line
and every whole log of the wild corpus of real pastes and on every text fixture of the classifier's own
tests, with the pre-scan and without it."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, List

import pytest

from trainguard_engine import classify

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def _texts() -> Iterator[str]:
    for path in sorted((FIXTURES / "wild").glob("*/log.txt")):
        text = path.read_text(encoding="utf-8", errors="replace")
        yield text
        yield from (line for line in text.splitlines() if line.strip())
    for path in sorted(FIXTURES.glob("**/*.txt")):
        if "wild" not in path.parts and path.stat().st_size < 400_000:
            yield path.read_text(encoding="utf-8", errors="replace")


def _both(text: str, monkeypatch: pytest.MonkeyPatch) -> List[object]:
    out = []
    for prescan in (True, False):
        monkeypatch.setattr(classify, "PRESCAN", prescan)
        out.append(classify.classify_text(text))
    return out


def test_the_prescan_changes_no_classification(monkeypatch: pytest.MonkeyPatch) -> None:
    texts = list(_texts())
    assert len(texts) > 2000
    differ = []
    for text in texts:
        with_scan, without = _both(text, monkeypatch)
        if with_scan != without:
            differ.append(text[:120])
    assert differ == []



def test_a_needle_outside_the_scan_is_still_found() -> None:
    """``has`` answers a needle no gate lists with ``str.find`` (rules ask such needles once a gate needle
    was found, e.g. NCCL's WARN patterns after ``nccl warn``)."""
    from trainguard_engine.classify.text import _Text

    t = _Text("NCCL WARN Call to ibv_create_cq failed", classify.SCAN)
    assert "nccl warn" in classify.SCAN and t.has("nccl warn")
    assert "ibv_create_cq failed" not in classify.SCAN and t.has("ibv_create_cq failed")
    assert not t.has("watchdog caught collective operation timeout")
    assert t.first("watchdog caught collective operation timeout", "ibv_create_cq") == len("NCCL WARN Call to ")
